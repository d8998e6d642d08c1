// C-style API of the partial-amax kernels (codecs/amax.h): raw pointers and streams, no torch.
//
//   src:      rows x cols elements of `dtype` (RX_BF16, RX_F16, RX_F32), row r at
//             src + r * row_stride (elements), unit stride along a row.
//   rowmap:   rows int32, colmap: cols int32: element (r, c) falls in cell rowmap[r] + colmap[c].
//   grid:     cells uint32 (FP32 bit patterns); each touched cell becomes
//             max(cell, abs_bits of every element in it): zero it first for a partial amax.
//   nan:      RX_AMAX_NAN_PROPAGATE or RX_AMAX_NAN_IGNORE (amax.h, NanMode).
// The CPU twin and the CUDA kernel give identical grids (integer max of the same bits).
// Returns 0, -1 for bad arguments, or (CUDA) a cudaError_t value.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { RX_AMAX_NAN_PROPAGATE = 0, RX_AMAX_NAN_IGNORE = 1 };

int32_t rx_amax_partial_cpu(const void* src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                            const int32_t* rowmap, const int32_t* colmap, int32_t nan, uint32_t* grid);

#ifdef RX_WITH_CUDA
// One launch on `stream` (a cudaStream_t); device pointers.
int32_t rx_amax_partial_cuda(const void* src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                             const int32_t* rowmap, const int32_t* colmap, int32_t nan, uint32_t* grid,
                             void* stream);
#endif

#ifdef __cplusplus
}
#endif
