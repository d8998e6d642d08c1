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

// Every tile takes the general path (its box says how to digest). Work item w is share
// w % (1 << warp_shift) of tile w >> warp_shift (narrow_tile, as in the copy), one warp
// each; the warps of a block sharing a tile add their sums in shared memory, so a tile
// costs one pair of 32-bit atomics per block, not one per warp. A kernel of its own so
// the copy's register budget stays as it is. The read passes keep up to 128 registers
// (half the copy's occupancy); the copy pass (a verified refit's pack and unpack) runs
// three blocks per SM (80 registers): its stores need more warps in flight, or the
// pipeline waits for it. One grid-stride instance per pass serves capped and uncapped
// grids alike (an uncapped grid runs its loop once): half the instances to compile.
template <int P>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp, P == RX_PASS_COPY ? 3 : 2)
    digest_boxes_kernel(const rx_box* __restrict__ boxes, const rx_tile* __restrict__ tiles, int64_t num_tiles,
                        int warp_shift, uint64_t* __restrict__ digests) {
  __shared__ Geom<RX_MAX_DIMS> slots[kWarpsPerBlock];
  __shared__ uint64_t sums[kWarpsPerBlock];
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t items = num_tiles << warp_shift;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  // Warps that share a tile within a block: aligned groups, as blocks start at multiples of 8.
  const int group = 1 << (warp_shift < 3 ? warp_shift : 3);
  // The bound is the block's, so every warp reaches each __syncthreads.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock; base < items; base += step) {
    const int64_t w = base + warp;
    Dg dg{};
    if (w < items) {
      rx_tile t = tiles[w >> warp_shift];
      if (narrow_tile(t, w & ((int64_t{1} << warp_shift) - 1), warp_shift))
        run_general<P>(boxes, t, lane, slots[warp], dg);
    }
    uint32_t lo = static_cast<uint32_t>(dg.acc), hi = static_cast<uint32_t>(dg.acc >> 32);
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      lo += __shfl_xor_sync(0xffffffffu, lo, o);
      hi += __shfl_xor_sync(0xffffffffu, hi, o);
    }
    if (lane == 0) sums[warp] = static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32;
    __syncthreads();
    if (lane == 0 && warp % group == 0 && w < items) {
      uint64_t s = 0;
      for (int k = 0; k < group; ++k) s = digest::add(s, sums[warp + k]);
      unsigned int* d = reinterpret_cast<unsigned int*>(digests + tiles[w >> warp_shift].box);
      atomicAdd(d, static_cast<uint32_t>(s));
      atomicAdd(d + 1, static_cast<uint32_t>(s >> 32));
    }
    __syncthreads();  // the next round rewrites the slots and sums
  }
}

}  // namespace

template <int P>
int32_t launch_digest(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t max_blocks,
                      int32_t warp_shift, cudaStream_t stream, uint64_t* digests) {
  if (!warp_shift_ok(num_tiles, warp_shift)) return cudaErrorInvalidValue;
  warp_shift = capped_warp_shift(num_tiles, max_blocks, warp_shift);
  int64_t blocks = share_blocks(num_tiles, warp_shift);
  if (max_blocks > 0 && max_blocks < blocks) blocks = max_blocks;  // then warps stride over the shares
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  digest_boxes_kernel<P><<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarp, 0, stream>>>(boxes, tiles, num_tiles,
                                                                                               warp_shift, digests);
  return cudaGetLastError();
}

}  // namespace rx
