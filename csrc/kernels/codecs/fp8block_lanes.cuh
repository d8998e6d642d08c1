// The blockwise FP8 codec's CUDA lanes (codecs/fp8block.h says what its boxes hold): run by
// the box kernels of copy_boxes.cu through codecs/lanes.cuh, per tile, with the walk W of
// the tile's items (init_geom: an item is kItem consecutive source elements of one row and
// one block, the E4M3 bytes they become).
#pragma once

#include "kernels/api.h"
#include "kernels/codecs/fp8block.h"
#include "kernels/lane.cuh"

namespace rx {
namespace fp8b {
namespace {

template <int ND, typename G>
RX_LANE void init_geom(G& g, const rx_box& b, const rx_tile& t) {
  group_innermost<ND, kItem>(g, b, t);
}

// Four source elements (BF16 or FP32, from element j of the item at p) as E4M3 bytes under
// factor `mult`, packed little-endian; one element at a time (few live registers).
RX_LANE uint32_t quantize4(const char* p, int j, bool bf16, uint32_t mult, int32_t scales) {
  uint32_t out = 0;
#pragma unroll 1
  for (int k = 0; k < 4; ++k) {
    const uint32_t x = bf16 ? static_cast<uint32_t>(load_item<unsigned short>(p + 2 * (j + k))) << 16
                            : load_item<unsigned int>(p + 4 * (j + k));
    out |= static_cast<uint32_t>(quantize(x, mult, scales)) << (8 * k);
  }
  return out;
}

// (o / n, o % n) with a 32-bit division where both fit (64-bit division is a long sequence).
RX_LANE void div_mod(int64_t o, int64_t n, int64_t* q, int64_t* r) {
  if ((static_cast<uint64_t>(o) | static_cast<uint64_t>(n)) >> 32 == 0) {
    *q = static_cast<uint32_t>(o) / static_cast<uint32_t>(n);
    *r = static_cast<uint32_t>(o) % static_cast<uint32_t>(n);
  } else {
    *q = o / n;
    *r = o % n;
  }
}

// Blockwise FP8 boxes: one lane per item. Item i holds elements 16 i .. 16 i + 15 of the
// box (ordinals); it finds its block from its element offset in the piece, reads the
// block's factor, and writes (or, verify passes, hashes) the 16 E4M3 bytes four at a
// time, so that little stays live (the one-pass copy kernel has 64 registers in all).
template <int P, typename W>
RX_LANE void box_items(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  constexpr bool kStore = P == RX_PASS_NONE || P == RX_PASS_COPY;
  const bool bf16 = b.src_dtype == RX_BF16;
#pragma unroll 1
  for (; i < end; i += kWarp) {
    const int64_t so = w.src_off();
    char* to = reinterpret_cast<char*>(b.dst) + w.dst_off();
    w.advance();
    const uint64_t ord = static_cast<uint64_t>(i) * kItem;
    uint32_t m = 0;
    if (P != RX_PASS_DST) {
      const Side* side = reinterpret_cast<const Side*>(b.param[0]);
      int64_t r, c;
      div_mod(b.param[1] + (bf16 ? so / 2 : so / 4), b.param[2], &r, &c);
      const int32_t cell =
          load_item<int>(reinterpret_cast<const char*>(load_item<unsigned long long>(
                             reinterpret_cast<const char*>(&side->rowmap))) + 4 * r) +
          load_item<int>(reinterpret_cast<const char*>(load_item<unsigned long long>(
                             reinterpret_cast<const char*>(&side->colmap))) + 4 * c);
      m = load_item<unsigned int>(reinterpret_cast<const char*>(load_item<unsigned long long>(
                                      reinterpret_cast<const char*>(&side->mult))) + 4 * static_cast<int64_t>(cell));
    }
    const char* from = reinterpret_cast<const char*>(b.src) + so;
    const bool wide_out = (reinterpret_cast<uintptr_t>(to) & 3u) == 0;
#pragma unroll 1
    for (int k = 0; k < kItem / 4; ++k) {
      uint32_t q;
      if (P == RX_PASS_DST) {  // what the destination holds
        q = wide_out ? load_item<unsigned int>(to + 4 * k)
                     : static_cast<uint32_t>(load_item<unsigned char>(to + 4 * k)) |
                           static_cast<uint32_t>(load_item<unsigned char>(to + 4 * k + 1)) << 8 |
                           static_cast<uint32_t>(load_item<unsigned char>(to + 4 * k + 2)) << 16 |
                           static_cast<uint32_t>(load_item<unsigned char>(to + 4 * k + 3)) << 24;
      } else {
        q = quantize4(from, 4 * k, bf16, m, box_scales(b));
        if (kStore) {
          if (wide_out) {
            store_item<unsigned int>(to + 4 * k, q);
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) store_item<unsigned char>(to + 4 * k + j, static_cast<unsigned char>(q >> (8 * j)));
          }
        }
      }
      if (P != RX_PASS_NONE) dg.acc = digest::add(dg.acc, digest::bytes4(ord + 4 * k, q));
    }
  }
}

}  // namespace
}  // namespace fp8b
}  // namespace rx
