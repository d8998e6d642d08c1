// The planner (DESIGN section 4): from the global layouts alone, the ops of ONE rank.
// Pure: no process group, no tensors. Every rank runs it on the same tables and gets
// its own share, so sender and receiver agree without talking.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/layout.h"

namespace rx {

// One side's layouts by name, sorted by name (the canonical order both sides use).
class LayoutTable {
 public:
  LayoutTable() = default;
  // Duplicated names must carry the same layout; a disagreement is a ReshardError.
  explicit LayoutTable(std::vector<std::pair<std::string, std::shared_ptr<const Layout>>> entries);

  int32_t size() const { return static_cast<int32_t>(names_.size()); }
  const std::string& name(int32_t i) const { return names_[i]; }
  const Layout& layout(int32_t i) const { return *layouts_[i]; }
  const std::shared_ptr<const Layout>& layout_ptr(int32_t i) const { return layouts_[i]; }
  uint64_t name_hash(int32_t i) const { return hashes_[i]; }
  int32_t find(const std::string& name) const;
  // Tensor indices grouped by mesh object: a rank finds the tensors it holds with one
  // look-up per mesh instead of one per tensor (a model's tensors share few meshes).
  const std::vector<std::pair<const Mesh*, std::vector<int32_t>>>& by_mesh() const { return by_mesh_; }

 private:
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<const Layout>> layouts_;
  std::vector<uint64_t> hashes_;
  std::unordered_map<std::string, int32_t> index_;
  std::vector<std::pair<const Mesh*, std::vector<int32_t>>> by_mesh_;
};

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull);

// The cut grain of a tensor without a codec: cuts inside its last dim fall on multiples
// of this many elements. A tensor whose boxes carry a codec takes its codec's grain
// instead (plan_rank's `grains`, from kernels/codecs/ traits through the transform).
constexpr int64_t kPlainGrain = 32;

struct Box {
  std::vector<int64_t> start;  // local coordinates in a piece
  std::vector<int64_t> size;
};

struct TransferOp {
  int32_t dst_name = -1;  // index into the dst table
  int32_t src_name = -1;  // index into the src table
  int32_t peer = -1;      // the other rank; the rank itself for a same-rank copy
  uint64_t name_hash = 0; // of the tensor name (digests)
  Box mine;               // in my piece (src piece for a send, dst piece for a recv/copy)
  Box theirs;             // in the peer's piece (for a copy: the src piece)
  std::vector<int64_t> global;  // global coordinates of the box origin
  int64_t numel = 0;
  int32_t wire_dtype = 0;
  int32_t dst_dtype = 0;  // the dst tensor's (what the receiver holds: verify digests)
  int64_t nbytes = 0;     // bytes on the wire
  int32_t batch = 0;
  int64_t offset = 0;     // byte offset inside the peer's region of the batch's staging buffer
  int64_t grain = kPlainGrain;  // cuts inside the last dim fall on multiples of this (the dst tensor's)
};

struct PeerRegion {
  int32_t peer;
  int64_t offset;  // in the batch's staging buffer
  int64_t bytes;
};

struct BatchLayout {
  std::vector<PeerRegion> sends, recvs;
  int64_t send_bytes = 0, recv_bytes = 0;
};

struct PairDigest {
  int32_t from, to;
  int64_t count, bytes;
  uint64_t hash;
};

// The wire dtype of a src->dst pair: the narrower float when both are floating (cast
// once, on the sender: fewer bytes, same bits), else the source type.
int32_t wire_dtype_for(int32_t src_dtype, int32_t dst_dtype);

// The batch (of k) holding byte `at` of a stream of `total` bytes: proportional to its
// place in the stream, so every batch of every pair carries its share and both ends of
// a pair agree. Tapered (k >= 3): k - 1 full shares, the first and the last batch half
// of one each.
int32_t batch_at(int64_t at, int64_t total, int32_t k, bool taper);

