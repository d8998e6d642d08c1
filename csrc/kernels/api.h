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

#include "common/dtype.h"
#include "core/box.h"

#ifdef __cplusplus
extern "C" {
#endif

// CPU twin: copies every box of the table, in order. Returns 0, or -1 on a bad box.
int32_t rx_copy_boxes_cpu(const rx_box* boxes, int64_t num_boxes);

// Verify passes over a box table: adds the digest of box i into digests[i] (digest::add,
// kernels/digest.h).
//   RX_PASS_COPY: copies, hashing the elements as they are written (fused);
//   RX_PASS_SRC: writes nothing, hashes what the box would write (reads its source);
//   RX_PASS_DST: writes nothing, hashes what its destination holds (and, for a codec
//     box that places side bytes such as MXFP8 scales, those too).
//   RX_PASS_COPY_COLD (CPU only): RX_PASS_COPY into destinations no one reads soon (tensors a
//     refit lands in): contiguous same-dtype runs are stored past the cache (non-temporal),
//     which spares the read-for-ownership of every destination line.
typedef enum rx_pass {
  RX_PASS_NONE = 0,
  RX_PASS_COPY = 1,
  RX_PASS_SRC = 2,
  RX_PASS_DST = 3,
  RX_PASS_COPY_COLD = 4
} rx_pass;
int32_t rx_digest_boxes_cpu(const rx_box* boxes, int64_t num_boxes, int32_t pass, uint64_t* digests);

// Work split of a box table for the CUDA kernel: one tile is one warp's share of one
// box. A tile walks `unit`-byte items of its box in row-major order:
//   unit 1/2/4/8/16: a same-dtype copy moving `unit` bytes per access. When unit exceeds
//     the element size the innermost dim is contiguous on both sides and is viewed as
//     shape[inner] * elem / unit items; item addresses count from the box pointers
//     rounded down to a multiple of unit (a no-op except for the aligned body of a
//     1-D box whose pointers are equally misaligned; its head and tail get
//     element-sized tiles).
//   unit 0: a cast; items are elements. Codec boxes (codec != RX_CODEC_NONE) also have
//     unit 0; their items are what the codec says (codecs::items: an MXFP8 block or
//     scale byte).
// Every element of every box lies in exactly one tile; empty boxes get none.
//
// RX_TILE_FLAT (flags): a copy tile of a box of at most 2 dims whose innermost dim is
// contiguous on both sides (a TP/EP slice of a weight folds to that: make_box merges
// contiguous dims)
// carries its own geometry, so its warp reads one 64-byte record before it moves data
// instead of the tile and then its 200-byte box: one dependent memory round trip less,
// a large share of a small launch's fixed cost.
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
// range, negative extent, non-castable dtypes or bad codec fields, pointers not aligned to
// their element).
int64_t rx_plan_tiles(const rx_box* boxes, int64_t num_boxes, int64_t tile_bytes,
                      rx_tile* tiles, int64_t max_tiles);

// log2 of the warps an uncapped copy launch puts on each tile (0..RX_MAX_WARP_SHIFT):
// enough that no warp copies much more than 2 KiB. Short-lived warps end a launch
// together (no tail of warps still streaming their own big tile) and keep the bytes in
// flight close together, without the table holding a 64-byte record per 2 KiB.
#define RX_MAX_WARP_SHIFT 5
int32_t rx_tile_warp_shift(const rx_tile* tiles, int64_t num_tiles);
#ifdef __cplusplus
static_assert(sizeof(rx_tile) == 64, "rx_tile is one 64-byte record (the kernel loads it as 4 x 16 bytes)");
#endif

#ifdef RX_WITH_CUDA
// CUDA: copies every box of a device-resident table in one launch on `stream`
// (a cudaStream_t). boxes_dev / tiles_dev: the table and its tiles (rx_plan_tiles) in
// device memory, 16-byte aligned, uploaded once at plan time. max_blocks > 0 caps the
// grid (warps then stride over the tiles): a copy that runs beside a transfer can leave
// SMs and memory bandwidth to it. 0: 1 << warp_shift warps per tile, side by side, each
// copying its share of the tile's items (rx_tile_warp_shift). Returns a cudaError_t value
// (0 = cudaSuccess).
// Runs the kernel's per-lane code on the host over a host table (copy_boxes.cu), each
// tile in its 1 << warp_shift shares: tests the kernel's index math and casts on machines
// without a GPU. Returns 0, or -1 for a warp_shift out of range.
int32_t rx_copy_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t warp_shift);

int32_t rx_copy_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev,
                           int64_t num_tiles, int32_t max_blocks, int32_t warp_shift, void* stream);

// The verify passes of rx_digest_boxes_cpu on the GPU (same digests): digests_dev holds
// one uint64 per box, zeroed by the caller; each tile adds its share with atomics.
// max_blocks and warp_shift as for rx_copy_boxes_cuda (a cap first lowers the shift).
int32_t rx_digest_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev, int64_t num_tiles,
                             int32_t max_blocks, int32_t warp_shift, void* stream, int32_t pass,
                             uint64_t* digests_dev);
// ... and their emulation on the host (host table and digests), each tile in its
// 1 << warp_shift shares. Returns 0, or -1 for a bad pass or warp_shift.
int32_t rx_digest_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t pass,
                                 int32_t warp_shift, uint64_t* digests);
#endif

#ifdef __cplusplus
}
#endif
