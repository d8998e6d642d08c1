// FP32 -> E4M3 (fn: max 448, no Inf, 0x7f NaN) conversions shared by the FP8 codecs, host
// and device. Round to nearest even and saturate to +-448, as torch's float8_e4m3fn cast,
// Transformer Engine and CUDA's __NV_SATFINITE conversion do.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

#include "common/host_device.h"
#include "kernels/cast.h"

namespace rx {

// E4M3 of (FP32 bits) * 2^k, exactly: round to nearest even, saturating to +-448 (Inf
// too); NaN -> 0x7f; the sign kept (-0 -> 0x80). Integer only, so no FP mode (FTZ, fast
// math) can change a bit: the reference every faster path is checked against.
RX_HD uint8_t e4m3_rn(uint32_t bits, int32_t k) {
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a == 0x7f800000u) return static_cast<uint8_t>(sign | 0x7eu);
  if (a == 0) return sign;
  const int32_t ef = static_cast<int32_t>(a >> 23);
  const uint32_t m = ef ? (a & 0x7fffffu) | 0x800000u : a;  // value = m * 2^e, m < 2^24
  const int32_t e = (ef ? ef : 1) - 150 + k;
#if defined(__CUDA_ARCH__)
  const int32_t p = 31 - __clz(m);
#else
  const int32_t p = 31 - __builtin_clz(m);
#endif
  int32_t exp_y = p + e;  // floor(log2 value)
  if (exp_y > 8) return static_cast<uint8_t>(sign | 0x7eu);
  if (exp_y < -6) exp_y = -6;  // E4M3 subnormals: quantum 2^-9
  const int32_t sh = (exp_y - 3) - e;  // value / quantum = m * 2^-sh
  uint32_t q;
  if (sh <= 0) {
    q = m << (-sh);  // sh >= -3 here: q <= 15
  } else if (sh > 25) {
    q = 0;  // below a quarter of the quantum
  } else {
    q = m >> sh;
    const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
  }
  // q in [0, 16]: normal q in [8, 16) at exponent exp_y; the formula also covers the
  // subnormals (exp_y = -6, q < 8) and the carry q = 16 into the next binade.
  int32_t out = ((exp_y + 7) << 3) + static_cast<int32_t>(q) - 8;
  if (out > 0x7e) out = 0x7e;
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(out));
}

// E4M3 bytes of four finite FP32 values, packed little-endian (a in the low byte). The
// codecs' hot loops: one cvt.rn.satfinite.e4m3x2.f32 per pair on sm_89+, which rounds
// and saturates finite values exactly as e4m3_rn(bits, 0) does (the kernel tests compare
// the two byte for byte); e4m3_rn elsewhere. NaN and Inf take each codec's own bytes.
RX_HD uint32_t e4m3x4_finite(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
#else
  return static_cast<uint32_t>(e4m3_rn(f32_bits(a), 0)) | static_cast<uint32_t>(e4m3_rn(f32_bits(b), 0)) << 8 |
         static_cast<uint32_t>(e4m3_rn(f32_bits(c), 0)) << 16 | static_cast<uint32_t>(e4m3_rn(f32_bits(d), 0)) << 24;
#endif
}

}  // namespace rx
