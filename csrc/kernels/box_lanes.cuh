// The per-lane code of the box kernels: the copy (copy_boxes.cu), its verify passes
// (digest_boxes.cu) and their host runs (boxes_emulated.cu) share it.
//
// One warp per tile (tiles.cc). A warp loads its 64-byte tile record in one go; a flat
// tile (RX_TILE_FLAT, api.h) carries its geometry, any other one reads its box next.
// Lane l of a tile handles items begin+l, begin+l+32, ...
// Each lane keeps its position as mixed-radix digits over the box's extents and steps
// by 32 items with carries (no division in the loop), issuing kUnroll independent
// loads before their stores so several accesses per lane are in flight. Items are
// 1..16 bytes (uint4 on the fast path) or, for a cast, single elements converted with
// cast.h so the bits equal the CPU twin and torch's Tensor.to. Codec boxes (api.h) run
// their codec's lanes (codecs/lanes.cuh: MXFP8 takes one 32-element block, or one scale
// byte, per item).
//
// The per-lane code is __host__ __device__ and has no warp intrinsics, so
// rx_copy_boxes_emulated runs the very same index math on the host (tests on machines
// without a GPU).
//
// Verify passes (rx_digest_boxes_cuda, api.h) are separate instances of the same code,
// template parameter P = rx_pass (RX_PASS_NONE: the plain copy, unchanged): each lane
// adds the digest terms (kernels/digest.h) of the elements it moves into a Dg, from the
// registers it stores (RX_PASS_COPY) or would store (RX_PASS_SRC), or from the
// destination it reads (RX_PASS_DST); the warp then adds its lanes' sums and one lane
// adds them to the box's digest with two 32-bit atomics.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdint.h>
#include <string.h>

#include "kernels/api.h"
#include "kernels/cast.h"
#include "kernels/codecs/lanes.cuh"
#include "kernels/digest.h"
#include "kernels/lane.cuh"

namespace rx {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;  // independent loads in flight per lane

// A box viewed as ND dims of items (outermost first); boxes with fewer dims are padded
// in front with extent-1, stride-0 dims. Uniform over the warp.
template <int ND>
struct Geom {
  int64_t n[ND];     // extents in items
  int64_t ss[ND];    // byte strides, src side
  int64_t ds[ND];    // byte strides, dst side
  int64_t step[ND];  // kWarp items in the same radix
};

// One lane's position as mixed-radix digits over a Geom. G is Geom<ND> (registers) or
// volatile Geom<ND> (a shared-memory slot: the general walk would otherwise hold ~100
// registers and halve the occupancy of every path).
template <int ND, typename G>
struct Walk {
  G& g;
  int64_t dig[ND];

  RX_LANE void advance() {
    int64_t carry = 0;
#pragma unroll
    for (int d = ND - 1; d > 0; --d) {  // digit + step < 2 * extent: one subtraction
      const int64_t n = g.n[d];
      const int64_t v = dig[d] + g.step[d] + carry;
      carry = v >= n;
      dig[d] = carry ? v - n : v;
    }
    dig[0] += g.step[0] + carry;
  }

  RX_LANE int64_t src_off() const {
    int64_t o = 0;
#pragma unroll
    for (int d = 0; d < ND; ++d) o += dig[d] * g.ss[d];
    return o;
  }

