// CUDA partial amax (codecs/amax_api.h): the CPU twin's grid, bit for bit (integer max of
// the same abs_bits, in any order).
//
// Work split: a unit is 8 consecutive columns of a segment of 16 rows; a warp's 32 lanes
// take the 32 units side by side (256 columns), so that each row's loads are coalesced.
// Where a unit's 8 columns share one cell and its rows are 16-byte aligned, a lane loads
// each row's 8 elements in one or two vector loads and folds them with packed maxima
// (amax.h Fold: the dtype and NaN mode are template parameters, two 16-bit elements per
// instruction); where its 16 rows share the cell too (every unit of NVFP4's per-tensor
// cell, and of FP8Block's 128x128 blocks), the whole unit is one max. Its 24 map entries
// come in 16-byte loads where the maps are aligned (torch's allocations are).
// A lane keeps the maxima of the last few cells it met in registers over all its units
// (a grid-stride loop over a grid of a few blocks per SM), and at the end the lanes of a
// warp that hold the same cell reduce to one atomicMax: a per-tensor amax (NVFP4), where
// every element shares one cell, costs one atomic per warp, not one per 128 elements.
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "kernels/codecs/amax.h"
#include "kernels/codecs/amax_api.h"

namespace am = rx::amax;

namespace {

constexpr int kThreads = 256;
constexpr int kCols = 8;    // columns per unit
constexpr int kRows = 16;   // rows per unit
constexpr int kSlots = 4;   // cells kept in registers before the oldest is flushed
constexpr int kBlocksPerSm = 3;  // resident at once: the launch bounds keep 80 registers

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

