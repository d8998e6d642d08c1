// The blockwise FP8 codec: E4M3 data and one FP32 scale_inv per 128x128 block of the
// global tensor's last two dims (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 checkpoints, vLLM's
// `weight_scale_inv`, Transformer Engine's Float8BlockwiseQTensor). What its boxes hold
// and the element math, shared by the CUDA lanes and the CPU twin (bit-identical by
// construction). A block's scale needs its amax over the whole global block, which the
// amax pre-pass (codecs/amax.h) provides before any box runs; so, unlike MXFP8, a box
// never computes a scale: it multiplies by the block's precomputed factor.
//
// Conventions (scales, the codec flag):
//   kFp32 (DeepSeek-V3's and DeepGEMM's per_block_cast_to_fp8, vLLM's and SGLang's test
//     references): amax = max |x| in FP32, NaN propagating (torch.amax), clamped below at
//     1e-4; scale_inv = amax / 448; data = E4M3(x * (448 / amax)), where torch evaluates
//     `448.0 / amax` as reciprocal(amax) * 448 (Tensor.__rtruediv__), rounding twice.
//   kPow2 (Transformer Engine's default for blockwise FP8, force_pow_2_scales=True, amax
//     epsilon 0: transformer_engine/common/recipe/recipe_common.cuh compute_scale_from_amax,
//     transpose/quantize_transpose_square_blockwise.cu): amax = fmaxf over |x| (NaN
//     ignored); scale = 1 for an amax of 0 or +Inf, else 448 / amax rounded to nearest,
//     FLT_MAX-like (2^127 after truncation) where that overflows, then truncated to a power
//     of two (exponent bits only); scale_inv = 1 / scale (exact); data = E4M3(x * scale).
// E4M3 casts round to nearest even and saturate to +-448 (Inf too), as torch's
// float8_e4m3fn cast and CUDA's __NV_SATFINITE conversion do. NaN data bytes are 0x7f,
// except kFp32's Inf elements of an Inf block: Inf * 0 is the default NaN of the x86 CPU
// torch's reference runs on, negative: 0xff. Both match torch's CPU reference bytes.
//
// Its box (rx_box.codec = RX_CODEC_FP8BLOCK | scales << 8): a pack or same-rank copy (or
// direct) box from a BF16 or FP32 source piece (the src end carries the codec) into E4M3
// (or uint8) bytes, unit stride innermost on both sides, innermost extent a multiple of
// kItem, each run of kItem innermost elements within one row of the piece and one block
// (the host only builds such boxes). Box params (core/exec_tables.h, from the src ref):
//   param[0]: a Side record in the device's memory (below);
//   param[1]: the element offset of the box's first element from the piece's element 0;
//   param[2]: the piece's row stride in elements (rows: every dim but the last, flattened).
// Element (r, c) of the piece (offset o = r * param[2] + c) is in cell rowmap[r] +
// colmap[c] of the tensor's grid and takes factor mult[cell] (block_mult).
#pragma once

#include <stdint.h>

#include "common/host_device.h"
#include "core/box.h"
#include "kernels/cast.h"
#include "kernels/codecs/registry.h"
#include "kernels/digest.h"
#include "kernels/e4m3.h"

