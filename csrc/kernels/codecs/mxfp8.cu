// CUDA MXFP8 quantize and scale swizzle: one launch each. Bit-identical to the CPU
// twin (codecs/mxfp8_cpu.cc): both run the integer math of codecs/mxfp8.h.
//
// Work split of the quantize: a thread owns 8 consecutive elements (one 16-byte load),
// 4 neighbouring lanes own one 32-element block and agree on its amax with two
// shuffles, so a warp reads 512 contiguous bytes of a row. In the swizzled layout the
// index space covers the padded scale matrix too, and threads of padding blocks write
// the 0 scale: one launch leaves the whole buffer defined.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/mxfp8_api.h"

namespace mx = rx::mx;

namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;
constexpr int kLanesPerBlock = mx::kBlock / kPerThread;  // 4

// Index: uint32_t when every index fits (64-bit division is emulated by a long
// instruction sequence and dominated this kernel), else int64_t.
template <typename Index>
__global__ void quantize_kernel(const uint16_t* __restrict__ in, int64_t rows, int64_t cols,
                                int64_t row_stride, uint8_t* __restrict__ data,
                                uint8_t* __restrict__ scale, int64_t rows_span, int64_t scols,
                                int64_t scols_span, int64_t total, bool swz, int32_t rounding,
                                bool vec_in, bool vec_out) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  const Index span = (Index)scols_span;
  // The loop bound is uniform per CUDA block so that every lane reaches the shuffles.
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < total; base += step) {
    const int64_t idx = base + threadIdx.x;
    const Index g = (Index)(idx / kLanesPerBlock);
    const int sub = (int)(idx % kLanesPerBlock);
    const int64_t r = (int64_t)(g / span), b = (int64_t)(g % span);
    const bool live = idx < total;
    const bool valid = live && r < rows && b < scols;
    const int64_t c0 = b * mx::kBlock + sub * kPerThread;
    uint16_t v[kPerThread];
    uint32_t amax = 0;
    if (valid) {
      const uint16_t* src = in + r * row_stride + c0;
      if (vec_in && c0 + kPerThread <= cols) {
        uint4 w = *reinterpret_cast<const uint4*>(src);
        const uint16_t* h = reinterpret_cast<const uint16_t*>(&w);
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) v[i] = h[i];
      } else {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) v[i] = c0 + i < cols ? src[i] : (uint16_t)0;
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) amax = max(amax, mx::finite_abs_bits(v[i]));
    }
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (!live || r >= rows_span) continue;
    const uint8_t s = valid ? mx::scale_exponent(amax, rounding) : (uint8_t)0;
    if (valid) {
      uint8_t q[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) q[i] = mx::e4m3_scaled(v[i], s);
      uint8_t* dst = data + r * cols + c0;
      if (vec_out && c0 + kPerThread <= cols) {
        uint2 w;
        w.x = q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
        w.y = q[4] | (uint32_t)q[5] << 8 | (uint32_t)q[6] << 16 | (uint32_t)q[7] << 24;
        *reinterpret_cast<uint2*>(dst) = w;
      } else {
        for (int i = 0; i < kPerThread && c0 + i < cols; ++i) dst[i] = q[i];
      }
    }
    if (sub == 0) scale[swz ? mx::swizzled_offset(r, b, scols) : r * scols + b] = s;
  }
}

__global__ void swizzle_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t scols,
                               int64_t scols_pad, int64_t total, uint8_t* __restrict__ out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / scols_pad, c = i % scols_pad;
    out[mx::swizzled_offset(r, c, scols)] = (r < rows && c < scols) ? in[r * scols + c] : (uint8_t)0;
  }
}

int64_t grid_for(int64_t total) {
  int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = 1 << 20;  // grid-stride beyond this
  return blocks < 1 ? 1 : (blocks > cap ? cap : blocks);
}

}  // namespace

extern "C" int32_t rx_mxfp8_quantize_cuda(const uint16_t* bf16, int64_t rows, int64_t cols,
                                          int64_t row_stride, uint8_t* data, uint8_t* scale,
                                          int32_t scale_layout, int32_t rounding, void* stream) {
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols)) return -1;
  if (scale_layout != RX_MX_SCALE_2D && scale_layout != RX_MX_SCALE_SWIZZLED) return -1;
  if (rounding != RX_MX_ROUND_CEIL && rounding != RX_MX_ROUND_FLOOR) return -1;
  const bool swz = scale_layout == RX_MX_SCALE_SWIZZLED;
  const int64_t scols = mx::scale_cols(cols);
  const int64_t rows_span = swz ? mx::swizzled_rows_padded(rows) : rows;
  const int64_t scols_span = swz ? mx::swizzled_cols_padded(scols) : scols;
  const int64_t total = rows_span * scols_span * kLanesPerBlock;
  if (total == 0) return 0;
  const bool vec_in = cols % kPerThread == 0 && row_stride % kPerThread == 0 &&
                      reinterpret_cast<uintptr_t>(bf16) % 16 == 0;
  const bool vec_out = cols % kPerThread == 0 && reinterpret_cast<uintptr_t>(data) % 8 == 0;
  const auto launch = [&](auto kernel) {
    kernel<<<(unsigned)grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        bf16, rows, cols, row_stride, data, scale, rows_span, scols, scols_span, total, swz, rounding,
        vec_in, vec_out);
  };
  if (total / kLanesPerBlock <= UINT32_MAX)  // every group index g fits
    launch(quantize_kernel<uint32_t>);
  else
    launch(quantize_kernel<int64_t>);
  return (int32_t)cudaGetLastError();
}

extern "C" int32_t rx_mxfp8_swizzle_cuda(const uint8_t* scale2d, int64_t rows, int64_t scale_cols,
                                         uint8_t* out, void* stream) {
  if (rows < 0 || scale_cols < 0) return -1;
  const int64_t scols_pad = mx::swizzled_cols_padded(scale_cols);
  const int64_t total = mx::swizzled_rows_padded(rows) * scols_pad;
  if (total == 0) return 0;
  swizzle_kernel<<<(unsigned)grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      scale2d, rows, scale_cols, scols_pad, total, out);
  return (int32_t)cudaGetLastError();
}
