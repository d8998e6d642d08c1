// The CUDA box copy: one launch copies every box of a device-resident table, one warp
// per tile (tiles.cc), with the per-lane code of box_lanes.cuh.
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "kernels/api.h"
#include "kernels/box_lanes.cuh"

namespace rx {
namespace {

constexpr int kMinBlocksPerSm = 4;  // 64 registers: 32 warps per SM, ~64 KiB of loads in flight

// One tile: the record as four independent 16-byte loads (one round trip, not one per
// field); a general tile then reads its fields from memory again (L1 hits), so the
// register copy is dead in the general walk, which has no registers to spare.
__device__ __forceinline__ void run_warp(const rx_box* boxes, const rx_tile* tile, int64_t share, int warp_shift,
                                         int lane, volatile Geom<RX_MAX_DIMS>& slot) {
  const uint4* q = reinterpret_cast<const uint4*>(tile);
  uint4 v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = __ldg(q + k);
  rx_tile t;
  memcpy(&t, v, sizeof t);
  if (!narrow_tile(t, share, warp_shift)) return;
  Dg none{};
  if (t.flags & RX_TILE_FLAT)
    run_flat(t, lane);
  else
    run_general<RX_PASS_NONE>(boxes, t, lane, slot, none);
}

// kStride: warps loop over the tiles (a launch capped below one warp per tile), a whole
// tile each: short shares would each pay the record's load on few warps per SM. Else warp
// w takes share w % (1 << warp_shift) of tile w >> warp_shift. A
// separate instance: the loop state does not fit the one-pass kernel's 64 registers,
// and a capped grid does not need that occupancy: the transport caps at half or three
// quarters of the SMs, one block per SM, so this instance may use up to 255 registers
// (tests/test_cuda_build.py checks it does not spill). A cap above the SM count
// (RESHARD_EXT_CUDA_MAX_BLOCKS) runs the blocks past one per SM in later waves.
template <bool kStride>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp, kStride ? 1 : kMinBlocksPerSm)
    copy_boxes_kernel(const rx_box* __restrict__ boxes, const rx_tile* __restrict__ tiles, int64_t num_tiles,
                      int warp_shift) {
  __shared__ Geom<RX_MAX_DIMS> slots[kWarpsPerBlock];  // every lane writes the same values
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if constexpr (!kStride) {
    if (t < (num_tiles << warp_shift))
      run_warp(boxes, tiles + (t >> warp_shift), t & ((int64_t{1} << warp_shift) - 1), warp_shift, lane, slots[warp]);
  } else {
    for (; t < num_tiles; t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
      run_warp(boxes, tiles + t, 0, 0, lane, slots[warp]);
      __syncwarp();  // the next tile rewrites the warp's slot: no lane may still read this one
    }
  }
}

}  // namespace
}  // namespace rx

extern "C" int32_t rx_copy_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev, int64_t num_tiles,
                                      int32_t max_blocks, int32_t warp_shift, void* stream) {
  if (num_tiles <= 0) return cudaSuccess;
  if (!rx::warp_shift_ok(num_tiles, warp_shift)) return cudaErrorInvalidValue;
  warp_shift = rx::capped_warp_shift(num_tiles, max_blocks, warp_shift);
  const int64_t blocks = rx::share_blocks(num_tiles, warp_shift);
  if (max_blocks > 0 && max_blocks < blocks) {
    rx::copy_boxes_kernel<true><<<static_cast<unsigned>(max_blocks), rx::kWarpsPerBlock * rx::kWarp, 0,
                                  static_cast<cudaStream_t>(stream)>>>(boxes_dev, tiles_dev, num_tiles, 0);
    return cudaGetLastError();
  }
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  rx::copy_boxes_kernel<false><<<static_cast<unsigned>(blocks), rx::kWarpsPerBlock * rx::kWarp, 0,
                          static_cast<cudaStream_t>(stream)>>>(boxes_dev, tiles_dev, num_tiles, warp_shift);
  return cudaGetLastError();
}
