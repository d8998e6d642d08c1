// The NVFP4 codec (NVIDIA's FP4: E2M1 elements packed two per byte, an E4M3 scale per 16
// elements along the last dim, one FP32 scale per tensor): what its boxes hold and the
// element math, shared by the CUDA kernels and the CPU twin (host/device, one code).
//
// The reference is torchao's NVFP4Tensor.to_nvfp4(x, per_tensor_scale=
// per_tensor_amax_to_scale(max|x|)) as it runs on a CPU (torchao 0.18, nvfp4_quantize):
//   pts = amax / 2688 (= 448 * 6)           the per-tensor scale, FP32
//   per block of 16:  s  = (bmax / 6) / pts   bmax = max |x| of the block, in FP32
//                     s8 = E4M3(clamp(s, 2^-6, 448))   the block scale (RNE)
//                     r  = (1 / pts) / float(s8)
//   per element:      E2M1(clamp(x * r, -6, 6))        RNE, torchao's bit recipe
// Every step is one IEEE FP32 operation rounded to nearest, computed here by the same
// operation (never contracted, no FTZ), so the bits match. Where torch's CPU kernels
// meet NaN the result depends on x86 NaN rules; those are written out here (div_bits,
// mul_bits) so the CUDA kernel gets the same bytes: a tensor holding a NaN has a NaN
// amax, hence every scale 0x7f and every element code 3 (byte 0x33); an invalid
// operation (0/0, inf/inf, 0*inf) is x86's default NaN 0xffc00000. Consequences: an
// all-zero tensor gets scales 0xff and bytes 0xcc; a tensor holding +-Inf gets scales
// 0xff and bytes 0xcc in the blocks with an Inf and scale 0x08, elements +-0 elsewhere.
//
// The boxes work in pair coordinates: a source is read as 4-byte words of two BF16
// (element 2i in the low half), one word per coordinate of the packed last dim [.., K/2],
// so one coordinate is one output byte and 8 coordinates are one 16-element block.
//   RX_CODEC_NVFP4: quantize fused into the copy (src RX_I32 words of BF16 pairs, dst
//     uint8 packed E2M1). The innermost dim has unit stride on both sides and an
//     extent that is a multiple of 8 (kBlockWords); each run of 8 innermost words is
//     one block (the host only builds such boxes where they lie on the logical
//     tensor's 16-grid). param[0]: the amax cell (a uint32, the FP32 bits of the whole
//     tensor's max |x|: a per-tensor cell of the amax pre-pass, codecs/amax.h), read by
//     the kernel when it runs.
//   RX_CODEC_NVFP4_SCALES: the block scales alone (src RX_I32 words, dst uint8 or
//     E4M3): dst element j is the scale of the 8 words at src element j's address, so
//     src strides step over whole blocks. param[0]: the amax cell, as for the data.
// Both: param[1] is the box's first word in the source (the exec tables' element offset,
// unused), param[2] is 0, no codec flags.
#pragma once

#include <math.h>
#include <stdint.h>

#include <string>

#include "common/host_device.h"
#include "core/box.h"
#include "core/runs.h"
#include "kernels/cast.h"
#include "kernels/codecs/amax.h"
#include "kernels/codecs/registry.h"

