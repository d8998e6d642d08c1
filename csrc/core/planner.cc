#include "core/planner.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "common/check.h"
#include "common/dtype.h"
#include "core/checked.h"

namespace rx {

namespace {

constexpr int64_t kOpAlign = 16;       // every box starts 16-byte aligned in staging


uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Every combination of one segment per dim is one box. `pick` is scratch.
template <typename Fn>
void for_each_box(const std::vector<std::vector<Segment>>& segs, std::vector<const Segment*>& pick, Fn&& fn) {
  const size_t nd = segs.size();
  for (const auto& s : segs)
    if (s.empty()) return;
  pick.resize(nd);
  if (std::all_of(segs.begin(), segs.end(), [](const auto& s) { return s.size() == 1; })) {
    for (size_t d = 0; d < nd; ++d) pick[d] = &segs[d][0];
    fn(pick);  // the common case: one box
    return;
  }
  std::vector<size_t> idx(nd, 0);
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
// over replicas per tensor would couple each batch to more peers, and a batch lasts as
// long as its slowest pair.
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
  const int64_t k = dst.replicas_per_class();
  int64_t below = 0, all = 0;
  if (src.mesh().size() < k) {  // count the replicas inside instead: fewer look-ups
    int64_t in_below = 0, in_all = 0;
    for (int32_t r : src.mesh().ranks()) {
      const int64_t pos = dst.mesh().position(r);
      if (pos < 0 || dst.class_of_position(pos) != dcls) continue;
      ++in_all;
      in_below += dst.replica_of_position(pos) < before;
    }
    return {std::min(before, k) - in_below, k - in_all};
  }
  for (int64_t j = 0; j < k; ++j) {
    const bool outside = src.mesh().position(dst.class_replica(dcls, j)) < 0;
    all += outside;
    below += outside && j < before;
  }
  return {below, all};
}

// Who serves whom between one src and one dst layout, as seen by one rank. It depends
// only on the two meshes and on which of their dims shard, not on the tensor, so the
// tensors of a model (tens of thousands over a few hundred meshes) share a few hundred
// of these, and a sender stops scanning every receiver of every tensor it holds (that
// scan was most of the planning time at 2,048 ranks).
struct Routes {
  // As receiver: my class and replica index in the dst layout, my position in the src
  // mesh (-1: outside), and outside it, my index among my dst class's replicas outside
  // the src mesh and their count (choose_replica).
  int64_t my_dcls = 0, my_src_pos = -1, outside_index = 0, outside_count = 0;
  // As sender (my class, my replica index in the src layout), per dst class: the
  // receivers that take my class from me whatever the tensor, and, where the choice
  // depends on the name (fewer receivers outside the src mesh than src replicas), the
  // receivers outside the src mesh in replica order.
  struct ToClass {
    std::vector<int32_t> fixed;
    std::vector<int32_t> by_name;
  };
  int64_t my_cls = 0, my_rep = 0;
  std::vector<ToClass> to;
};

struct RouteKey {
  const Mesh* src;
  const Mesh* dst;
  uint32_t src_mask, dst_mask;
  bool sender;
  bool operator==(const RouteKey& o) const {
    return src == o.src && dst == o.dst && src_mask == o.src_mask && dst_mask == o.dst_mask && sender == o.sender;
  }
};

struct RouteKeyHash {
  size_t operator()(const RouteKey& k) const {
    return static_cast<size_t>(mix64(reinterpret_cast<uintptr_t>(k.src) * 31 + reinterpret_cast<uintptr_t>(k.dst)) ^
                               (static_cast<uint64_t>(k.src_mask) << 33 | static_cast<uint64_t>(k.dst_mask) << 1 |
                                k.sender));
  }
};

Routes receiver_routes(const Layout& src, const Layout& dst, int32_t rank) {
  Routes r;
  const int64_t my_pos = dst.mesh().position(rank);
  r.my_dcls = dst.class_of_position(my_pos);
  r.my_src_pos = src.mesh().position(rank);
  if (r.my_src_pos < 0)
    std::tie(r.outside_index, r.outside_count) =
        replicas_outside(src, dst, r.my_dcls, dst.replica_of_position(my_pos));
  return r;
}

Routes sender_routes(const Layout& src, const Layout& dst, int32_t rank) {
  Routes r;
  const int64_t my_pos = src.mesh().position(rank);
  r.my_cls = src.class_of_position(my_pos);
  r.my_rep = src.replica_of_position(my_pos);
  r.to.resize(dst.num_classes());
  for (int64_t dcls = 0; dcls < dst.num_classes(); ++dcls) {
    Routes::ToClass& to = r.to[dcls];
    const int64_t outside_count = replicas_outside(src, dst, dcls, 0).second;
    // Below this count the name salts the choice (choose_replica): decided per tensor.
    const bool by_name = outside_count < src.replicas_per_class();
    int64_t outside_index = 0;
    for (int64_t j = 0; j < dst.replicas_per_class(); ++j) {
      const int32_t receiver = dst.class_replica(dcls, j);
      if (receiver == rank) continue;  // a same-rank copy, planned on the receive side
      const int64_t src_pos = src.mesh().position(receiver);
      if (src_pos < 0 && by_name) {
        to.by_name.push_back(receiver);
        ++outside_index;
        continue;
      }
      const int64_t pick = choose_replica(src, r.my_cls, src_pos, dcls, outside_index, outside_count, 0);
      if (src_pos < 0) ++outside_index;
      if (pick == r.my_rep) to.fixed.push_back(receiver);
    }
  }
  return r;
}

// The pieces of at most `limit` wire bytes an op of `size` (numel elements of `elem`
// bytes) is cut into along its outermost dims, in order: fn(offsets, sizes, numel) per
// piece, offsets relative to the op's origin; cuts inside the last dim fall on multiples
// of `grain` (the op's). `off` and `size` are scratch, restored on return. Both split_op
// and the dry run of the batch layout (batch_layouts) cut by it.
template <typename Fn>
void for_each_split(std::vector<int64_t>& off, std::vector<int64_t>& size, int64_t numel, int64_t limit,
                    int32_t elem, int64_t grain, Fn&& fn) {
  if (limit <= 0 || numel * elem <= limit) return fn(off, size, numel);
  const size_t nd = size.size();
  size_t d = 0;
  while (d < nd && size[d] == 1) ++d;
  if (d == nd) return fn(off, size, numel);
  const int64_t per = numel * elem / size[d];
  int64_t step = per > limit ? 1 : std::max<int64_t>(1, limit / per);
  // Cuts inside the last dim fall on multiples of the grain (soft limit), so codec
  // blocks stay whole in every box.
  if (d + 1 == nd) step = std::max<int64_t>(grain, step / grain * grain);
  if (step >= size[d]) return fn(off, size, numel);  // no finer cut allowed (whole codec blocks)
  const int64_t full = size[d], base = off[d];
  for (int64_t lo = 0; lo < full; lo += step) {
    size[d] = std::min(step, full - lo);
    off[d] = base + lo;
    for_each_split(off, size, numel / full * size[d], limit, elem, grain, fn);
  }
  size[d] = full;
  off[d] = base;
}

}  // namespace

void split_op(const TransferOp& op, int64_t limit, int32_t elem, std::vector<TransferOp>& out) {
  if (limit <= 0 || op.nbytes <= limit) {
    out.push_back(op);
    return;
  }
  std::vector<int64_t> off(op.mine.size.size(), 0), size = op.mine.size;
  for_each_split(off, size, op.numel, limit, elem, op.grain,
                 [&](const std::vector<int64_t>& o, const std::vector<int64_t>& n, int64_t numel) {
                   TransferOp part = op;
                   for (size_t d = 0; d < n.size(); ++d) {
                     part.mine.start[d] += o[d];
                     part.theirs.start[d] += o[d];
                     part.global[d] += o[d];
                     part.mine.size[d] = part.theirs.size[d] = n[d];
                   }
                   part.numel = numel;
                   part.nbytes = checked_mul(numel, elem, "bytes of a box");
                   out.push_back(std::move(part));
                 });
}

namespace {

bool op_less(const TransferOp& a, const TransferOp& b) {
  if (a.peer != b.peer) return a.peer < b.peer;
  if (a.dst_name != b.dst_name) return a.dst_name < b.dst_name;
  return a.global < b.global;
}

// Sorts by op_less through an index, so each op (five vectors) moves once.
void sort_ops(std::vector<TransferOp>& ops) {
  std::vector<uint32_t> order(ops.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&ops](uint32_t a, uint32_t b) { return op_less(ops[a], ops[b]); });
  std::vector<TransferOp> out;
  out.reserve(ops.size());
  for (uint32_t i : order) out.push_back(std::move(ops[i]));
  ops.swap(out);
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
  std::unordered_map<const Mesh*, size_t> group;
  for (int32_t i = 0; i < size(); ++i) {
    const Mesh* m = &layouts_[i]->mesh();
    auto [it, fresh] = group.emplace(m, by_mesh_.size());
    if (fresh) by_mesh_.push_back({m, {}});
    by_mesh_[it->second].second.push_back(i);
  }
}

int32_t LayoutTable::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

int32_t wire_dtype_for(int32_t src_dtype, int32_t dst_dtype) {
  if (dtype_is_float(src_dtype) && dtype_is_float(dst_dtype) && dtype_size(dst_dtype) < dtype_size(src_dtype))
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
    if (!dtype_castable(s.dtype(), d.dtype()))
      errors.push_back(detail::format(
          "tensor '", dst.name(i), "': cannot convert ", dtype_name(s.dtype()), " to ", dtype_name(d.dtype()),
          ": conversions exist only among float16, bfloat16, float32 and float64 (same bits as Tensor.to); "
          "any other dtype, FP8 included, must be the same on both sides (for FP8 weights use a transform "
          "such as rx.MXFP8)"));
  }
  return errors;
}

