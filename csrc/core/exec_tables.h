// Descriptor tables of one rank's plan: the rx_box records the kernels replay on every
// execute. Built once per (plan, bound tensors); execute only reads them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/box.h"
#include "core/planner.h"

namespace rx {

struct TensorRef {
  uint64_t ptr = 0;              // address of element 0
  std::vector<int64_t> strides;  // in elements
  int32_t dtype = -1;
  std::vector<int64_t> shape;    // the piece's shape (coordinates); empty: not known, no memory checks
  std::string name;              // for messages
  // A codec fused into the boxes of this piece (rx_box.codec, core/box.h; 0: plain).
  // Every box that touches the piece gets it; what ptr/strides/dtype then mean is the
  // codec's (kernels/codecs/), e.g. the E4M3 data buffer of an MXFP8 dst, or the BF16
  // source an MXFP8 src is read from. At most one end of a box has a codec.
  //   side, arg: a codec's side buffer (e.g. MXFP8 scales of a dst, a peer's mapping of
  //     it for a direct send; the per-block scales a blockwise FP8 src reads) and argument
  //     (MXFP8: the data rows' length). Each box into (dst) or out of (src) the piece gets
  //     param = {side, element offset of its first element from ptr, arg} when side != 0,
  //     else all 0.
  //   grain: elements of the tensor at ptr that one coordinate of the piece's last dim
  //     covers (a codec reading whole blocks per coordinate, e.g. an MXFP8 scale source:
  //     32); the box strides and memory checks scale the last dim by it.
  int32_t codec = 0;
  uint64_t side = 0;
  int64_t arg = 0;
  int64_t grain = 1;
};

// What is wrong with `ref` on its own ("" if nothing): an unknown dtype code, strides
// whose count differs from a given shape, a negative extent, grain < 1, or codec fields
// (side, arg, grain) without a codec. Named after ref.name where it has one.
std::string tensor_ref_error(const TensorRef& ref);

// A codec's per-box parameters (rx_box.param); all 0 for a copy.
struct BoxParams {
  int64_t p[3] = {0, 0, 0};
};

// A dst the receiver converts with a codec after it lands (rx.MXFP8(where="receiver")
// staging): the boxes into it that read `dtype` and keep `grain`-element blocks of the
// logical last dim whole are digested as `digest` (RX_DIGEST_CODEC, core/box.h).
struct ReceiverCodec {
  int32_t digest = 0;
  int64_t grain = 1;
  int32_t dtype = -1;
};

// Builds one box and folds its dims: size-1 dims drop out and dims contiguous on both
// sides merge, so a row-major slab becomes one long run. src/dst strides of nullptr
// mean row-major contiguous. Throws ReshardError past RX_MAX_DIMS dims, and an
// InternalError for a box rx_box_valid rejects (a codec's own checks run where the
// kernels take the table: the bindings check every bound box).
rx_box make_box(const std::vector<int64_t>& size, uint64_t src, const int64_t* src_strides, int32_t src_dtype,
                uint64_t dst, const int64_t* dst_strides, int32_t dst_dtype, int32_t codec = 0, BoxParams params = {});

// One point-to-point message of a batch: `bytes` at `ptr` (staging, or the tensor
// itself for a direct message) to or from `peer`. Both ends cut a peer's ops into the
// same messages, since the rule looks only at what both know (op order and size).
struct Message {
  int32_t peer;
  uint64_t ptr;
  int64_t bytes;
  bool own = false;  // one op of at least direct_bytes alone (direct, or staged on its own)
};

// A receiver's dst piece as a direct sender sees it (ExecTables::bind_direct): the
// receiver's TensorRef of dst table entry `dst_name`, with ptr and side already
// translated into the sender's mapping of the receiver's memory.
struct PeerPiece {
  int32_t peer = -1;
  int32_t dst_name = -1;
  TensorRef ref;
};

class ExecTables {
 public:
  explicit ExecTables(std::shared_ptr<const RankPlan> plan);