namespace rx::nv {

constexpr int kBlock = 16;                // elements per E4M3 block scale
constexpr int kBlockWords = kBlock / 2;   // 4-byte words (BF16 pairs) per block = packed bytes per block
constexpr uint32_t kNaN = 0x7fc00000u;    // torch's NaN (its amax of a tensor holding one)
constexpr uint32_t kIndefinite = 0xffc00000u;  // x86's default NaN: 0/0, inf/inf, 0*inf
constexpr float kTensorDivisor = 2688.0f;      // 448 (E4M3 max) * 6 (E2M1 max)

RX_HD uint64_t box_amax(const rx_box& b) { return (uint64_t)b.param[0]; }
RX_HD bool box_is_data(const rx_box& b) { return RX_CODEC_ID(b.codec) == RX_CODEC_NVFP4; }

// a / b on FP32 bits as torch's CPU kernels compute it on x86: a NaN operand comes back
// quieted, the dividend's first; 0/0 and inf/inf give the default NaN.
RX_HD uint32_t div_bits(uint32_t a, uint32_t b) {
  if (is_nan(a)) return a | 0x00400000u;
  if (is_nan(b)) return b | 0x00400000u;
  const uint32_t ma = a & 0x7fffffffu, mb = b & 0x7fffffffu;
  if ((ma == 0 && mb == 0) || (ma == 0x7f800000u && mb == 0x7f800000u)) return kIndefinite;
  return f32_bits(div_rn(f32_from_bits(a), f32_from_bits(b)));
}

// a * b likewise, as torch's broadcast multiply returns NaNs: the second operand's first.
RX_HD uint32_t mul_bits(uint32_t a, uint32_t b) {
  if (is_nan(b)) return b | 0x00400000u;
  if (is_nan(a)) return a | 0x00400000u;
  const uint32_t ma = a & 0x7fffffffu, mb = b & 0x7fffffffu;
  if ((ma == 0 && mb == 0x7f800000u) || (ma == 0x7f800000u && mb == 0)) return kIndefinite;
  return f32_bits(mul_rn(f32_from_bits(a), f32_from_bits(b)));
}

// clamp(x, lo, hi) as torch.clamp: NaN passes through unchanged.
RX_HD uint32_t clamp_bits(uint32_t x, float lo, float hi) {
  const float f = f32_from_bits(x);
  return f < lo ? f32_bits(lo) : (f > hi ? f32_bits(hi) : x);
}

// A block's amax is the max of |x| as the FP32 bits torch's amax compares (amax::abs_bits
// of a BF16): integer max over these is the float max, NaN (any payload) above
// everything; canonical() then maps a NaN to torch's.
RX_HD uint32_t canonical(uint32_t amax) { return is_nan(amax) ? kNaN : amax; }

// The amax of a block of 8 words, in packed 16-bit maxima (amax::Fold).
RX_HD uint32_t block_amax(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t e, uint32_t f, uint32_t g,
                          uint32_t h) {
  amax::Fold<RX_BF16, amax::kPropagate> m;
  m.add2(a, b);
  m.add2(c, d);
  m.add2(e, f);
  m.add2(g, h);
  return m.bits();
}

// The per-tensor scale (torchao per_tensor_amax_to_scale) of an amax (abs_bits max).
RX_HD uint32_t tensor_scale_bits(uint32_t amax) { return div_bits(canonical(amax), f32_bits(kTensorDivisor)); }

// E4M3 (fn) of a value in [2^-6, 448] or NaN, as c10's float -> Float8_e4m3fn does
// (round to nearest even; NaN -> 0x7f with its sign).
RX_HD uint8_t e4m3_of(uint32_t f) {
  if (is_nan(f)) return (uint8_t)(0x7fu | ((f >> 24) & 0x80u));
  return (uint8_t)((f + 0xc4000000u + 0x7ffffu + ((f >> 20) & 1u)) >> 20);  // rebias 127 -> 7, round
}

// FP32 bits of an E4M3 scale byte in [0x08, 0x7e] or a NaN, as c10 widens it (a NaN
// becomes 0x7ff00000 with its sign).
RX_HD uint32_t f32_of_e4m3(uint8_t s) {
  const uint32_t sign = (uint32_t)(s & 0x80u) << 24;
  if ((s & 0x7fu) == 0x7fu) return sign | 0x7ff00000u;
  return sign | ((uint32_t)((s & 0x7fu) >> 3) + 120u) << 23 | (uint32_t)(s & 7u) << 20;
}

// The per-tensor state every block of a tensor needs, from its amax cell.
struct TensorScale {
  uint32_t pts;  // FP32 bits of the per-tensor scale
  uint32_t rcp;  // FP32 bits of 1 / pts
  // pts and rcp finite and pts nonzero (every tensor without NaN/Inf whose amax is not 0):
  // a block with a finite amax then meets none of div_bits' special cases
  bool plain;
};
RX_HD TensorScale tensor_scale(uint32_t amax) {
  const uint32_t pts = tensor_scale_bits(amax);
  const uint32_t rcp = div_bits(f32_bits(1.0f), pts);
  return TensorScale{pts, rcp, is_finite(pts) && (pts & 0x7fffffffu) != 0 && is_finite(rcp)};
}

// Whether a block whose amax (abs_bits max) is `bmax` takes the plain path of its tensor.
RX_HD bool block_plain(uint32_t bmax, TensorScale t) { return t.plain && bmax < 0x7f800000u; }

// a * b + c in one FP32 rounding to nearest even.
RX_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

// div_rn(x, 6) of a finite BF16 magnitude x (abs_bits): the product by the rounded 1/6
// and one correction (exhaustively equal for every finite BF16 magnitude, not for FP32 in
// general), in place of a division with its range check.
RX_HD float div6(float x) {
  const float r = 0.16666667163372039795f;  // RN(1/6)
  const float q = mul_rn(x, r);
  return fma_rn(fma_rn(-q, 6.0f, x), r, q);
}

// A block's E4M3 scale: its byte and its value as FP32 bits (c10's widening).
struct BlockScale {
  uint8_t scale;
  uint32_t value;
};

// The block scale of a block whose amax (abs_bits max) is `bmax`.
RX_HD BlockScale block_scale(uint32_t bmax, TensorScale t) {
  if (block_plain(bmax, t)) {
    // Plain FP32 steps; the clamped value is positive, finite and not NaN, so its E4M3 is
    // its bits rounded at bit 20 (nearest, ties to even), rebiased, and the widening of
    // that byte is the rounded bits themselves.
    const float s = div_rn(div6(f32_from_bits(bmax)), f32_from_bits(t.pts));
    const uint32_t c = f32_bits(fmaxf(fminf(s, 448.0f), 0.015625f));
    const uint32_t r = c + 0x7ffffu + ((c >> 20) & 1u);
    return BlockScale{(uint8_t)((r >> 20) + 0x40u), r & 0xfff00000u};  // 0x40: the rebias 127 -> 7, mod 256
  }
  const uint8_t s8 =
      e4m3_of(clamp_bits(div_bits(div_bits(canonical(bmax), f32_bits(6.0f)), t.pts), 0.015625f, 448.0f));
  return BlockScale{s8, f32_of_e4m3(s8)};
}

// What every element of a block is multiplied by: FP32 bits of (1 / pts) / float(scale).
RX_HD uint32_t block_mult(uint32_t bmax, BlockScale b, TensorScale t) {
  if (block_plain(bmax, t)) return f32_bits(div_rn(f32_from_bits(t.rcp), f32_from_bits(b.value)));
  return div_bits(t.rcp, b.value);
}

// FP32 bits a rounded at bit 22 (nearest, ties to even) and rebased so that 1.0 is 2.
RX_HD uint32_t e2m1_rebias(uint32_t a) { return (a + 0x1fffffu + ((a >> 22) & 1u) - 0x3f000000u) >> 22; }

// min(a + b, c) of unsigned words (one VIADDMNMX on the GPU).
RX_HD uint32_t add_min(uint32_t a, uint32_t b, uint32_t c) {
#if defined(RX_DPX)
  return __viaddmin_u32(a, b, c);
#else
  return a + b < c ? a + b : c;
#endif
}

// E2M1 code (3 bits) of FP32 bits a >= 0 that are not NaN, as torchao's
// _f32_to_floatx_unpacked rounds min(a, 6) (to nearest, ties to even codes). E2M1 steps by
// 0.5 below 2, by 1 up to 4, by 2 up to 6: an FP32 add of 1.5 * 2^22 (unit in the last
// place 0.5) rounds a as the first range does and leaves the step count in the low bits,
// 2 * round(a), the code below 2; adds of 1.5 * 2^23 and 1.5 * 2^24 give round(a) + 2 and
// round(a / 2) + 4, the codes from 2 and from 4. Each is the code in its range and no less
// than it elsewhere (the counts grow faster the finer the step; Inf and every a past 2^21
// give huge counts), and 7 saturates: the code is their minimum (equal to rounding by
// E2M1's thresholds on every non-NaN a >= 0, checked exhaustively on the host).
RX_HD uint32_t e2m1_magnitude(uint32_t a) {
  const float f = f32_from_bits(a);
  const uint32_t c1 = f32_bits(add_rn(f, 6291456.0f)), c2 = f32_bits(add_rn(f, 12582912.0f)),
                 c4 = f32_bits(add_rn(f, 25165824.0f));
  const uint32_t m = add_min(c4, 0u - (0x4bc00000u - 4u), add_min(c2, 0u - (0x4b400000u - 2u), 7u));
  return add_min(c1, 0u - 0x4ac00000u, m);
}

// E2M1 code (sign << 3 | 3 bits) of FP32 bits y that are not NaN, clamped to [-6, 6].
RX_HD uint32_t e2m1_of_number(uint32_t y) { return e2m1_magnitude(y & 0x7fffffffu) | ((y >> 28) & 8u); }

// Any FP32 bits: a NaN takes torchao's exponent-rebias path, so its code comes from its bits.
RX_HD uint32_t e2m1_of(uint32_t y) {
  if (!is_nan(y)) return e2m1_of_number(y);
  return ((e2m1_rebias(y & 0x7fffffffu) & 0xffu) | ((y >> 28) & 8u)) & 0xffu;
}

// The E2M1 magnitude codes of elements 2i (low nibble) and 2i+1 of a BF16 word under
// multiplier m, where both elements are finite and m is finite and not negative (every
// finite multiplier is: block_scale divides non-negative values): no NaN to propagate, no
// 0 * Inf, and x * m is |x| * m with x's sign, so the product of the magnitude (a free
// operand modifier) gives the code; the sign bits are the caller's.
RX_HD uint32_t word_codes(uint32_t w, float m) {
  const uint32_t lo = e2m1_magnitude(f32_bits(mul_rn(fabsf(f32_from_bits(w << 16)), m)));
  const uint32_t hi = e2m1_magnitude(f32_bits(mul_rn(f32_from_bits(w & 0x7fff0000u), m)));
  return (hi << 4) + lo;
}

// The packed E2M1 byte of a word under such an m: its codes and its elements' sign bits.
RX_HD uint32_t quantize_word_finite(uint32_t w, float m) {
  return word_codes(w, m) | ((w >> 12) & 0x8u) | ((w >> 24) & 0x80u);
}

// Byte n of the result is byte (s >> 4n) & 7 of y:x (x bytes 0-3): one PRMT on the GPU.
RX_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t v = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= (uint32_t)(v >> (8 * ((s >> (4 * n)) & 7u)) & 0xffu) << (8 * n);
  return r;
#endif
}

