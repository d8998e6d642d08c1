// Bit-exact element conversions shared by the CPU twins and the CUDA kernels, so both
// produce the same bits as torch's Tensor.to (round to nearest even; float64 sources
// go through float32 for the 16-bit types, as c10::BFloat16/c10::Half do).
#pragma once

#include <stdint.h>
#include <string.h>

#include "common/dtype.h"
#include "common/host_device.h"
#include "kernels/api.h"

namespace rx {

// The bits of a value as another type of the same size. memcpy of a local is folded
// into a register move by nvcc and by host compilers alike (the SASS of both kernels
// has no local-memory traffic), so one definition serves both sides.
template <typename To, typename From>
RX_HD To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

RX_HD uint32_t f32_bits(float f) { return bit_cast<uint32_t>(f); }
RX_HD float f32_from_bits(uint32_t u) { return bit_cast<float>(u); }
RX_HD uint64_t f64_bits(double d) { return bit_cast<uint64_t>(d); }
RX_HD double f64_from_bits(uint64_t u) { return bit_cast<double>(u); }

// Whether FP32 bits are a NaN (either sign, any payload).
RX_HD bool is_nan(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }

// Whether FP32 bits are finite (not Inf, not NaN); whether both BF16 of a word are.
RX_HD bool is_finite(uint32_t bits) { return (bits & 0x7f800000u) != 0x7f800000u; }
RX_HD bool bf16x2_finite(uint32_t w) {
  const uint32_t e = (w & 0x7f807f80u) ^ 0x7f807f80u;  // nonzero in a half whose exponent is not all ones
  return (e & 0xffffu) != 0 && (e >> 16) != 0;
}

// One FP32 operation rounded to nearest even, never fused into another (no FMA
// contraction, no fast math), so that host twins and kernels agree bit for bit.
RX_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RX_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RX_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// A NaN comes out as torch's Tensor.to makes it on the device that casts. On the CPU,
// ATen's vectorized conversion (AVX2/AVX-512): bfloat16 0xffff for every NaN, and for
// float16 the F16C instruction's quiet NaN with the sign and top payload bits kept. On
// CUDA, c10's conversions (__float2bfloat16 from sm_80, __float2half): the canonical NaN
// 0x7fff; below sm_80 c10's bfloat16 rounding in software: 0x7fc0.
RX_HD uint16_t bf16_nan(uint32_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return 0x7fff;
#elif defined(__CUDA_ARCH__)
  return 0x7fc0;
#else
  return 0xffff;
#endif
}

RX_HD uint16_t f16_nan(uint32_t x) {
#if defined(__CUDA_ARCH__)
  (void)x;
  return 0x7fff;
#else
  return (uint16_t)(((x >> 16) & 0x8000u) | 0x7e00u | ((x & 0x7fffffu) >> 13));
#endif
}

RX_HD uint16_t bf16_from_f32(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_nan(u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

RX_HD float f32_from_bf16(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

RX_HD uint16_t f16_from_f32(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return f16_nan(x);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // overflow (incl. inf) after rounding
  if (ax < 0x38800000u) {                                   // subnormal or zero in half
    if (ax < 0x33000000u) return (uint16_t)sign;            // below half of the smallest subnormal
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    int shift = 113 - (int)(ax >> 23) + 13;                 // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));                 // rebias exponent 127 -> 15
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

RX_HD float f32_from_f16(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // subnormal: normalise
    int e = -1;
    do { mant <<= 1; e++; } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    return f32_from_bits(sign | ((uint32_t)(112 - e) << 23) | (mant << 13));
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Reads one floating element as float: exact (NaN payloads included) for the 16/32-bit
// types; float64 narrows with C's conversion, as c10 does before a 16-bit type.
RX_HD float load_float(const void* p, int32_t dtype) {
  switch (dtype) {
    case RX_F16: return f32_from_f16(*(const uint16_t*)p);
    case RX_BF16: return f32_from_bf16(*(const uint16_t*)p);
    case RX_F32: return *(const float*)p;
    default: return (float)*(const double*)p;
  }
}

// Writes one floating element, rounding as torch does. Only f64 -> f64 keeps more than
// float precision, and that pair never casts (equal types copy raw bytes).
RX_HD void store_float(void* p, int32_t dtype, float v) {
  switch (dtype) {
    case RX_F16: *(uint16_t*)p = f16_from_f32(v); break;
    case RX_BF16: *(uint16_t*)p = bf16_from_f32(v); break;
    case RX_F32: *(float*)p = v; break;
    default: *(double*)p = (double)v; break;
  }
}

RX_HD float f32_of(uint64_t raw, int dt) {
  switch (dt) {
    case RX_F16: return f32_from_f16(static_cast<uint16_t>(raw));
    case RX_BF16: return f32_from_bf16(static_cast<uint16_t>(raw));
    default: return f32_from_bits(static_cast<uint32_t>(raw));
  }
}

RX_HD uint64_t bits_of(float f, int dt) {
  switch (dt) {
    case RX_F16: return f16_from_f32(f);
    case RX_BF16: return bf16_from_f32(f);
    default: return f32_bits(f);
  }
}

// The cast of load_float/store_float on raw bits (the CUDA kernel's and the digests'):
// 16/32-bit types stay in float, f64 narrows through float as c10 does.
RX_HD uint64_t convert_bits(uint64_t raw, int s, int d) {
  if (s == RX_F64) return bits_of(static_cast<float>(f64_from_bits(raw)), d);
  const float f = f32_of(raw, s);
  return d == RX_F64 ? f64_bits(static_cast<double>(f)) : bits_of(f, d);
}

}  // namespace rx
