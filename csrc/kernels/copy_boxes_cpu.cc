// CPU twin of the box-copy kernel: the reference the CUDA kernel must match bit for bit,
// and the data path of the CPU (gloo) refit.
#include <string.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/dtype.h"
#include "core/box.h"
#include "kernels/api.h"
#include "kernels/cast.h"
#include "kernels/codecs/registry.h"
#include "kernels/cpu_twin.h"
#include "kernels/digest.h"

namespace {

// Copies `n` elements along the innermost dim.
void copy_row(const char* src, int64_t src_stride, int32_t src_dtype, char* dst,
              int64_t dst_stride, int32_t dst_dtype, int64_t n) {
  const int32_t ss = rx::dtype_size(src_dtype), ds = rx::dtype_size(dst_dtype);
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

// ---- verify digests (kernels/digest.h) ------------------------------------------------

namespace dg = rx::digest;

using rx::cpu::kChunk;

uint64_t load_bits(const char* p, int size) {
  switch (size) {
    case 1: return static_cast<uint8_t>(*p);
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
  }
}

// Contiguous elements of one size, no conversion: the hot loop of a verified refit
// (digest::keyed over a run: the key steps by kKeyLo while the ordinal's high word stays,
// so the run is split where the low word wraps). kk: the first element's key. With a
// `to`, the loops also store what they load there: a copy pass in one sweep, whose
// hashing then runs while the copy waits on memory.
template <typename T>
uint64_t hash_scalar(const char* p, uint32_t kk, int64_t m, char* to = nullptr) {
  if (to) memcpy(to, p, static_cast<size_t>(m) * sizeof(T));
  uint64_t acc = 0;
  for (int64_t i = 0; i < m; ++i) {
    T v;
    memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    acc = dg::add(acc, dg::keyed(kk + static_cast<uint32_t>(i) * dg::kKeyLo, static_cast<uint64_t>(v), sizeof(T)));
  }
  return acc;
}

#if defined(__GNUC__) && defined(__x86_64__)
// How far ahead the vector digest loops prefetch: a verified refit hashes what another
// pass (the kernel's socket copy, a peer's write) left in DRAM, and one core's hardware
// prefetch alone leaves the loop waiting on memory.
constexpr int64_t kPrefetchAhead = 4096;
template <typename T>
constexpr int64_t kLineElems = 64 / static_cast<int64_t>(sizeof(T));  // a prefetch per 64-byte line
// hash_scalar 8 words per vector (each word an element zero-extended, or a part of one: 2 or
// 4 narrow elements, or half of an 8-byte one), in GCC's vector extensions built for AVX2:
// each word xor its key, squared by vpmuludq; adding the 64-bit squares as 32-bit lanes is
// digest::add. AVX2 alone: 512-bit vectors measured no faster (RESULTS.md, verify=True
// on the CPU).
struct Avx2Vec {
  typedef uint32_t u32 __attribute__((vector_size(32)));
  typedef uint64_t u64 __attribute__((vector_size(32)));
};

// The exact 64-bit square of the low 32-bit word of each 64-bit lane.
__attribute__((target("avx2"))) inline Avx2Vec::u64 square_words(Avx2Vec::u64 x) {
  typedef int v8si __attribute__((vector_size(32)));
  return reinterpret_cast<Avx2Vec::u64>(__builtin_ia32_pmuludq256(reinterpret_cast<v8si>(x), reinterpret_cast<v8si>(x)));
}

// Adds the exact squares of the even and of the odd words of w ^ k into e and o: vpmuludq
// (a u64 product would emulate 64 x 64 bits).
__attribute__((target("avx2"))) inline void add_squares(Avx2Vec::u32 w, Avx2Vec::u32 k, Avx2Vec::u32& e,
                                                        Avx2Vec::u32& o) {
  const Avx2Vec::u64 x = reinterpret_cast<Avx2Vec::u64>(w ^ k);
  e += reinterpret_cast<Avx2Vec::u32>(square_words(x));
  o += reinterpret_cast<Avx2Vec::u32>(square_words(x >> 32));
}

// The 32 bytes at `at` under keys key[j] (part j of each word) into e and o (and stored
// at `out` for a copy).
template <typename T, int kParts, bool kCopy, bool kCold = false>
__attribute__((target("avx2"))) inline void add_vector(const char* at, char* out, const Avx2Vec::u32* key,
                                                       Avx2Vec::u32& e, Avx2Vec::u32& o) {
  constexpr uint32_t kMask = sizeof(T) < 4 ? (1u << (8 * sizeof(T))) - 1 : ~0u;
  Avx2Vec::u32 w;
  memcpy(&w, at, sizeof(w));
  if constexpr (kCold)  // out is 32-byte aligned (hash_cold)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), (__m256i)w);
  else if constexpr (kCopy)
    memcpy(out, &w, sizeof(w));
  for (int j = 0; j < kParts; ++j) add_squares(kParts == 1 ? w : (w >> (8 * sizeof(T) * j)) & kMask, key[j], e, o);
}

// Two vectors per pass, each with its own keys and sums: the sums' and keys' one-cycle
// chains would otherwise bound the loop. Elements narrower than a word come 32 bytes to a
// vector, each word split into its kParts elements (with keys to match): widening them 8 at
// a time cost more than the hashing (RESULTS.md, the digest loop in the cache).
template <typename T, bool kCopy, bool kCold = false>
__attribute__((target("avx2"))) uint64_t hash_avx2(const char* p, uint32_t kk, int64_t m, char* to) {
  using U32 = Avx2Vec::u32;
  constexpr int kWords = 8;
  constexpr int kParts = sizeof(T) < 4 ? 4 / static_cast<int>(sizeof(T)) : 1;  // elements per word
  constexpr int kElems = sizeof(T) == 8 ? 4 : 8 * kParts;                        // elements per vector
  constexpr int64_t kBytes = 32;
  const U32 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  U32 key[kParts];  // part j of word w: element kParts * w + j
  if constexpr (sizeof(T) == 8) {  // words 2e, 2e + 1: element e's low and high word
    key[0] = kk + (lane >> 1) * dg::kKeyLo + (lane & 1) * dg::kHiSalt;
  } else {
    for (int j = 0; j < kParts; ++j) key[j] = kk + (kParts * lane + j) * dg::kKeyLo;
  }
  const uint32_t step = static_cast<uint32_t>(kElems) * dg::kKeyLo;
  U32 key2[kParts];  // the second vector's
  for (int j = 0; j < kParts; ++j) key2[j] = key[j] + step;
  U32 even = {}, odd = {}, even2 = {}, odd2 = {};
  int64_t i = 0;
  for (; i + 2 * kElems <= m; i += 2 * kElems) {
    const char* at = p + i * static_cast<int64_t>(sizeof(T));
    if ((i & (kLineElems<T> - 1)) == 0) __builtin_prefetch(at + kPrefetchAhead, 0, 0);
    char* out = kCopy ? to + (at - p) : nullptr;
    add_vector<T, kParts, kCopy, kCold>(at, out, key, even, odd);
    add_vector<T, kParts, kCopy, kCold>(at + kBytes, out + kBytes, key2, even2, odd2);
    for (int j = 0; j < kParts; ++j) {
      key[j] += 2 * step;
      key2[j] += 2 * step;
    }
  }
  if (i + kElems <= m) {
    add_vector<T, kParts, kCopy, kCold>(p + i * static_cast<int64_t>(sizeof(T)),
                                        kCopy ? to + i * static_cast<int64_t>(sizeof(T)) : nullptr, key, even, odd);
    i += kElems;
  }
  const U32 sum = (even + odd) + (even2 + odd2);
  uint64_t acc = 0;
  for (int j = 0; j < kWords; j += 2) acc = dg::add(acc, sum[j] | static_cast<uint64_t>(sum[j + 1]) << 32);
  return dg::add(acc, hash_scalar<T>(p + i * static_cast<int64_t>(sizeof(T)),
                                     kk + static_cast<uint32_t>(i) * dg::kKeyLo, m - i,
                                     kCopy ? to + i * static_cast<int64_t>(sizeof(T)) : nullptr));
}

bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// hash_avx2's copy with the stores past the cache (RX_PASS_COPY_COLD): the head up to the
// first 32-byte boundary of `to` as hash_scalar copies it, the rest streamed (run_boxes
// fences once at its end).
template <typename T>
__attribute__((target("avx2"))) uint64_t hash_cold(const char* p, uint32_t kk, int64_t m, char* to) {
  const auto addr = reinterpret_cast<uintptr_t>(to);
  if (addr % sizeof(T) != 0) return hash_avx2<T, true>(p, kk, m, to);
  int64_t head = static_cast<int64_t>((32 - addr % 32) % 32 / sizeof(T));
  head = head < m ? head : m;
  uint64_t acc = hash_scalar<T>(p, kk, head, to);
  const int64_t off = head * static_cast<int64_t>(sizeof(T));
  acc = dg::add(acc, hash_avx2<T, true, true>(p + off, kk + static_cast<uint32_t>(head) * dg::kKeyLo, m - head,
                                              to + off));
  return acc;
}
#endif

template <typename T, bool kCopy, bool kCold = false>
uint64_t hash_run(const char* p, uint64_t k0, int64_t n, char* to) {
  uint64_t acc = 0;
  while (n > 0) {
    const int64_t room = static_cast<int64_t>((uint64_t{1} << 32) - (k0 & 0xffffffffu));
    const int64_t m = n < room ? n : room;
    const uint32_t kk = dg::key(k0);
#if defined(__GNUC__) && defined(__x86_64__)
    acc = dg::add(acc, !have_avx2() ? hash_scalar<T>(p, kk, m, to)
                       : kCold       ? hash_cold<T>(p, kk, m, to)
                                     : hash_avx2<T, kCopy>(p, kk, m, to));
#else
    acc = dg::add(acc, hash_scalar<T>(p, kk, m, to));
#endif
    p += m * static_cast<int64_t>(sizeof(T));
    if (kCopy) to += m * static_cast<int64_t>(sizeof(T));
    k0 += static_cast<uint64_t>(m);
    n -= m;
  }
  return acc;
}

template <bool kCopy, bool kCold = false>
uint64_t hash_sized(const char* p, int size, uint64_t k0, int64_t n, char* to) {
  switch (size) {
    case 1: return hash_run<uint8_t, kCopy, kCold>(p, k0, n, to);
    case 2: return hash_run<uint16_t, kCopy, kCold>(p, k0, n, to);
    case 4: return hash_run<uint32_t, kCopy, kCold>(p, k0, n, to);
    default: return hash_run<uint64_t, kCopy, kCold>(p, k0, n, to);
  }
}

// The digest of n contiguous elements of `size` bytes at p, ordinals k0..; with a `to`,
// also copies them there in the same sweep.
// cold: the copy's stores go past the cache (RX_PASS_COPY_COLD).
uint64_t hash_contiguous(const char* p, int size, uint64_t k0, int64_t n, char* to = nullptr, bool cold = false) {
  if (!to) return hash_sized<false>(p, size, k0, n, nullptr);
  return cold ? hash_sized<true, true>(p, size, k0, n, to) : hash_sized<true>(p, size, k0, n, to);
}

// The digest of `n` innermost elements of a copy box's row (ordinals k0..) in a verify
// pass: src/dst point at their first element.
uint64_t digest_chunk(const rx_box& box, int32_t pass, const char* src, char* dst, uint64_t k0, int64_t n,
                      bool cold) {
  const int inner = box.ndim - 1;
  const int64_t ssi = box.src_stride[inner], dsi = box.dst_stride[inner];
  alignas(16) char tmp[kChunk * 8];
  // What the box writes, as (pointer, stride): dst after a copy, dst itself when only
  // reading it, the source where a same-dtype copy would write its bits unchanged, else a
  // temporary row the box writes instead of dst.
  const char* at = dst;
  int64_t stride = dsi;
  if (pass == RX_PASS_COPY && box.src_dtype == box.dst_dtype && ssi == 1 && dsi == 1 &&
      RX_DIGEST_KIND(box.digest) == RX_DIGEST_AS_WRITTEN)  // the hot case: one sweep
    return hash_contiguous(src, rx::dtype_size(box.dst_dtype), k0, n, dst, cold);
  if (pass == RX_PASS_COPY) {
    copy_row(src, ssi, box.src_dtype, dst, dsi, box.dst_dtype, n);
  } else if (pass == RX_PASS_SRC) {
    if (box.src_dtype == box.dst_dtype) {
      at = src;
      stride = ssi;
    } else {
      copy_row(src, ssi, box.src_dtype, tmp, 1, box.dst_dtype, n);
      at = tmp;
      stride = 1;
    }
  }
  return rx::cpu::hash_elems(at, stride, box.dst_dtype, box.digest, k0, n);
}

// The copy (pass RX_PASS_NONE) or a verify pass over every box of a table.
int32_t run_boxes(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests) {
  const bool cold = pass == RX_PASS_COPY_COLD;  // a copy pass whose contiguous runs stream past the cache
  if (cold) pass = RX_PASS_COPY;
  for (int64_t b = 0; b < num_boxes; ++b) {
    const rx_box& box = boxes[b];
    if (!rx::codecs::box_ok(box)) return -1;
    int64_t count = 1;
    for (int d = 0; d < box.ndim; ++d) count *= box.shape[d];
    if (count == 0) continue;
    const int32_t ss = rx::dtype_size(box.src_dtype), ds = rx::dtype_size(box.dst_dtype);
    const int inner = box.ndim - 1;
    const int64_t n = box.shape[inner];
    int64_t idx[RX_MAX_DIMS] = {0};
    const int64_t rows = count / n;
    const int64_t ordinal = RX_BOX_FIRST_ORDINAL(box);  // a piece of an op's box goes on from its ordinal
    uint64_t acc = 0;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t so = 0, doff = 0;
      for (int d = 0; d < inner; ++d) {
        so += idx[d] * box.src_stride[d];
        doff += idx[d] * box.dst_stride[d];
      }
      const char* src = reinterpret_cast<const char*>(box.src) + so * ss;
      char* dst = reinterpret_cast<char*>(box.dst) + doff * ds;
      if (pass != RX_PASS_NONE) {
        // A codec row starts at element param[1] + doff of the dst's buffer (codecs/registry.h).
        for (int64_t c = 0; c < n; c += kChunk) {
          const char* s_at = src + c * box.src_stride[inner] * ss;
          char* d_at = dst + c * box.dst_stride[inner] * ds;
          const uint64_t k0 = static_cast<uint64_t>(ordinal + r * n + c);
          const int64_t m = n - c < kChunk ? n - c : kChunk;
          acc = dg::add(acc, box.codec == RX_CODEC_NONE
                                 ? digest_chunk(box, pass, s_at, d_at, k0, m, cold)
                                 : rx::codecs::cpu_row(box, pass, s_at, d_at, box.param[1] + doff + c, k0, m));
        }
      } else if (box.codec == RX_CODEC_NONE) {
        copy_row(src, box.src_stride[inner], box.src_dtype, dst, box.dst_stride[inner], box.dst_dtype, n);
      } else {
        rx::codecs::cpu_row(box, RX_PASS_NONE, src, dst, box.param[1] + doff, 0, n);
      }
      for (int d = inner - 1; d >= 0; --d) {  // odometer over the outer dims
        if (++idx[d] < box.shape[d]) break;
        idx[d] = 0;
      }
    }
    if (digests) digests[b] = dg::add(digests[b], acc);
  }
#if defined(__GNUC__) && defined(__x86_64__)
  if (cold) _mm_sfence();  // the streamed stores before whatever the caller stores next (a ring's tail)
#endif
  return 0;
}

}  // namespace

