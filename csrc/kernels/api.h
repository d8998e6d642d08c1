// C-style kernel API: raw pointers, descriptor tables and streams. No torch, no STL.
//
// Every data movement of a refit is one of three things, and all three are the same
// operation - a strided box copy with an optional dtype cast - over a table of boxes:
//   pack:   tensor boxes  -> contiguous regions of a staging buffer
//   unpack: staging regions -> tensor boxes (cast fused)
//   copy:   tensor boxes -> tensor boxes on the same rank, no staging
// A staging region is simply a box whose strides are row-major contiguous.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RX_MAX_DIMS 6

// Element types, fixed codes shared with Python (reshard_ext/_dtypes.py).
typedef enum rx_dtype {
  RX_U8 = 0,
  RX_I8 = 1,
  RX_I16 = 2,
  RX_I32 = 3,
  RX_I64 = 4,
  RX_F16 = 5,
  RX_BF16 = 6,
  RX_F32 = 7,
  RX_F64 = 8,
  RX_BOOL = 9,
  RX_F8E4M3 = 10,
  RX_F8E5M2 = 11,
  RX_F8E8M0 = 12,
  RX_U16 = 13,
  RX_U32 = 14,
  RX_U64 = 15,
  RX_NUM_DTYPES = 16
} rx_dtype;

// What a box does with its elements (rx_box.mode = kind | rounding << 8 | scales << 16).
//   RX_BOX_COPY: copy, casting between floating types (mode 0, no MX fields but
//     mx_first: the verify ordinal of the box's first element, >= 0; a piece of a
//     larger box that is digested piece by piece (kernels/digest.h), else 0).
//   RX_BOX_MX_DATA: MXFP8 quantize fused into the copy (src BF16, dst E4M3 or uint8
//     bytes). The innermost dim has unit stride on both sides and an extent that is a
//     multiple of RX_BOX_MX_GROUP; each run of 32 innermost elements is one MX block
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
#define RX_BOX_MX_GROUP 32
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

// Size in bytes of one element of `dtype`, 0 for an unknown code.
int32_t rx_dtype_size(int32_t dtype);
// 1 when boxes may convert src -> dst (equal types, or both floating).
int32_t rx_dtype_castable(int32_t src, int32_t dst);

// 1 when a box is well formed for its mode (ndim, extents, dtypes, MX geometry).
int32_t rx_box_valid(const rx_box* box);

// CPU twin: copies every box of the table, in order. Returns 0, or -1 on a bad box.
int32_t rx_copy_boxes_cpu(const rx_box* boxes, int64_t num_boxes);

// Verify passes over a box table: adds the digest of box i into digests[i] (digest::add,
// kernels/digest.h).
//   RX_PASS_COPY: copies, hashing the elements as they are written (fused);
//   RX_PASS_SRC: writes nothing, hashes what the box would write (reads its source);
//   RX_PASS_DST: writes nothing, hashes what its destination holds (and, for an
//     MX_DATA box with aux, the scale bytes at its blocks' places).
typedef enum rx_pass { RX_PASS_NONE = 0, RX_PASS_COPY = 1, RX_PASS_SRC = 2, RX_PASS_DST = 3 } rx_pass;
int32_t rx_digest_boxes_cpu(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests);

// Work split of a box table for the CUDA kernel: one tile is one warp's share of one
// box. A tile walks `unit`-byte items of its box in row-major order:
//   unit 1/2/4/8/16: a same-dtype copy moving `unit` bytes per access. When unit exceeds
//     the element size the innermost dim is contiguous on both sides and is viewed as
//     shape[inner] * elem / unit items; item addresses count from the box pointers
//     rounded down to a multiple of unit (a no-op except for the aligned body of a
//     1-D box whose pointers are equally misaligned; its head and tail get
//     element-sized tiles).
//   unit 0: a cast; items are elements. MX boxes (mode != RX_BOX_COPY) also have
//     unit 0; their items are 32-element blocks (MX_DATA) or scale bytes (MX_SCALE).
// Every element of every box lies in exactly one tile; empty boxes get none.
//
// RX_TILE_FLAT (flags): a copy tile of a box of at most 2 dims whose innermost dim is
// contiguous on both sides (a TP/EP slice of a weight folds to that: make_box merges
// contiguous dims)
// carries its own geometry, so its warp reads one 64-byte record before it moves data
// instead of the tile and then its 200-byte box, one dependent memory round trip less
// (the whole fixed cost of a launch that moves 16 MiB from cold HBM is a few of them).
// Item i of the box is at src + (i / row_items) * src_pitch + (i % row_items) * unit,
// and likewise at dst.
#define RX_TILE_FLAT 1
typedef struct rx_tile {
  int32_t box;        // index into the box table
  uint8_t unit;       // bytes per item, 0 for a cast
  uint8_t src_size;   // element sizes, resolved once on the host
  uint8_t dst_size;
  uint8_t flags;      // RX_TILE_FLAT or 0
  int64_t begin;      // first item of the box this tile covers
  int64_t end;        // one past the last
  // RX_TILE_FLAT only (else 0):
  uint64_t src;       // the box pointers rounded down to a multiple of unit
  uint64_t dst;
  int64_t row_items;  // items per row (INT64_MAX for a 1-D box: one row)
  int64_t src_pitch;  // bytes from one row to the next
  int64_t dst_pitch;
} rx_tile;

// Splits a host box table into tiles of about `tile_bytes` (<= 0: chosen from the
// table's total so one launch fills the GPU for one huge box and for 10,000 tiny ones
// alike). Writes at most `max_tiles` tiles into `tiles` (which may be NULL when
// max_tiles is 0) and returns how many are needed, or -1 for a bad box (ndim out of
// range, negative extent, non-castable dtypes or MX geometry, pointers not aligned to
// their element).
int64_t rx_plan_tiles(const rx_box* boxes, int64_t num_boxes, int64_t tile_bytes,
                      rx_tile* tiles, int64_t max_tiles);
#ifdef __cplusplus
static_assert(sizeof(rx_tile) == 64, "rx_tile is one 64-byte record (the kernel loads it as 4 x 16 bytes)");
#endif

#ifdef RX_WITH_CUDA
// CUDA: copies every box of a device-resident table in one launch on `stream`
// (a cudaStream_t). boxes_dev / tiles_dev: the table and its tiles (rx_plan_tiles) in
// device memory, 16-byte aligned, uploaded once at plan time. max_blocks > 0 caps the
// grid (warps then stride over the tiles): a copy that runs beside a transfer can leave
// SMs and memory bandwidth to it. 0: one warp per tile. Returns a cudaError_t value
// (0 = cudaSuccess).
// Runs the kernel's per-lane code on the host over a host table (copy_boxes.cu): tests
// the kernel's index math and casts on machines without a GPU. Returns 0.
int32_t rx_copy_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles);

int32_t rx_copy_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev,
                           int64_t num_tiles, int32_t max_blocks, void* stream);

// The verify passes of rx_digest_boxes_cpu on the GPU (same digests): digests_dev holds
// one uint64 per box, zeroed by the caller; each tile adds its share with atomics.
int32_t rx_digest_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev, int64_t num_tiles,
                             int32_t max_blocks, void* stream, int32_t pass, uint64_t* digests_dev);
// ... and their emulation on the host (host table and digests).
int32_t rx_digest_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t pass,
                                 uint64_t* digests);
#endif

#ifdef __cplusplus
}
#endif
