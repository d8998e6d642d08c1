// The NVFP4 codec's CUDA lanes (codecs/nvfp4.h says what its boxes hold): run by the box
// kernels of copy_boxes.cu through codecs/lanes.cuh, per tile, with the walk W of the
// tile's items (init_geom: an item is a 16-element block, 8 words in and 8 bytes out, or
// a scale byte).
#pragma once

#include "kernels/api.h"
#include "kernels/codecs/nvfp4.h"
#include "kernels/lane.cuh"

namespace rx {
namespace nv {
namespace {

// The items of a data box are whole blocks of its unit-stride innermost dim (a scale box's
// items are its elements, as planned).
template <int ND, typename G>
RX_LANE void init_geom(G& g, const rx_box& b, const rx_tile& t) {
  if (box_is_data(b)) group_innermost<ND, kBlockWords>(g, b, t);
}

// Words 4c..4c+3 of the block at p (4-byte aligned: words of an int32 view): one 16-byte
// load where 16-byte aligned, else word loads.
RX_LANE uint4 load_chunk(const char* p, int c, bool wide) {
  if (wide) return load_item<uint4>(p + 16 * c);
  return make_uint4(load_item<unsigned int>(p + 16 * c), load_item<unsigned int>(p + 16 * c + 4),
                    load_item<unsigned int>(p + 16 * c + 8), load_item<unsigned int>(p + 16 * c + 12));
}

// 8 packed bytes at p as two little-endian words: one load where 8-byte aligned.
RX_LANE void load8(const char* p, uint32_t* q) {
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    const uint2 v = load_item<uint2>(p);
    q[0] = v.x, q[1] = v.y;
    return;
  }
  q[0] = q[1] = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) q[k / 4] |= static_cast<uint32_t>(load_item<unsigned char>(p + k)) << (8 * (k % 4));
}

RX_LANE void store8(char* p, const uint32_t* q) {
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    store_item<uint2>(p, make_uint2(q[0], q[1]));
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) store_item<unsigned char>(p + k, static_cast<unsigned char>(q[k / 4] >> (8 * (k % 4))));
}

// NVFP4 boxes: one lane per item (no warp intrinsics, so the emulated run executes this
// very code). The tensor's amax is read once per lane. A lane reads its block once and
// holds its 8 words for the amax, the scale and the packed bytes. A data box writes a
// block's 8 packed bytes, a scale box its scale byte (and derives no multiplier). Item i
// is block i (its first byte has ordinal 8 i) or scale byte i.
template <int P, typename W>
RX_LANE void box_items(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  constexpr bool kStore = P == RX_PASS_NONE || P == RX_PASS_COPY;
  const bool data = box_is_data(b);
  const char* src = reinterpret_cast<const char*>(b.src);
  char* dst = reinterpret_cast<char*>(b.dst);
  TensorScale ts{0, 0, false};
  if (P != RX_PASS_DST) ts = tensor_scale(load_item<unsigned int>(reinterpret_cast<const char*>(box_amax(b))));
#pragma unroll 1
  for (; i < end; i += kWarp) {
    const char* from = src + w.src_off();
    char* to = dst + w.dst_off();
    w.advance();
    const uint64_t ord = static_cast<uint64_t>(i);
    uint32_t q[2];
    if (P == RX_PASS_DST) {  // what the destination holds
      if (!data) {
        hash_element(dg, ord, load_item<unsigned char>(to));
        continue;
      }
      load8(to, q);
    } else {
      const bool wide = (reinterpret_cast<uintptr_t>(from) & 15u) == 0;
      const uint4 x = load_chunk(from, 0, wide), y = load_chunk(from, 1, wide);
      const uint32_t bmax = block_amax(x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w);
      const BlockScale bs = block_scale(bmax, ts);
      if (!data) {
        if (kStore) store_item<unsigned char>(to, bs.scale);
        if (P != RX_PASS_NONE) hash_element(dg, ord, bs.scale);
        continue;
      }
      const uint32_t mult = block_mult(bmax, bs, ts);  // a scale box never needs it
      const bool finite = block_finite(bmax, mult);
      q[0] = quantize_words4(x.x, x.y, x.z, x.w, mult, finite);
      q[1] = quantize_words4(y.x, y.y, y.z, y.w, mult, finite);
      if (kStore) store8(to, q);
    }
    if (P != RX_PASS_NONE)
      dg.acc = digest::add(digest::add(dg.acc, digest::bytes4(kBlockWords * ord, q[0])),
                           digest::bytes4(kBlockWords * ord + 4, q[1]));
  }
}

}  // namespace
}  // namespace nv
}  // namespace rx
