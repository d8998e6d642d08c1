// Box validity: the checks every consumer of a box table (the kernels, their CPU twins,
// the table builders) runs before it trusts a box.
#include "core/box.h"

#include "common/dtype.h"
#include "core/mxfp8.h"

namespace {

// rx_box.digest (box.h): a cast target must be a float the written float converts to;
// an MX digest needs a BF16 copy whose innermost rows are whole blocks.
bool digest_valid(const rx_box& b) {
  if (b.reserved != 0 || (b.digest >> 16) != 0) return false;
  const int32_t arg = RX_DIGEST_ARG(b.digest);
  switch (RX_DIGEST_KIND(b.digest)) {
    case RX_DIGEST_AS_WRITTEN: return arg == 0;
    case RX_DIGEST_CAST:
      return b.mode == RX_BOX_COPY && rx::dtype_is_float(b.dst_dtype) && rx::dtype_is_float(arg);
    case RX_DIGEST_MX:
      return b.mode == RX_BOX_COPY && b.dst_dtype == RX_BF16 && (arg == rx::mx::kCeil || arg == rx::mx::kFloor) &&
             b.shape[b.ndim - 1] % rx::mx::kBlock == 0 && b.mx_first % rx::mx::kBlock == 0;
    default: return false;
  }
}

}  // namespace

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
  // Scale placement (box.h): only an MX_DATA box with a scale buffer has one.
  const bool places_scales = kind == RX_BOX_MX_DATA && b->aux != 0;
  const bool first_ordinal = kind == RX_BOX_COPY && b->mx_first >= 0;  // box.h: a piece's first verify ordinal
  if (!places_scales && (scales != 0 || b->aux != 0 || (b->mx_first != 0 && !first_ordinal) || b->mx_cols != 0))
    return 0;
  if (!digest_valid(*b)) return 0;
  if (kind == RX_BOX_COPY) return b->mode == 0 && rx::dtype_castable(b->src_dtype, b->dst_dtype);
  if (rounding != rx::mx::kCeil && rounding != rx::mx::kFloor) return 0;
  if (b->src_dtype != RX_BF16) return 0;
  const int inner = b->ndim - 1;
  if (kind == RX_BOX_MX_SCALE) return b->dst_dtype == RX_U8 || b->dst_dtype == RX_F8E8M0;
  if (kind != RX_BOX_MX_DATA || !(b->dst_dtype == RX_F8E4M3 || b->dst_dtype == RX_U8)) return 0;
  if (b->src_stride[inner] != 1 || b->dst_stride[inner] != 1 || b->shape[inner] % rx::mx::kBlock != 0) return 0;
  if (!places_scales) return 1;
  // Every block starts on the data buffer's 32-grid, inside one row of K elements.
  if (scales != rx::mx::k2D && scales != rx::mx::kSwizzled) return 0;
  if (b->mx_cols <= 0 || b->mx_cols % rx::mx::kBlock != 0) return 0;
  if (b->mx_first < 0 || b->mx_first % rx::mx::kBlock != 0) return 0;
  for (int d = 0; d < inner; ++d)
    if (b->dst_stride[d] % rx::mx::kBlock != 0) return 0;
  return 1;
}

