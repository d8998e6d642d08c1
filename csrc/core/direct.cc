#include "core/direct.h"

#include <algorithm>
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
      constexpr int64_t kMaxPitch = (int64_t{1} << 31) - 1;
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

std::pair<uint64_t, uint64_t> dst_span(const rx_box& box) {
  const int64_t elem = dtype_size(box.dst_dtype);
  int64_t lo = 0, hi = 0;  // byte offsets from box.dst of the first and one past the last element
  for (int d = 0; d < box.ndim; ++d) {
    if (box.shape[d] <= 0) return {box.dst, box.dst};
    const int64_t reach = (box.shape[d] - 1) * box.dst_stride[d] * elem;
    (reach < 0 ? lo : hi) += reach;
  }
  return {box.dst + static_cast<uint64_t>(lo), box.dst + static_cast<uint64_t>(hi + elem)};
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
