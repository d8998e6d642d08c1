// C-style API of the MXFP8 kernels: BF16 -> E4M3 data + E8M0 scales, one scale per 32
// consecutive elements of a row (the last dim). Raw pointers and streams, no torch.
//
//   bf16:   rows x cols BF16 values, row r at bf16 + r * row_stride (elements).
//   data:   rows x cols E4M3 bytes, row-major contiguous.
//   scale:  RX_MX_SCALE_2D: rows x ceil(cols/32) bytes, row-major contiguous;
//           RX_MX_SCALE_SWIZZLED: rx_mxfp8_swizzled_size(rows, ceil(cols/32)) bytes in
//           the 128x4-tile layout (codecs/mxfp8.h); the padding is written as 0.
//   rounding: RX_MX_ROUND_CEIL (2^ceil(log2(amax/448)), the default) or
//             RX_MX_ROUND_FLOOR (OCP MX v1.0: 2^(floor(log2 amax) - 8)).
// The CPU twin and the CUDA kernel produce identical bytes (same integer code).
// Returns 0, -1 for bad arguments, or (CUDA) a cudaError_t value.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { RX_MX_SCALE_2D = 0, RX_MX_SCALE_SWIZZLED = 1 };
enum { RX_MX_ROUND_CEIL = 0, RX_MX_ROUND_FLOOR = 1 };

// Bytes of a swizzled scale buffer for rows x scale_cols scales (padded to 128 x 4).
int64_t rx_mxfp8_swizzled_size(int64_t rows, int64_t scale_cols);

int32_t rx_mxfp8_quantize_cpu(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                              uint8_t* data, uint8_t* scale, int32_t scale_layout, int32_t rounding);

// Rewrites a row-major rows x scale_cols scale matrix into the swizzled layout
// (padding written as 0). `out` must not alias `scale2d`.
int32_t rx_mxfp8_swizzle_cpu(const uint8_t* scale2d, int64_t rows, int64_t scale_cols, uint8_t* out);

#ifdef RX_WITH_CUDA
// One launch on `stream` (a cudaStream_t). Pointers are device pointers.
int32_t rx_mxfp8_quantize_cuda(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                               uint8_t* data, uint8_t* scale, int32_t scale_layout, int32_t rounding,
                               void* stream);
int32_t rx_mxfp8_swizzle_cuda(const uint8_t* scale2d, int64_t rows, int64_t scale_cols, uint8_t* out,
                              void* stream);
#endif

#ifdef __cplusplus
}
#endif
