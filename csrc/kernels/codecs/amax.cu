// CUDA partial amax (codecs/amax_api.h): the CPU twin's grid, bit for bit (integer max of
// the same abs_bits, in any order).
//
// Work split: a unit is 8 consecutive columns of a segment of 16 rows; a warp's 32 lanes
// take the 32 units side by side (256 columns), so that each row's loads are coalesced.
// Where a unit's 8 columns share one cell and its rows are 16-byte aligned, a lane loads
// each row's 8 elements in one or two vector loads and folds them into one max per row.
// A lane keeps the maxima of the last few cells it met in registers over all its units
// (a grid-stride loop over a grid of a few blocks per SM), and at the end the lanes of a
// warp that hold the same cell reduce to one atomicMax: a per-tensor amax (NVFP4), where
// every element shares one cell, costs one atomic per warp, not one per 128 elements.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/codecs/amax.h"
#include "kernels/codecs/amax_api.h"

namespace am = rx::amax;

namespace {

constexpr int kThreads = 256;
constexpr int kCols = 8;    // columns per unit
constexpr int kRows = 16;   // rows per unit
constexpr int kSlots = 4;   // cells kept in registers before the oldest is flushed
constexpr int kBlocksPerSm = 8;

struct Cells {
  int32_t cell[kSlots];
  uint32_t max[kSlots];
  int next = 0;

  __device__ void init() {
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      cell[k] = -1;
      max[k] = 0;
    }
  }

  __device__ void add(int32_t c, uint32_t a, uint32_t* grid) {
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
      if (cell[k] == c) {
        max[k] = a > max[k] ? a : max[k];
        return;
      }
#pragma unroll
    for (int k = 0; k < kSlots; ++k)  // a register index, not a stack slot
      if (k == next) {
        if (cell[k] >= 0) atomicMax(grid + cell[k], max[k]);
        cell[k] = c;
        max[k] = a;
      }
    next = (next + 1) % kSlots;
  }

  // Called by every lane of the warp (the loop below keeps the warp converged).
  __device__ void flush_warp(uint32_t* grid) {
    const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
#if __CUDA_ARCH__ >= 800
      const unsigned peers = __match_any_sync(0xffffffffu, cell[k]);
      const uint32_t m = __reduce_max_sync(peers, max[k]);
      if (cell[k] >= 0 && lane == __ffs(peers) - 1) atomicMax(grid + cell[k], m);
#else
      (void)lane;
      if (cell[k] >= 0) atomicMax(grid + cell[k], max[k]);
#endif
    }
  }
};

// Max of abs_bits over the 8 elements of a 16-byte-aligned run (one or two 16-byte loads).
template <typename T>
__device__ uint32_t run_max(const T* p, int32_t dtype, int32_t nan) {
  uint32_t m = 0;
  if constexpr (sizeof(T) == 2) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = am::abs_bits(w[k] & 0xffffu, dtype, nan), hi = am::abs_bits(w[k] >> 16, dtype, nan);
      m = lo > m ? lo : m;
      m = hi > m ? hi : m;
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + h);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t a = am::abs_bits(w[k], dtype, nan);
        m = a > m ? a : m;
      }
    }
  }
  return m;
}

template <typename T>
__device__ void unit_amax(const T* __restrict__ src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                          const int32_t* __restrict__ rowmap, const int32_t* __restrict__ colmap, int32_t nan,
                          bool aligned, int64_t t, int64_t chunks, Cells& acc, uint32_t* grid) {
  const int64_t r0 = t / chunks * kRows, c0 = t % chunks * kCols;
  const int nr = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
  const int nc = static_cast<int>(cols - c0 < kCols ? cols - c0 : kCols);
  const int32_t ccell = __ldg(colmap + c0);
  bool one_cell = aligned && nc == kCols;
#pragma unroll
  for (int j = 1; j < kCols; ++j) one_cell = one_cell && __ldg(colmap + c0 + j) == ccell;
  if (one_cell && nr == kRows) {
    // The unit's 16 rows in one cell too (a block's 128 rows, or NVFP4's one tensor cell):
    // all loads issued together, one max, one add.
    const int32_t rcell = __ldg(rowmap + r0);
    bool same = true;
#pragma unroll
    for (int i = 1; i < kRows; ++i) same = same && __ldg(rowmap + r0 + i) == rcell;
    if (same) {
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const uint32_t a = run_max(src + (r0 + i) * row_stride + c0, dtype, nan);
        m = a > m ? a : m;
      }
      acc.add(rcell + ccell, m, grid);
      return;
    }
  }
  if (one_cell) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (i >= nr) break;
      acc.add(__ldg(rowmap + r0 + i) + ccell, run_max(src + (r0 + i) * row_stride + c0, dtype, nan), grid);
    }
    return;
  }
  for (int j = 0; j < nc; ++j) {
    const int32_t cj = __ldg(colmap + c0 + j);
    for (int i = 0; i < nr; ++i) {
      const T raw = __ldg(src + (r0 + i) * row_stride + c0 + j);
      acc.add(__ldg(rowmap + r0 + i) + cj, am::abs_bits(static_cast<uint32_t>(raw), dtype, nan), grid);
    }
  }
}

template <typename T>
__global__ void partial_kernel(const T* __restrict__ src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                               const int32_t* __restrict__ rowmap, const int32_t* __restrict__ colmap, int32_t nan,
                               bool aligned, uint32_t* __restrict__ grid, int64_t chunks, int64_t total) {
  Cells acc;
  acc.init();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Whole warps step together, lanes past the end idle, so that flush_warp sees all 32.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u); base < total;
       base += stride) {
    const int64_t t = base + (threadIdx.x & 31u);
    if (t < total) unit_amax(src, dtype, rows, cols, row_stride, rowmap, colmap, nan, aligned, t, chunks, acc, grid);
  }
  acc.flush_warp(grid);
}

}  // namespace

extern "C" int32_t rx_amax_partial_cuda(const void* src, int32_t dtype, int64_t rows, int64_t cols,
                                        int64_t row_stride, const int32_t* rowmap, const int32_t* colmap,
                                        int32_t nan, uint32_t* grid, void* stream) {
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols) || !am::readable(dtype)) return -1;
  if (nan != RX_AMAX_NAN_PROPAGATE && nan != RX_AMAX_NAN_IGNORE) return -1;
  const int64_t chunks = (cols + kCols - 1) / kCols;
  const int64_t total = (rows + kRows - 1) / kRows * chunks;
  if (total == 0) return 0;
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return static_cast<int32_t>(e);
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks > static_cast<int64_t>(sms) * kBlocksPerSm ? static_cast<int64_t>(sms) * kBlocksPerSm : blocks;
  const int64_t elem = dtype == RX_F32 ? 4 : 2;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 && (rows <= 1 || row_stride * elem % 16 == 0);
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == RX_F32)
    partial_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        static_cast<const uint32_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, aligned, grid, chunks, total);
  else
    partial_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        static_cast<const uint16_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, aligned, grid, chunks, total);
  return static_cast<int32_t>(cudaGetLastError());
}
