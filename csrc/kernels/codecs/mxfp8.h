// The MXFP8 codec (OCP Microscaling v1.0, E4M3 elements + E8M0 shared scale per 32
// elements along the last dim): what its boxes hold, the element math, the swizzled
// scale layout and the scale-slice geometry. Plain C++17, no CUDA and no torch: the
// inline functions carry a host/device annotation only so the CUDA kernel and the CPU
// twin run the very same integer code (bit-identical by construction).
//
// Its boxes (rx_box.codec = id | rounding << 8 | scales << 16, ids of codecs/registry.h):
//   RX_CODEC_MXFP8: quantize fused into the copy (src BF16, dst E4M3 or uint8 bytes).
//     The innermost dim has unit stride on both sides and an extent that is a multiple
//     of the MX block (32, kBlock); each run of 32 innermost elements is one MX block
//     (the host only builds such boxes where they lie on the logical tensor's 32-grid).
//     Per block: e = shared E8M0 exponent of its amax, data = x / 2^(e-127) in E4M3.
//     param[0] (the scale buffer, its byte 0) != 0: e is also written there, for a dst
//     that is a window of a contiguous [M, K] data buffer: the block at dst element
//     offset o within the box starts at element f = param[1] + o of that buffer, i.e.
//     row f / K, block column (f % K) / 32 (K = param[2], a multiple of 32; param[1]
//     and the outer dst strides multiples of 32), and its scale byte is
//     param[0] + scale_offset(f, K, scales):
//       scales k2D: row-major [M, K/32], byte f / 32;
//       scales kSwizzled: the cuBLAS 128x4-tile layout; the box writes only the scales
//         of its blocks, never the padding (the host zeroes that once).
//     param[0] == 0: no scales (a sender's pack of the data alone); scales, param[1]
//     and param[2] are 0.
//   RX_CODEC_MXFP8_SCALES: the scales alone (src BF16, dst uint8 or E8M0): dst element
//     j is the shared exponent of the 32 contiguous BF16 at src element j's address, so
//     src strides step over whole blocks (innermost 32 for a row of blocks); scales and
//     param[] are 0.
//   A copy box with digest RX_DIGEST_CODEC | rounding << 8 | RX_CODEC_MXFP8 << 16: BF16
//     whose receiver quantizes it later, digested as E4M3 bytes and block scales; its
//     innermost extent is whole blocks (each run of 32 innermost elements is a block).
// rounding: kCeil (0) or kFloor (1); scales: k2D (0) or kSwizzled (1).
#pragma once

#include <stdint.h>

#include <string>

#include "common/host_device.h"
#include "core/box.h"
#include "core/runs.h"
#include "kernels/codecs/registry.h"
#include "kernels/digest.h"
#include "kernels/e4m3.h"

