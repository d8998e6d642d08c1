// The codecs: fused conversions the box kernels apply on the way (rx_box.codec, core/box.h).
// Core carries a codec id, its flags and per-box parameters without reading them; the
// kernels dispatch on the id once per box (per tile on the GPU), never inside a loop.
//
// A codec is one folder entry: <name>.h (what its boxes hold, the element math shared by
// the CUDA lanes and the CPU twin, host/device), <name>_lanes.cuh (the CUDA per-lane
// code), <name>_cpu.cc (the CPU twin, host checks and its Traits records), optional
// whole-tensor kernels (<name>.cu, <name>_api.h) and their bindings (python/bind_<name>.cc).
// Its policy (which tensors, which side) and the TensorRefs it binds live in Python
// (reshard_ext/codecs/<name>.py and its transform). Adding one touches, outside its files:
//   - here: its ids in rx_codec_id;
//   - registry.cc: one line in the table pointing at its Traits records (all the host
//     dispatch: box checks, tile items, the CPU twin, digests; the planner's cut grain,
//     which Python reads and passes to plan_rank);
//   - lanes.cuh (the compile-time CUDA dispatch): its <name>_lanes.cuh include and one
//     case per id in codec_geom and codec_items, and in codec_digest_items for an id with
//     a receiver digest;
//   - CMakeLists.txt (its sources), python/register.h + python_api.cpp (its bindings).
// A sender-side box (its codec on the source TensorRef) writes its dst elements where dst and
// dst_stride put them and nothing else, whatever those strides are: the direct transport runs
// such boxes into contiguous staging and lets the copy engines carry the bytes into the peer
// (core/direct.h, plan_staging), so every codec's sender side moves at the link's rate.
#pragma once

#include <stdint.h>

#include "core/box.h"

#ifdef __cplusplus
extern "C" {
#endif

// Codec ids (RX_CODEC_ID of rx_box.codec; RX_CODEC_NONE = 0 is a plain copy). Stable:
// Python binds boxes with them.
enum rx_codec_id {
  RX_CODEC_MXFP8 = 1,         // BF16 -> E4M3 data (+ E8M0 scales): codecs/mxfp8.h
  RX_CODEC_MXFP8_SCALES = 2,  // BF16 -> the E8M0 scales alone: codecs/mxfp8.h
  RX_CODEC_FP8BLOCK = 3,      // BF16/FP32 -> E4M3 under per-128x128-block scales: codecs/fp8block.h
  RX_CODEC_NVFP4 = 5,         // BF16 pairs -> packed E2M1 data: codecs/nvfp4.h
  RX_CODEC_NVFP4_SCALES = 6,  // BF16 pairs -> the E4M3 block scales alone: codecs/nvfp4.h
};

// 1 when a box's codec fields (codec, param[], a codec digest) are well formed for its
// codec; 1 for a plain copy. The kernels and CPU twins check it with rx_box_valid.
int32_t rx_codec_valid(const rx_box* box);

#ifdef __cplusplus
}

namespace rx::codecs {

// One codec id's record: all the host side asks of it. Defined by the codec (its
// <name>_cpu.cc), listed once in registry.cc's table.
struct Traits {
  int32_t id;            // RX_CODEC_* above
  const char* name;      // Python finds the id by it (_C.codec_traits)
  // The planner's cut grain for a tensor whose boxes carry the id: cuts inside its last
  // dim fall on multiples of this many elements, so each box holds whole codec blocks
  // (MXFP8 32; a blockwise FP8 would say 128). Python passes it to plan_rank (core
  // never includes kernels).
  int64_t grain;
  int64_t item_elems;    // a box's elements per item (a lane's unit of work, never split across tiles)
  int64_t item_bytes;    // source bytes one item reads
  // The codec's checks of a box with the id, or of a copy with its digest, on top of
  // rx_box_valid.
  bool (*valid)(const rx_box& b);
  // The CPU twin of one innermost row of a box with the id (cpu_row below).
  uint64_t (*cpu_row)(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0,
                      int64_t n);
  // The CPU twin of a copy's digest RX_DIGEST_CODEC with the id (cpu_digest below);
  // nullptr: the id is no receiver digest kind.
  uint64_t (*cpu_digest)(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n);
};

// The record of a codec id; nullptr for RX_CODEC_NONE or an unknown id.
const Traits* find(int32_t id);
// Every record, in table order (bindings, tests).
int32_t count();
const Traits& at(int32_t i);

// rx_box_valid and rx_codec_valid: a box the kernels may run.
inline bool box_ok(const rx_box& b) { return rx_box_valid(&b) && rx_codec_valid(&b); }

// Tile planning (tiles.cc): a codec box's items (a lane's unit of work, never split
// across tiles) and the source bytes one item reads.
int64_t items(const rx_box& b);
int64_t item_bytes(const rx_box& b);

// CPU twin (copy_boxes_cpu.cc) of a codec box: one innermost row of `n` elements whose
// first element is element `first` of the dst's buffer (codec boxes with params: the
// buffer param[] describes). pass RX_PASS_NONE: the copy, returns 0; otherwise the
// verify pass's digest of the row, as for a copy row (ordinals k0..; n <= cpu::kChunk).
uint64_t cpu_row(const rx_box& b, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n);

// CPU twin of a codec digest (RX_DIGEST_CODEC): `n` elements of the copy box's dst dtype
// at p (stride in elements), ordinals k0.., as the codec would write them.
uint64_t cpu_digest(int32_t digest, const char* p, int64_t stride, int32_t dtype, uint64_t k0, int64_t n);

}  // namespace rx::codecs
#endif
