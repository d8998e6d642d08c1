#include "core/direct.h"

#include <algorithm>
#include <cstdlib>
#include <unordered_map>
#include <unordered_set>

#include "common/check.h"
#include "common/dtype.h"
#include "core/checked.h"

namespace rx {

RankPlan split_direct(const RankPlan& plan, const LayoutTable& src, const std::vector<int32_t>& peers) {
  RankPlan out = plan;
  auto is_direct = [&](int32_t peer) { return std::find(peers.begin(), peers.end(), peer) != peers.end(); };
  auto split = [&](const std::vector<TransferOp>& all, std::vector<TransferOp>& kept, std::vector<TransferOp>& direct) {
    kept.clear();
    for (const TransferOp& op : all) {
      if (!is_direct(op.peer)) {
        kept.push_back(op);
        continue;
      }
      TransferOp d = op;
      RX_HOST_ASSERT(op.src_name >= 0 && op.src_name < src.size(), "split_direct: op without a source tensor");
      d.wire_dtype = src.layout(op.src_name).dtype();
      d.nbytes = d.numel * dtype_size(d.wire_dtype);
      d.batch = 0;
      d.offset = 0;
      direct.push_back(std::move(d));
    }
  };
  split(plan.sends, out.sends, out.direct_sends);
  split(plan.recvs, out.recvs, out.direct_recvs);
  out.batches.clear();
  out.digests.clear();
  out.send_digest = out.recv_digest = 0;
  return out;
}

namespace {

constexpr int64_t kMaxPitch = (int64_t{1} << 31) - 1;  // wider copy-engine pitches are refused by some drivers

int64_t box_bytes(const rx_box& b) {
  int64_t n = dtype_size(b.dst_dtype);
  for (int d = 0; d < b.ndim; ++d) n *= b.shape[d];
  return n;
}

}  // namespace

void split_engines(const std::vector<rx_box>& boxes, int64_t min_bytes, std::vector<EngineCopy>* engine,
                   std::vector<rx_box>* kernel) {
  engine->clear();
  kernel->clear();
  for (const rx_box& b : boxes) {
    const int64_t elem = dtype_size(b.src_dtype);
    const int last = b.ndim - 1;
    bool ok = min_bytes > 0 && b.codec == RX_CODEC_NONE && b.src_dtype == b.dst_dtype && elem > 0 &&
              (b.ndim == 1 || b.ndim == 2) && b.src_stride[last] == 1 && b.dst_stride[last] == 1 &&
              box_bytes(b) >= min_bytes;
    EngineCopy c;
    if (ok) {
      c.dst = b.dst;
      c.src = b.src;
      c.width = b.shape[last] * elem;
      c.height = b.ndim == 2 ? b.shape[0] : 1;
      c.spitch = b.ndim == 2 ? b.src_stride[0] * elem : c.width;
      c.dpitch = b.ndim == 2 ? b.dst_stride[0] * elem : c.width;
      // cudaMemcpy2D wants pitches >= width (rows that do not overlap); very wide pitches
      // are refused by some drivers, so those boxes stay with the kernel.
      if (c.height > 1)
        ok = c.width >= kMinEngineRow && c.spitch >= c.width && c.dpitch >= c.width && c.spitch <= kMaxPitch &&
             c.dpitch <= kMaxPitch;
    }
    if (ok)
      engine->push_back(c);
    else
      kernel->push_back(b);
  }
}

EngineBatches batch_engines(const std::vector<EngineCopy>& copies, const SameAllocation& same_allocation) {
  EngineBatches out;
  for (const EngineCopy& c : copies) {
    if (c.height != 1) {
      out.pitched.push_back(c);
      continue;
    }
    EngineCopy* last = out.runs.empty() ? nullptr : &out.runs.back();
    if (last != nullptr && last->src + static_cast<uint64_t>(last->width) == c.src &&
        last->dst + static_cast<uint64_t>(last->width) == c.dst &&
        (!same_allocation || (same_allocation(last->src, c.src) && same_allocation(last->dst, c.dst)))) {
      last->width += c.width;
      last->spitch = last->dpitch = last->width;
    } else {
      out.runs.push_back(c);
    }
  }
  return out;
}

int auto_engine_streams(size_t num_copies) {
  const int64_t want = (static_cast<int64_t>(num_copies) + kCopiesPerEngineStream - 1) / kCopiesPerEngineStream;
  return static_cast<int>(std::clamp<int64_t>(want, kMinEngineStreams, kMaxEngineStreams));
}

std::vector<std::vector<EngineCopy>> spread_engines(const std::vector<EngineCopy>& copies, int n) {
  n = n <= 0 ? auto_engine_streams(copies.size()) : n;
  std::vector<std::vector<EngineCopy>> out(static_cast<size_t>(n));
  int64_t total = 0;
  for (const EngineCopy& c : copies) total += c.width * c.height;
  const int64_t share = (total + n - 1) / n;
  size_t i = 0;
  int64_t filled = 0;
  for (EngineCopy c : copies) {
    while (c.width > 0 && c.height > 0) {
      const bool last = i + 1 == out.size();
      const int64_t room = share - filled;
      const int64_t bytes = c.width * c.height;
      if (last || bytes <= room) {
        out[i].push_back(c);
        filled += bytes;
        break;
      }
      EngineCopy head = c;
      if (c.height == 1) {
        head.width = head.spitch = head.dpitch = room;
        c.width -= room;
        c.spitch = c.dpitch = c.width;
        c.src += static_cast<uint64_t>(room);
        c.dst += static_cast<uint64_t>(room);
      } else {
        head.height = room / c.width;
        c.height -= head.height;
        c.src += static_cast<uint64_t>(head.height * c.spitch);
        c.dst += static_cast<uint64_t>(head.height * c.dpitch);
      }
      if (head.width > 0 && head.height > 0) out[i].push_back(head);
      ++i;
      filled = 0;
    }
  }
  return out;
}

bool staged_copy(const rx_box& box, uint64_t src, EngineCopy* copy) {
  const int64_t es = dtype_size(box.dst_dtype);
  // The box's dims by the destination alone, innermost first, merged where contiguous in dst.
  struct Dim { int64_t n, stride; };
  std::vector<Dim> dims;
  for (int d = box.ndim - 1; d >= 0; --d) {
    if (box.shape[d] == 1) continue;
    if (box.shape[d] <= 0 || box.dst_stride[d] <= 0) return false;
    if (!dims.empty() && box.dst_stride[d] == dims.back().n * dims.back().stride) {
      dims.back().n *= box.shape[d];
      continue;
    }
    dims.push_back({box.shape[d], box.dst_stride[d]});
  }
  if (dims.empty()) dims.push_back({1, 1});
  if (dims.size() > 2 || dims[0].stride != 1 || es <= 0) return false;
  EngineCopy c;
  c.src = src;
  c.dst = box.dst;
  c.width = c.spitch = c.dpitch = dims[0].n * es;
  c.height = 1;
  if (dims.size() == 2) {
    c.height = dims[1].n;
    c.dpitch = dims[1].stride * es;
    if (c.width < kMinEngineRow || c.dpitch < c.width || c.dpitch > kMaxPitch) return false;
  }
  *copy = c;
  return true;
}

StagingPlan plan_staging(const std::vector<rx_box>& boxes, const std::vector<int32_t>& groups,
                         const std::vector<uint8_t>& stageable, int64_t slot_bytes, std::vector<int32_t>* rest,
                         const std::vector<int64_t>& ordinals, int32_t slots) {
  RX_HOST_ASSERT(stageable.size() == boxes.size() && (groups.empty() || groups.size() == boxes.size()) &&
                     (ordinals.empty() || ordinals.size() == boxes.size()) && slots >= 1,
                 "plan_staging: ", stageable.size(), " flags, ", groups.size(), " groups and ", ordinals.size(),
                 " ordinals for ", boxes.size(), " boxes, ", slots, " slots");
  StagingPlan plan;
  rest->clear();
  auto aligned = [](int64_t n) { return (n + kStageAlign - 1) / kStageAlign * kStageAlign; };
  // (group, index) of each staged box, then in that order into chunks.
  std::vector<std::pair<int32_t, int32_t>> staged;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const rx_box& b = boxes[i];
    EngineCopy probe;
    const int64_t bytes = box_bytes(b);
    if (slot_bytes > 0 && stageable[i] && bytes > 0 && aligned(bytes) <= slot_bytes && staged_copy(b, 0, &probe))
      staged.emplace_back(groups.empty() ? 0 : groups[i], static_cast<int32_t>(i));
    else
      rest->push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(staged.begin(), staged.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [group, i] : staged) {
    const rx_box& b = boxes[static_cast<size_t>(i)];
    const int64_t bytes = aligned(box_bytes(b));
    if (plan.chunks.empty() || plan.chunks.back().group != group || plan.chunks.back().bytes + bytes > slot_bytes) {
      plan.chunks.emplace_back();
      plan.chunks.back().group = group;
    }
    StagedChunk& c = plan.chunks.back();
    rx_box pack = b;  // the same elements, written row-major into the slot
    pack.dst = static_cast<uint64_t>(c.bytes);
    int64_t stride = 1;
    for (int d = b.ndim - 1; d >= 0; --d) {
      pack.dst_stride[d] = stride;
      stride *= b.shape[d];
    }
    EngineCopy copy;
    RX_HOST_ASSERT(staged_copy(b, pack.dst, &copy), "plan_staging: box ", i, " lost its copy");
    rx_box digest = pack;  // the slot's bytes as a plain copy onto themselves (a read pass writes nothing)
    digest.src = pack.dst;
    digest.src_dtype = b.dst_dtype;
    std::copy(pack.dst_stride, pack.dst_stride + RX_MAX_DIMS, digest.src_stride);
    digest.codec = RX_CODEC_NONE;
    digest.param[0] = ordinals.empty() ? 0 : ordinals[static_cast<size_t>(i)];
    digest.param[1] = digest.param[2] = 0;
    digest.digest = RX_DIGEST_AS_WRITTEN;
    c.pack.push_back(pack);
    c.digest.push_back(digest);
    c.copies.push_back(copy);
    c.boxes.push_back(i);
    c.bytes += bytes;
    plan.slot_bytes = std::max(plan.slot_bytes, c.bytes);
  }
  plan.slots = static_cast<int32_t>(std::min<size_t>(static_cast<size_t>(slots), plan.chunks.size()));
  for (size_t k = 0; k < plan.chunks.size(); ++k) plan.chunks[k].slot = static_cast<int32_t>(k) % plan.slots;
  return plan;
}

void relocate_staging(StagingPlan* plan, uint64_t base) {
  for (StagedChunk& c : plan->chunks) {
    const uint64_t slot = base + static_cast<uint64_t>(c.slot) * static_cast<uint64_t>(plan->slot_bytes);
    for (rx_box& b : c.pack) b.dst += slot;
    for (rx_box& b : c.digest) b.src = b.dst = b.src + slot;
    for (EngineCopy& e : c.copies) e.src += slot;
  }
}

StageScript stage_script(const StagingPlan& plan, int32_t groups, int32_t streams, bool digest,
                         const std::vector<int32_t>& gates) {
  RX_HOST_ASSERT(streams >= 1 && groups >= 0, "stage_script: ", streams, " streams, ", groups, " groups");
  RX_HOST_ASSERT(gates.empty() || gates.size() == plan.chunks.size(), "stage_script: ", gates.size(),
                 " gates for ", plan.chunks.size(), " chunks");
  StageScript out;
  const int32_t slots = plan.slots, n = static_cast<int32_t>(plan.chunks.size());
  out.parts.resize(static_cast<size_t>(std::max(groups, 1)));
  if (n == 0) return out;  // nothing staged: no action at all
  out.streams = streams;
  out.events = 2 * slots + streams + (digest ? 1 : 0);
  const auto packed = [](int32_t c, int32_t s) { return c % s; };
  int32_t prepared = -1;  // the last prep event the pack stream waited for (its later packs need no wait for less)
  auto pack = [&](std::vector<StageAction>& to, int32_t c) {
    if (!gates.empty() && gates[static_cast<size_t>(c)] > prepared) {
      prepared = gates[static_cast<size_t>(c)];
      to.push_back({kStageWait, 0, stage_prep_event(prepared)});
    }
    to.push_back({kStagePack, 0, c});
    to.push_back({kStageRecord, 0, packed(c, slots)});
    if (digest) to.push_back({kStageDigest, 0, c});
  };
  out.prefill.push_back({kStageWait, 0, gates.empty() ? kStageStart : kStageSources});
  for (int32_t c = 0; c < slots; ++c) pack(out.prefill, c);
  int32_t c = 0;
  for (int32_t k = 0; k < static_cast<int32_t>(out.parts.size()); ++k) {
    std::vector<StageAction>& part = out.parts[static_cast<size_t>(k)];
    if (groups > 0 && k > 0)
      for (int32_t e = 0; e < streams; ++e) part.push_back({kStageWait, 1 + e, kStageLanded});
    for (; c < n && (groups == 0 || plan.chunks[static_cast<size_t>(c)].group == k); ++c) {
      const int32_t stream = 1 + c % streams, slot = packed(c, slots);
      part.push_back({kStageWait, stream, slot});
      part.push_back({kStageCopy, stream, c});
      part.push_back({kStageRecord, stream, slots + slot});
      if (c + slots < n) {  // the chunk that reuses the slot, once it is copied out
        part.push_back({kStageWait, 0, slots + slot});
        pack(part, c + slots);
      }
    }
    for (int32_t e = 0; e < streams; ++e) part.push_back({kStageRecord, 1 + e, 2 * slots + e});
    if (digest && k + 1 == static_cast<int32_t>(out.parts.size())) part.push_back({kStageRecord, 0, 2 * slots + streams});
  }
  RX_HOST_ASSERT(c == n, "stage_script: chunks out of landing-group order, or of groups past ", groups);
  return out;
}

namespace {

// [lo, hi) of the bytes a box's elements span at `base` with `stride` (in elements of `elem`
// bytes), each element reading `last` bytes from its address (empty boxes: lo == hi).
std::pair<uint64_t, uint64_t> span_at(const rx_box& box, uint64_t base, const int64_t* stride, int64_t elem,
                                      int64_t last) {
  int64_t lo = 0, hi = 0;  // byte offsets from base of the first and of the last element
  for (int d = 0; d < box.ndim; ++d) {
    if (box.shape[d] <= 0) return {base, base};
    const int64_t reach = (box.shape[d] - 1) * stride[d] * elem;
    (reach < 0 ? lo : hi) += reach;
  }
  return {base + static_cast<uint64_t>(lo), base + static_cast<uint64_t>(hi + last)};
}

}  // namespace

std::pair<uint64_t, uint64_t> dst_span(const rx_box& box) {
  const int64_t elem = dtype_size(box.dst_dtype);
  return span_at(box, box.dst, box.dst_stride, elem, elem);
}

std::pair<uint64_t, uint64_t> src_span(const rx_box& box) {
  const int64_t elem = dtype_size(box.src_dtype);
  const int64_t step = box.ndim > 0 ? std::abs(box.src_stride[box.ndim - 1]) : 1;
  return span_at(box, box.src, box.src_stride, elem, std::max<int64_t>(step, 1) * elem);
}

PrepSchedule prep_schedule(const StagingPlan& plan, const std::vector<PrepRegion>& regions) {
  // Regions by start, with the furthest end of each prefix: the regions a span [lo, hi)
  // overlaps are among those starting before hi, scanned back while a prefix reaches past lo.
  std::vector<int32_t> by_start;
  for (size_t r = 0; r < regions.size(); ++r)
    if (regions[r].bytes > 0) by_start.push_back(static_cast<int32_t>(r));
  std::sort(by_start.begin(), by_start.end(), [&](int32_t a, int32_t b) {
    return regions[static_cast<size_t>(a)].addr < regions[static_cast<size_t>(b)].addr;
  });
  std::vector<uint64_t> starts, reach;
  for (int32_t r : by_start) {
    const PrepRegion& g = regions[static_cast<size_t>(r)];
    starts.push_back(g.addr);
    reach.push_back(std::max(reach.empty() ? 0 : reach.back(), g.addr + static_cast<uint64_t>(g.bytes)));
  }
  PrepSchedule out;
  std::vector<int32_t> position(regions.size(), -1);
  for (const StagedChunk& c : plan.chunks) {
    int32_t gate = -1;
    for (const rx_box& b : c.pack) {
      const auto [lo, hi] = src_span(b);
      if (hi <= lo) continue;
      for (auto i = std::lower_bound(starts.begin(), starts.end(), hi) - starts.begin(); i-- > 0 && reach[i] > lo;) {
        const int32_t r = by_start[static_cast<size_t>(i)];
        const PrepRegion& g = regions[static_cast<size_t>(r)];
        if (g.addr + static_cast<uint64_t>(g.bytes) <= lo) continue;
        int32_t& at = position[static_cast<size_t>(r)];
        if (at < 0) {
          at = static_cast<int32_t>(out.order.size());
          out.order.push_back(r);
        }
        gate = std::max(gate, at);
      }
    }
    out.gates.push_back(gate);
  }
  return out;
}

std::vector<int32_t> landing_groups(const std::vector<TransferOp>& ops, int32_t groups) {
  RX_HOST_ASSERT(groups >= 1 && groups <= kMaxLandingGroups, "landing_groups: ", groups, " groups");
  std::unordered_map<int32_t, int64_t> total, seen;
  for (const TransferOp& op : ops) total[op.peer] = checked_add(total[op.peer], op.numel, "landing_groups");
  std::vector<int32_t> out;
  out.reserve(ops.size());
  for (const TransferOp& op : ops) {
    int64_t& before = seen[op.peer];
    const int64_t all = total[op.peer], left = all - before;
    int32_t k = 0;
    while (k < groups - 1 && k < 62 && left <= (all >> (k + 1))) ++k;
    out.push_back(k);
    before += op.numel;
  }
  return out;
}

std::vector<std::vector<std::pair<int64_t, int64_t>>> landing_runs(const std::vector<TransferOp>& recvs,
                                                                  const std::vector<int32_t>& senders, int32_t groups) {
  const std::vector<int32_t> group = landing_groups(recvs, groups);
  const std::unordered_set<int32_t> direct(senders.begin(), senders.end());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(static_cast<size_t>(groups) + 1);
  for (size_t i = 0; i < recvs.size(); ++i) {
    const size_t k = direct.count(recvs[i].peer) ? static_cast<size_t>(group[i]) : static_cast<size_t>(groups);
    auto& r = runs[k];
    const auto at = static_cast<int64_t>(i);
    if (!r.empty() && r.back().second == at)
      ++r.back().second;
    else
      r.emplace_back(at, at + 1);
  }
  return runs;
}

}  // namespace rx
