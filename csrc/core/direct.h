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
