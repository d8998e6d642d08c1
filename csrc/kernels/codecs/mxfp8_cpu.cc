// CPU twin of the MXFP8 codec: its box rows (the reference the CUDA lanes must match
// byte for byte, and the data path of the CPU (gloo) refit), the whole-tensor quantize
// and swizzle, its box checks and the scale-slice geometry. Same inline math (mxfp8.h).
#include <string.h>

#include "common/check.h"
#include "common/dtype.h"
#include "kernels/api.h"
#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/mxfp8_api.h"
#include "kernels/cpu_twin.h"

namespace mx = rx::mx;

namespace rx::mx {

namespace {

// Shared exponent of the block of 16 words at w.
uint8_t block_scale(const uint32_t* w, int32_t rounding) {
  uint32_t amax = 0;
  for (int i = 0; i < kBlockWords; ++i) {
    const uint32_t a = word_amax(w[i]);
    amax = a > amax ? a : amax;
  }
  return scale_exponent(amax, rounding);
}

// One innermost row of an MXFP8 box: `n` elements (data) or scale bytes (scales alone).
// `first`: for data with scales (param[0]), the data-buffer element of the row's first
// element; ignored otherwise. place_scales = false leaves the scale buffer alone (a
// verify pass that must not write); scales_out, when set, gets each block's scale too.
void row(const rx_box& box, const char* src, char* dst, int64_t first, int64_t n, bool place_scales,
         uint8_t* scales_out) {
  const int32_t rounding = box_rounding(box);
  uint32_t w[kBlockWords];
  if (!box_is_data(box)) {
    const int64_t ss = box.src_stride[box.ndim - 1] * 2, ds = box.dst_stride[box.ndim - 1];
    for (int64_t j = 0; j < n; ++j) {
      memcpy(w, src + j * ss, sizeof(w));
      dst[j * ds] = static_cast<char>(block_scale(w, rounding));
    }
    return;
  }
  uint8_t* scale = place_scales ? reinterpret_cast<uint8_t*>(box_scale_buf(box)) : nullptr;
  uint32_t q[kBlock / 4];
  for (int64_t g = 0; g < n / kBlock; ++g) {
    memcpy(w, src + g * kBlock * 2, sizeof(w));
    const uint8_t e = block_scale(w, rounding);
    for (int i = 0; i < kBlock / 4; ++i) q[i] = quantize_words(w[2 * i], w[2 * i + 1], e);
    memcpy(dst + g * kBlock, q, sizeof(q));
    if (scale) scale[scale_offset(first + g * kBlock, box_cols(box), box_scales(box))] = e;
    if (scales_out) scales_out[g] = e;
  }
}

}  // namespace

uint64_t cpu_row(const rx_box& box, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n) {
  if (pass == RX_PASS_NONE) {
    row(box, src, dst, first, n, true, nullptr);
    return 0;
  }
  const bool places = box_is_data(box) && box_scale_buf(box);
  uint8_t scales[cpu::kChunk / kBlock];
  alignas(16) char tmp[cpu::kChunk];
  // What the box writes, as (pointer, stride): dst after the quantize, dst itself when
  // only reading it, else a temporary row the box writes instead of dst.
  const char* at = dst;
  int64_t stride = box.dst_stride[box.ndim - 1];
  if (pass == RX_PASS_COPY) {
    row(box, src, dst, first, n, true, scales);
  } else if (pass == RX_PASS_SRC) {
    rx_box contiguous = box;
    contiguous.dst_stride[box.ndim - 1] = 1;
    row(contiguous, src, tmp, first, n, false, scales);
    at = tmp;
    stride = 1;
  } else if (places) {  // RX_PASS_DST: the scales where the blocks put them
    for (int64_t g = 0; g < n / kBlock; ++g)
      scales[g] = reinterpret_cast<const uint8_t*>(box_scale_buf(box))[scale_offset(first + g * kBlock, box_cols(box),
                                                                                      box_scales(box))];
  }
  uint64_t acc = cpu::hash_elems(at, stride, box.dst_dtype, box.digest, k0, n);
  if (places)
    for (int64_t g = 0; g < n / kBlock; ++g) acc = digest::add(acc, digest::scale(k0 / kBlock + g, scales[g]));
  return acc;
}

uint64_t cpu_digest(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n) {
  (void)dtype;  // BF16 (box_valid)
  uint64_t acc = 0;
  for (int64_t g = 0; g < n; g += kBlock) {
    const char* b = p + g * stride * 2;
    acc = digest::add(acc, digest_block(
                               [&](int j) {
                                 uint16_t v;
                                 memcpy(&v, b + j * stride * 2, 2);
                                 return v;
                               },
                               k0 + static_cast<uint64_t>(g), RX_DIGEST_ARG(digest)));
  }
  return acc;
}

bool box_valid(const rx_box& b) {
  if (b.codec == RX_CODEC_NONE) {  // a copy digested as the receiver's quantize holds it, from a block start
    const int32_t arg = RX_DIGEST_ARG(b.digest);
    return RX_DIGEST_CODEC_ID(b.digest) == RX_CODEC_MXFP8 && b.dst_dtype == RX_BF16 && (arg == kCeil || arg == kFloor) &&
           b.shape[b.ndim - 1] % kBlock == 0 && RX_BOX_FIRST_ORDINAL(b) % kBlock == 0;
  }
  if ((b.codec >> 24) != 0) return false;
  const int32_t rounding = box_rounding(b), scales = box_scales(b);
  // Scale placement: only a data box with a scale buffer has one.
  const bool places_scales = RX_CODEC_ID(b.codec) == RX_CODEC_MXFP8 && b.param[0] != 0;
  if (!places_scales && (scales != 0 || b.param[0] != 0 || b.param[1] != 0 || b.param[2] != 0)) return false;
  if (RX_DIGEST_KIND(b.digest) != RX_DIGEST_AS_WRITTEN) return false;
  if (rounding != kCeil && rounding != kFloor) return false;
  if (b.src_dtype != RX_BF16) return false;
  const int inner = b.ndim - 1;
  if (RX_CODEC_ID(b.codec) == RX_CODEC_MXFP8_SCALES) return b.dst_dtype == RX_U8 || b.dst_dtype == RX_F8E8M0;
  if (RX_CODEC_ID(b.codec) != RX_CODEC_MXFP8 || !(b.dst_dtype == RX_F8E4M3 || b.dst_dtype == RX_U8)) return false;
  if (b.src_stride[inner] != 1 || b.dst_stride[inner] != 1 || b.shape[inner] % kBlock != 0) return false;
  if (!places_scales) return true;
  // Every block starts on the data buffer's 32-grid, inside one row of K elements.
  if (scales != k2D && scales != kSwizzled) return false;
  if (box_cols(b) <= 0 || box_cols(b) % kBlock != 0) return false;
  if (box_first(b) < 0 || box_first(b) % kBlock != 0) return false;
  for (int d = 0; d < inner; ++d)
    if (b.dst_stride[d] % kBlock != 0) return false;
  return true;
}

// A data box's item is one block (never split); a scales box's, one scale byte, which
// reads a block. The planner cuts a data tensor's last dim on whole blocks; a scale
// tensor's elements are whole blocks already (grain 1).
const codecs::Traits kDataTraits{RX_CODEC_MXFP8, "mxfp8", kBlock, kBlock, kBlock * 2, box_valid, cpu_row, cpu_digest};
const codecs::Traits kScalesTraits{RX_CODEC_MXFP8_SCALES, "mxfp8_scales", 1, 1, kBlock * 2, box_valid, cpu_row,
                                   nullptr};

std::string scale_runs(const Runs& runs, int64_t extent, Runs* out) {
  out->clear();
  // Index of the last non-empty run: only it may end inside a (partial) final block.
  int64_t last = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i)
    if (runs[i].len > 0) last = i;
  for (int64_t i = 0; i <= last; ++i) {
    const Run& r = runs[i];
    if (r.len == 0) continue;
    RX_HOST_ASSERT(r.start >= 0 && r.start + r.len <= extent, "run outside the dim");
    if (r.start % kBlock != 0)
      return detail::format("the piece starts at element ", r.start, " of the last dim, not on a ",
                            kBlock, "-element scale block boundary");
    const bool ends_at_extent = r.start + r.len == extent;
    if (r.len % kBlock != 0 && !(i == last && ends_at_extent))
      return detail::format("the piece covers elements [", r.start, ", ", r.start + r.len,
                            ") of the last dim, which is not made of whole ", kBlock,
                            "-element scale blocks");
    append_run(*out, Run{r.start / kBlock, scale_cols(r.len)});
  }
  return "";
}

}  // namespace rx::mx

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
