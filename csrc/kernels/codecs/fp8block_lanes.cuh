// The blockwise FP8 codec's CUDA lanes (codecs/fp8block.h says what its boxes hold): run by
// the box kernels of copy_boxes.cu through codecs/lanes.cuh, per tile, with the walk W of
// the tile's items (init_geom: an item is kItem consecutive source elements of one row and
// one block, the E4M3 bytes they become).
#pragma once

#include <stddef.h>

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

// The 16 source elements of the item at p (BF16 or FP32) as E4M3 bytes under factor
// `mult`: 16-byte loads where the item is 16-byte aligned (tensor rows and staging
// slots of whole items are), else element loads.
RX_LANE uint4 quantize16(const char* p, bool bf16, uint32_t mult, int32_t scales) {
  const bool wide = (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
  uint32_t q[4];
  if (bf16) {
    uint32_t v[8];
    if (wide) {
      const uint4 a = load_item<uint4>(p), b = load_item<uint4>(p + 16);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[k] = static_cast<uint32_t>(load_item<unsigned short>(p + 4 * k)) |
               static_cast<uint32_t>(load_item<unsigned short>(p + 4 * k + 2)) << 16;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
      q[k] = quantize4(v[2 * k] << 16, v[2 * k] & 0xffff0000u, v[2 * k + 1] << 16, v[2 * k + 1] & 0xffff0000u, mult,
                       scales);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint4 a;
      if (wide) {
        a = load_item<uint4>(p + 16 * k);
      } else {
        a = make_uint4(load_item<unsigned int>(p + 16 * k), load_item<unsigned int>(p + 16 * k + 4),
                       load_item<unsigned int>(p + 16 * k + 8), load_item<unsigned int>(p + 16 * k + 12));
      }
      q[k] = quantize4(a.x, a.y, a.z, a.w, mult, scales);
    }
  }
  return make_uint4(q[0], q[1], q[2], q[3]);
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
// block's factor, and writes (or, verify passes, hashes) the 16 E4M3 bytes.
template <int P, typename W>
RX_LANE void box_items(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  constexpr bool kStore = P == RX_PASS_NONE || P == RX_PASS_COPY;
  const bool bf16 = b.src_dtype == RX_BF16;
  const int32_t scales = box_scales(b);
  const char *mult = nullptr, *rowmap = nullptr, *colmap = nullptr;
  if (P != RX_PASS_DST) {  // the grid's tables, read once per box
    const char* side = reinterpret_cast<const char*>(b.param[0]);
    mult = reinterpret_cast<const char*>(load_item<unsigned long long>(side + offsetof(Side, mult)));
    rowmap = reinterpret_cast<const char*>(load_item<unsigned long long>(side + offsetof(Side, rowmap)));
    colmap = reinterpret_cast<const char*>(load_item<unsigned long long>(side + offsetof(Side, colmap)));
  }
#pragma unroll 1
  for (; i < end; i += kWarp) {
    const int64_t so = w.src_off();
    char* to = reinterpret_cast<char*>(b.dst) + w.dst_off();
    w.advance();
    const uint64_t ord = static_cast<uint64_t>(i) * kItem;
    uint4 q;
    if (P == RX_PASS_DST) {  // what the destination holds
      q = load_bytes16(to);
    } else {
      int64_t r, c;
      div_mod(b.param[1] + (bf16 ? so / 2 : so / 4), b.param[2], &r, &c);
      const int32_t cell = load_item<int>(rowmap + 4 * r) + load_item<int>(colmap + 4 * c);
      const uint32_t m = load_item<unsigned int>(mult + 4 * static_cast<int64_t>(cell));
      q = quantize16(reinterpret_cast<const char*>(b.src) + so, bf16, m, scales);
      if (kStore) store_bytes16(to, q);
    }
    if (P != RX_PASS_NONE) hash_bytes16(dg, ord, q);
  }
}

}  // namespace
}  // namespace fp8b
}  // namespace rx
