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

// ---- the CUDA kernel's fold (amax.cu), here so that host code can check it -------------
// A 16-bit float's magnitude bits h & 0x7fff order as |x| (every NaN above Inf) and its
// widening to FP32 keeps that order, so the max of abs_bits over elements is abs_bits of
// the max of their magnitude bits: two elements of a word fold in one packed 16x2 max, and
// only the run's max is widened. kIgnore adds a bias to every magnitude that lifts exactly
// the NaNs into the sign bit, so that a signed max never picks one and a run of NaNs only
// keeps the initial bias (FP32: the same on 32 bits).

// The three-operand integer min/max intrinsics (CUDA 12; one instruction from sm_90).
#if defined(__CUDA_ARCH__) && __CUDACC_VER_MAJOR__ >= 12
#define RX_DPX 1
#endif

// Per-half max of three words, each half read as H: uint16_t, or int16_t (a signed max).
template <typename H>
RX_HD uint32_t max3_16x2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(RX_DPX)
  if constexpr (H(-1) < H(0))
    return __vimax3_s16x2(a, b, c);
  else
    return __vimax3_u16x2(a, b, c);
#else
  uint32_t r = 0;
  for (int s = 0; s < 32; s += 16) {
    const H x = (H)(a >> s & 0xffffu), y = (H)(b >> s & 0xffffu), z = (H)(c >> s & 0xffffu);
    const H m = x > y ? x : y;
    r |= (uint32_t)(uint16_t)(m > z ? m : z) << s;
  }
  return r;
#endif
}

RX_HD uint32_t max3_u32(uint32_t a, uint32_t b, uint32_t c) {
#if defined(RX_DPX)
  return __vimax3_u32(a, b, c);
#else
  const uint32_t m = a > b ? a : b;
  return m > c ? m : c;
#endif
}

RX_HD uint32_t max3_s32(uint32_t a, uint32_t b, uint32_t c) {
#if defined(RX_DPX)
  return (uint32_t)__vimax3_s32((int)a, (int)b, (int)c);
#else
  const int32_t x = (int32_t)a, y = (int32_t)b, z = (int32_t)c, m = x > y ? x : y;
  return (uint32_t)(m > z ? m : z);
#endif
}

// The max of abs_bits(x, Dtype, Nan) over the elements of the words added (two per word
// for BF16/F16, one for F32), 0 for none; the dtype and NaN mode fixed at compile time.
template <int32_t Dtype, int32_t Nan>
struct Fold {
  static constexpr bool kHalves = Dtype != RX_F32;
  static constexpr uint32_t kMag = kHalves ? 0x7fff7fffu : 0x7fffffffu;
  // NaN magnitudes are those above 0x7f80 (BF16), 0x7c00 (F16), 0x7f800000 (F32): the bias
  // takes them, and only them, to 0x8000 (0x80000000) and up; no half carries into the next.
  static constexpr uint32_t kBias =
      Nan == kPropagate ? 0u : (Dtype == RX_BF16 ? 0x007f007fu : (Dtype == RX_F16 ? 0x03ff03ffu : 0x007fffffu));
  uint32_t acc = kBias;

  RX_HD void add2(uint32_t a, uint32_t b) {
    a = (a & kMag) + kBias;
    b = (b & kMag) + kBias;
    if constexpr (kHalves) acc = Nan == kPropagate ? max3_16x2<uint16_t>(acc, a, b) : max3_16x2<int16_t>(acc, a, b);
    else acc = Nan == kPropagate ? max3_u32(acc, a, b) : max3_s32(acc, a, b);
  }

  RX_HD uint32_t bits() const {
    uint32_t m = acc;
    if constexpr (kHalves) {
      const uint32_t lo = m & 0xffffu, hi = m >> 16;
      m = lo > hi ? lo : hi;
    }
    return abs_bits(m - (kHalves ? kBias & 0xffffu : kBias), Dtype, Nan);  // no NaN left where ignored
  }
};

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
