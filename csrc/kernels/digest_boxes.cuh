// The verify passes of the box copy: pass P of the per-lane code (box_lanes.cuh) over
// every tile, each warp adding its lanes' digests into its box's. One pass per translation
// unit (digest_boxes_<pass>.cu), so a build compiles the three in parallel; the C API's
// dispatch over them is digest_boxes.cu.
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>

#include "kernels/api.h"
#include "kernels/box_lanes.cuh"
#include "kernels/digest_boxes.h"

namespace rx {
namespace {

// Every tile takes the general path (its box says how to digest) and adds its lanes'
// digests into the box's with one atomic per 32-bit word. A kernel of its own so the
// copy's register budget stays as it is. The read passes keep up to 128 registers (half
// the copy's occupancy); the copy pass (a verified refit's pack and unpack) runs three
// blocks per SM (80 registers): its stores need more warps in flight, or the pipeline
// waits for it. One grid-stride instance per pass serves capped and uncapped grids alike
// (an uncapped grid runs its loop once): half the instances to compile.
template <int P>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp, P == RX_PASS_COPY ? 3 : 2)
    digest_boxes_kernel(const rx_box* __restrict__ boxes, const rx_tile* __restrict__ tiles, int64_t num_tiles,
                        uint64_t* __restrict__ digests) {
  __shared__ Geom<RX_MAX_DIMS> slots[kWarpsPerBlock];
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < num_tiles; t += step) {
    Dg dg{};
    run_general<P>(boxes, tiles[t], lane, slots[warp], dg);
    uint32_t lo = static_cast<uint32_t>(dg.acc), hi = static_cast<uint32_t>(dg.acc >> 32);
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      lo += __shfl_xor_sync(0xffffffffu, lo, o);
      hi += __shfl_xor_sync(0xffffffffu, hi, o);
    }
    if (lane == 0) {
      unsigned int* d = reinterpret_cast<unsigned int*>(digests + tiles[t].box);
      atomicAdd(d, lo);
      atomicAdd(d + 1, hi);
    }
    __syncwarp();  // the next tile rewrites the warp's slot
  }
}

}  // namespace

template <int P>
int32_t launch_digest(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t max_blocks,
                      cudaStream_t stream, uint64_t* digests) {
  int64_t blocks = (num_tiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (max_blocks > 0 && max_blocks < blocks) blocks = max_blocks;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  digest_boxes_kernel<P><<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarp, 0, stream>>>(boxes, tiles, num_tiles,
                                                                                               digests);
  return cudaGetLastError();
}

}  // namespace rx
