// CPU twin of the box-copy kernel: the reference the CUDA kernel must match bit for bit,
// and the data path of the CPU (gloo) refit.
#include <string.h>

#include "common/dtype.h"
#include "core/box.h"
#include "core/mxfp8.h"
#include "kernels/api.h"
#include "kernels/cast.h"
#include "kernels/digest.h"

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
// element (api.h); ignored otherwise. place_scales = false leaves aux alone (a verify
// pass that must not write); scales_out, when set, gets each block's scale byte too.
void mx_row(const rx_box& box, const char* src, char* dst, int64_t first, int64_t n, bool place_scales = true,
            uint8_t* scales_out = nullptr) {
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
  uint8_t* scale = place_scales ? reinterpret_cast<uint8_t*>(box.aux) : nullptr;
  uint32_t q[mx::kBlock / 4];
  for (int64_t g = 0; g < n / mx::kBlock; ++g) {
    memcpy(w, src + g * mx::kBlock * 2, sizeof(w));
    const uint8_t e = block_scale(w, rounding);
    for (int i = 0; i < mx::kBlock / 4; ++i) q[i] = mx::quantize_words(w[2 * i], w[2 * i + 1], e);
    memcpy(dst + g * mx::kBlock, q, sizeof(q));
    if (scale) scale[mx::scale_offset(first + g * mx::kBlock, box.mx_cols, RX_BOX_SCALES(box.mode))] = e;
    if (scales_out) scales_out[g] = e;
  }
}

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

// Elements hashed per step: a chunk just written is hashed while it is still in cache.
// A multiple of the MX block.
constexpr int64_t kChunk = 2048;

uint64_t load_bits(const char* p, int size) {
  switch (size) {
    case 1: return static_cast<uint8_t>(*p);
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
  }
}

// Contiguous elements of one size, no conversion: the hot loop of a verified refit
// (digest::element with its words summed apart, so it vectorizes; the key steps by
// kKeyLo while the ordinal's high word stays, so the loop is split where the low word
// wraps).
template <typename T>
inline __attribute__((always_inline)) uint64_t hash_run(const char* p, uint64_t k0, int64_t n) {
  uint32_t lo = 0, hi = 0;
  while (n > 0) {
    const int64_t room = static_cast<int64_t>((uint64_t{1} << 32) - (k0 & 0xffffffffu));
    const int64_t m = n < room ? n : room;
    const uint32_t k = dg::key(k0);
    for (int64_t i = 0; i < m; ++i) {
      T v;
      memcpy(&v, p + i * sizeof(T), sizeof(T));
      const uint32_t kk = k + static_cast<uint32_t>(i) * dg::kKeyLo;
      const uint32_t x = static_cast<uint32_t>(v) ^ kk;
      lo += dg::mix(x, dg::kLoA, 15);
      hi += dg::mix(x, dg::kLoB, 13);
      if constexpr (sizeof(T) == 8) {
        const uint32_t y = static_cast<uint32_t>(static_cast<uint64_t>(v) >> 32) ^ kk;
        lo += dg::mix(y, dg::kHiA, 15);
        hi += dg::mix(y, dg::kHiB, 13);
      }
    }
    p += m * sizeof(T);
    k0 += static_cast<uint64_t>(m);
    n -= m;
  }
  return lo | static_cast<uint64_t>(hi) << 32;
}

// Compiled for the widest vectors the CPU has (SSE2 has no 32-bit multiply), chosen once
// at load time.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define RX_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RX_VECTOR_CLONES
#endif
RX_VECTOR_CLONES uint64_t hash_contiguous(const char* p, int size, uint64_t k0, int64_t n) {
  switch (size) {
    case 1: return hash_run<uint8_t>(p, k0, n);
    case 2: return hash_run<uint16_t>(p, k0, n);
    case 4: return hash_run<uint32_t>(p, k0, n);
    default: return hash_run<uint64_t>(p, k0, n);
  }
}

