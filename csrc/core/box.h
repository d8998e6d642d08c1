// The box table: the format the planner (core) builds and the kernels consume. Core owns
// it because core produces it; kernels include it (kernels -> core), never the reverse.
// Plain C: the CUDA kernels, the CPU twins and the bindings read the same records.
#pragma once

#include <stdint.h>

#include "common/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RX_MAX_DIMS 6

// What a box does with its elements (rx_box.mode = kind | rounding << 8 | scales << 16).
//   RX_BOX_COPY: copy, casting between floating types (mode 0, no MX fields but
//     mx_first: the verify ordinal of the box's first element, >= 0, for a piece of a
//     larger box digested piece by piece (kernels/digest.h); else 0).
//   RX_BOX_MX_DATA: MXFP8 quantize fused into the copy (src BF16, dst E4M3 or uint8
//     bytes). The innermost dim has unit stride on both sides and an extent that is a
//     multiple of the MX block (32, rx::mx::kBlock); each run of 32 innermost elements is one MX block
//     (the host only builds such boxes where they lie on the logical tensor's 32-grid).
//     Per block: e = shared E8M0 exponent of its amax, data = x / 2^(e-127) in E4M3
//     (core/mxfp8.h). aux != 0: e is also written into the scale buffer at aux, for a
//     dst that is a window of a contiguous [M, K] data buffer: the block at dst element
//     offset o within the box starts at element f = mx_first + o of that buffer, i.e.
//     row f / K, block column (f % K) / 32 (K = mx_cols, a multiple of 32; mx_first
//     and the outer dst strides multiples of 32), and its scale byte is
//     aux + rx::mx::scale_offset(f, K, scales) (core/mxfp8.h):
//       scales RX_MX_SCALE_2D: row-major [M, K/32], byte f / 32;
//       scales RX_MX_SCALE_SWIZZLED: the cuBLAS 128x4-tile layout; the box writes only
//         the scales of its blocks, never the padding (the host zeroes that once).
//     aux == 0: no scales (a sender's pack of the data alone); scales, mx_first and
//     mx_cols are 0.
//   RX_BOX_MX_SCALE: the scales alone (src BF16, dst uint8 or E8M0): dst element j is
//     the shared exponent of the 32 contiguous BF16 at src element j's address, so
//     src strides step over whole blocks (innermost 32 for a row of blocks); aux,
//     scales, mx_first and mx_cols are 0.
// rounding: RX_MX_ROUND_CEIL (0) or RX_MX_ROUND_FLOOR (1), scales: RX_MX_SCALE_2D (0) or
// RX_MX_SCALE_SWIZZLED (1), both of kernels/mxfp8_api.h.
typedef enum rx_box_kind { RX_BOX_COPY = 0, RX_BOX_MX_DATA = 1, RX_BOX_MX_SCALE = 2 } rx_box_kind;
#define RX_BOX_KIND(mode) ((mode) & 0xff)
#define RX_BOX_ROUNDING(mode) (((mode) >> 8) & 0xff)
#define RX_BOX_SCALES(mode) (((mode) >> 16) & 0xff)

// One box: `shape` elements (outermost dim first), read at `src` with `src_stride`
// (in elements of src_dtype) and written at `dst` with `dst_stride` (in elements of
// dst_dtype). For a copy, src_dtype != dst_dtype only between floating types
// (f16/bf16/f32/f64); the cast rounds to nearest even, as torch's Tensor.to does.
typedef struct rx_box {
  uint64_t src;
  uint64_t dst;
  int64_t shape[RX_MAX_DIMS];
  int64_t src_stride[RX_MAX_DIMS];
  int64_t dst_stride[RX_MAX_DIMS];
  int32_t ndim;
  int32_t src_dtype;
  int32_t dst_dtype;
  int32_t mode;       // rx_box_kind | rounding << 8 | scales << 16
  uint64_t aux;       // RX_BOX_MX_DATA: the scale buffer (its byte 0), or 0
  int64_t mx_first;   // ... with aux: element offset of dst in its contiguous data buffer; COPY: first ordinal
  int64_t mx_cols;    // ... with aux: that buffer's row length K (elements)
  int32_t digest;     // verify only: how the receiver holds what the box writes (RX_DIGEST_*)
  int32_t reserved;   // 0
} rx_box;

// rx_box.digest (kind | arg << 8): how verify digests (kernels/digest.h) see the box's
// written elements when the receiver ends up holding something else.
//   0: as written (the dst dtype; an MX_DATA box: its E4M3 bytes, and its scales with
//     aux; an MX_SCALE box: its scale bytes).
//   RX_DIGEST_CAST, arg = a floating dtype: converted to that type (a sender's pack of a
//     wire dtype the receiver casts on unpack).
//   RX_DIGEST_MX, arg = rounding: the BF16 it writes as the receiver's MXFP8 quantize
//     holds them (E4M3 bytes and block scales); a COPY box writing BF16 whose innermost
//     extent is whole 32-element blocks (each run of 32 innermost elements is a block).
enum { RX_DIGEST_AS_WRITTEN = 0, RX_DIGEST_CAST = 1, RX_DIGEST_MX = 2 };
#define RX_DIGEST_KIND(d) ((d) & 0xff)
#define RX_DIGEST_ARG(d) (((d) >> 8) & 0xff)

// 1 when a box is well formed for its mode (ndim, extents, dtypes, MX geometry).
int32_t rx_box_valid(const rx_box* box);

#ifdef __cplusplus
}
#endif
