// CUDA partial amax (codecs/amax_api.h): the CPU twin's grid, bit for bit (integer max of
// the same abs_bits, in any order).
//
// Work split: a thread owns 8 consecutive columns of a segment of 16 rows (a warp reads
// 256 consecutive columns of a row at a time), walks its columns outer and rows inner,
// and keeps the maxima of the last few cells it met in registers, so that a thread issues
// one atomicMax per cell it touches (a 128x128 block: 128 atomics), not one per element.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/codecs/amax.h"
#include "kernels/codecs/amax_api.h"

namespace am = rx::amax;

namespace {

constexpr int kThreads = 256;
constexpr int kCols = 8;    // columns per thread
constexpr int kRows = 16;   // rows per thread
constexpr int kSlots = 4;   // cells kept in registers before the oldest is flushed

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
    if (cell[next] >= 0) atomicMax(grid + cell[next], max[next]);
    cell[next] = c;
    max[next] = a;
    next = (next + 1) % kSlots;
  }

  __device__ void flush(uint32_t* grid) {
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
      if (cell[k] >= 0) atomicMax(grid + cell[k], max[k]);
  }
};

template <typename T>
__global__ void partial_kernel(const T* __restrict__ src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                               const int32_t* __restrict__ rowmap, const int32_t* __restrict__ colmap, int32_t nan,
                               uint32_t* __restrict__ grid, int64_t chunks, int64_t total) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r0 = t / chunks * kRows, c0 = t % chunks * kCols;
    const int nr = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
    const int nc = static_cast<int>(cols - c0 < kCols ? cols - c0 : kCols);
    int32_t rcell[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) rcell[i] = i < nr ? __ldg(rowmap + r0 + i) : 0;
    Cells acc;
    acc.init();
    for (int j = 0; j < nc; ++j) {
      const int32_t ccell = __ldg(colmap + c0 + j);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (i >= nr) break;
        const T raw = __ldg(src + (r0 + i) * row_stride + c0 + j);
        acc.add(rcell[i] + ccell, am::abs_bits(static_cast<uint32_t>(raw), dtype, nan), grid);
      }
    }
    acc.flush(grid);
  }
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
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks > (1 << 20) ? (1 << 20) : blocks;  // grid-stride beyond
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == RX_F32)
    partial_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        static_cast<const uint32_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, grid, chunks, total);
  else
    partial_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        static_cast<const uint16_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, grid, chunks, total);
  return static_cast<int32_t>(cudaGetLastError());
}