RankPlan plan_rank(const LayoutTable& src, const LayoutTable& dst, int32_t rank, int64_t max_batch_bytes,
                   const std::unordered_map<int32_t, int64_t>& grains) {
  for (const auto& [i, g] : grains)
    RX_USER_CHECK(i >= 0 && i < dst.size() && g >= 1, "plan_rank: bad cut grain ", g, " for dst table index ", i);
  RankPlan plan;
  plan.rank = rank;
  plan.max_batch_bytes = max_batch_bytes;
  std::vector<TransferOp> raw_sends, raw_recvs;

  auto make_op = [&dst, &grains](int32_t dst_name, int32_t src_name, int32_t peer,
                                 const std::vector<const Segment*>& pick, bool mine_is_a, int32_t wire) {
    TransferOp op;
    op.dst_name = dst_name;
    if (const auto g = grains.find(dst_name); g != grains.end()) op.grain = g->second;
    op.name_hash = dst.name_hash(dst_name);
    op.src_name = src_name;
    op.peer = peer;
    op.numel = 1;
    const size_t nd = pick.size();
    op.mine.start.resize(nd);
    op.theirs.start.resize(nd);
    op.mine.size.resize(nd);
    op.global.resize(nd);
    for (size_t d = 0; d < nd; ++d) {
      const Segment* s = pick[d];
      op.mine.start[d] = mine_is_a ? s->a_local : s->b_local;
      op.theirs.start[d] = mine_is_a ? s->b_local : s->a_local;
      op.mine.size[d] = s->len;
      op.global[d] = s->global;
      op.numel = checked_mul(op.numel, s->len, "elements of a box");
    }
    op.theirs.size = op.mine.size;
    op.wire_dtype = wire;
    op.dst_dtype = dst.layout(dst_name).dtype();
    op.nbytes = checked_mul(op.numel, dtype_size(wire), "bytes of a box");
    return op;
  };

  std::unordered_map<RouteKey, Routes, RouteKeyHash> route_cache;
  auto routes = [&](const Layout& sl, const Layout& dl, bool sender) -> const Routes& {
    const RouteKey key{&sl.mesh(), &dl.mesh(), sl.shard_mask(), dl.shard_mask(), sender};
    auto it = route_cache.find(key);
    if (it == route_cache.end())
      it = route_cache.emplace(key, sender ? sender_routes(sl, dl, rank) : receiver_routes(sl, dl, rank)).first;
    return it->second;
  };

  std::vector<const Segment*> pick_scratch;
  auto for_held = [rank](const LayoutTable& t, auto&& fn) {
    for (const auto& [mesh, indices] : t.by_mesh())
      if (mesh->position(rank) >= 0)
        for (int32_t i : indices)
          if (t.layout(i).numel() > 0) fn(i);
  };

  // As receiver: my dst piece of each tensor against every src class.
  Piece mine;
  for_held(dst, [&](int32_t di) {
    const Layout& dl = dst.layout(di);
    const int32_t si = src.find(dst.name(di));
    RX_HOST_ASSERT(si >= 0, "unchecked table");
    const Layout& sl = src.layout(si);
    const Routes& rt = routes(sl, dl, false);
    mine = dl.class_piece(rt.my_dcls);
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
      const int64_t j = choose_replica(sl, cls, rt.my_src_pos, rt.my_dcls, rt.outside_index, rt.outside_count,
                                       dst.name_hash(di));
      const int32_t peer = j < 0 ? rank : sl.class_replica(cls, j);
      for_each_box(segs, pick_scratch, [&](const std::vector<const Segment*>& pick) {
        (peer == rank ? plan.copies : raw_recvs).push_back(make_op(di, si, peer, pick, false, wire));
      });
    }
  });

  // As sender: for each tensor I hold, the dst pieces that choose me.
  for_held(src, [&](int32_t si) {
    const Layout& sl = src.layout(si);
    const int32_t di = dst.find(src.name(si));
    if (di < 0) return;  // extra src names are ignored
    const Layout& dl = dst.layout(di);
    const Routes& rt = routes(sl, dl, true);
    const Piece held = sl.class_piece(rt.my_cls);
    const int32_t wire = wire_dtype_for(sl.dtype(), dl.dtype());
    const uint64_t name_hash = dst.name_hash(di);
    std::vector<std::vector<Segment>> segs(sl.ndim());
    for (int64_t dcls = 0; dcls < dl.num_classes(); ++dcls) {
      const Routes::ToClass& to = rt.to[dcls];
      if (to.fixed.empty() && to.by_name.empty()) continue;
      const Piece want = dl.class_piece(dcls);
      bool empty = false;
      for (int d = 0; d < sl.ndim() && !empty; ++d) {
        segs[d] = intersect(held[d], want[d]);
        empty = segs[d].empty();
      }
      if (empty) continue;
      auto send_to = [&](int32_t receiver) {
        for_each_box(segs, pick_scratch, [&](const std::vector<const Segment*>& p) {
          raw_sends.push_back(make_op(di, si, receiver, p, true, wire));
        });
      };
      for (int32_t receiver : to.fixed) send_to(receiver);
      const int64_t n = static_cast<int64_t>(to.by_name.size());
      for (int64_t i = 0; i < n; ++i)
        if (choose_replica(sl, rt.my_cls, -1, dcls, i, n, name_hash) == rt.my_rep) send_to(to.by_name[i]);
    }
  });

  auto finish = [&](std::vector<TransferOp>& raw, std::vector<TransferOp>& out) {
    out.reserve(raw.size());
    for (TransferOp& op : raw) {
      if (max_batch_bytes <= 0 || op.nbytes <= max_batch_bytes)
        out.push_back(std::move(op));
      else
        split_op(op, max_batch_bytes, dtype_size(op.wire_dtype), out);
    }
    sort_ops(out);
  };
  finish(raw_sends, plan.sends);
  finish(raw_recvs, plan.recvs);
  sort_ops(plan.copies);
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
int64_t RankPlan::direct_send_total() const { return total_bytes(direct_sends); }
int64_t RankPlan::direct_recv_total() const { return total_bytes(direct_recvs); }