  const RankPlan& plan() const { return *plan_; }
  // Table indices of the src / dst tensors this rank's plan reads or writes (a direct
  // receive counts: the receiver binds the piece its peer writes into).
  const std::vector<int32_t>& src_used() const { return src_used_; }
  const std::vector<int32_t>& dst_used() const { return dst_used_; }
  int32_t num_batches() const { return static_cast<int32_t>(plan_->batches.size()); }
  int64_t send_buffer_bytes() const;  // the largest batch
  int64_t recv_buffer_bytes() const;

  // Binds tensors (aligned with src_used()/dst_used()) and staging buffers; batch b
  // stages in send_bufs[b % n] / recv_bufs[b % n] (two each for pipelining).
  // direct_bytes > 0 (host transports): an op of at least that many bytes travels as a
  // message of its own, read from / written to the tensor in place when its box is one
  // contiguous run of the same dtype (no pack or unpack copy); smaller ops of a peer
  // share one message. 0: one message per peer (GPU: packing is cheap, messages are not).
  // codec_receivers: dst table index -> how the receiver converts that tensor after it
  // lands: what verify digests of it cover (see digest_of in exec_tables.cc).
  // Memory rules (checked first, ReshardError naming the tensors): no dst piece has
  // elements that share memory (stride 0) or shares memory with another dst piece; a
  // dst piece may share memory with a src piece only with a single batch, where every
  // read of the plan happens before its first write (such ops are then staged, a large
  // one still in a message of its own, as its peer cuts it), no same-rank copy writes
  // what another one reads and no peer accesses either directly (direct backend). A
  // copy from a piece to the very same memory is a no-op and dropped.
  void bind(const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst,
            const std::vector<uint64_t>& send_bufs, const std::vector<uint64_t>& recv_bufs,
            int64_t direct_bytes = 0, const std::unordered_map<int32_t, ReceiverCodec>& codec_receivers = {});

  // Positions in dst_used() of the dst pieces whose every incoming box (receives and
  // same-rank copies) reads `dtype` and keeps `group`-element blocks of the last dim
  // whole: the pieces a block codec's dst ref may bind to (MXFP8: BF16, 32). src_dtypes:
  // the dtype of each src tensor, aligned with src_used() (what bind will get).
  std::vector<int32_t> whole_group_dsts(const std::vector<int32_t>& src_dtypes, int64_t group, int32_t dtype) const;

  const std::vector<rx_box>& pack(int32_t b) const { return pack_[b]; }
  const std::vector<rx_box>& unpack(int32_t b) const { return unpack_[b]; }
  const std::vector<rx_box>& copies() const { return copies_; }
  // The same-rank copies cut into `parts` runs of consecutive boxes, each carrying about
  // a batch's share of the bytes (tapered like the batches; boxes are never split): the
  // GPU transport interleaves them with the batches so a large local copy does not hold
  // back the pack of the next batch.
  std::vector<std::vector<rx_box>> copies_split(int32_t parts) const;
  // Direct sends (plan().direct_sends): one box per op from this rank's bound src piece
  // (src, aligned with src_used() as in bind) straight into the receiver's piece. Every
  // (peer, dst_name) of a direct send must be among `pieces`.
  // A box whose codec belongs to its source (a sender-side conversion: its dst is a plain
  // tensor, so the box writes exactly its dst elements) is stageable: the direct transport
  // may run it into local staging and copy the bytes on (core/direct.h, plan_staging).
  // stage_bytes > 0: the op of a stageable box that writes more than that many bytes is cut
  // as the batches cut ops (split_op), one box per piece, so that each fits a staging slot.
  void bind_direct(const std::vector<TensorRef>& src, const std::vector<PeerPiece>& pieces, int64_t stage_bytes = 0);
  const std::vector<rx_box>& direct() const { return direct_; }
  // Aligned with direct(): the plan().direct_sends op each box moves (part of), and whether
  // the box is stageable (1) or not (0).
  const std::vector<int32_t>& direct_ops() const { return direct_ops_; }
  const std::vector<uint8_t>& direct_stageable() const { return direct_stageable_; }
  // ... and the verify ordinal of the box's first element within its op (0 for a whole op).
  const std::vector<int64_t>& direct_ordinals() const { return direct_ordinals_; }
  // (peer, position in dst_used()) of every dst piece a peer writes into directly, sorted.
  std::vector<std::pair<int32_t, int32_t>> direct_recv_pieces() const;

