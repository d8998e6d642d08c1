// Checked 64-bit arithmetic for every size, offset and byte count the core computes.
// These numbers come from the caller's shapes, meshes and batch sizes, so an overflow
// is the caller's input being too large: it raises ReshardError naming the quantity
// instead of wrapping around into a plan that moves nothing or writes out of bounds.
#pragma once

#include <cstdint>

#include "common/check.h"

namespace rx {

inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw ReshardError(detail::format(what, ": ", a, " * ", b, " overflows a 64-bit integer"));
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw ReshardError(detail::format(what, ": ", a, " + ", b, " overflows a 64-bit integer"));
  return r;
}

// x rounded up to a multiple of a (a > 0).
inline int64_t checked_align_up(int64_t x, int64_t a, const char* what) {
  return checked_add(x, a - 1, what) / a * a;
}

}  // namespace rx