int32_t batch_at(int64_t at, int64_t total, int32_t k, bool taper) {
  if (total <= 0) return 0;
  // 64-bit arithmetic while it cannot overflow (any real refit): the 128-bit division
  // was most of the cost of laying out 100,000 ops
  if (at < (int64_t{1} << 40) && total < (int64_t{1} << 40) && k < (1 << 20)) {
    const int64_t b = taper && k >= 3 ? (at * 2 * (k - 1) + total) / (2 * total) : at * k / total;
    return static_cast<int32_t>(std::min<int64_t>(k - 1, b));
  }
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

namespace {
// Staging of `buffers` copies (1 with a single batch) of the largest send plus the
// largest receive batch.
int64_t staging_of(const std::vector<BatchLayout>& batches, int32_t buffers) {
  int64_t send = 0, recv = 0;
  for (const BatchLayout& b : batches) {
    send = std::max(send, b.send_bytes);
    recv = std::max(recv, b.recv_bytes);
  }
  return checked_mul(batches.size() > 1 ? buffers : 1, checked_add(send, recv, "staging bytes"), "staging bytes");
}
bool fits_with(const RankPlan& plan, int64_t k, int64_t limit, int32_t buffers) {
  return staging_of(plan.batch_layouts(static_cast<int32_t>(k)), buffers) <= limit;
}
}  // namespace

int64_t RankPlan::staging_bytes(int32_t buffers) const { return staging_of(batches, buffers); }

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
    const int64_t staging = staging_of(batch_layouts(static_cast<int32_t>(k)), buffers);
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

// The cut of a pair's ops for k batches: pieces of at most 1 / (2 * fineness) of the
// share of the pair's smallest batch (0: no cut), so no batch of the pair carries much
// more than its share: a batch's transfer lasts as long as its busiest pair, so one
// unsplit large op (a vocab shard) would stretch its batch. Both ends of a pair hold the
// same op list and cut it the same way. Never below `floor`: tiny pairs (norms) are not
// worth thousands of boxes, and at thousands of ranks such cuts would multiply the boxes
// per rank.
int64_t pair_limit(int64_t total, int32_t k, bool taper, int64_t floor, int32_t fineness) {
  if (k <= 1) return 0;
  const int64_t parts =
      fineness * (taper && k >= 3 ? 4 * static_cast<int64_t>(k - 1) : 2 * static_cast<int64_t>(k));
  return std::max<int64_t>(std::max<int64_t>(1, floor), total / parts + (total % parts != 0));
}

// The smallest cut of pair_limit: 1 MiB, or an eighth of max_batch_bytes where that is
// smaller (tiny batch bounds, as tests use, keep their balance).
int64_t min_cut(int64_t max_batch_bytes) {
  return max_batch_bytes > 0 ? std::min<int64_t>(int64_t{1} << 20, max_batch_bytes / 8) : 0;
}

void resplit_pairs(std::vector<TransferOp>& ops, int32_t k, bool taper, int64_t floor, int32_t fineness) {
  if (k <= 1) return;
  std::vector<TransferOp> out;
  out.reserve(ops.size());
  for_each_pair(ops, [&](size_t begin, size_t end, int64_t total) {
    const int64_t limit = pair_limit(total, k, taper, floor, fineness);
    for (size_t o = begin; o < end; ++o) split_op(ops[o], limit, dtype_size(ops[o].wire_dtype), out);
  });
  ops.swap(out);
}

// Places a pair's ops, in order, into k batches: the batch of each and its offset in the
// pair's region of that batch's staging buffer.
class PairPlacer {
 public:
  PairPlacer(int64_t total, int32_t k, bool taper, int64_t region_align)
      : total_(total), k_(k), taper_(taper), region_align_(region_align), fill_(k, 0) {}
  std::pair<int32_t, int64_t> place(int64_t nbytes) {
    const int32_t b = batch_at(running_, total_, k_, taper_);
    running_ += nbytes;  // <= total, which did not overflow
    const int64_t offset = checked_align_up(fill_[b], kOpAlign, "staging offset");
    fill_[b] = checked_add(offset, nbytes, "staging bytes of a peer");
    return {b, offset};
  }
  // Appends the pair's region of each batch it uses to the batches' layouts.
  void add_regions(std::vector<BatchLayout>& batches, int32_t peer, bool is_send) const {
    for (int32_t b = 0; b < k_; ++b) {
      if (fill_[b] == 0) continue;
      BatchLayout& bl = batches[b];
      int64_t& used = is_send ? bl.send_bytes : bl.recv_bytes;
      const int64_t off = checked_align_up(used, region_align_, "staging offset");
      (is_send ? bl.sends : bl.recvs).push_back({peer, off, fill_[b]});
      used = checked_add(off, fill_[b], "staging bytes of a batch");
    }
  }

 private:
  int64_t total_;
  int32_t k_;
  bool taper_;
  int64_t region_align_;
  int64_t running_ = 0;
  std::vector<int64_t> fill_;
};

}  // namespace