  RX_LANE int64_t dst_off() const {
    int64_t o = 0;
#pragma unroll
    for (int d = 0; d < ND; ++d) o += dig[d] * g.ds[d];
    return o;
  }
};

template <int ND, typename N, typename Out>
RX_LANE void split(const N& n, int64_t i, Out& out) {
#pragma unroll
  for (int d = ND - 1; d > 0; --d) {
    out[d] = i % n[d];
    i /= n[d];
  }
  out[0] = i;
}

template <int ND, typename G>
RX_LANE void init_geom(G& g, const rx_box& b, const rx_tile& t) {
  const int pad = ND - b.ndim;
#pragma unroll
  for (int d = 0; d < ND; ++d) {
    if (d < pad) {
      g.n[d] = 1;
      g.ss[d] = g.ds[d] = 0;
    } else {
      g.n[d] = b.shape[d - pad];
      g.ss[d] = b.src_stride[d - pad] * t.src_size;
      g.ds[d] = b.dst_stride[d - pad] * t.dst_size;
    }
  }
  if (t.unit > t.src_size) {  // contiguous innermost dim read as wider items
    g.n[ND - 1] = b.shape[b.ndim - 1] * t.src_size / t.unit;
    g.ss[ND - 1] = g.ds[ND - 1] = t.unit;
  }
  codec_geom<ND>(g, b, t);  // a codec's items (an MXFP8 block)
  split<ND>(g.n, kWarp, g.step);
}

// An item's bytes as little-endian 32-bit words.
RX_LANE void words_of(uint4 v, uint32_t* w) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
RX_LANE void words_of(unsigned long long v, uint32_t* w) {
  w[0] = static_cast<uint32_t>(v);
  w[1] = static_cast<uint32_t>(v >> 32);
}
template <typename T>
RX_LANE void words_of(T v, uint32_t* w) { w[0] = v; }

// Element j (ES bytes, zero-extended) of an item's little-endian words; j a constant,
// so the words stay in registers.
template <int ES>
RX_LANE uint64_t element_bits(const uint32_t* w, int j) {
  const int byte = j * ES;
  if (ES == 8) return w[byte / 4] | static_cast<uint64_t>(w[byte / 4 + (ES == 8 ? 1 : 0)]) << 32;
  return ES == 4 ? w[byte / 4] : (w[byte / 4] >> (8 * (byte % 4))) & (ES == 2 ? 0xffffu : 0xffu);
}

// The ES-byte elements of one N-byte item whose first element has ordinal k.
template <int ES, int N>
RX_LANE void hash_words(Dg& dg, const uint32_t* w, uint64_t k) {
#pragma unroll
  for (int j = 0; j < N / ES; ++j) hash_element(dg, k + j, element_bits<ES>(w, j));
}

// hash_words of elements kept as written (RX_DIGEST_AS_WRITTEN), the hot path of a
// verified refit: one key() per item, then one add per element (digest::keyed), summed
// in two 32-bit words. Falls back where the ordinal's low word wraps inside the item.
template <int ES, int N>
RX_LANE void hash_words_as_written(Dg& dg, const uint32_t* w, uint64_t k) {
  constexpr int M = N / ES;
  if ((k & 0xffffffffu) + (M - 1) > 0xffffffffu) {
    hash_words<ES, N>(dg, w, k);
    return;
  }
  const uint32_t kk = digest::key(k);
  uint64_t acc = 0;
#pragma unroll
  for (int j = 0; j < M; ++j)
    acc = digest::add(acc, digest::keyed(kk + static_cast<uint32_t>(j) * digest::kKeyLo, element_bits<ES>(w, j), ES));
  dg.acc = digest::add(dg.acc, acc);
}

// The elements of item i (sizeof(T) bytes) of a same-dtype copy. Items are unit-aligned
// and every unit byte from the box's first element on is the box's, so i * N >= delta.
template <typename T>
RX_LANE void hash_item(Dg& dg, T v, int64_t i) {
  constexpr int N = static_cast<int>(sizeof(T));
  uint32_t w[N >= 4 ? N / 4 : 1];
  words_of(v, w);
  const uint64_t k = (static_cast<uint64_t>(i * N - dg.delta) >> dg.shift) + static_cast<uint64_t>(dg.first);
  if (RX_DIGEST_KIND(dg.spec) == RX_DIGEST_AS_WRITTEN) {
    switch (dg.size) {  // the unit is a multiple of the element
      case 1: hash_words_as_written<1, N>(dg, w, k); break;
      case 2: if constexpr (N >= 2) hash_words_as_written<2, N>(dg, w, k); break;
      case 4: if constexpr (N >= 4) hash_words_as_written<4, N>(dg, w, k); break;
      default: if constexpr (N >= 8) hash_words_as_written<8, N>(dg, w, k); break;
    }
    return;
  }
  switch (dg.size) {  // a receiver's cast (RX_DIGEST_CAST): floating elements only
    case 2: if constexpr (N >= 2) hash_words<2, N>(dg, w, k); break;
    case 4: if constexpr (N >= 4) hash_words<4, N>(dg, w, k); break;
    default: if constexpr (N >= 8) hash_words<8, N>(dg, w, k); break;
  }
}

template <int P, int U, typename T, typename W>
RX_LANE void copy_items(const char* src, char* dst, W& w, int64_t i, int64_t end, Dg& dg) {
#pragma unroll 1  // the inner passes are unrolled; more only costs registers
  for (; i < end; i += kWarp * U) {
    T v[U];
    int64_t to[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (i + k * kWarp < end) v[k] = load_item<T>(P == RX_PASS_DST ? dst + w.dst_off() : src + w.src_off());
      to[k] = w.dst_off();
      w.advance();
    }
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (i + k * kWarp < end) {
        if (P == RX_PASS_NONE || P == RX_PASS_COPY) store_item<T>(dst + to[k], v[k]);
        if (P != RX_PASS_NONE) hash_item(dg, v[k], i + k * kWarp);
      }
  }
}

template <int U, typename T>
RX_LANE void load_raw(const char* src, const int64_t* from, const bool* ok, uint64_t* raw) {
#pragma unroll
  for (int k = 0; k < U; ++k) raw[k] = ok[k] ? load_item<T>(src + from[k]) : 0;
}

template <int U, typename T>
RX_LANE void store_raw(char* dst, const int64_t* to, const bool* ok, const uint64_t* raw) {
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (ok[k]) store_item<T>(dst + to[k], static_cast<T>(raw[k]));
}

template <int P, int U, typename W>
RX_LANE void cast_items(const char* src, char* dst, const rx_box& b, const rx_tile& t, W& w, int64_t i,
                        int64_t end, Dg& dg) {
  const int s = b.src_dtype, d = b.dst_dtype;
#pragma unroll 1
  for (; i < end; i += kWarp * U) {
    int64_t from[U], to[U];
    bool ok[U];
    uint64_t raw[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      ok[k] = i + k * kWarp < end;
      from[k] = w.src_off();
      to[k] = w.dst_off();
      w.advance();
    }
    if (P == RX_PASS_DST) {  // what the destination holds, in its own dtype
      switch (t.dst_size) {
        case 2: load_raw<U, unsigned short>(dst, to, ok, raw); break;
        case 4: load_raw<U, unsigned int>(dst, to, ok, raw); break;
        default: load_raw<U, unsigned long long>(dst, to, ok, raw); break;
      }
    } else {
      switch (t.src_size) {  // loads of a whole pass first, then convert and store
        case 2: load_raw<U, unsigned short>(src, from, ok, raw); break;
        case 4: load_raw<U, unsigned int>(src, from, ok, raw); break;
        default: load_raw<U, unsigned long long>(src, from, ok, raw); break;
      }
#pragma unroll
      for (int k = 0; k < U; ++k) raw[k] = convert_bits(raw[k], s, d);
    }
    if (P == RX_PASS_NONE || P == RX_PASS_COPY) {
      switch (t.dst_size) {
        case 2: store_raw<U, unsigned short>(dst, to, ok, raw); break;
        case 4: store_raw<U, unsigned int>(dst, to, ok, raw); break;
        default: store_raw<U, unsigned long long>(dst, to, ok, raw); break;
      }
    }
    if (P != RX_PASS_NONE) {
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (ok[k]) hash_element(dg, static_cast<uint64_t>(dg.first + i + k * kWarp), raw[k]);
    }
  }
}

// The same-dtype copy of this lane's items, `unit` bytes per access.
template <int P, int U, typename W>
RX_LANE void copy_units(int unit, const char* src, char* dst, W& w, int64_t first, int64_t end, Dg& dg) {
  switch (unit) {
    case 16: copy_items<P, U, uint4>(src, dst, w, first, end, dg); break;
    case 8: copy_items<P, U, unsigned long long>(src, dst, w, first, end, dg); break;
    case 4: copy_items<P, U, unsigned int>(src, dst, w, first, end, dg); break;
    case 2: copy_items<P, U, unsigned short>(src, dst, w, first, end, dg); break;
    default: copy_items<P, U, unsigned char>(src, dst, w, first, end, dg); break;
  }
}

// (i / n, i % n) without a 64-bit division where 32 bits hold both (nearly always).
RX_LANE void split_row(int64_t n, int64_t i, int64_t* q_r) {
  if (i < n) {
    q_r[0] = 0;
    q_r[1] = i;
    return;
  }
  const int64_t q = static_cast<uint64_t>(i | n) <= UINT32_MAX
                        ? static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(n))
                        : i / n;
  q_r[0] = q;
  q_r[1] = i - q * n;
}