namespace rx::mx {

constexpr int kBlock = 32;          // elements per shared scale (the one MX block size)
constexpr int kTileRows = 128;      // swizzled scale tile: 128 rows ...
constexpr int kTileCols = 4;        // ... x 4 scale columns = 512 bytes
constexpr int kTileBytes = kTileRows * kTileCols;

enum Rounding : int32_t { kCeil = 0, kFloor = 1 };
enum ScaleLayout : int32_t { k2D = 0, kSwizzled = 1 };

// The codec's fields of an MXFP8 box (see the top of this file).
RX_HD int32_t box_rounding(const rx_box& b) { return (b.codec >> 8) & 0xff; }
RX_HD int32_t box_scales(const rx_box& b) { return (b.codec >> 16) & 0xff; }
RX_HD bool box_is_data(const rx_box& b) { return RX_CODEC_ID(b.codec) == RX_CODEC_MXFP8; }
RX_HD uint64_t box_scale_buf(const rx_box& b) { return (uint64_t)b.param[0]; }
RX_HD int64_t box_first(const rx_box& b) { return b.param[1]; }
RX_HD int64_t box_cols(const rx_box& b) { return b.param[2]; }

// |x| of a BF16 as its bit pattern when finite, else 0: integer max over these bit
// patterns is the float max of the finite magnitudes (NaN and +-Inf do not vote).
RX_HD uint32_t finite_abs_bits(uint16_t h) {
  uint32_t a = h & 0x7fffu;
  return a < 0x7f80u ? a : 0u;
}

// Biased E8M0 exponent of the shared scale from the block's amax bits (finite_abs_bits).
//   floor (OCP MX v1.0): X = 2^(floor(log2 amax) - 8)      (8 = emax of E4M3)
//   ceil  (default):     X = 2^ceil(log2(amax / 448))      (the largest |x|/X <= 448)
// Both exact: with amax = m * 2^E, m in [1, 2), amax/448 = (m/1.75) * 2^(E-8) and
// m/1.75 in (0.5, 8/7), so the ceil is E-8, plus one when m > 1.75 (7-bit mantissa > 96).
// Zero, BF16-subnormal and all-non-finite blocks get the smallest scale, biased 0.
RX_HD uint8_t scale_exponent(uint32_t amax_bits, int32_t rounding) {
  int32_t ef = (int32_t)(amax_bits >> 7);  // BF16 biased exponent (bias 127, as E8M0)
  if (ef == 0) return 0;
  int32_t biased = ef - 8 + ((rounding == kCeil && (amax_bits & 0x7fu) > 96u) ? 1 : 0);
  return (uint8_t)(biased < 0 ? 0 : (biased > 254 ? 254 : biased));
}

// E4M3 (fn: no Inf, 0x7f/0xff NaN, max 448) of x * 2^(127 - scale_biased), rounding to
// nearest even and saturating to +-448 (Inf too); NaN stays NaN with its sign (as the
// MX reference keeps it); the sign is kept (-0 -> 0x80). Integer-only (e4m3_rn).
RX_HD uint8_t e4m3_scaled(uint16_t h, uint8_t scale_biased) {
  if ((h & 0x7fffu) > 0x7f80u) return (uint8_t)(((h >> 8) & 0x80u) | 0x7fu);
  return e4m3_rn((uint32_t)h << 16, 127 - (int32_t)scale_biased);
}

// Whole 32-element blocks in the box kernels (CUDA and CPU twin alike) are handled a
// word of two BF16 at a time (element 2i in the low half, as little-endian memory
// holds it), so a lane keeps only a few words of a block live.
constexpr int kBlockWords = kBlock / 2;

// finite_abs_bits max of the two BF16 of a word.
RX_HD uint32_t word_amax(uint32_t w) {
  const uint32_t lo = finite_abs_bits((uint16_t)(w & 0xffffu)), hi = finite_abs_bits((uint16_t)(w >> 16));
  return lo > hi ? lo : hi;
}

// E4M3 bytes of the four BF16 of words a, b under scale `s`, packed little-endian.
RX_HD uint32_t quantize_words(uint32_t a, uint32_t b, uint8_t s) {
  // Finite elements (all four exponents not all ones): x * 2^(127 - s) is exact in FP32 (s
  // <= 247 from a BF16 amax, so the factor is a normal FP32), and e4m3x4_finite rounds it
  // as e4m3_scaled does; NaN and Inf keep their signed bytes below.
  if (bf16x2_finite(a) && bf16x2_finite(b) && s <= 253) {
    const float f = f32_from_bits(static_cast<uint32_t>(254 - s) << 23);
    return e4m3x4_finite(mul_rn(f32_from_bits(a << 16), f), mul_rn(f32_from_bits(a & 0xffff0000u), f),
                         mul_rn(f32_from_bits(b << 16), f), mul_rn(f32_from_bits(b & 0xffff0000u), f));
  }
  return (uint32_t)e4m3_scaled((uint16_t)(a & 0xffffu), s) | (uint32_t)e4m3_scaled((uint16_t)(a >> 16), s) << 8 |
         (uint32_t)e4m3_scaled((uint16_t)(b & 0xffffu), s) << 16 | (uint32_t)e4m3_scaled((uint16_t)(b >> 16), s) << 24;
}

// The digest of one block as the receiver's quantize holds it (RX_DIGEST_CODEC): 32 BF16 (load(j) returns the
// bits of element j) -> E4M3 bytes at ordinals k0.. and the scale of block k0 / 32.
// Reads the block twice (amax, then quantize) so no caller holds all of it at once.
template <typename Load>
RX_HD uint64_t digest_block(Load load, uint64_t k0, int32_t rounding) {
  uint32_t amax = 0;
  for (int j = 0; j < kBlock; ++j) {
    const uint32_t a = finite_abs_bits(load(j));
    amax = a > amax ? a : amax;
  }
  const uint8_t e = scale_exponent(amax, rounding);
  uint64_t h = digest::scale(k0 / kBlock, e);
  for (int j = 0; j < kBlock; ++j) h = digest::add(h, digest::element(k0 + j, e4m3_scaled(load(j), e), 1));
  return h;
}

// Scale columns for `cols` elements (the last block may be partial).
RX_HD int64_t scale_cols(int64_t cols) { return (cols + kBlock - 1) / kBlock; }

// Swizzled layout (cuBLAS/cuBLASLt "1D block scaling factors layout", also what
// Transformer Engine's swizzle and torchao's to_blocked produce): the [rows, scols]
// scale matrix is padded to multiples of 128 rows and 4 columns and cut into 128x4
// tiles stored one after another in row-major tile order (all tiles of rows 0..127
// first). A tile is 512 bytes viewed as 32x16: row r, column c of the tile lands at
// (r % 32) * 16 + (r / 32) * 4 + c.
RX_HD int64_t swizzled_cols_padded(int64_t scols) { return (scols + kTileCols - 1) / kTileCols * kTileCols; }
RX_HD int64_t swizzled_rows_padded(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }
RX_HD int64_t swizzled_size(int64_t rows, int64_t scols) {
  return swizzled_rows_padded(rows) * swizzled_cols_padded(scols);
}
RX_HD int64_t swizzled_offset(int64_t row, int64_t col, int64_t scols) {
  const int64_t tiles_per_row = swizzled_cols_padded(scols) / kTileCols;
  const int64_t tile = (row / kTileRows) * tiles_per_row + col / kTileCols;
  const int64_t r = row % kTileRows, c = col % kTileCols;
  return tile * kTileBytes + (r % 32) * 16 + (r / 32) * 4 + c;
}

// Scale byte (offset into the scale buffer) of the block that starts at element `first`
// (a multiple of 32) of a contiguous [M, cols] data buffer, cols a multiple of 32:
// row-major [M, cols/32] (k2D) or swizzled. The fused box kernels (CUDA, its emulation
// and the CPU twin) all place scales through this one function.
RX_HD int64_t scale_offset(int64_t first, int64_t cols, int32_t layout) {
  if (layout != kSwizzled) return first / kBlock;
  int64_t row, col;
  if (((uint64_t)first | (uint64_t)cols) >> 32 == 0) {  // 64-bit division is a long emulated sequence on GPUs
    row = (uint32_t)first / (uint32_t)cols;
    col = (uint32_t)first % (uint32_t)cols;
  } else {
    row = first / cols;
    col = first % cols;
  }
  return swizzled_offset(row, col / kBlock, cols / kBlock);
}

// ---- host only ---------------------------------------------------------------------

// The codec's checks of an MXFP8 box (id RX_CODEC_MXFP8 or _SCALES) or of a copy box with
// an MXFP8 digest, on top of rx_box_valid.
bool box_valid(const rx_box& b);

// The codec's CPU twin (codecs::cpu_row, cpu_digest of registry.h).
uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n);
uint64_t cpu_digest(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n);

// Its records in the codec table (registry.cc): RX_CODEC_MXFP8 (also a receiver digest)
// and RX_CODEC_MXFP8_SCALES.
extern const codecs::Traits kDataTraits, kScalesTraits;


// Maps a piece's runs along the last dim (global extent `extent`) to the runs of its
// scale columns. Local quantization equals quantizing the logical tensor only when
// every run starts on a 32-element boundary and all but the piece's last run cover
// whole blocks (the last may end at `extent`, in a partial final block). Returns ""
// and fills `out`, or says why not.
std::string scale_runs(const Runs& runs, int64_t extent, Runs* out);

}  // namespace rx::mx
