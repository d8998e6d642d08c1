// C-style API of the NVFP4 quantize: BF16 -> E2M1 data packed two per byte + an E4M3
// scale per 16 consecutive elements of a row (the last dim) + one FP32 per-tensor scale
// from the tensor's amax (codecs/nvfp4.h has the math). Raw pointers and streams, no torch.
//
//   bf16:   rows x cols BF16 values (cols a multiple of 16), row r at bf16 + r * row_stride.
//   amax:   one uint32, the FP32 bits of the whole tensor's max |x| (NaN: any NaN), e.g.
//           a per-tensor cell of the amax pre-pass (codecs/amax.h), which reduces it over
//           the pieces of a sharded tensor.
//   data:   rows x cols/2 bytes, row-major contiguous, element 2i in the low nibble.
//   scale:  RX_NV_SCALE_2D: rows x cols/16 bytes, row-major contiguous;
//           RX_NV_SCALE_SWIZZLED: the 128x4-tile layout of MXFP8's (codecs/mxfp8.h),
//           rx_mxfp8_swizzled_size(rows, cols/16) bytes, padding written as 0.
//   tensor_scale: nullptr, or one FP32 that gets the per-tensor scale.
// The CPU twin and the CUDA kernels produce identical bytes (same code).
// Returns 0, -1 for bad arguments, or (CUDA) a cudaError_t value.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { RX_NV_SCALE_2D = 0, RX_NV_SCALE_SWIZZLED = 1 };

int32_t rx_nvfp4_quantize_cpu(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                              const uint32_t* amax, uint8_t* data, uint8_t* scale, int32_t scale_layout,
                              float* tensor_scale);
// The per-tensor scale alone (what quantize writes to tensor_scale), e.g. for a sender
// whose pack boxes quantize.
int32_t rx_nvfp4_tensor_scale_cpu(const uint32_t* amax, float* tensor_scale);

#ifdef RX_WITH_CUDA
// One launch each on `stream` (a cudaStream_t). Pointers are device pointers.
int32_t rx_nvfp4_quantize_cuda(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                               const uint32_t* amax, uint8_t* data, uint8_t* scale, int32_t scale_layout,
                               float* tensor_scale, void* stream);
int32_t rx_nvfp4_tensor_scale_cuda(const uint32_t* amax, float* tensor_scale, void* stream);
#endif

#ifdef __cplusplus
}
#endif