void RankPlan::assign_batches(int32_t k) {
  RX_HOST_ASSERT(k >= 1, "need at least one batch");
  RX_HOST_ASSERT(region_align >= kOpAlign && region_align % kOpAlign == 0, "bad region alignment ", region_align);
  batches.assign(k, BatchLayout{});
  digests.clear();
  send_digest = recv_digest = 0;
  resplit_pairs(sends, k, taper, min_cut(max_batch_bytes), fineness);
  resplit_pairs(recvs, k, taper, min_cut(max_batch_bytes), fineness);

  auto side = [&](std::vector<TransferOp>& ops, bool is_send) {
    for_each_pair(ops, [&](size_t i, size_t end, int64_t total) {
      const int32_t peer = ops[i].peer;
      PairPlacer placer(total, k, taper, region_align);
      uint64_t h = 1469598103934665603ull;
      for (size_t o = i; o < end; ++o) {
        TransferOp& op = ops[o];
        std::tie(op.batch, op.offset) = placer.place(op.nbytes);
        const int64_t key[5] = {static_cast<int64_t>(op.name_hash), op.batch, op.offset, op.nbytes,
                                op.wire_dtype};
        h = fnv1a(key, sizeof(key), h);
        h = fnv1a(op.global.data(), op.global.size() * sizeof(int64_t), h);
        h = fnv1a(op.mine.size.data(), op.mine.size.size() * sizeof(int64_t), h);
      }
      placer.add_regions(batches, peer, is_send);
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

std::vector<BatchLayout> RankPlan::batch_layouts(int32_t k) const {
  RX_HOST_ASSERT(k >= 1, "need at least one batch");
  std::vector<BatchLayout> out(k);
  std::vector<int64_t> off, size;
  auto side = [&](const std::vector<TransferOp>& ops, bool is_send) {
    for_each_pair(ops, [&](size_t i, size_t end, int64_t total) {
      PairPlacer placer(total, k, taper, region_align);
      const int64_t limit = pair_limit(total, k, taper, min_cut(max_batch_bytes), fineness);
      for (size_t o = i; o < end; ++o) {
        if (limit <= 0 || ops[o].nbytes <= limit) {
          placer.place(ops[o].nbytes);
          continue;
        }
        const int32_t elem = dtype_size(ops[o].wire_dtype);
        size = ops[o].mine.size;
        off.assign(size.size(), 0);
        for_each_split(off, size, ops[o].numel, limit, elem, ops[o].grain,
                       [&](const std::vector<int64_t>&, const std::vector<int64_t>&, int64_t numel) {
                         placer.place(checked_mul(numel, elem, "bytes of a box"));
                       });
      }
      placer.add_regions(out, ops[i].peer, is_send);
    });
  };
  side(sends, true);
  side(recvs, false);
  return out;
}

std::vector<FanOut> send_fanout(const RankPlan& plan) {
  RX_HOST_ASSERT(plan.batches.size() <= 1, "send_fanout needs the plan before its ops are cut into batches");
  // Sends ordered by box (tensor, origin, size), then receiver: a run is one box and the
  // receivers it goes to, in order.
  const std::vector<TransferOp>& ops = plan.sends;
  auto same_box = [&ops](uint32_t a, uint32_t b) {
    return ops[a].dst_name == ops[b].dst_name && ops[a].global == ops[b].global &&
           ops[a].mine.size == ops[b].mine.size;
  };
  std::vector<uint32_t> order(ops.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&ops](uint32_t a, uint32_t b) {
    const TransferOp &x = ops[a], &y = ops[b];
    return std::tie(x.dst_name, x.global, x.mine.size, x.peer) < std::tie(y.dst_name, y.global, y.mine.size, y.peer);
  });
  std::map<std::vector<int32_t>, int64_t> by_set;
  std::vector<int32_t> receivers;
  for (size_t i = 0; i < order.size();) {
    size_t end = i;
    receivers.clear();
    while (end < order.size() && same_box(order[i], order[end])) receivers.push_back(ops[order[end++]].peer);
    by_set[receivers] += ops[order[i]].nbytes;
    i = end;
  }
  std::vector<FanOut> out;
  out.reserve(by_set.size());
  for (auto& [set, nbytes] : by_set) out.push_back({set, nbytes});
  return out;
}

}  // namespace rx