uint64_t rx::cpu::hash_elems(const char* p, int64_t stride, int32_t dtype, int32_t digest, uint64_t k0, int64_t n) {
  const int size = rx::dtype_size(dtype);
  const int32_t kind = RX_DIGEST_KIND(digest);
  if (kind == RX_DIGEST_CODEC) return rx::codecs::cpu_digest(digest, p, stride, dtype, k0, n);
  if (kind == RX_DIGEST_AS_WRITTEN && stride == 1) return hash_contiguous(p, size, k0, n);
  const int32_t to = kind == RX_DIGEST_CAST ? RX_DIGEST_ARG(digest) : dtype;
  const int to_size = rx::dtype_size(to);
  uint64_t acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t bits = load_bits(p + i * stride * size, size);
    if (to != dtype) bits = rx::convert_bits(bits, dtype, to);
    acc = dg::add(acc, dg::element(k0 + static_cast<uint64_t>(i), bits, to_size));
  }
  return acc;
}

extern "C" int32_t rx_copy_boxes_cpu(const rx_box* boxes, int64_t num_boxes) {
  return run_boxes(boxes, num_boxes, RX_PASS_NONE, nullptr);
}

extern "C" int32_t rx_digest_boxes_cpu(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests) {
  if (pass != RX_PASS_COPY && pass != RX_PASS_COPY_COLD && pass != RX_PASS_SRC && pass != RX_PASS_DST) return -1;
  return run_boxes(boxes, num_boxes, pass, digests);
}
