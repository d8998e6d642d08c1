// What the per-lane code of the box kernels (copy_boxes.cu) shares with the codecs'
// lanes (codecs/*_lanes.cuh): item loads and stores and a lane's verify digest. Included
// through box_lanes.cuh (internal linkage: each box-kernel translation unit has its copy).
// __host__ __device__ and free of warp intrinsics, so the emulated run executes it too.
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "core/box.h"
#include "kernels/cast.h"
#include "kernels/digest.h"

#define RX_LANE __host__ __device__ __forceinline__

namespace rx {
namespace {

constexpr int kWarp = 32;

// Global-space accesses that skip L1 (data is touched once); plain ones on the host.
// A codec box's items as runs of `per` elements of its unit-stride innermost dim (a
// block, or a quantizer's item): the walk G steps over runs, not elements.
template <int ND, int Per, typename G>
RX_LANE void group_innermost(G& g, const rx_box& b, const rx_tile& t) {
  g.n[ND - 1] = b.shape[b.ndim - 1] / Per;
  g.ss[ND - 1] = Per * t.src_size;
  g.ds[ND - 1] = Per * t.dst_size;
}

template <typename T>
RX_LANE T load_item(const char* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(reinterpret_cast<const T*>(p));
#else
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
#endif
}

template <typename T>
RX_LANE void store_item(char* p, T v) {
#if defined(__CUDA_ARCH__)
  __stcg(reinterpret_cast<T*>(p), v);
#else
  memcpy(p, &v, sizeof(T));
#endif
}

// 16 bytes at p (a codec's output): one access where 16-byte aligned, else byte (load) or
// word/byte (store) accesses.
RX_LANE uint4 load_bytes16(const char* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) return load_item<uint4>(p);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 16; ++k) w[k / 4] |= static_cast<uint32_t>(load_item<unsigned char>(p + k)) << (8 * (k % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

RX_LANE void store_bytes16(char* p, uint4 q) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if ((a & 15u) == 0) {
    store_item<uint4>(p, q);
    return;
  }
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if ((a & 3u) == 0) {
      store_item<unsigned int>(p + 4 * k, qw[k]);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) store_item<unsigned char>(p + 4 * k + j, static_cast<unsigned char>(qw[k] >> (8 * j)));
  }
}

// One lane's digest of a verify pass: the sum so far and how the box's elements count
// (fixed per box). Unused by the plain copy (P = RX_PASS_NONE).
struct Dg {
  uint64_t acc;
  int32_t dtype;  // the elements as written: the box's dst dtype ...
  int32_t size;   // ... and its size
  int32_t spec;   // rx_box.digest
  int32_t shift;  // log2(size): an item's first ordinal without a 64-bit division
  int64_t delta;  // bytes from a copy item's unit-aligned base to the box's first element
  int64_t first;  // the ordinal of the box's first element (RX_BOX_FIRST_ORDINAL, core/box.h)
};

// The term of element `bits` (of dtype `from`) at ordinal k as the receiver's cast to
// `to` holds it. Out of line: inlined, the conversion is copied into every unrolled item
// path of every verify pass, which bloats the kernels (and their compile) for a rare case.
__host__ __device__ __noinline__ uint64_t cast_term(uint64_t k, uint64_t bits, int32_t from, int32_t to) {
  return digest::element(k, convert_bits(bits, from, to), to == RX_F64 ? 8 : (to == RX_F32 ? 4 : 2));
}

// Adds the term of one element as written (`bits` of dg.dtype) at ordinal k.
RX_LANE void hash_element(Dg& dg, uint64_t k, uint64_t bits) {
  const uint64_t term = RX_DIGEST_KIND(dg.spec) == RX_DIGEST_CAST
                            ? cast_term(k, bits, dg.dtype, RX_DIGEST_ARG(dg.spec))  // as the receiver's cast holds it
                            : digest::element(k, bits, dg.size);
  dg.acc = digest::add(dg.acc, term);
}

// Digest terms of 16 one-byte elements (four little-endian words) at ordinals k..
RX_LANE void hash_bytes16(Dg& dg, uint64_t k, uint4 q) {
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) dg.acc = digest::add(dg.acc, digest::bytes4(k + 4 * m, qw[m]));
}

}  // namespace
}  // namespace rx