// A flat tile: rows of row_items contiguous items, geometry from the tile alone.
RX_LANE void run_flat(const rx_tile& t, int lane) {
  const int64_t first = t.begin + lane;
  if (first >= t.end) return;
  Geom<2> g;
  g.n[0] = 0;  // the outer digit only ever counts up
  g.n[1] = t.row_items;
  g.ss[0] = t.src_pitch;
  g.ds[0] = t.dst_pitch;
  g.ss[1] = g.ds[1] = t.unit;
  split_row(g.n[1], kWarp, g.step);
  Walk<2, Geom<2>> w{g, {}};
  split_row(g.n[1], first, w.dig);
  Dg none{};
  copy_units<RX_PASS_NONE, kUnroll>(t.unit, reinterpret_cast<const char*>(t.src), reinterpret_cast<char*>(t.dst), w,
                                    first, t.end, none);
}

// The copy (or verify pass) of this lane's items of a COPY box.
template <int P, int U, typename W>
RX_LANE void run_copy(const rx_box& b, const rx_tile& t, W& w, int64_t first, Dg& dg) {
  if (t.unit == 0) {
    cast_items<P, U>(reinterpret_cast<const char*>(b.src), reinterpret_cast<char*>(b.dst), b, t, w, first, t.end, dg);
    return;
  }
  const uint64_t align = ~static_cast<uint64_t>(t.unit - 1);
  copy_units<P, U>(t.unit, reinterpret_cast<const char*>(b.src & align), reinterpret_cast<char*>(b.dst & align), w, first,
                   t.end, dg);
}

