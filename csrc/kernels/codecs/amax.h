// Global amaxes of block-scaled codecs whose scale depends on a block that several ranks'
// pieces may share: blockwise FP8's 128x128 blocks (a TP shard of 64 rows cuts them),
// NVFP4's per-tensor scale (every shard shares the one "block"). A codec general facility,
// not one format's: each rank max-reduces |x| of its own piece into the cells of the
// tensor's global block grid its elements fall in (the partial kernels: amax_api.h), the
// ranks reduce the partial grids with MAX (reshard_ext/codecs/amax.py, over the group's
// host channel) before any block is quantized, and the codec reads the global amax of
// each block from the reduced grid.
//
// A cell holds the FP32 bit pattern of a non-negative value, or of a NaN. For such
// patterns the unsigned integer order is the float order (and every NaN lies above +Inf),
// so partial grids reduce with integer max: atomicMax on the GPU, numpy's maximum between
// ranks, in any order, with the same bits at the end.
//
// The grid: a tensor of shape S cut into blocks of shape B (one size per dim; 1 for a dim
// that is not blocked, S[d] for one whole dim, e.g. a per-tensor amax) has
// ceil(S[d] / B[d]) cells along dim d, flattened row-major. A rank's piece is viewed as
// rows x cols (the last dim as cols, every other dim flattened into rows, in local
// order); rowmap[r] + colmap[c] is the flat cell of local element (r, c) (PieceGrid).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/host_device.h"
#include "core/runs.h"
#include "kernels/cast.h"

namespace rx::amax {

// What a NaN element contributes: itself, so that the block's amax is NaN (torch.amax,
// hence DeepSeek's and torchao's references), or nothing (fmaxf, as Transformer Engine's
// kernels reduce).
enum NanMode : int32_t { kPropagate = 0, kIgnore = 1 };

// |x| of one element of `dtype` (RX_BF16, RX_F16 or RX_F32; raw: its bits) as FP32 bits,
// exact; a NaN per `nan`.
RX_HD uint32_t abs_bits(uint32_t raw, int32_t dtype, int32_t nan) {
  uint32_t a;
  if (dtype == RX_BF16)
    a = (raw & 0x7fffu) << 16;
  else if (dtype == RX_F32)
    a = raw & 0x7fffffffu;
  else
    a = f32_bits(f32_from_f16(static_cast<uint16_t>(raw))) & 0x7fffffffu;
  return (nan == kIgnore && a > 0x7f800000u) ? 0u : a;
}

// A dtype the partial kernels read.
inline bool readable(int32_t dtype) { return dtype == RX_BF16 || dtype == RX_F16 || dtype == RX_F32; }

// The block grid of one rank's piece (see the top of this file).
struct PieceGrid {
  std::vector<int64_t> grid;     // cells per dim
  std::vector<int32_t> rowmap;   // per local row: the flat cell of its column-0 block
  std::vector<int32_t> colmap;   // per local column: its cell offset along the last dim
  std::vector<int64_t> cells;    // the flat cells the piece touches, ascending
  bool aligned = true;           // every run starts on the grid and ends on it or at the extent
};

// The grid of the piece whose per-dim runs (global_start, len) are `runs` in a tensor of
// `shape` cut into blocks `block`. "" and `out` filled, or why not (a block < 1, a run
// outside the shape, more than 2^31 cells).
std::string piece_grid(const std::vector<Runs>& runs, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& block, PieceGrid* out);

// The block runs along one dim of extent `extent` (blocks of `block`) of the runs of a
// piece, in local order (merged where contiguous); `aligned` says whether every run starts
// on a block boundary and ends on one or at the extent. Only an aligned piece holds its
// blocks whole (no other piece shares them); then these are its runs of the block grid.
Runs block_runs(const Runs& runs, int64_t extent, int64_t block, bool* aligned);

}  // namespace rx::amax