namespace rx::fp8b {

constexpr int kBlock = 128;  // the block's rows and columns (the one size engines load)
constexpr int kItem = 16;    // elements per lane item of a box (one cell: blocks hold whole items)

enum Scales : int32_t { kFp32 = 0, kPow2 = 1 };

// What a box reads besides its source: device pointers into the tensor's grid.
struct Side {
  uint64_t mult;    // uint32 per cell: block_mult
  uint64_t rowmap;  // int32 per local row of the piece
  uint64_t colmap;  // int32 per local column
};

RX_HD int32_t box_scales(const rx_box& b) { return (b.codec >> 8) & 0xff; }

// The factor of a block from its amax (FP32 bits; codecs/amax.h): kFp32: the FP32 bits of
// 448 / amax as torch computes it (NaN for a NaN amax, 0 for +Inf); kPow2: the exponent k
// of the power-of-two scale 2^k.
RX_HD uint32_t block_mult(uint32_t amax, int32_t scales) {
  if (scales == kPow2) {
    if (amax == 0 || amax >= 0x7f800000u) return 0;  // 0, +Inf (and a NaN, which kPow2 never sees): scale 1
    const uint32_t q = f32_bits(div_rn(448.0f, f32_from_bits(amax)));
    if (q >= 0x7f800000u) return 127;  // 448 / amax overflows: the input type's max, truncated: 2^127
    return static_cast<uint32_t>(static_cast<int32_t>(q >> 23) - 127);
  }
  if (is_nan(amax)) return 0x7fc00000u;
  if (amax == 0x7f800000u) return 0;
  const float a = amax > f32_bits(1e-4f) ? f32_from_bits(amax) : 1e-4f;
  return f32_bits(mul_rn(div_rn(1.0f, a), 448.0f));
}

// The block's scale_inv (FP32 bits) from its amax.
RX_HD uint32_t block_scale_inv(uint32_t amax, int32_t scales) {
  if (scales == kPow2) {
    const int32_t k = static_cast<int32_t>(block_mult(amax, scales));
    return k <= 126 ? static_cast<uint32_t>(127 - k) << 23 : 1u << (149 - k);  // 2^-k; 2^-127 is subnormal
  }
  if (is_nan(amax)) return 0x7fc00000u;
  if (amax == 0x7f800000u) return amax;
  const float a = amax > f32_bits(1e-4f) ? f32_from_bits(amax) : 1e-4f;
  return f32_bits(div_rn(a, 448.0f));
}

// One element (FP32 bits of x) under its block's factor.
RX_HD uint8_t quantize(uint32_t x, uint32_t mult, int32_t scales) {
  if (scales == kPow2) return e4m3_rn(x, static_cast<int32_t>(mult));
  if (is_nan(x) || is_nan(mult)) return 0x7f;
  if ((x & 0x7fffffffu) == 0x7f800000u) return mult == 0 ? 0xff : static_cast<uint8_t>(((x >> 24) & 0x80u) | 0x7eu);
  return e4m3_rn(f32_bits(mul_rn(f32_from_bits(x), f32_from_bits(mult))), 0);
}

// Four elements of one block (FP32 bits) under its factor, as E4M3 bytes packed
// little-endian: the hardware conversion where all four are finite (quantize's special
// cases are all non-finite ones), else quantize one at a time.
RX_HD uint32_t quantize4(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, uint32_t mult, int32_t scales) {
  const bool pow2 = scales == kPow2;
  if (is_finite(x0) && is_finite(x1) && is_finite(x2) && is_finite(x3) && (pow2 || !is_nan(mult))) {
    // kPow2's k is in [-120, 127] (block_mult), so 2^k is a normal FP32 and x * 2^k exact
    // down to the FP32 subnormals, far below E4M3's smallest step.
    const float f = f32_from_bits(pow2 ? static_cast<uint32_t>(static_cast<int32_t>(mult) + 127) << 23 : mult);
    return e4m3x4_finite(mul_rn(f32_from_bits(x0), f), mul_rn(f32_from_bits(x1), f), mul_rn(f32_from_bits(x2), f),
                         mul_rn(f32_from_bits(x3), f));
  }
  return static_cast<uint32_t>(quantize(x0, mult, scales)) | static_cast<uint32_t>(quantize(x1, mult, scales)) << 8 |
         static_cast<uint32_t>(quantize(x2, mult, scales)) << 16 | static_cast<uint32_t>(quantize(x3, mult, scales)) << 24;
}

// FP32 bits of a source element (BF16 or FP32 raw bits).
RX_HD uint32_t f32_of_raw(uint32_t raw, int32_t dtype) { return dtype == RX_BF16 ? raw << 16 : raw; }

// ---- host only ---------------------------------------------------------------------

bool box_valid(const rx_box& b);
uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n);
extern const codecs::Traits kTraits;

}  // namespace rx::fp8b
