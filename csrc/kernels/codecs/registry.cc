// Host dispatch over the codecs (registry.h): a look-up in one table of Traits records,
// one line per codec (its records live in its own files).
#include "kernels/codecs/registry.h"

#include "kernels/codecs/fp8block.h"
#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/nvfp4.h"

namespace rx::codecs {

namespace {
const Traits* const kTable[] = {
    &mx::kDataTraits, &mx::kScalesTraits,  // codecs/mxfp8_cpu.cc
    &fp8b::kTraits,                        // codecs/fp8block_cpu.cc
    &nv::kDataTraits, &nv::kScalesTraits,  // codecs/nvfp4_cpu.cc
};
}  // namespace

const Traits* find(int32_t id) {
  for (const Traits* t : kTable)
    if (t->id == id) return t;
  return nullptr;
}

int32_t count() { return static_cast<int32_t>(sizeof(kTable) / sizeof(kTable[0])); }
const Traits& at(int32_t i) { return *kTable[i]; }

int64_t items(const rx_box& b) {
  const Traits* t = find(RX_CODEC_ID(b.codec));
  if (!t) return 0;  // unreachable: rx_codec_valid came first
  int64_t n = 1;
  for (int d = 0; d < b.ndim; ++d) n *= b.shape[d];
  return n / t->item_elems;
}

int64_t item_bytes(const rx_box& b) {
  const Traits* t = find(RX_CODEC_ID(b.codec));
  return t ? t->item_bytes : 0;
}

uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n) {
  const Traits* t = find(RX_CODEC_ID(b.codec));
  return t ? t->cpu_row(b, pass, src, dst, first, k0, n) : 0;
}

uint64_t cpu_digest(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n) {
  const Traits* t = find(RX_DIGEST_CODEC_ID(digest));
  return t && t->cpu_digest ? t->cpu_digest(digest, p, stride, dtype, k0, n) : 0;
}

}  // namespace rx::codecs

extern "C" int32_t rx_codec_valid(const rx_box* b) {
  const bool by_digest = b->codec == RX_CODEC_NONE && RX_DIGEST_KIND(b->digest) == RX_DIGEST_CODEC;
  const int32_t id = b->codec != RX_CODEC_NONE ? RX_CODEC_ID(b->codec)
                     : by_digest                ? RX_DIGEST_CODEC_ID(b->digest)
                                                : RX_CODEC_NONE;
  if (id == RX_CODEC_NONE) return b->codec == RX_CODEC_NONE;
  const rx::codecs::Traits* t = rx::codecs::find(id);
  return t && (!by_digest || t->cpu_digest) && t->valid(*b);
}
