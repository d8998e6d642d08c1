// C-style API of the blockwise FP8 kernels (codecs/fp8block.h): the per-block scales from
// the amax grid (codecs/amax.h) and the whole-piece quantize of the staged paths (a
// receiver's landed BF16, a sender whose boxes cannot quantize in place). Raw pointers and
// streams, no torch. The CPU twins and the CUDA kernels give identical bytes.
//
//   rx_fp8block_scales: per cell of `cells`, from amax (FP32 bits): scale_inv (FP32) and
//     mult (the boxes' factor, fp8block.h block_mult). scales: RX_FP8B_FP32 | RX_FP8B_POW2.
//   rx_fp8block_quantize: rows x cols elements of `dtype` (RX_BF16, RX_F32), row r at
//     src + r * row_stride (elements), element (r, c) under mult[rowmap[r] + colmap[c]],
//     into `data`: rows x cols E4M3 bytes, row-major contiguous.
// Return 0, -1 for bad arguments, or (CUDA) a cudaError_t value.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { RX_FP8B_FP32 = 0, RX_FP8B_POW2 = 1 };

int32_t rx_fp8block_scales_cpu(const uint32_t* amax, int64_t cells, int32_t scales, float* scale_inv, uint32_t* mult);
int32_t rx_fp8block_quantize_cpu(const void* src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                 const int32_t* rowmap, const int32_t* colmap, const uint32_t* mult, int32_t scales,
                                 uint8_t* data);

#ifdef RX_WITH_CUDA
// One launch each on `stream` (a cudaStream_t); device pointers.
int32_t rx_fp8block_scales_cuda(const uint32_t* amax, int64_t cells, int32_t scales, float* scale_inv, uint32_t* mult,
                                void* stream);
int32_t rx_fp8block_quantize_cuda(const void* src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  const int32_t* rowmap, const int32_t* colmap, const uint32_t* mult, int32_t scales,
                                  uint8_t* data, void* stream);
#endif

#ifdef __cplusplus
}
#endif
