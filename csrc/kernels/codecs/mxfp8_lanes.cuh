// The MXFP8 codec's CUDA lanes (codecs/mxfp8.h says what its boxes hold): run by the box
// kernels of copy_boxes.cu through codecs/lanes.cuh, per tile, with the walk W of the
// tile's items (init_geom: an item is a 32-element block, or a scale byte).
#pragma once

#include "kernels/api.h"
#include "kernels/codecs/mxfp8.h"
#include "kernels/lane.cuh"

namespace rx {
namespace mx {
namespace {

// The items of a data box are whole blocks of its unit-stride innermost dim (a scale box's
// items are its elements, as planned).
template <int ND, typename G>
RX_LANE void init_geom(G& g, const rx_box& b, const rx_tile& t) {
  if (box_is_data(b)) group_innermost<ND, kBlock>(g, b, t);
}

// Words 4c..4c+3 of the BF16 block at p: one 16-byte load where the block is 16-byte
// aligned (staging and tensor rows of whole blocks are), else 2-byte loads.
RX_LANE uint4 load_chunk(const char* p, int c, bool wide) {
  if (wide) return load_item<uint4>(p + 16 * c);
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = static_cast<uint32_t>(load_item<unsigned short>(p + 16 * c + 4 * k)) |
           static_cast<uint32_t>(load_item<unsigned short>(p + 16 * c + 4 * k + 2)) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The shared exponent of the BF16 block at `from` (load_chunk's `wide`).
RX_LANE uint8_t block_exponent(const char* from, bool wide, int32_t rounding) {
  uint32_t amax = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint4 v = load_chunk(from, c, wide);
    amax = max(amax, max(max(word_amax(v.x), word_amax(v.y)), max(word_amax(v.z), word_amax(v.w))));
  }
  return scale_exponent(amax, rounding);
}

// Half h (16 elements) of the BF16 block at `from` as E4M3 under scale e: 16 bytes.
RX_LANE uint4 quantize_half(const char* from, int h, bool wide, uint8_t e) {
  const uint4 u = load_chunk(from, 2 * h, wide), v = load_chunk(from, 2 * h + 1, wide);
  return make_uint4(quantize_words(u.x, u.y, e), quantize_words(u.z, u.w, e), quantize_words(v.x, v.y, e),
                    quantize_words(v.z, v.w, e));
}

// MXFP8 boxes: one lane per item (no warp intrinsics, so the emulated run executes this
// very code). A block is read twice, once for its amax and once to quantize it 16
// elements at a time: the second read hits L2, and a lane never holds the whole block
// (which would spill at this kernel's 64-register budget). A data box writes the block's
// E4M3 bytes (and, with a scale buffer, its scale byte where scale_offset puts it: 2-D
// or swizzled), a scale box the scale byte. Item i is block i (its first element has
// ordinal 32 i) or scale byte i.
template <int P, typename W>
RX_LANE void box_items(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  constexpr bool kStore = P == RX_PASS_NONE || P == RX_PASS_COPY;
  const int32_t rounding = box_rounding(b);
  const bool data = box_is_data(b);
  const char* src = reinterpret_cast<const char*>(b.src);
  char* dst = reinterpret_cast<char*>(b.dst);
#pragma unroll 1
  for (; i < end; i += kWarp) {
    const char* from = src + w.src_off();
    char* to = dst + w.dst_off();
    w.advance();
    const uint64_t ord = static_cast<uint64_t>(i);
    // dst elements are bytes: the block starts at data element param[1] + (to - dst).
    const auto scale_byte = [&] {
      return reinterpret_cast<char*>(box_scale_buf(b)) + scale_offset(box_first(b) + (to - dst), box_cols(b), box_scales(b));
    };
    if (P == RX_PASS_DST) {  // what the destination holds: data bytes and scales, or a scale byte
      if (!data) {
        hash_element(dg, ord, load_item<unsigned char>(to));
        continue;
      }
      hash_bytes16(dg, 32 * ord, load_bytes16(to));
      hash_bytes16(dg, 32 * ord + 16, load_bytes16(to + 16));
      if (box_scale_buf(b)) dg.acc = digest::add(dg.acc, digest::scale(ord, load_item<unsigned char>(scale_byte())));
      continue;
    }
    const bool wide_in = (reinterpret_cast<uintptr_t>(from) & 15u) == 0;
    const uint8_t e = block_exponent(from, wide_in, rounding);
    if (!data) {
      if (kStore) store_item<unsigned char>(to, e);
      if (P != RX_PASS_NONE) hash_element(dg, ord, e);
      continue;
    }
    // Stored before the data, so the offset math is not live across the quantize.
    if (kStore && box_scale_buf(b)) store_item<unsigned char>(scale_byte(), e);
    if (P != RX_PASS_NONE && box_scale_buf(b)) dg.acc = digest::add(dg.acc, digest::scale(ord, e));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 q = quantize_half(from, h, wide_in, e);
      if (P != RX_PASS_NONE) hash_bytes16(dg, 32 * ord + 16 * h, q);
      if (kStore) store_bytes16(to + 16 * h, q);
    }
  }
}

// The digest of a BF16 copy box whose receiver quantizes it (RX_DIGEST_CODEC): a block's
// 32 elements lie in several lanes' items, so each lane hashes the blocks that start in
// its items, reading every such block whole again (an L2 hit right after the copy), as
// the receiver's quantize sees it: BF16, from the source (cast to BF16 where the box
// casts) or, for RX_PASS_DST, from the destination.
template <int P, typename W>
RX_LANE void digest_items(const rx_box& b, const rx_tile& t, W& w, int64_t i, int64_t end, Dg& dg) {
  constexpr bool kDst = P == RX_PASS_DST;
  const int inner = b.ndim - 1;
  const int32_t dtype = kDst ? b.dst_dtype : b.src_dtype;
  const int size = kDst ? t.dst_size : t.src_size;
  const int64_t stride = (kDst ? b.dst_stride[inner] : b.src_stride[inner]) * size;
  const uint64_t align = t.unit ? ~static_cast<uint64_t>(t.unit - 1) : ~uint64_t{0};
  const char* base = reinterpret_cast<const char*>((kDst ? b.dst : b.src) & align);
  const int per = t.unit ? t.unit / size : 1;  // elements per item (contiguous when more than one)
  const int32_t rounding = RX_DIGEST_ARG(b.digest);
#pragma unroll 1
  for (; i < end; i += kWarp) {
    const char* at = base + (kDst ? w.dst_off() : w.src_off());
    w.advance();
    const int64_t k0 = dg.first + (t.unit ? (i * t.unit - dg.delta) / size : i);
    for (int j = 0; j < per; ++j) {
      if ((k0 + j) % kBlock != 0) continue;
      const char* p = at + j * size;
      const uint64_t k = static_cast<uint64_t>(k0 + j);
      if (dtype == RX_BF16 && stride == 2) {  // a contiguous block: as box_items reads it
        const bool wide = (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
        const uint8_t e = block_exponent(p, wide, rounding);
        dg.acc = digest::add(dg.acc, digest::scale(k / kBlock, e));
        hash_bytes16(dg, k, quantize_half(p, 0, wide, e));
        hash_bytes16(dg, k + 16, quantize_half(p, 1, wide, e));
        continue;
      }
      const auto load = [&](int m) -> uint16_t {
        const char* e = p + m * stride;
        const uint64_t raw = size == 2 ? load_item<unsigned short>(e)
                                       : (size == 4 ? load_item<unsigned int>(e) : load_item<unsigned long long>(e));
        return static_cast<uint16_t>(dtype == RX_BF16 ? raw : convert_bits(raw, dtype, RX_BF16));
      };
      dg.acc = digest::add(dg.acc, digest_block(load, k, rounding));
    }
  }
}

}  // namespace
}  // namespace mx
}  // namespace rx