  // Each cell sits in at most one slot, so the compares need no early exit, and every
  // index is a constant: the slots stay in registers.
  __device__ void add(int32_t c, uint32_t a, uint32_t* grid) {
    bool hit = false;
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
      if (cell[k] == c) {
        max[k] = a > max[k] ? a : max[k];
        hit = true;
      }
    if (hit) return;
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
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

// The element type a kernel reads: the raw bits of `Dtype`.
template <int32_t Dtype>
using Elem = typename std::conditional<Dtype == RX_F32, uint32_t, uint16_t>::type;

// n consecutive map entries at m: 16-byte loads where the map is 16-byte aligned.
template <int N>
__device__ void load_map(const int32_t* __restrict__ m, bool wide, int32_t* out) {
  if (wide) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(m) + k);
      out[4 * k] = v.x, out[4 * k + 1] = v.y, out[4 * k + 2] = v.z, out[4 * k + 3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = __ldg(m + k);
}

template <int N>
__device__ bool all_equal(const int32_t* v) {
  bool same = true;
#pragma unroll
  for (int k = 1; k < N; ++k) same = same && v[k] == v[0];
  return same;
}

// The 16-byte-aligned runs of 8 elements in rows [0, N) at p, folded: every load issued
// before the first fold (one or two 16-byte loads per row).
template <int N, int32_t Dtype, int32_t Nan>
__device__ void fold_rows(const Elem<Dtype>* p, int64_t row_stride, am::Fold<Dtype, Nan>& f) {
  constexpr int kLoads = static_cast<int>(kCols * sizeof(Elem<Dtype>) / 16);
  uint4 v[N * kLoads];
#pragma unroll
  for (int i = 0; i < N; ++i, p += row_stride)
#pragma unroll
    for (int h = 0; h < kLoads; ++h) v[i * kLoads + h] = __ldg(reinterpret_cast<const uint4*>(p) + h);
#pragma unroll
  for (int k = 0; k < N * kLoads; ++k) {
    f.add2(v[k].x, v[k].y);
    f.add2(v[k].z, v[k].w);
  }
}

// Unit (seg, chunk): rows [16 seg, +16) x columns [8 chunk, +8), clipped to the piece.
template <int32_t Dtype, int32_t Nan>
__device__ void unit_amax(const Elem<Dtype>* __restrict__ src, int64_t rows, int64_t cols, int64_t row_stride,
                          const int32_t* __restrict__ rowmap, const int32_t* __restrict__ colmap, bool aligned,
                          bool wide_maps, int64_t seg, int64_t chunk, Cells& acc, uint32_t* grid) {
  const int64_t r0 = seg * kRows, c0 = chunk * kCols;
  const int nr = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
  const int nc = static_cast<int>(cols - c0 < kCols ? cols - c0 : kCols);
  const Elem<Dtype>* p = src + r0 * row_stride + c0;
  if (aligned && nc == kCols) {
    int32_t cc[kCols];
    load_map<kCols>(colmap + c0, wide_maps, cc);
    if (all_equal<kCols>(cc)) {
      if (nr == kRows) {
        int32_t rc[kRows];
        load_map<kRows>(rowmap + r0, wide_maps, rc);
        if (all_equal<kRows>(rc)) {
          // The whole unit in one cell: its loads issued 128 bytes at a time (more would
          // spill at this kernel's 80 registers), one max, one add.
          constexpr int kBatch = 128 / (kCols * sizeof(Elem<Dtype>));
          am::Fold<Dtype, Nan> f;
#pragma unroll 1
          for (int i = 0; i < kRows; i += kBatch, p += kBatch * row_stride) fold_rows<kBatch>(p, row_stride, f);
          acc.add(rc[0] + cc[0], f.bits(), grid);
          return;
        }
      }
#pragma unroll 1
      for (int i = 0; i < nr; ++i, p += row_stride) {
        am::Fold<Dtype, Nan> f;
        fold_rows<1>(p, row_stride, f);
        acc.add(__ldg(rowmap + r0 + i) + cc[0], f.bits(), grid);
      }
      return;
    }
  }
#pragma unroll 1
  for (int j = 0; j < nc; ++j) {
    const int32_t cj = __ldg(colmap + c0 + j);
#pragma unroll 1
    for (int i = 0; i < nr; ++i)
      acc.add(__ldg(rowmap + r0 + i) + cj, am::abs_bits(__ldg(p + i * row_stride + j), Dtype, Nan), grid);
  }
}

template <int32_t Dtype, int32_t Nan>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    partial_kernel(const Elem<Dtype>* __restrict__ src, int64_t rows, int64_t cols, int64_t row_stride,
                   const int32_t* __restrict__ rowmap, const int32_t* __restrict__ colmap, bool aligned,
                   bool wide_maps, uint32_t* __restrict__ grid, int64_t chunks, int64_t total) {
  Cells acc;
  acc.init();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Whole warps step together, lanes past the end idle, so that flush_warp sees all 32.
  int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u);
  int64_t t = base + (threadIdx.x & 31u);
  // Unit t is (t / chunks, t % chunks); a step of `stride` units advances both without a division.
  int64_t seg = t / chunks, chunk = t % chunks;
  const int64_t dseg = stride / chunks, dchunk = stride % chunks;
  for (; base < total; base += stride, t += stride) {
    if (t < total)
      unit_amax<Dtype, Nan>(src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, seg, chunk, acc, grid);
    seg += dseg;
    chunk += dchunk;
    if (chunk >= chunks) chunk -= chunks, ++seg;
  }
  acc.flush_warp(grid);
}

template <int32_t Dtype, int32_t Nan>
void launch(const void* src, int64_t rows, int64_t cols, int64_t row_stride, const int32_t* rowmap,
            const int32_t* colmap, bool aligned, bool wide_maps, uint32_t* grid, int64_t chunks, int64_t total,
            unsigned blocks, cudaStream_t s) {
  partial_kernel<Dtype, Nan><<<blocks, kThreads, 0, s>>>(static_cast<const Elem<Dtype>*>(src), rows, cols, row_stride,
                                                         rowmap, colmap, aligned, wide_maps, grid, chunks, total);
}

template <int32_t Dtype>
void launch(int32_t nan, const void* src, int64_t rows, int64_t cols, int64_t row_stride, const int32_t* rowmap,
            const int32_t* colmap, bool aligned, bool wide_maps, uint32_t* grid, int64_t chunks, int64_t total,
            unsigned blocks, cudaStream_t s) {
  if (nan == RX_AMAX_NAN_IGNORE)
    launch<Dtype, am::kIgnore>(src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, grid, chunks, total,
                               blocks, s);
  else
    launch<Dtype, am::kPropagate>(src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, grid, chunks, total,
                                  blocks, s);
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
  // As many sweeps as the resident blocks need, and the fewest blocks that cover the units in
  // that many: every lane gets the same number of units, none idles through a last sweep.
  const int64_t resident = static_cast<int64_t>(sms) * kBlocksPerSm * kThreads;
  const int64_t sweeps = (total + resident - 1) / resident;
  const int64_t blocks = (total + sweeps * kThreads - 1) / (sweeps * kThreads);
  const int64_t elem = dtype == RX_F32 ? 4 : 2;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 && (rows <= 1 || row_stride * elem % 16 == 0);
  const bool wide_maps = reinterpret_cast<uintptr_t>(rowmap) % 16 == 0 && reinterpret_cast<uintptr_t>(colmap) % 16 == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto n = static_cast<unsigned>(blocks);
  if (dtype == RX_BF16)
    launch<RX_BF16>(nan, src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, grid, chunks, total, n, s);
  else if (dtype == RX_F16)
    launch<RX_F16>(nan, src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, grid, chunks, total, n, s);
  else
    launch<RX_F32>(nan, src, rows, cols, row_stride, rowmap, colmap, aligned, wide_maps, grid, chunks, total, n, s);
  return static_cast<int32_t>(cudaGetLastError());
}
