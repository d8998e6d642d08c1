// CUDA blockwise FP8 scales and whole-piece quantize (codecs/fp8block_api.h): the bytes of
// the CPU twins (codecs/fp8block_cpu.cc), one launch each; both run fp8block.h's math.
// The quantize gives a thread 8 consecutive columns of a row (a warp: 256 columns).
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/codecs/fp8block.h"
#include "kernels/codecs/fp8block_api.h"

namespace fp8b = rx::fp8b;

namespace {

constexpr int kThreads = 256;
constexpr int kPer = 8;

__global__ void scales_kernel(const uint32_t* __restrict__ amax, int64_t cells, int32_t scales,
                              uint32_t* __restrict__ scale_inv, uint32_t* __restrict__ mult) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < cells;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    scale_inv[i] = fp8b::block_scale_inv(amax[i], scales);
    mult[i] = fp8b::block_mult(amax[i], scales);
  }
}

// Eight columns of one row in one block: two quantize4.
__device__ __forceinline__ uint2 quantize8(const uint32_t* v, bool bf16, uint32_t m, int32_t scales) {
  if (bf16)
    return make_uint2(fp8b::quantize4(v[0] << 16, v[0] & 0xffff0000u, v[1] << 16, v[1] & 0xffff0000u, m, scales),
                      fp8b::quantize4(v[2] << 16, v[2] & 0xffff0000u, v[3] << 16, v[3] & 0xffff0000u, m, scales));
  return make_uint2(fp8b::quantize4(v[0], v[1], v[2], v[3], m, scales), fp8b::quantize4(v[4], v[5], v[6], v[7], m, scales));
}

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ src, int32_t dtype, int64_t rows, int64_t cols,
                                int64_t row_stride, const int32_t* __restrict__ rowmap,
                                const int32_t* __restrict__ colmap, const uint32_t* __restrict__ mult, int32_t scales,
                                uint8_t* __restrict__ data, int64_t chunks, int64_t total) {
  constexpr int kWords = kPer * sizeof(T) / 4;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / chunks, c0 = t % chunks * kPer;
    const uint32_t* cells = mult + __ldg(rowmap + r);
    const T* in = src + r * row_stride + c0;
    uint8_t* out = data + r * cols + c0;
    // Whole 16-byte loads and an 8-byte store where the chunk is aligned and in one block
    // (a piece need not start on a multiple of 8 columns); else one element at a time.
    const int32_t cell = __ldg(colmap + c0);
    if (c0 + kPer <= cols && (reinterpret_cast<uintptr_t>(in) & 15u) == 0 && (reinterpret_cast<uintptr_t>(out) & 7u) == 0 &&
        __ldg(colmap + c0 + kPer - 1) == cell) {
      uint32_t v[kWords];
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(in) + k);
        v[4 * k] = u.x, v[4 * k + 1] = u.y, v[4 * k + 2] = u.z, v[4 * k + 3] = u.w;
      }
      *reinterpret_cast<uint2*>(out) = quantize8(v, dtype == RX_BF16, __ldg(cells + cell), scales);
      continue;
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t c = c0 + k;
      if (c < cols)
        out[k] = fp8b::quantize(fp8b::f32_of_raw(static_cast<uint32_t>(__ldg(in + k)), dtype),
                                __ldg(cells + __ldg(colmap + c)), scales);
    }
  }
}

unsigned grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > (1 << 20) ? (1 << 20) : blocks));
}

}  // namespace

extern "C" int32_t rx_fp8block_scales_cuda(const uint32_t* amax, int64_t cells, int32_t scales, float* scale_inv,
                                           uint32_t* mult, void* stream) {
  if (cells < 0 || (scales != RX_FP8B_FP32 && scales != RX_FP8B_POW2)) return -1;
  if (cells == 0) return 0;
  scales_kernel<<<grid_for(cells), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      amax, cells, scales, reinterpret_cast<uint32_t*>(scale_inv), mult);
  return static_cast<int32_t>(cudaGetLastError());
}

extern "C" int32_t rx_fp8block_quantize_cuda(const void* src, int32_t dtype, int64_t rows, int64_t cols,
                                             int64_t row_stride, const int32_t* rowmap, const int32_t* colmap,
                                             const uint32_t* mult, int32_t scales, uint8_t* data, void* stream) {
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols)) return -1;
  if ((dtype != RX_BF16 && dtype != RX_F32) || (scales != RX_FP8B_FP32 && scales != RX_FP8B_POW2)) return -1;
  const int64_t chunks = (cols + kPer - 1) / kPer, total = rows * chunks;
  if (total == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == RX_BF16)
    quantize_kernel<<<grid_for(total), kThreads, 0, s>>>(static_cast<const uint16_t*>(src), dtype, rows, cols,
                                                         row_stride, rowmap, colmap, mult, scales, data, chunks, total);
  else
    quantize_kernel<<<grid_for(total), kThreads, 0, s>>>(static_cast<const uint32_t*>(src), dtype, rows, cols,
                                                         row_stride, rowmap, colmap, mult, scales, data, chunks, total);
  return static_cast<int32_t>(cudaGetLastError());
}
