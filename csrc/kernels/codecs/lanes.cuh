// The CUDA dispatch over the codecs (registry.h), once per tile: copy_boxes.cu calls these
// for a box with a codec (or a codec digest) instead of its copy loop. One case per id.
#pragma once

#include "kernels/codecs/fp8block_lanes.cuh"
#include "kernels/codecs/mxfp8_lanes.cuh"
#include "kernels/codecs/nvfp4_lanes.cuh"
#include "kernels/codecs/registry.h"
#include "kernels/lane.cuh"

namespace rx {
namespace {

// A codec's view of a tile's items, after the copy's (init_geom of copy_boxes.cu).
template <int ND, typename G>
RX_LANE void codec_geom(G& g, const rx_box& b, const rx_tile& t) {
  switch (RX_CODEC_ID(b.codec)) {
    case RX_CODEC_MXFP8:
    case RX_CODEC_MXFP8_SCALES: mx::init_geom<ND>(g, b, t); break;
    case RX_CODEC_FP8BLOCK: fp8b::init_geom<ND>(g, b, t); break;
    case RX_CODEC_NVFP4:
    case RX_CODEC_NVFP4_SCALES: nv::init_geom<ND>(g, b, t); break;
    default: break;  // a copy: items as planned
  }
}

// The codec box's items [i, end) of this lane, stepping by a warp (or verify pass P).
template <int P, typename W>
RX_LANE void codec_items_inline(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  switch (RX_CODEC_ID(b.codec)) {
    case RX_CODEC_MXFP8:
    case RX_CODEC_MXFP8_SCALES: mx::box_items<P>(b, w, i, end, dg); break;
    case RX_CODEC_FP8BLOCK: fp8b::box_items<P>(b, w, i, end, dg); break;
    case RX_CODEC_NVFP4:
    case RX_CODEC_NVFP4_SCALES: nv::box_items<P>(b, w, i, end, dg); break;
    default: break;
  }
}

// The hashing copy pass runs at 80 registers: codec boxes there are called, not inlined,
// so that their registers do not make the plain copy loop spill.
template <int P, typename W>
__host__ __device__ __noinline__ void codec_items_called(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  codec_items_inline<P>(b, w, i, end, dg);
}

template <int P, typename W>
RX_LANE void codec_items(const rx_box& b, W& w, int64_t i, int64_t end, Dg& dg) {
  if constexpr (P == RX_PASS_COPY) codec_items_called<P>(b, w, i, end, dg);
  else codec_items_inline<P>(b, w, i, end, dg);
}

// Verify pass P of a copy box with a codec digest (RX_DIGEST_CODEC) over this lane's items.
template <int P, typename W>
RX_LANE void codec_digest_items(const rx_box& b, const rx_tile& t, W& w, int64_t i, int64_t end, Dg& dg) {
  switch (RX_DIGEST_CODEC_ID(b.digest)) {
    case RX_CODEC_MXFP8: mx::digest_items<P>(b, t, w, i, end, dg); break;
    default: break;
  }
}

}  // namespace
}  // namespace rx
