// Host dispatch over the codecs (registry.h): one case per codec id.
#include "kernels/codecs/registry.h"

#include "kernels/codecs/mxfp8.h"

namespace rx::codecs {

int64_t items(const rx_box& b) {
  int64_t n = 1;
  for (int d = 0; d < b.ndim; ++d) n *= b.shape[d];
  switch (RX_CODEC_ID(b.codec)) {
    case RX_CODEC_MXFP8: return n / mx::kBlock;  // one lane per block: a block is never split
    case RX_CODEC_MXFP8_SCALES: return n;        // one lane per scale byte (a block read)
    default: return 0;                           // unreachable: rx_codec_valid came first
  }
}

int64_t item_bytes(const rx_box& b) {
  switch (RX_CODEC_ID(b.codec)) {
    case RX_CODEC_MXFP8:
    case RX_CODEC_MXFP8_SCALES: return mx::kBlock * 2;  // a whole block of BF16
    default: return 0;
  }
}

uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n) {
  switch (RX_CODEC_ID(b.codec)) {
    case RX_CODEC_MXFP8:
    case RX_CODEC_MXFP8_SCALES: return mx::cpu_row(b, pass, src, dst, first, k0, n);
    default: return 0;
  }
}

uint64_t cpu_digest(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n) {
  switch (RX_DIGEST_CODEC_ID(digest)) {
    case RX_CODEC_MXFP8: return mx::cpu_digest(digest, p, stride, dtype, k0, n);
    default: return 0;
  }
}

}  // namespace rx::codecs

extern "C" int32_t rx_codec_valid(const rx_box* b) {
  const int32_t id = b->codec != RX_CODEC_NONE ? RX_CODEC_ID(b->codec)
                     : RX_DIGEST_KIND(b->digest) == RX_DIGEST_CODEC ? RX_DIGEST_CODEC_ID(b->digest)
                                                                     : RX_CODEC_NONE;
  switch (id) {
    case RX_CODEC_NONE: return b->codec == RX_CODEC_NONE;
    case RX_CODEC_MXFP8:
    case RX_CODEC_MXFP8_SCALES: return rx::mx::box_valid(*b);
    default: return 0;
  }
}