// Copies (or runs verify pass P over) this lane's items of tile t. g: where the tile's
// geometry lives (see Walk).
template <int P, int ND, typename G>
RX_LANE void run_tile(const rx_box& b, const rx_tile& t, int lane, G& g, Dg& dg) {
  // The general walk keeps fewer accesses in flight: its digits cost registers, as does
  // the copy pass's digest beside its stores. The read-only passes (direct messages,
  // rx.verify) stream from HBM with nothing else in flight: they need the loads.
  constexpr int U = ND <= 2 && P != RX_PASS_COPY ? kUnroll : 2;
  const int64_t first = t.begin + lane;
  if (first >= t.end) return;
  init_geom<ND>(g, b, t);
  Walk<ND, G> w{g, {}};
  split<ND>(g.n, first, w.dig);
  if constexpr (P != RX_PASS_NONE) {
    dg.dtype = b.dst_dtype;
    dg.size = t.dst_size;
    dg.spec = b.digest;
    dg.shift = dg.size == 8 ? 3 : (dg.size == 4 ? 2 : (dg.size == 2 ? 1 : 0));
    dg.first = RX_BOX_FIRST_ORDINAL(b);
    dg.delta = t.unit ? static_cast<int64_t>(b.src & static_cast<uint64_t>(t.unit - 1)) : 0;
  }
  if (b.codec != RX_CODEC_NONE) {
    codec_items<P>(b, w, first, t.end, dg);
    return;
  }
  if constexpr (P != RX_PASS_NONE) {
    if (RX_DIGEST_KIND(b.digest) == RX_DIGEST_CODEC) {
      Walk<ND, G> again = w;
      if (P == RX_PASS_COPY) run_copy<RX_PASS_NONE, U>(b, t, w, first, dg);
      codec_digest_items<P>(b, t, again, first, t.end, dg);
      return;
    }
  }
  run_copy<P, U>(b, t, w, first, dg);
}