// The same byte for any bits.
RX_HD uint32_t quantize_word(uint32_t w, uint32_t m) {
  if (bf16x2_finite(w) && m < 0x7f800000u) return quantize_word_finite(w, f32_from_bits(m));
  const auto one = [m](uint16_t h) {
    return e2m1_of(clamp_bits(mul_bits((uint32_t)h << 16, m), -6.0f, 6.0f));
  };
  return (one((uint16_t)(w & 0xffffu)) | one((uint16_t)(w >> 16)) << 4) & 0xffu;
}

// The 4 packed bytes (little-endian) of 4 words (8 elements) under multiplier m. `finite`:
// block_finite of the block's amax and m, so every element is: one test per block instead
// of one per word.
RX_HD uint32_t quantize_words4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t m, bool finite) {
  if (finite) {
    // Byte k holds word k's codes; the signs of all 8 elements come in together: byte 1
    // (low element) and byte 3 (high) of each word gathered into byte k, bit 7 of which is
    // the sign, moved to bit 3 (low nibble) or kept at bit 7 (high nibble).
    const float f = f32_from_bits(m);
    const uint32_t lo = word_codes(a, f) | word_codes(b, f) << 8, hi = word_codes(c, f) | word_codes(d, f) << 8;
    const uint32_t u = byte_perm(a, b, 0x7531u), v = byte_perm(c, d, 0x7531u);
    return (lo | hi << 16) | (byte_perm(u, v, 0x7531u) & 0x80808080u) | ((byte_perm(u, v, 0x6420u) >> 4) & 0x08080808u);
  }
  return quantize_word(a, m) | quantize_word(b, m) << 8 | quantize_word(c, m) << 16 | quantize_word(d, m) << 24;
}

