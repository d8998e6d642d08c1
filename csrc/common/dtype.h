// Element types: the one table of codes, sizes, names and float-ness. Core, kernels and
// bindings read it here; Python gets it through _C.DType / _C.dtype_info (bind_common.cc).
// The codes are an ABI (box tables, plan metadata): never renumber, only append.
// Naming: rx_/RX_ C names are the C ABI only (the codes here, core/box.h's records,
// kernels/*api.h's entry points); C++ callers use rx::dtype_size and friends.
#pragma once

#include <stdint.h>

#include "common/host_device.h"

// X(enum, code, bytes, torch name, is_float). is_float: the types a copy may cast
// between (castability is "same type, or both float").
#define RX_DTYPE_TABLE(X)                      \
  X(RX_U8, 0, 1, "uint8", 0)                   \
  X(RX_I8, 1, 1, "int8", 0)                    \
  X(RX_I16, 2, 2, "int16", 0)                  \
  X(RX_I32, 3, 4, "int32", 0)                  \
  X(RX_I64, 4, 8, "int64", 0)                  \
  X(RX_F16, 5, 2, "float16", 1)                \
  X(RX_BF16, 6, 2, "bfloat16", 1)              \
  X(RX_F32, 7, 4, "float32", 1)                \
  X(RX_F64, 8, 8, "float64", 1)                \
  X(RX_BOOL, 9, 1, "bool", 0)                  \
  X(RX_F8E4M3, 10, 1, "float8_e4m3fn", 0)      \
  X(RX_F8E5M2, 11, 1, "float8_e5m2", 0)        \
  X(RX_F8E8M0, 12, 1, "float8_e8m0fnu", 0)     \
  X(RX_U16, 13, 2, "uint16", 0)                \
  X(RX_U32, 14, 4, "uint32", 0)                \
  X(RX_U64, 15, 8, "uint64", 0)

#ifdef __cplusplus
extern "C" {
#endif

#define RX_DTYPE_ENUM_(e, code, bytes, name, is_float) e = code,
typedef enum rx_dtype { RX_DTYPE_TABLE(RX_DTYPE_ENUM_) RX_NUM_DTYPES } rx_dtype;  // codes are 0..N-1
#undef RX_DTYPE_ENUM_

#ifdef __cplusplus
}

namespace rx {

// Device code reads the table through these switches (no table in device memory).
#define RX_DTYPE_SIZE_CASE_(e, code, bytes, name, is_float) case code: return bytes;
#define RX_DTYPE_FLOAT_CASE_(e, code, bytes, name, is_float) case code: return is_float;
RX_HD int32_t dtype_size(int32_t d) { switch (d) { RX_DTYPE_TABLE(RX_DTYPE_SIZE_CASE_) default: return 0; } }
RX_HD bool dtype_is_float(int32_t d) { switch (d) { RX_DTYPE_TABLE(RX_DTYPE_FLOAT_CASE_) default: return false; } }
#undef RX_DTYPE_SIZE_CASE_
#undef RX_DTYPE_FLOAT_CASE_

RX_HD bool dtype_castable(int32_t src, int32_t dst) {
  if (dtype_size(src) == 0 || dtype_size(dst) == 0) return false;
  return src == dst || (dtype_is_float(src) && dtype_is_float(dst));
}

// torch's name of the type ("bfloat16"), "unknown" for an unknown code.
const char* dtype_name(int32_t dtype);

}  // namespace rx
#endif