  const std::vector<Message>& send_messages(int32_t b) const { return send_msgs_[b]; }
  const std::vector<Message>& recv_messages(int32_t b) const { return recv_msgs_[b]; }

  // Verify (rx.execute(verify=True), rx.verify): digests are per plan op. send_boxes()[i]
  // is the pack box of plan().sends[i] (tensor -> staging), recv_boxes()[j] the unpack
  // box of plan().recvs[j], copies()[c] moves plan().copies[c]; pack(b)[k] moves
  // plan().sends[pack_ops(b)[k]] (likewise unpack); the ops of batch b that travel as
  // direct messages have no box in pack(b) / unpack(b) and are listed apart.
  const std::vector<rx_box>& send_boxes() const { return send_boxes_; }
  const std::vector<rx_box>& recv_boxes() const { return recv_boxes_; }
  const std::vector<int32_t>& pack_ops(int32_t b) const { return pack_ops_[b]; }
  const std::vector<int32_t>& unpack_ops(int32_t b) const { return unpack_ops_[b]; }
  const std::vector<int32_t>& direct_sends(int32_t b) const { return direct_sends_[b]; }
  const std::vector<int32_t>& direct_recvs(int32_t b) const { return direct_recvs_[b]; }

  // Verified refits move batch b in rounds, so that the receiver digests the direct
  // receives that landed in round r while round r + 1 moves (a direct message has no
  // unpack to hash in). A pair's messages that are one op alone (Message::own), in order,
  // form one stream of T bytes; round r carries its bytes [T r / rounds, T (r + 1) / rounds),
  // or with piece > 0 (gloo: a round small enough to hash from cache) bytes
  // [piece r, piece (r + 1)), a message cut only where a round boundary falls inside it
  // (down to a multiple of kRoundAlign from its start), so a batch of many small messages
  // keeps about one message per op. Round 0 carries every other message whole (a batch
  // without large ops stays one exchange). Both ends of a pair cut alike, since only op
  // sizes decide; with pieces, a batch has piece_rounds(b, piece) rounds on this rank.
  // round_messages: the pieces of round r; direct_round: aligned with direct_sends(b)
  // (send) or direct_recvs(b), the piece of each direct op that moves in round r as a
  // 1-D box (shape 0 where none does) whose ordinals go on from the op's
  // (RX_BOX_FIRST_ORDINAL, core/box.h).
  static constexpr int64_t kRoundAlign = 16384;  // a multiple of 32 elements of every size (MX blocks)
  std::vector<Message> round_messages(int32_t b, bool send, int32_t r, int32_t rounds, int64_t piece = 0) const;
  std::vector<rx_box> direct_round(int32_t b, bool send, int32_t r, int32_t rounds, int64_t piece = 0) const;
  std::vector<rx_box> direct_recv_round(int32_t b, int32_t r, int32_t rounds) const {
    return direct_round(b, false, r, rounds);
  }
  int32_t piece_rounds(int32_t b, int64_t piece) const;

 private:
  std::shared_ptr<const RankPlan> plan_;
  std::vector<int32_t> src_used_, dst_used_;
  std::vector<std::vector<rx_box>> pack_, unpack_;
  std::vector<rx_box> copies_, direct_;
  std::vector<int32_t> direct_ops_;
  std::vector<uint8_t> direct_stageable_;
  std::vector<int64_t> direct_ordinals_;
  std::vector<std::vector<Message>> send_msgs_, recv_msgs_;
  std::vector<rx_box> send_boxes_, recv_boxes_;
  std::vector<std::vector<int32_t>> pack_ops_, unpack_ops_, direct_sends_, direct_recvs_;
};

}  // namespace rx