// Whether a block whose amax (abs_bits max) is `bmax` is finite and its multiplier finite and
// not negative (as quantize_word_finite needs): NaN patterns sort above Inf, so the amax
// bounds every element, and non-negative finite FP32 bits are those below Inf's.
RX_HD bool block_finite(uint32_t bmax, uint32_t mult) { return bmax < 0x7f800000u && mult < 0x7f800000u; }

// One block of 8 BF16 words: its scale byte, and its 8 packed bytes (little-endian, two
// words) when `packed` is given.
RX_HD uint8_t quantize_block(const uint32_t* w, TensorScale t, uint32_t* packed) {
  const uint32_t bmax = block_amax(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
  const BlockScale b = block_scale(bmax, t);
  if (packed) {
    const uint32_t mult = block_mult(bmax, b, t);
    const bool finite = block_finite(bmax, mult);
    packed[0] = quantize_words4(w[0], w[1], w[2], w[3], mult, finite);
    packed[1] = quantize_words4(w[4], w[5], w[6], w[7], mult, finite);
  }
  return b.scale;
}

// ---- host only ---------------------------------------------------------------------

// The codec's checks of an NVFP4 box (id RX_CODEC_NVFP4 or _SCALES), on top of rx_box_valid.
bool box_valid(const rx_box& b);

// The codec's CPU twin of one innermost row (codecs::cpu_row of registry.h).
uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n);

// Its records in the codec table (registry.cc).
extern const codecs::Traits kDataTraits, kScalesTraits;

// Maps a piece's runs along the last dim (global extent `extent`, in elements) to the
// runs of a coarser tensor whose coordinate covers `per` elements (2: the packed data;
// 16: the block scales). Quantizing pieces locally equals quantizing the logical tensor
// only when every run starts on a block boundary and covers whole blocks (the extent is
// a multiple of 16). Returns "" and fills `out`, or says why not.
std::string coarse_runs(const Runs& runs, int64_t extent, int64_t per, Runs* out);

}  // namespace rx::nv
