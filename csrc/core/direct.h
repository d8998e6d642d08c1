// The direct transport's share of a rank's plan and how its boxes are carried (DESIGN
// section 4, "Direct path"): a sender writes each box straight into the receiver's
// destination tensor through a peer mapping, with no staging at either end and no
// unpack. Pure: no CUDA, no torch.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "core/box.h"
#include "core/planner.h"

namespace rx {

// A copy of `plan` whose sends and receives with a peer in `peers` move to direct_sends /
// direct_recvs (order kept). A direct op's wire_dtype becomes its source tensor's dtype
// (what its box reads: there is no wire) and nbytes the bytes read. Batches and digests
// are cleared: call assign_batches on the result, with the batch count every rank agrees
// on, before building tables from it. Both ends of a pair must pass each other alike.
RankPlan split_direct(const RankPlan& plan, const LayoutTable& src, const std::vector<int32_t>& peers);

// Rows narrower than this slow the copy engines down (FACTS.md: 512 B rows still reach the
// link's limit).
constexpr int64_t kMinEngineRow = 512;

// One copy-engine copy: `height` rows of `width` bytes, rows `spitch` / `dpitch` bytes
// apart (height 1: one contiguous run; the pitches are then `width`).
struct EngineCopy {
  uint64_t dst = 0, src = 0;
  int64_t dpitch = 0, spitch = 0, width = 0, height = 0;
};

// Splits boxes between the copy engines and the box kernel. A plain copy (same dtype, no
// codec) of at least `min_bytes` whose innermost dim is contiguous on both sides, 1-D or 2-D
// after make_box folded it, with rows of at least kMinEngineRow bytes and pitches that do
// not overlap rows, becomes an EngineCopy; every other box stays a kernel box, in order.
// min_bytes <= 0: no copy engines.
void split_engines(const std::vector<rx_box>& boxes, int64_t min_bytes, std::vector<EngineCopy>* engine,
                   std::vector<rx_box>* kernel);

// Copy-engine copies as the executor submits them: contiguous runs (height 1) and pitched
// 2-D copies, each in the order given. A run that continues the previous run on both
// sides (its src and dst start where that one's end) is merged into it: adjacent tensors,
// as a caching allocator hands them out, then cost one copy (a batch has no order, and
// no two copies of a plan write the same bytes). `same_allocation(a, b)`, where given, must
// hold for both sides too: a copy may not span two allocations that merely touch.
struct EngineBatches {
  std::vector<EngineCopy> runs, pitched;
};
using SameAllocation = std::function<bool(uint64_t a, uint64_t b)>;
EngineBatches batch_engines(const std::vector<EngineCopy>& copies, const SameAllocation& same_allocation = nullptr);

// Spreads copies over `n` lists of about equal bytes, in order, cutting a copy that would
// overfill a list at a byte (run) or row (pitched) boundary, so that `n` streams keep as
// many copy engines busy. n == 1: one list holding the copies as they are; n <= 0:
// auto_engine_streams(copies.size()) lists.
std::vector<std::vector<EngineCopy>> spread_engines(const std::vector<EngineCopy>& copies, int n);

// The streams `spread_engines` uses by default for `num_copies` copies: one per
// kCopiesPerEngineStream, within [kMinEngineStreams, kMaxEngineStreams]. Thousands of
// MB-sized copies (an MoE's experts) gain from more engines at once, which hide each
// other's per-copy setup; a few hundred large ones do not.
constexpr int kMinEngineStreams = 4, kMaxEngineStreams = 32;
constexpr int64_t kCopiesPerEngineStream = 100;
int auto_engine_streams(size_t num_copies);

// ---- Staged codec boxes ---------------------------------------------------------------
// A box whose codec belongs to its source (ExecTables::direct_stageable: a sender-side
// conversion such as rx.MXFP8(where="sender"), which writes exactly its dst elements) does
// not store into the peer from the box kernel, whose codec lanes write narrow, scattered
// pieces (a lane per codec block) that the link carries at a fraction of its rate. The box
// kernel runs it into a local staging ring instead, as the NCCL path's pack does, and the
// copy engines carry the ring's bytes into the peer's destination: chunk by chunk, the pack
// of chunk c + 1 running while the engines carry chunk c. The ring has kStageSlots slots of
// at most the slot bytes the transport chose (within max_batch_bytes); a chunk fills one.
constexpr int32_t kStageSlots = 4;    // the pack runs up to three chunks ahead of the engines
constexpr int32_t kStageStreams = 2;  // copy-engine streams, chunk c on stream c % 2: two chunks in flight
constexpr int64_t kStageAlign = 256;  // of each box in a slot (wide stores, as in NCCL's staging)

// One chunk: boxes that fill one slot, all of one landing group.
struct StagedChunk {
  int32_t group = 0;
  int32_t slot = 0;
  int64_t bytes = 0;                // of its slot in use
  std::vector<rx_box> pack;         // the boxes, writing contiguously into the slot
  std::vector<EngineCopy> copies;   // slot -> the peer's destinations, one per box
  std::vector<int32_t> boxes;       // the index of each box in plan_staging's input
  // A verified execute's send digests of the boxes: plain copies of their bytes in the slot
  // (dst dtype, first ordinal the box's within its op), read by RX_PASS_SRC. A sender-side
  // box's digest is that of the dst elements it writes (what its receiver's unpack hashes on
  // the NCCL path), so this reads 1 byte per byte sent instead of running the codec again.
  std::vector<rx_box> digest;
};

// Addresses in the ring are offsets from 0 until relocate_staging adds the ring's base.
struct StagingPlan {
  int64_t slot_bytes = 0;  // the largest chunk's bytes, aligned
  int32_t slots = 0;       // min(kStageSlots, chunks)
  std::vector<StagedChunk> chunks;
  int64_t ring_bytes() const { return slot_bytes * slots; }
};

// The copy-engine copy that moves a box's dst elements from a contiguous staging region at
// `src` (row-major over the box's shape) into the box's destination, or false where the
// destination is not one copy: its elements fold (dims contiguous in dst merged) to one
// run, or to rows of at least kMinEngineRow bytes with a pitch (as split_engines wants).
bool staged_copy(const rx_box& box, uint64_t src, EngineCopy* copy);

// Stages boxes[i] where stageable[i], its destination is one copy (staged_copy) and it
// fits `slot_bytes` (ExecTables::bind_direct cuts ops to fit); chunks group the staged
// boxes by landing group (groups[i]; empty: all 0) in ascending group order, each group's
// boxes in order, a chunk filled up to slot_bytes, the ring of `slots` slots (at most one
// per chunk). `rest` gets the indices of the other boxes, in order. slot_bytes <= 0:
// nothing is staged. ordinals[i] (empty: all 0): the verify ordinal of box i's first
// element within its op (ExecTables::direct_ordinals), for the chunks' digest boxes.
StagingPlan plan_staging(const std::vector<rx_box>& boxes, const std::vector<int32_t>& groups,
                         const std::vector<uint8_t>& stageable, int64_t slot_bytes, std::vector<int32_t>* rest,
                         const std::vector<int64_t>& ordinals = {}, int32_t slots = kStageSlots);
// Moves the plan's pack destinations and copy sources into the ring at `base`.
void relocate_staging(StagingPlan* plan, uint64_t base);

// How a staged execute is queued: actions in host order on the staging streams, the same
// list for the CUDA executor (DirectExec) and its CPU emulation (tests/_direct_sim.py).
// Streams: 0 runs the pack kernels, 1 + e copy-engine stream e. Events (CUDA semantics: a
// wait waits for the latest record of the event queued before it, if any): ids [0, slots)
// "slot s packed", [slots, 2 slots) "slot s copied out", [2 slots, 2 slots + streams) "copy
// stream e reached the end of a group"; kStageStart: the execute's start on the caller's
// stream (sources ready, the ring free since the previous execute's end); kStageLanded: the
// previous landing group was signalled.
enum StageOp : int32_t { kStagePack = 0, kStageCopy = 1, kStageWait = 2, kStageRecord = 3, kStageDigest = 4 };
constexpr int32_t kStageStart = -1, kStageLanded = -2;
struct StageAction {
  int32_t op, stream, arg;  // arg: the chunk (pack, copy) or the event (wait, record)
};
struct StageScript {
  int32_t streams = 0, events = 0;
  // Queued before the host waits for the receivers: the pack stream waits for the start
  // and packs the first chunks (a slot each), which write local memory only.
  std::vector<StageAction> prefill;
  // Then per landing group (groups > 0) or one part (groups == 0): a copy stream waits
  // for its chunk's pack, copies and records the slot copied out; the pack stream packs
  // the chunk that reuses that slot once it is copied out; every copy stream records its
  // group-end event last. A landing group k > 0 first makes every copy stream wait for
  // kStageLanded. The executor signals group k (or the whole execute) once every copy
  // stream's group-end event of part k has completed, and records kStageLanded there.
  // Nothing staged: every list is empty (streams and events 0).
  std::vector<std::vector<StageAction>> parts;
};
StageScript stage_script(const StagingPlan& plan, int32_t groups, int32_t streams = kStageStreams, bool digest = false,
                         const std::vector<int32_t>& gates = {});

// ---- Deferred pre-pass work (rx.Tuning.direct_prep_overlap) ------------------------------
// A sender-side codec's boxes read per-tensor values computed from the source each execute
// (blockwise FP8's block factors, NVFP4's amax): the amax pre-pass and the codec's step after
// it. Where a tensor's work needs no other rank, the transport may run it per tensor on a prep
// stream instead of before the execute, in the order the staged chunks read the tensors, and
// record prep event k after the k-th tensor's work; the pack stream then waits, before it packs
// chunk c, only for the event of the last tensor chunk c's boxes read, so the first chunks move
// while later tensors are still prepared. A tensor is known by the source bytes its work reads
// (a region); a box belongs to every region its source bytes overlap (aliased or interleaved
// views: the latest of them gates it, never an earlier one). With gates, the prefill waits for
// kStageSources (the caller's stream when the sources were ready, recorded before the prep
// work) instead of kStageStart, which the executor records only after every prep event.
constexpr int32_t kStageSources = -3;
constexpr int32_t stage_prep_event(int32_t k) { return -4 - k; }  // prep event k's id in a script
constexpr int32_t stage_prep_index(int32_t id) { return -4 - id; }  // ... and back (>= 0 for prep events)
struct PrepRegion {
  uint64_t addr = 0;
  int64_t bytes = 0;
};
struct PrepSchedule {
  std::vector<int32_t> order;  // the regions some chunk reads, in the order the chunks first read them
  std::vector<int32_t> gates;  // per chunk: the position in `order` of the last region it reads (-1: none)
};
PrepSchedule prep_schedule(const StagingPlan& plan, const std::vector<PrepRegion>& regions);

// [lo, hi): the source bytes a box reads, taking each coordinate to read up to the next one
// along the innermost dim (a codec coordinate may read a whole block there: NVFP4's scales).
std::pair<uint64_t, uint64_t> src_span(const rx_box& box);

// Landing groups of a verified direct execute: each sender writes a pair's ops in
// `groups` groups and signals each group as it lands, so that the receiver digests group
// k while k + 1 is still on the link. Groups halve: an op of a peer (in plan order) is in
// group k when the elements of the pair's ops from its first one on are at most 1 / 2^k of
// them and more than 1 / 2^(k + 1) (the last group takes the rest), so the digest left
// after the transfer covers about 1 / 2^(groups - 1) of the bytes. Both ends of a pair
// derive the same groups from the same op sizes.
constexpr int32_t kMaxLandingGroups = 255;
// The group of each op (per peer, as above); 1 <= groups <= kMaxLandingGroups.
std::vector<int32_t> landing_groups(const std::vector<TransferOp>& ops, int32_t groups);
// [begin, end) runs of `recvs` (sorted by peer) per group: runs[k] holds the ops of a peer
// in `senders` in group k; runs[groups] every other peer's ops.
std::vector<std::vector<std::pair<int64_t, int64_t>>> landing_runs(const std::vector<TransferOp>& recvs,
                                                                  const std::vector<int32_t>& senders, int32_t groups);
// The signal word a sender stores once the first `landed` of `groups` groups of execute
// `seq` are in the receiver (landed == groups: the whole execute). Values grow with both.
constexpr uint64_t landed_word(uint64_t seq, int32_t landed, int32_t groups) {
  return seq * (kMaxLandingGroups + 1) + static_cast<uint64_t>(landed >= groups ? kMaxLandingGroups : landed);
}

// [lo, hi): the bytes of dst memory a box's elements span (a codec's side bytes, such as
// MXFP8 scales, are not included). Empty boxes give lo == hi.
std::pair<uint64_t, uint64_t> dst_span(const rx_box& box);

}  // namespace rx