class RankPlan {
 public:
  int32_t rank = 0;
  std::vector<TransferOp> sends, recvs, copies;  // sorted by (peer, name, global)
  // Ops with the peers the direct transport serves (core/direct.h split_direct): the
  // sender writes them straight into the receiver's tensor, outside batches and staging.
  std::vector<TransferOp> direct_sends, direct_recvs;
  std::vector<BatchLayout> batches;
  std::vector<PairDigest> digests;  // one per peer and direction, copies excluded
  uint64_t send_digest = 0, recv_digest = 0;
  int64_t max_batch_bytes = 0;
  // With 3 or more batches, the first and the last carry half the bytes of the others:
  // the pack of the first batch and the unpack of the last are the only kernels that
  // cannot overlap a transfer. Every rank must use the same setting (the digests differ
  // otherwise, and rx.plan reports it).
  bool taper = true;
  // Alignment of each peer's region in a batch's staging buffer (256 keeps NCCL's
  // transfers aligned on GPUs). Set before assign_batches, alike on every rank.
  int64_t region_align = 256;
  // A pair's ops are cut to at most 1 / (2 * fineness) of its share of a batch, so a
  // batch overshoots its share by at most that much (the last op that starts in it).
  // 1 by default; finer under a hard staging bound. Alike on every rank.
  int32_t fineness = 1;

  // How many batches this rank would need under max_batch_bytes (1 when unbounded): a
  // soft target per direction (each batch carries about that many bytes each way).
  int32_t wanted_batches() const;
  // Bytes of staging this rank allocates with the current batches: `buffers` copies
  // (the transport's pipelining depth, 1 with a single batch) of the largest send batch
  // plus the largest receive batch, alignment included.
  int64_t staging_bytes(int32_t buffers) const;
  // The fewest batches found (searching upward from the byte totals) with which
  // staging_bytes(buffers) <= limit: a hard bound. 0 when no count up to kMaxBatches
  // fits (an op that cannot be cut small enough, or alignment alone exceeding `limit`).
  int32_t batches_within(int64_t limit, int32_t buffers) const;
  // Bit i set: first + i batches keep staging_bytes(buffers) <= limit (i < 64). Staging
  // is not monotone in the batch count (batch boundaries cut ops differently), so ranks
  // agree on a count every one of them fits.
  uint64_t fitting_counts(int64_t limit, int32_t buffers, int32_t first) const;
  static constexpr int32_t kMaxBatches = 1 << 20;
  // Splits every pair's ops into k batches (k is agreed globally: the max wanted),
  // assigns offsets, regions and digests.
  void assign_batches(int32_t k);
  // The batch layouts assign_batches(k) would produce (staging bytes and regions per
  // batch), without cutting the ops: for sizing staging before k is agreed.
  std::vector<BatchLayout> batch_layouts(int32_t k) const;
  int64_t send_total() const;
  int64_t recv_total() const;
  int64_t copy_total() const;  // bytes of same-rank copies
  int64_t direct_send_total() const;  // bytes of direct_sends / direct_recvs
  int64_t direct_recv_total() const;
};

// Splits an op into pieces of at most `limit` bytes of `elem`-byte elements along its
// outermost dims, appending them to `out` in order; cuts inside the last dim fall on
// multiples of op.grain (whole codec blocks), so a piece may exceed `limit` where no finer
// cut is allowed. The batches cut ops by it, and so does the direct transport's staging.
void split_op(const TransferOp& op, int64_t limit, int32_t elem, std::vector<TransferOp>& out);

// A set of receivers that get the same boxes from one sender, and the bytes of those
// boxes counted once.
struct FanOut {
  std::vector<int32_t> receivers;  // sorted
  int64_t bytes;
};

// This rank's sends grouped by the boxes they carry (tensor, origin, size): what a relay
// schedule would forward among receivers instead of sending each its own copy. Only
// before assign_batches(k > 1), which cuts a pair's ops by the pair's own total.
std::vector<FanOut> send_fanout(const RankPlan& plan);

// grains: dst table index -> the cut grain of that tensor's last dim (its codec's
// block: whole blocks in every box), alike on every rank; kPlainGrain for the others.
RankPlan plan_rank(const LayoutTable& src, const LayoutTable& dst, int32_t rank, int64_t max_batch_bytes,
                   const std::unordered_map<int32_t, int64_t>& grains = {});

// Deterministic checks of the global tables (every rank gets the same answer):
// invalid layouts, ranks outside [0, world_size), unknown dst names, shape mismatch,
// casts that cannot be exact in kind. One message per problem, naming the tensor.
std::vector<std::string> check_tables(const LayoutTable& src, const LayoutTable& dst, int32_t world_size);

}  // namespace rx
