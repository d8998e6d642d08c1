#include "core/planner.h"

#include <algorithm>
#include <functional>
#include <tuple>
#include <utility>

#include "core/check.h"
#include "core/checked.h"
#include "kernels/api.h"

namespace rx {

namespace {

constexpr int64_t kLastDimGrain = RX_BOX_MX_GROUP;
constexpr int64_t kOpAlign = 16;       // every box starts 16-byte aligned in staging


uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool is_float(int32_t d) { return d == RX_F16 || d == RX_BF16 || d == RX_F32 || d == RX_F64; }

// Every combination of one segment per dim is one box.
void for_each_box(const std::vector<std::vector<Segment>>& segs,
                  const std::function<void(const std::vector<const Segment*>&)>& fn) {
  const size_t nd = segs.size();
  for (const auto& s : segs)
    if (s.empty()) return;
  std::vector<size_t> idx(nd, 0);
  std::vector<const Segment*> pick(nd);
  while (true) {
    for (size_t d = 0; d < nd; ++d) pick[d] = &segs[d][idx[d]];
    fn(pick);
    size_t d = nd;
    while (d > 0) {
      --d;
      if (++idx[d] < segs[d].size()) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (nd == 0) return;
  }
}

// Replica choice among the ranks holding a src class (DESIGN section 4, step 2). The
// aim is pairs: each receiver takes a class from one holder for every tensor of the same
// layouts, and each holder serves an equal share of the receivers. Spreading receivers
// over replicas per tensor made every batch of a TP2·DP2 -> TP1·DP4 refit couple all
// four ranks (2 peers each; 4x H200: ~0.12 ms per batch against ~0.02 with one peer).
// - The receiver itself when it holds the class (a local copy).
// - A receiver holding another class of the tensor takes the holder with its own
//   replica index (its DP group): every class has the same replicas, so each holder
//   serves as many receivers as any other.
// - A receiver outside the src mesh: round robin over its (dst class + index among the
//   dst class's replicas outside the src mesh). When those are fewer than the replicas,
//   the name offsets the choice, so that every holder serves some of the tensors.
// Both ends evaluate this alike. Returns the src replica index j, or -1 for "the
// receiver itself".
int64_t choose_replica(const Layout& src, int64_t cls, int64_t receiver_src_pos, int64_t dst_class,
                       int64_t outside_index, int64_t outside_count, uint64_t name_hash) {
  if (receiver_src_pos >= 0)
    return src.class_of_position(receiver_src_pos) == cls ? -1 : src.replica_of_position(receiver_src_pos);
  const uint64_t nrep = static_cast<uint64_t>(src.replicas_per_class());
  const uint64_t salt = static_cast<uint64_t>(outside_count) < nrep ? name_hash : 0;
  return static_cast<int64_t>((salt + static_cast<uint64_t>(dst_class + outside_index)) % nrep);
}

// How many of dst class `dcls`'s replicas are outside the src mesh: before replica
// `before` (first) and in all (second).
std::pair<int64_t, int64_t> replicas_outside(const Layout& src, const Layout& dst, int64_t dcls, int64_t before) {
  int64_t below = 0, all = 0;
  for (int64_t j = 0; j < dst.replicas_per_class(); ++j) {
    const bool outside = src.mesh().position(dst.class_replica(dcls, j)) < 0;
    all += outside;
    below += outside && j < before;
  }
  return {below, all};
}

// Splits an op into pieces of at most `limit` wire bytes along its outermost dims.
void split_op(const TransferOp& op, int64_t limit, int32_t elem, std::vector<TransferOp>& out) {
  if (limit <= 0 || op.nbytes <= limit) {
    out.push_back(op);
    return;
  }
  const size_t nd = op.mine.size.size();
  size_t d = 0;
  while (d < nd && op.mine.size[d] == 1) ++d;
  if (d == nd) {
    out.push_back(op);
    return;
  }
  const int64_t per = op.nbytes / op.mine.size[d];
  int64_t step = per > limit ? 1 : std::max<int64_t>(1, limit / per);
  // Cuts inside the last dim fall on multiples of 32 elements (soft limit), so MXFP8
  // blocks stay whole in every box (a fused quantize needs a block in one box).
  if (d + 1 == nd) step = std::max<int64_t>(kLastDimGrain, step / kLastDimGrain * kLastDimGrain);
  if (step >= op.mine.size[d]) {  // no finer cut allowed (whole MX blocks): keep it whole
    out.push_back(op);
    return;
  }
  for (int64_t lo = 0; lo < op.mine.size[d]; lo += step) {
    const int64_t n = std::min(step, op.mine.size[d] - lo);
    TransferOp part = op;
    part.mine.start[d] += lo;
    part.theirs.start[d] += lo;
    part.global[d] += lo;
    part.mine.size[d] = part.theirs.size[d] = n;
    part.numel = op.numel / op.mine.size[d] * n;
    part.nbytes = checked_mul(part.numel, elem, "bytes of a box");
    split_op(part, limit, elem, out);
  }
}

bool op_less(const TransferOp& a, const TransferOp& b) {
  if (a.peer != b.peer) return a.peer < b.peer;
  if (a.dst_name != b.dst_name) return a.dst_name < b.dst_name;
  return a.global < b.global;
}

}  // namespace

uint64_t fnv1a(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

LayoutTable::LayoutTable(std::vector<std::pair<std::string, std::shared_ptr<const Layout>>> entries) {
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [name, layout] : entries) {
    if (!names_.empty() && names_.back() == name) {
      RX_USER_CHECK(layouts_.back()->same_as(*layout), "tensor '", name, "': ranks disagree on its layout: ",
                    layouts_.back()->describe(), " vs ", layout->describe());
      continue;
    }
    index_.emplace(name, static_cast<int32_t>(names_.size()));
    hashes_.push_back(fnv1a(name.data(), name.size()));
    names_.push_back(std::move(name));
    layouts_.push_back(std::move(layout));
  }
}

int32_t LayoutTable::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

int32_t wire_dtype_for(int32_t src_dtype, int32_t dst_dtype) {
  if (is_float(src_dtype) && is_float(dst_dtype) && rx_dtype_size(dst_dtype) < rx_dtype_size(src_dtype))
    return dst_dtype;
  return src_dtype;
}

std::vector<std::string> check_tables(const LayoutTable& src, const LayoutTable& dst, int32_t world_size) {
  std::vector<std::string> errors;
  auto check_side = [&](const LayoutTable& t, const char* side) {
    for (int32_t i = 0; i < t.size(); ++i) {
      const Layout& l = t.layout(i);
      if (!l.error().empty()) {
        errors.push_back(detail::format(side, " tensor '", t.name(i), "': invalid layout: ", l.error()));
        continue;
      }
      if (world_size > 0) {
        for (int32_t r : l.mesh().ranks()) {
          if (r >= world_size) {
            errors.push_back(detail::format(side, " tensor '", t.name(i), "': mesh names rank ", r,
                                            ", outside the group of size ", world_size));
            break;
          }
        }
      }
    }
  };
  check_side(src, "src");
  check_side(dst, "dst");
  for (int32_t i = 0; i < dst.size(); ++i) {
    const int32_t j = src.find(dst.name(i));
    if (j < 0) {
      errors.push_back(detail::format("dst tensor '", dst.name(i), "' has no source: no rank passed it in src"));
      continue;
    }
    const Layout& d = dst.layout(i);
    const Layout& s = src.layout(j);
    if (d.shape() != s.shape())
      errors.push_back(detail::format("tensor '", dst.name(i), "': global shape differs between src ",
                                      s.describe(), " and dst ", d.describe()));
    if (!rx_dtype_castable(s.dtype(), d.dtype()))
      errors.push_back(detail::format("tensor '", dst.name(i), "': cannot convert ", dtype_name(s.dtype()),
                                      " to ", dtype_name(d.dtype()), " exactly in kind (only floating types convert)"));
  }
  return errors;
}

RankPlan plan_rank(const LayoutTable& src, const LayoutTable& dst, int32_t rank, int64_t max_batch_bytes) {
  RankPlan plan;
  plan.rank = rank;
  plan.max_batch_bytes = max_batch_bytes;
  std::vector<TransferOp> raw_sends, raw_recvs;

  auto make_op = [&dst](int32_t dst_name, int32_t src_name, int32_t peer, const std::vector<const Segment*>& pick,
                        bool mine_is_a, int32_t wire) {
    TransferOp op;
    op.dst_name = dst_name;
    op.name_hash = dst.name_hash(dst_name);
    op.src_name = src_name;
    op.peer = peer;
    op.numel = 1;
    for (const Segment* s : pick) {
      op.mine.start.push_back(mine_is_a ? s->a_local : s->b_local);
      op.theirs.start.push_back(mine_is_a ? s->b_local : s->a_local);
      op.mine.size.push_back(s->len);
      op.theirs.size.push_back(s->len);
      op.global.push_back(s->global);
      op.numel = checked_mul(op.numel, s->len, "elements of a box");
    }
    op.wire_dtype = wire;
    op.nbytes = checked_mul(op.numel, rx_dtype_size(wire), "bytes of a box");
    return op;
  };

  // As receiver: my dst piece of each tensor against every src class.
  Piece mine;
  for (int32_t di = 0; di < dst.size(); ++di) {
    const Layout& dl = dst.layout(di);
    const int64_t my_pos = dl.mesh().position(rank);
    if (my_pos < 0 || dl.numel() == 0) continue;
    const int32_t si = src.find(dst.name(di));
    RX_HOST_ASSERT(si >= 0, "unchecked table");
    const Layout& sl = src.layout(si);
    const int64_t my_dcls = dl.class_of_position(my_pos);
    // Only a receiver outside the src mesh needs its index among such replicas.
    const int64_t my_src_pos = sl.mesh().position(rank);
    int64_t outside_index = 0, outside_count = 0;
    if (my_src_pos < 0) {
      std::tie(outside_index, outside_count) = replicas_outside(sl, dl, my_dcls, dl.replica_of_position(my_pos));
    }
    mine = dl.class_piece(my_dcls);
    const int32_t wire = wire_dtype_for(sl.dtype(), dl.dtype());
    std::vector<std::vector<Segment>> segs(dl.ndim());
    for (int64_t cls = 0; cls < sl.num_classes(); ++cls) {
      const Piece theirs = sl.class_piece(cls);
      bool empty = false;
      for (int d = 0; d < dl.ndim() && !empty; ++d) {
        segs[d] = intersect(theirs[d], mine[d]);
        empty = segs[d].empty();
      }
      if (empty) continue;
      const int64_t j = choose_replica(sl, cls, my_src_pos, my_dcls, outside_index, outside_count, dst.name_hash(di));
      const int32_t peer = j < 0 ? rank : sl.class_replica(cls, j);
      for_each_box(segs, [&](const std::vector<const Segment*>& pick) {
        (peer == rank ? plan.copies : raw_recvs).push_back(make_op(di, si, peer, pick, false, wire));
      });
    }
  }

  // As sender: for each tensor I hold, the dst pieces that choose me.
  for (int32_t si = 0; si < src.size(); ++si) {
    const Layout& sl = src.layout(si);
    const int64_t my_pos = sl.mesh().position(rank);
    if (my_pos < 0 || sl.numel() == 0) continue;
    const int32_t di = dst.find(src.name(si));
    if (di < 0) continue;  // extra src names are ignored
    const Layout& dl = dst.layout(di);
    const int64_t my_cls = sl.class_of_position(my_pos);
    const Piece held = sl.class_piece(my_cls);
    const int32_t wire = wire_dtype_for(sl.dtype(), dl.dtype());
    std::vector<std::vector<Segment>> segs(sl.ndim());
    for (int64_t dcls = 0; dcls < dl.num_classes(); ++dcls) {
      const Piece want = dl.class_piece(dcls);
      bool empty = false;
      for (int d = 0; d < sl.ndim() && !empty; ++d) {
        segs[d] = intersect(held[d], want[d]);
        empty = segs[d].empty();
      }
      if (empty) continue;
      int64_t outside_index = 0, outside_count = -1;  // counted once, when first needed
      for (int64_t j = 0; j < dl.replicas_per_class(); ++j) {
        const int32_t receiver = dl.class_replica(dcls, j);
        if (receiver == rank) continue;  // a same-rank copy, planned on the receive side
        const int64_t src_pos = sl.mesh().position(receiver);
        if (src_pos < 0 && outside_count < 0) outside_count = replicas_outside(sl, dl, dcls, 0).second;
        const int64_t pick = choose_replica(sl, my_cls, src_pos, dcls, outside_index, outside_count, dst.name_hash(di));
        if (src_pos < 0) ++outside_index;
        if (pick < 0 || sl.class_replica(my_cls, pick) != rank) continue;
        for_each_box(segs, [&](const std::vector<const Segment*>& p) {
          raw_sends.push_back(make_op(di, si, receiver, p, true, wire));
        });
      }
    }
  }

  auto finish = [&](std::vector<TransferOp>& raw, std::vector<TransferOp>& out) {
    out.reserve(raw.size());
    for (const TransferOp& op : raw) split_op(op, max_batch_bytes, rx_dtype_size(op.wire_dtype), out);
    std::sort(out.begin(), out.end(), op_less);
  };
  finish(raw_sends, plan.sends);
  finish(raw_recvs, plan.recvs);
  std::sort(plan.copies.begin(), plan.copies.end(), op_less);
  plan.assign_batches(1);
  return plan;
}

namespace {
int64_t total_bytes(const std::vector<TransferOp>& ops) {
  int64_t n = 0;
  for (const auto& op : ops) n = checked_add(n, op.nbytes, "bytes of a rank's ops");
  return n;
}
}  // namespace

int64_t RankPlan::send_total() const { return total_bytes(sends); }
int64_t RankPlan::recv_total() const { return total_bytes(recvs); }
int64_t RankPlan::copy_total() const { return total_bytes(copies); }

int32_t batch_at(int64_t at, int64_t total, int32_t k, bool taper) {
  if (total <= 0) return 0;
  const __int128 b = taper && k >= 3 ? (static_cast<__int128>(at) * 2 * (k - 1) + total) / (2 * static_cast<__int128>(total))
                                     : static_cast<__int128>(at) * k / total;
  return static_cast<int32_t>(std::min<__int128>(k - 1, b));
}

int32_t RankPlan::wanted_batches() const {
  if (max_batch_bytes <= 0) return 1;
  const int64_t most = std::max(send_total(), recv_total());
  const int64_t k = std::max<int64_t>(1, most / max_batch_bytes + (most % max_batch_bytes != 0));
  RX_USER_CHECK(k < kMaxBatches, "max_batch_bytes=", max_batch_bytes, " would cut the ", most,
                " bytes of rank ", rank, " into more than ", kMaxBatches, " batches");
  // Tapered, k + 1 batches hold k full ones: two half batches at the ends.
  return static_cast<int32_t>(taper && k >= 2 ? k + 1 : k);
}

int64_t RankPlan::staging_bytes(int32_t buffers) const {
  int64_t send = 0, recv = 0;
  for (const BatchLayout& b : batches) {
    send = std::max(send, b.send_bytes);
    recv = std::max(recv, b.recv_bytes);
  }
  return checked_mul(batches.size() > 1 ? buffers : 1, checked_add(send, recv, "staging bytes"), "staging bytes");
}

namespace {
int64_t staging_with(const RankPlan& plan, int64_t k, int32_t buffers) {
  RankPlan trial = plan;
  trial.assign_batches(static_cast<int32_t>(k));
  return trial.staging_bytes(buffers);
}
bool fits_with(const RankPlan& plan, int64_t k, int64_t limit, int32_t buffers) {
  return staging_with(plan, k, buffers) <= limit;
}
}  // namespace

uint64_t RankPlan::fitting_counts(int64_t limit, int32_t buffers, int32_t first) const {
  RX_USER_CHECK(limit > 0 && buffers >= 1 && first >= 1, "fitting_counts: bad arguments");
  uint64_t mask = 0;
  for (int i = 0; i < 64 && first + i <= kMaxBatches; ++i)
    if (fits_with(*this, first + i, limit, buffers)) mask |= uint64_t{1} << i;
  return mask;
}

int32_t RankPlan::batches_within(int64_t limit, int32_t buffers) const {
  RX_USER_CHECK(limit > 0 && buffers >= 1, "batches_within: limit ", limit, " and buffers ", buffers, " must be positive");
  if (fits_with(*this, 1, limit, buffers)) return 1;
  // Start from the ideal count (every batch exactly its share) and grow by a quarter:
  // ops cut at batch boundaries and alignment make a batch up to about 1.5 shares. Stop
  // once more batches stop helping: ops cannot be cut below a row (or a 32-element
  // block), and every pair's first op lands in the first batch.
  const int64_t total = checked_add(send_total(), recv_total(), "bytes of a rank");
  int64_t k = std::max<int64_t>(2, checked_mul(total / limit + 1, buffers, "batches"));
  int64_t best = INT64_MAX;
  for (int stale = 0; stale < 6 && k <= kMaxBatches; k += std::max<int64_t>(1, k / 4)) {
    const int64_t staging = staging_with(*this, k, buffers);
    if (staging <= limit) return static_cast<int32_t>(k);
    stale = staging < best ? 0 : stale + 1;
    best = std::min(best, staging);
  }
  return 0;
}

namespace {

// Calls fn(begin, end, total bytes) for each run of ops with the same peer (ops are
// sorted by peer: one run per pair).
template <typename Fn>
void for_each_pair(const std::vector<TransferOp>& ops, Fn&& fn) {
  size_t i = 0;
  while (i < ops.size()) {
    size_t end = i;
    int64_t total = 0;
    while (end < ops.size() && ops[end].peer == ops[i].peer)
      total = checked_add(total, ops[end++].nbytes, "bytes exchanged with one peer");
    fn(i, end, total);
    i = end;
  }
}

// Cuts a pair's ops bigger than half the share of its smallest batch along their outer
// dims, so no batch of the pair carries much more than its share: a batch's transfer
// lasts as long as its busiest pair, and one unsplit op of a few hundred MB (a vocab
// shard) made one batch of a 4-GPU refit take 6 ms where the others took 1.6. Both ends
// of a pair hold the same op list and cut it the same way.
void resplit_pairs(std::vector<TransferOp>& ops, int32_t k, bool taper, int32_t fineness) {
  if (k <= 1) return;
  const int64_t parts = fineness * (taper && k >= 3 ? 4 * static_cast<int64_t>(k - 1) : 2 * static_cast<int64_t>(k));
  std::vector<TransferOp> out;
  out.reserve(ops.size());
  for_each_pair(ops, [&](size_t begin, size_t end, int64_t total) {
    const int64_t limit = std::max<int64_t>(1, total / parts + (total % parts != 0));
    for (size_t o = begin; o < end; ++o) split_op(ops[o], limit, rx_dtype_size(ops[o].wire_dtype), out);
  });
  ops.swap(out);
}

}  // namespace

void RankPlan::assign_batches(int32_t k) {
  RX_HOST_ASSERT(k >= 1, "need at least one batch");
  RX_HOST_ASSERT(region_align >= kOpAlign && region_align % kOpAlign == 0, "bad region alignment ", region_align);
  batches.assign(k, BatchLayout{});
  digests.clear();
  send_digest = recv_digest = 0;
  resplit_pairs(sends, k, taper, fineness);
  resplit_pairs(recvs, k, taper, fineness);

  auto side = [&](std::vector<TransferOp>& ops, bool is_send) {
    for_each_pair(ops, [&](size_t i, size_t end, int64_t total) {
      const int32_t peer = ops[i].peer;
      std::vector<int64_t> fill(k, 0);
      int64_t running = 0;
      uint64_t h = 1469598103934665603ull;
      for (size_t o = i; o < end; ++o) {
        TransferOp& op = ops[o];
        op.batch = batch_at(running, total, k, taper);
        running += op.nbytes;  // <= total, which did not overflow
        op.offset = checked_align_up(fill[op.batch], kOpAlign, "staging offset");
        fill[op.batch] = checked_add(op.offset, op.nbytes, "staging bytes of a peer");
        const int64_t key[5] = {static_cast<int64_t>(op.name_hash), op.batch, op.offset, op.nbytes,
                                op.wire_dtype};
        h = fnv1a(key, sizeof(key), h);
        h = fnv1a(op.global.data(), op.global.size() * sizeof(int64_t), h);
        h = fnv1a(op.mine.size.data(), op.mine.size.size() * sizeof(int64_t), h);
      }
      for (int32_t b = 0; b < k; ++b) {
        if (fill[b] == 0) continue;
        BatchLayout& bl = batches[b];
        auto& regions = is_send ? bl.sends : bl.recvs;
        int64_t& used = is_send ? bl.send_bytes : bl.recv_bytes;
        const int64_t off = checked_align_up(used, region_align, "staging offset");
        regions.push_back({peer, off, fill[b]});
        used = checked_add(off, fill[b], "staging bytes of a batch");
      }
      PairDigest d{is_send ? rank : peer, is_send ? peer : rank, static_cast<int64_t>(end - i), total, h};
      const uint64_t folded = mix64(h ^ mix64(static_cast<uint64_t>(d.count) * 31 + static_cast<uint64_t>(d.bytes)) ^
                                    mix64((static_cast<uint64_t>(d.from) << 32) | static_cast<uint32_t>(d.to)));
      (is_send ? send_digest : recv_digest) += folded;
      digests.push_back(d);
    });
  };
  side(sends, true);
  side(recvs, false);
}

}  // namespace rx
