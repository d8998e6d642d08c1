// CPU twin of the box-copy kernel: the reference the CUDA kernel must match bit for bit,
// and the data path of the CPU (gloo) refit.
#include <string.h>

#include "kernels/api.h"
#include "kernels/cast.h"

extern "C" int32_t rx_dtype_size(int32_t dtype) {
  switch (dtype) {
    case RX_U8: case RX_I8: case RX_BOOL: case RX_F8E4M3: case RX_F8E5M2: case RX_F8E8M0:
      return 1;
    case RX_I16: case RX_F16: case RX_BF16: case RX_U16:
      return 2;
    case RX_I32: case RX_F32: case RX_U32:
      return 4;
    case RX_I64: case RX_F64: case RX_U64:
      return 8;
    default:
      return 0;
  }
}

extern "C" int32_t rx_dtype_castable(int32_t src, int32_t dst) {
  if (rx_dtype_size(src) == 0 || rx_dtype_size(dst) == 0) return 0;
  return src == dst || (rx::dtype_is_float(src) && rx::dtype_is_float(dst));
}

namespace {

// Copies `n` elements along the innermost dim.
void copy_row(const char* src, int64_t src_stride, int32_t src_dtype, char* dst,
              int64_t dst_stride, int32_t dst_dtype, int64_t n) {
  const int32_t ss = rx_dtype_size(src_dtype), ds = rx_dtype_size(dst_dtype);
  if (src_dtype == dst_dtype) {
    if (src_stride == 1 && dst_stride == 1) {
      memcpy(dst, src, (size_t)(n * ss));
      return;
    }
    for (int64_t i = 0; i < n; ++i) memcpy(dst + i * dst_stride * ds, src + i * src_stride * ss, (size_t)ss);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    rx::store_float(dst + i * dst_stride * ds, dst_dtype, rx::load_float(src + i * src_stride * ss, src_dtype));
}

}  // namespace

extern "C" int32_t rx_copy_boxes_cpu(const rx_box* boxes, int64_t num_boxes) {
  for (int64_t b = 0; b < num_boxes; ++b) {
    const rx_box& box = boxes[b];
    if (box.ndim < 1 || box.ndim > RX_MAX_DIMS || !rx_dtype_castable(box.src_dtype, box.dst_dtype)) return -1;
    int64_t count = 1;
    for (int d = 0; d < box.ndim; ++d) count *= box.shape[d];
    if (count == 0) continue;
    const int32_t ss = rx_dtype_size(box.src_dtype), ds = rx_dtype_size(box.dst_dtype);
    const int inner = box.ndim - 1;
    int64_t idx[RX_MAX_DIMS] = {0};
    const int64_t rows = count / box.shape[inner];
    for (int64_t r = 0; r < rows; ++r) {
      int64_t so = 0, doff = 0;
      for (int d = 0; d < inner; ++d) {
        so += idx[d] * box.src_stride[d];
        doff += idx[d] * box.dst_stride[d];
      }
      copy_row(reinterpret_cast<const char*>(box.src) + so * ss, box.src_stride[inner], box.src_dtype,
               reinterpret_cast<char*>(box.dst) + doff * ds, box.dst_stride[inner], box.dst_dtype,
               box.shape[inner]);
      for (int d = inner - 1; d >= 0; --d) {  // odometer over the outer dims
        if (++idx[d] < box.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  return 0;
}
