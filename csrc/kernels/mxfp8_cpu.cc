// CPU twin of the MXFP8 kernels: the reference the CUDA kernel must match byte for
// byte, and the data path of the CPU (gloo) refit. Same inline math (core/mxfp8.h).
#include <string.h>

#include "core/mxfp8.h"
#include "kernels/mxfp8_api.h"

namespace mx = rx::mx;

extern "C" int64_t rx_mxfp8_swizzled_size(int64_t rows, int64_t scale_cols) {
  return mx::swizzled_size(rows, scale_cols);
}

extern "C" int32_t rx_mxfp8_quantize_cpu(const uint16_t* bf16, int64_t rows, int64_t cols,
                                         int64_t row_stride, uint8_t* data, uint8_t* scale,
                                         int32_t scale_layout, int32_t rounding) {
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols)) return -1;
  if (scale_layout != RX_MX_SCALE_2D && scale_layout != RX_MX_SCALE_SWIZZLED) return -1;
  if (rounding != RX_MX_ROUND_CEIL && rounding != RX_MX_ROUND_FLOOR) return -1;
  const int64_t scols = mx::scale_cols(cols);
  const bool swz = scale_layout == RX_MX_SCALE_SWIZZLED;
  if (swz) memset(scale, 0, (size_t)mx::swizzled_size(rows, scols));  // padding is 0
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* in = bf16 + r * row_stride;
    uint8_t* out = data + r * cols;
    for (int64_t b = 0; b < scols; ++b) {
      const int64_t c0 = b * mx::kBlock;
      const int64_t c1 = c0 + mx::kBlock < cols ? c0 + mx::kBlock : cols;
      uint32_t amax = 0;
      for (int64_t c = c0; c < c1; ++c) {
        uint32_t a = mx::finite_abs_bits(in[c]);
        amax = a > amax ? a : amax;
      }
      const uint8_t s = mx::scale_exponent(amax, rounding);
      for (int64_t c = c0; c < c1; ++c) out[c] = mx::e4m3_scaled(in[c], s);
      scale[swz ? mx::swizzled_offset(r, b, scols) : r * scols + b] = s;
    }
  }
  return 0;
}

extern "C" int32_t rx_mxfp8_swizzle_cpu(const uint8_t* scale2d, int64_t rows, int64_t scale_cols,
                                        uint8_t* out) {
  if (rows < 0 || scale_cols < 0) return -1;
  memset(out, 0, (size_t)mx::swizzled_size(rows, scale_cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < scale_cols; ++c)
      out[mx::swizzled_offset(r, c, scale_cols)] = scale2d[r * scale_cols + c];
  return 0;
}
