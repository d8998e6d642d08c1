// Box validity: the checks every consumer of a box table (the kernels, their CPU twins,
// the table builders) runs before it trusts a box. A codec's own fields are its codec's
// to check (kernels/codecs/registry.h).
#include "core/box.h"

#include "common/dtype.h"

namespace {

// rx_box.digest (box.h): a cast target must be a float the written float converts to;
// a codec digest belongs to a copy box (its codec checks the rest).
bool digest_valid(const rx_box& b) {
  if (b.reserved != 0) return false;
  const int32_t arg = RX_DIGEST_ARG(b.digest);
  if (RX_DIGEST_KIND(b.digest) == RX_DIGEST_CODEC)
    return (b.digest >> 24) == 0 && RX_DIGEST_CODEC_ID(b.digest) != RX_CODEC_NONE && b.codec == RX_CODEC_NONE;
  if ((b.digest >> 16) != 0) return false;
  switch (RX_DIGEST_KIND(b.digest)) {
    case RX_DIGEST_AS_WRITTEN: return arg == 0;
    case RX_DIGEST_CAST:
      return b.codec == RX_CODEC_NONE && rx::dtype_is_float(b.dst_dtype) && rx::dtype_is_float(arg);
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
  if (b->codec < 0 || !digest_valid(*b)) return 0;
  if (b->codec != RX_CODEC_NONE) return 1;  // the rest is the codec's (kernels/codecs/registry.h)
  // A copy's param[0] is its first verify ordinal (box.h).
  return b->param[0] >= 0 && b->param[1] == 0 && b->param[2] == 0 && rx::dtype_castable(b->src_dtype, b->dst_dtype);
}