// `n` elements of `dtype` at p (stride in elements) at ordinals k0.., as a box with
// digest spec `digest` (api.h) has the receiver hold them.
uint64_t hash_elems(const char* p, int64_t stride, int32_t dtype, int32_t digest, uint64_t k0, int64_t n) {
  const int size = rx::dtype_size(dtype);
  const int32_t kind = RX_DIGEST_KIND(digest);
  if (kind == RX_DIGEST_MX) {
    uint64_t acc = 0;
    for (int64_t g = 0; g < n; g += rx::mx::kBlock) {
      const char* b = p + g * stride * 2;
      acc = dg::add(acc, dg::mx_block([&](int j) { return static_cast<uint16_t>(load_bits(b + j * stride * 2, 2)); },
                                      k0 + static_cast<uint64_t>(g), RX_DIGEST_ARG(digest)));
    }
    return acc;
  }
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

// The digest of `n` innermost elements of a box row (ordinals k0..) in a verify pass:
// src/dst point at their first element; `first` as mx_row's.
uint64_t digest_chunk(const rx_box& box, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0,
                      int64_t n) {
  const int inner = box.ndim - 1;
  const int64_t ssi = box.src_stride[inner], dsi = box.dst_stride[inner];
  const int32_t kind = RX_BOX_KIND(box.mode);
  uint8_t scales[kChunk / rx::mx::kBlock];
  alignas(16) char tmp[kChunk * 8];
  // What the box writes, as (pointer, stride): dst after a copy, dst itself when only
  // reading it, the source where a same-dtype copy would write its bits unchanged, else a
  // temporary row the box writes instead of dst.
  const char* at = dst;
  int64_t stride = dsi;
  if (pass == RX_PASS_COPY) {
    if (kind == RX_BOX_COPY)
      copy_row(src, ssi, box.src_dtype, dst, dsi, box.dst_dtype, n);
    else
      mx_row(box, src, dst, first, n, true, scales);
  } else if (pass == RX_PASS_SRC) {
    if (kind == RX_BOX_COPY && box.src_dtype == box.dst_dtype) {
      at = src;
      stride = ssi;
    } else {
      rx_box contiguous = box;
      contiguous.dst_stride[inner] = 1;
      if (kind == RX_BOX_COPY)
        copy_row(src, ssi, box.src_dtype, tmp, 1, box.dst_dtype, n);
      else
        mx_row(contiguous, src, tmp, first, n, false, scales);
      at = tmp;
      stride = 1;
    }
  } else if (kind == RX_BOX_MX_DATA && box.aux) {  // RX_PASS_DST: the scales where the blocks put them
    for (int64_t g = 0; g < n / rx::mx::kBlock; ++g)
      scales[g] = reinterpret_cast<const uint8_t*>(box.aux)[rx::mx::scale_offset(
          first + g * rx::mx::kBlock, box.mx_cols, RX_BOX_SCALES(box.mode))];
  }
  uint64_t acc = hash_elems(at, stride, box.dst_dtype, box.digest, k0, n);
  if (kind == RX_BOX_MX_DATA && box.aux)
    for (int64_t g = 0; g < n / rx::mx::kBlock; ++g) acc = dg::add(acc, dg::scale(k0 / rx::mx::kBlock + g, scales[g]));
  return acc;
}

// The copy (pass RX_PASS_NONE) or a verify pass over every box of a table.
int32_t run_boxes(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests) {
  for (int64_t b = 0; b < num_boxes; ++b) {
    const rx_box& box = boxes[b];
    if (!rx_box_valid(&box)) return -1;
    int64_t count = 1;
    for (int d = 0; d < box.ndim; ++d) count *= box.shape[d];
    if (count == 0) continue;
    const int32_t ss = rx::dtype_size(box.src_dtype), ds = rx::dtype_size(box.dst_dtype);
    const int inner = box.ndim - 1;
    const int64_t n = box.shape[inner];
    int64_t idx[RX_MAX_DIMS] = {0};
    const int64_t rows = count / n;
    const int64_t ordinal = box.mode == RX_BOX_COPY ? box.mx_first : 0;  // core/box.h
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
        // MX_DATA dst elements are bytes: the row starts at data element mx_first + doff.
        for (int64_t c = 0; c < n; c += kChunk)
          acc = dg::add(acc, digest_chunk(box, pass, src + c * box.src_stride[inner] * ss, dst + c * box.dst_stride[inner] * ds,
                                          box.mx_first + doff + c, static_cast<uint64_t>(ordinal + r * n + c),
                                          n - c < kChunk ? n - c : kChunk));
      } else if (box.mode == RX_BOX_COPY) {
        copy_row(src, box.src_stride[inner], box.src_dtype, dst, box.dst_stride[inner], box.dst_dtype, n);
      } else {  // dst elements are bytes: the row starts at data element mx_first + doff
        mx_row(box, src, dst, box.mx_first + doff, n);
      }
      for (int d = inner - 1; d >= 0; --d) {  // odometer over the outer dims
        if (++idx[d] < box.shape[d]) break;
        idx[d] = 0;
      }
    }
    if (digests) digests[b] = dg::add(digests[b], acc);
  }
  return 0;
}

}  // namespace

extern "C" int32_t rx_copy_boxes_cpu(const rx_box* boxes, int64_t num_boxes) {
  return run_boxes(boxes, num_boxes, RX_PASS_NONE, nullptr);
}

extern "C" int32_t rx_digest_boxes_cpu(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests) {
  if (pass != RX_PASS_COPY && pass != RX_PASS_SRC && pass != RX_PASS_DST) return -1;
  return run_boxes(boxes, num_boxes, pass, digests);
}
