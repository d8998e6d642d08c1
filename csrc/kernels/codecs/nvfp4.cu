// CUDA NVFP4 whole-piece quantize and per-tensor scale: one launch each. Bit-identical to the
// CPU twin (codecs/nvfp4_cpu.cc): both run the math of codecs/nvfp4.h.
//
// Quantize: a thread owns one 16-element block (two 16-byte loads, 8 bytes and a scale
// byte out), so a warp reads 1 KiB of a row. In the swizzled layout the index space
// covers the padded scale matrix too, and threads of padding blocks write the 0 scale:
// one launch leaves the whole buffer defined.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/nvfp4.h"
#include "kernels/codecs/nvfp4_api.h"


namespace {

constexpr int kThreads = 256;

int64_t grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = 1 << 20;  // grid-stride beyond this
  return blocks < 1 ? 1 : (blocks > cap ? cap : blocks);
}

// The 8 words of block b of row r (row_stride in elements; vec: 16-byte aligned rows).
__device__ void load_block(const uint16_t* in, int64_t r, int64_t b, int64_t row_stride, bool vec, uint32_t* w) {
  const uint16_t* p = in + r * row_stride + b * rx::nv::kBlock;
  if (vec) {
    const uint4 a = *reinterpret_cast<const uint4*>(p), c = *reinterpret_cast<const uint4*>(p + 8);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = c.x, w[5] = c.y, w[6] = c.z, w[7] = c.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < rx::nv::kBlockWords; ++k) w[k] = p[2 * k] | static_cast<uint32_t>(p[2 * k + 1]) << 16;
}

template <typename Index>
__global__ void quantize_kernel(const uint16_t* __restrict__ in, int64_t rows, int64_t scols, int64_t row_stride,
                                const uint32_t* __restrict__ amax, uint8_t* __restrict__ data,
                                uint8_t* __restrict__ scale, int64_t scols_span, int64_t total, bool swz, bool vec,
                                bool vec_out, float* tensor_scale) {
  const rx::nv::TensorScale ts = rx::nv::tensor_scale(*amax);
  if (tensor_scale && blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<uint32_t*>(tensor_scale) = ts.pts;
  const Index span = (Index)scols_span;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = (int64_t)((Index)g / span), b = (int64_t)((Index)g % span);
    if (r >= rows || b >= scols) {  // swizzled padding
      scale[rx::mx::swizzled_offset(r, b, scols)] = 0;
      continue;
    }
    uint32_t w[rx::nv::kBlockWords], q[2];
    load_block(in, r, b, row_stride, vec, w);
    const uint8_t s = rx::nv::quantize_block(w, ts, q);
    uint8_t* out = data + (r * scols + b) * rx::nv::kBlockWords;
    if (vec_out) {
      *reinterpret_cast<uint2*>(out) = make_uint2(q[0], q[1]);
    } else {
#pragma unroll
      for (int k = 0; k < rx::nv::kBlockWords; ++k) out[k] = static_cast<uint8_t>(q[k / 4] >> (8 * (k % 4)));
    }
    scale[swz ? rx::mx::swizzled_offset(r, b, scols) : r * scols + b] = s;
  }
}

__global__ void tensor_scale_kernel(const uint32_t* amax, float* out) {
  *reinterpret_cast<uint32_t*>(out) = rx::nv::tensor_scale_bits(*amax);
}

bool shape_ok(int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && cols % rx::nv::kBlock == 0 && (rows <= 1 || row_stride >= cols);
}

bool vec_ok(const uint16_t* in, int64_t row_stride) {
  return row_stride % 8 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
}

}  // namespace

extern "C" int32_t rx_nvfp4_quantize_cuda(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                                          const uint32_t* amax, uint8_t* data, uint8_t* scale, int32_t scale_layout,
                                          float* tensor_scale, void* stream) {
  if (!shape_ok(rows, cols, row_stride)) return -1;
  if (scale_layout != RX_NV_SCALE_2D && scale_layout != RX_NV_SCALE_SWIZZLED) return -1;
  const bool swz = scale_layout == RX_NV_SCALE_SWIZZLED;
  const int64_t scols = cols / rx::nv::kBlock;
  const int64_t rows_span = swz ? rx::mx::swizzled_rows_padded(rows) : rows;
  const int64_t scols_span = swz ? rx::mx::swizzled_cols_padded(scols) : scols;
  const int64_t total = rows_span * scols_span;
  const auto launch = [&](auto kernel) {
    kernel<<<(unsigned)grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        bf16, rows, scols, row_stride, amax, data, scale, scols_span, total, swz, vec_ok(bf16, row_stride),
        reinterpret_cast<uintptr_t>(data) % 8 == 0, tensor_scale);
  };
  if (total <= UINT32_MAX)  // 64-bit division is a long emulated sequence on GPUs
    launch(quantize_kernel<uint32_t>);
  else
    launch(quantize_kernel<int64_t>);
  return (int32_t)cudaGetLastError();
}

extern "C" int32_t rx_nvfp4_tensor_scale_cuda(const uint32_t* amax, float* tensor_scale, void* stream) {
  tensor_scale_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax, tensor_scale);
  return (int32_t)cudaGetLastError();
}
