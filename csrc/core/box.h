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

// What a box does with its elements: rx_box.codec = id | flags << 8.
//   id RX_CODEC_NONE (0): a copy, casting between floating types (codec 0); its
//     param[0] is its first verify ordinal (RX_BOX_FIRST_ORDINAL), param[1..2] are 0.
//   any other id: a fused conversion (a codec: MXFP8 today) that the kernels apply to
//     the box's elements on the way, dispatching on the id once per box. Ids, flags and
//     the meaning of param[] belong to the codec (kernels/codecs/: registry.h lists the
//     ids, one header per codec says what its boxes hold); core builds such boxes from
//     TensorRefs and checks only what every box must satisfy (RX_MAX_DIMS, sizes).
enum { RX_CODEC_NONE = 0 };
#define RX_CODEC_ID(codec) ((codec) & 0xff)
#define RX_CODEC_FLAGS(codec) ((codec) >> 8)

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
  int32_t codec;      // RX_CODEC_NONE, or a codec's id | flags << 8
  int64_t param[3];   // the codec's per-box parameters (e.g. where its scales go); a copy's: above
  int32_t digest;     // verify only: how the receiver holds what the box writes (RX_DIGEST_*)
  int32_t reserved;   // 0
} rx_box;

// rx_box.digest (kind | arg << 8 | codec id << 16): how verify digests (kernels/digest.h)
// see the box's written elements when the receiver ends up holding something else.
//   0: as written (the dst dtype; a codec box: what its codec writes).
//   RX_DIGEST_CAST, arg = a floating dtype: converted to that type (a sender's pack of a
//     wire dtype the receiver casts on unpack).
//   RX_DIGEST_CODEC, codec id != 0, arg = codec flags: a copy box (codec 0) whose
//     elements the receiver converts with that codec after they land, digested as the
//     codec would write them (the codec says which boxes qualify).
enum { RX_DIGEST_AS_WRITTEN = 0, RX_DIGEST_CAST = 1, RX_DIGEST_CODEC = 2 };
#define RX_DIGEST_KIND(d) ((d) & 0xff)
#define RX_DIGEST_ARG(d) (((d) >> 8) & 0xff)
#define RX_DIGEST_CODEC_ID(d) (((d) >> 16) & 0xff)

// The verify ordinal (kernels/digest.h) of a box's first element. A copy's param[0],
// >= 0: 0 for a whole op's box, the op ordinal it starts at for a piece of one digested
// piece by piece (ExecTables::direct_recv_round); a codec box's ordinals start at 0.
#define RX_BOX_FIRST_ORDINAL(b) ((b).codec == RX_CODEC_NONE ? (b).param[0] : 0)

// 1 when a box is well formed as far as core can tell (ndim, extents, byte spans, dtypes
// and digest of a copy). A codec box or codec digest is checked further by its codec
// (rx_codec_valid, kernels/codecs/registry.h) wherever the kernels consume boxes.
int32_t rx_box_valid(const rx_box* box);

#ifdef __cplusplus
}
#endif