// Most boxes fold to 1 or 2 dims (make_box merges contiguous dims); those keep their
// geometry in registers, the rest share the padded general walk in `slot`.
template <int P>
RX_LANE void run_general(const rx_box* boxes, const rx_tile& t, int lane, volatile Geom<RX_MAX_DIMS>& slot, Dg& dg) {
  const rx_box& b = boxes[t.box];
  switch (b.ndim) {
    case 1: {
      Geom<1> g;
      run_tile<P, 1>(b, t, lane, g, dg);
      break;
    }
    case 2: {
      Geom<2> g;
      run_tile<P, 2>(b, t, lane, g, dg);
      break;
    }
    default: run_tile<P, RX_MAX_DIMS>(b, t, lane, slot, dg); break;
  }
}

// Narrows t to share `share` of its 1 << warp_shift shares (rx_tile_warp_shift): whole
// warp passes each, in order. False: the share is empty (a tile shorter than the rest).
RX_LANE bool narrow_tile(rx_tile& t, int64_t share, int warp_shift) {
  const int64_t n = t.end - t.begin;
  const int64_t per = (((n + (int64_t{1} << warp_shift) - 1) >> warp_shift) + kWarp - 1) / kWarp * kWarp;
  const int64_t begin = t.begin + share * per;
  if (begin >= t.end) return false;
  t.begin = begin;
  t.end = begin + per < t.end ? begin + per : t.end;
  return true;
}

// The launch side of the shares (copy and verify kernels alike): whether warp_shift is in
// range with num_tiles << warp_shift representable; the blocks of a grid of one warp per
// share; and the shift a cap max_blocks > 0 leaves, lowered until that grid fits it.
inline bool warp_shift_ok(int64_t num_tiles, int32_t warp_shift) {
  return warp_shift >= 0 && warp_shift <= RX_MAX_WARP_SHIFT && num_tiles <= (INT64_MAX >> (RX_MAX_WARP_SHIFT + 1));
}
inline int64_t share_blocks(int64_t num_tiles, int32_t warp_shift) {
  return ((num_tiles << warp_shift) + kWarpsPerBlock - 1) / kWarpsPerBlock;
}
inline int32_t capped_warp_shift(int64_t num_tiles, int32_t max_blocks, int32_t warp_shift) {
  while (max_blocks > 0 && warp_shift > 0 && share_blocks(num_tiles, warp_shift) > max_blocks) --warp_shift;
  return warp_shift;
}

// The host loop's dispatch (rx_copy_boxes_emulated); the kernel's is run_warp.
RX_LANE void run_lane(const rx_box* boxes, const rx_tile& t, int lane, volatile Geom<RX_MAX_DIMS>& slot) {
  Dg none{};
  if (t.flags & RX_TILE_FLAT)
    run_flat(t, lane);
  else
    run_general<RX_PASS_NONE>(boxes, t, lane, slot, none);
}

}  // namespace
}  // namespace rx
