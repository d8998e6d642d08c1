// CPU twin of the box-copy kernel: the reference the CUDA kernel must match bit for bit,
// and the data path of the CPU (gloo) refit.
#include <string.h>

#include "core/mxfp8.h"
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

extern "C" int32_t rx_box_valid(const rx_box* b) {
  if (b->ndim < 1 || b->ndim > RX_MAX_DIMS) return 0;
  // Every byte count and offset the kernels and tilers compute from a box must fit 64
  // bits: its element count times the widest element (8 bytes), and its extent on
  // either side in bytes.
  const __int128 kMax = INT64_MAX;
  __int128 bytes = 8, src_span = 0, dst_span = 0;
  for (int d = 0; d < b->ndim; ++d) {
    if (b->shape[d] < 0) return 0;
    const __int128 n = b->shape[d];
    const __int128 ss = b->src_stride[d] < 0 ? -static_cast<__int128>(b->src_stride[d]) : b->src_stride[d];
    const __int128 ds = b->dst_stride[d] < 0 ? -static_cast<__int128>(b->dst_stride[d]) : b->dst_stride[d];
    bytes *= n;
    src_span += n * ss;
    dst_span += n * ds;
    if (bytes > kMax || src_span > kMax / 8 || dst_span > kMax / 8) return 0;
  }
  if (b->mode < 0 || (b->mode >> 24) != 0) return 0;
  const int32_t kind = RX_BOX_KIND(b->mode), rounding = RX_BOX_ROUNDING(b->mode), scales = RX_BOX_SCALES(b->mode);
  // Scale placement (api.h): only an MX_DATA box with a scale buffer has one.
  const bool places_scales = kind == RX_BOX_MX_DATA && b->aux != 0;
  if (!places_scales && (scales != 0 || b->aux != 0 || b->mx_first != 0 || b->mx_cols != 0)) return 0;
  if (kind == RX_BOX_COPY) return b->mode == 0 && rx_dtype_castable(b->src_dtype, b->dst_dtype);
  if (rounding != rx::mx::kCeil && rounding != rx::mx::kFloor) return 0;
  if (b->src_dtype != RX_BF16) return 0;
  const int inner = b->ndim - 1;
  if (kind == RX_BOX_MX_SCALE) return b->dst_dtype == RX_U8 || b->dst_dtype == RX_F8E8M0;
  if (kind != RX_BOX_MX_DATA || !(b->dst_dtype == RX_F8E4M3 || b->dst_dtype == RX_U8)) return 0;
  if (b->src_stride[inner] != 1 || b->dst_stride[inner] != 1 || b->shape[inner] % RX_BOX_MX_GROUP != 0) return 0;
  if (!places_scales) return 1;
  // Every block starts on the data buffer's 32-grid, inside one row of K elements.
  if (scales != rx::mx::k2D && scales != rx::mx::kSwizzled) return 0;
  if (b->mx_cols <= 0 || b->mx_cols % RX_BOX_MX_GROUP != 0) return 0;
  if (b->mx_first < 0 || b->mx_first % RX_BOX_MX_GROUP != 0) return 0;
  for (int d = 0; d < inner; ++d)
    if (b->dst_stride[d] % RX_BOX_MX_GROUP != 0) return 0;
  return 1;
}

namespace {

// Shared exponent of the block of 16 words at w.
uint8_t block_scale(const uint32_t* w, int32_t rounding) {
  uint32_t amax = 0;
  for (int i = 0; i < rx::mx::kBlockWords; ++i) {
    const uint32_t a = rx::mx::word_amax(w[i]);
    amax = a > amax ? a : amax;
  }
  return rx::mx::scale_exponent(amax, rounding);
}

// One innermost row of an MX box: `n` elements (MX_DATA) or scale bytes (MX_SCALE).
// `first`: for MX_DATA with scales (aux), the data-buffer element of the row's first
// element (api.h); ignored otherwise.
void mx_row(const rx_box& box, const char* src, char* dst, int64_t first, int64_t n) {
  namespace mx = rx::mx;
  const int32_t rounding = RX_BOX_ROUNDING(box.mode);
  uint32_t w[mx::kBlockWords];
  if (RX_BOX_KIND(box.mode) == RX_BOX_MX_SCALE) {
    const int64_t ss = box.src_stride[box.ndim - 1] * 2, ds = box.dst_stride[box.ndim - 1];
    for (int64_t j = 0; j < n; ++j) {
      memcpy(w, src + j * ss, sizeof(w));
      dst[j * ds] = static_cast<char>(block_scale(w, rounding));
    }
    return;
  }
  uint8_t* scale = reinterpret_cast<uint8_t*>(box.aux);
  uint32_t q[mx::kBlock / 4];
  for (int64_t g = 0; g < n / mx::kBlock; ++g) {
    memcpy(w, src + g * mx::kBlock * 2, sizeof(w));
    const uint8_t e = block_scale(w, rounding);
    for (int i = 0; i < mx::kBlock / 4; ++i) q[i] = mx::quantize_words(w[2 * i], w[2 * i + 1], e);
    memcpy(dst + g * mx::kBlock, q, sizeof(q));
    if (scale) scale[mx::scale_offset(first + g * mx::kBlock, box.mx_cols, RX_BOX_SCALES(box.mode))] = e;
  }
}

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
    if (!rx_box_valid(&box)) return -1;
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
      const char* src = reinterpret_cast<const char*>(box.src) + so * ss;
      char* dst = reinterpret_cast<char*>(box.dst) + doff * ds;
      if (box.mode == RX_BOX_COPY)
        copy_row(src, box.src_stride[inner], box.src_dtype, dst, box.dst_stride[inner], box.dst_dtype,
                 box.shape[inner]);
      else  // dst elements are bytes: the row starts at data element mx_first + doff
        mx_row(box, src, dst, box.mx_first + doff, box.shape[inner]);
      for (int d = inner - 1; d >= 0; --d) {  // odometer over the outer dims
        if (++idx[d] < box.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  return 0;
}
