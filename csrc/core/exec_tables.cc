#include "core/exec_tables.h"

#include <algorithm>
#include <functional>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "common/check.h"
#include "common/dtype.h"
#include "core/checked.h"
#include "core/overlap.h"

namespace rx {

rx_box make_box(const std::vector<int64_t>& size, uint64_t src, const int64_t* src_strides, int32_t src_dtype,
                uint64_t dst, const int64_t* dst_strides, int32_t dst_dtype, int32_t codec, BoxParams params) {
  const int nd = static_cast<int>(size.size());
  std::vector<int64_t> contig(nd, 1);
  for (int d = nd - 2; d >= 0; --d) contig[d] = checked_mul(contig[d + 1], size[d + 1], "elements of a box");
  const int64_t* ss = src_strides ? src_strides : contig.data();
  const int64_t* ds = dst_strides ? dst_strides : contig.data();
  // Innermost first, merging outward.
  struct Dim { int64_t n, s, d; };
  std::vector<Dim> dims;
  for (int d = nd - 1; d >= 0; --d) {
    if (size[d] == 1) continue;
    if (!dims.empty() && ss[d] == dims.back().n * dims.back().s && ds[d] == dims.back().n * dims.back().d) {
      dims.back().n = checked_mul(dims.back().n, size[d], "elements of a box");
      continue;
    }
    dims.push_back({size[d], ss[d], ds[d]});
  }
  if (dims.empty()) dims.push_back({1, 1, 1});
  RX_USER_CHECK(static_cast<int>(dims.size()) <= RX_MAX_DIMS, "a box needs ", dims.size(),
                " non-mergeable dims; at most ", RX_MAX_DIMS, " are supported");
  rx_box b{};
  b.src = src;
  b.dst = dst;
  b.ndim = static_cast<int32_t>(dims.size());
  b.src_dtype = src_dtype;
  b.dst_dtype = dst_dtype;
  for (int i = 0; i < b.ndim; ++i) {
    const Dim& dm = dims[dims.size() - 1 - i];
    b.shape[i] = dm.n;
    b.src_stride[i] = dm.s;
    b.dst_stride[i] = dm.d;
  }
  b.codec = codec;
  for (int i = 0; i < 3; ++i) b.param[i] = params.p[i];
  // Merging only multiplies the innermost extent, so a codec's whole blocks stay whole.
  RX_HOST_ASSERT(rx_box_valid(&b), "bad box for codec ", codec, ": innermost extent ", b.shape[b.ndim - 1],
                 ", strides ", b.src_stride[b.ndim - 1], "/", b.dst_stride[b.ndim - 1], ", dtypes ", src_dtype, "->",
                 dst_dtype);
  return b;
}

ExecTables::ExecTables(std::shared_ptr<const RankPlan> plan) : plan_(std::move(plan)) {
  for (const auto* ops : {&plan_->sends, &plan_->copies, &plan_->direct_sends})
    for (const auto& op : *ops) src_used_.push_back(op.src_name);
  for (const auto* ops : {&plan_->recvs, &plan_->copies, &plan_->direct_recvs})
    for (const auto& op : *ops) dst_used_.push_back(op.dst_name);
  for (auto* v : {&src_used_, &dst_used_}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
}

int64_t ExecTables::send_buffer_bytes() const {
  int64_t n = 0;
  for (const auto& b : plan_->batches) n = std::max(n, b.send_bytes);
  return n;
}

int64_t ExecTables::recv_buffer_bytes() const {
  int64_t n = 0;
  for (const auto& b : plan_->batches) n = std::max(n, b.recv_bytes);
  return n;
}

std::string tensor_ref_error(const TensorRef& ref) {
  auto error = [&](const auto&... why) {
    return detail::format(ref.name.empty() ? std::string("TensorRef") : "TensorRef of '" + ref.name + "'", ": ",
                          why...);
  };
  if (dtype_size(ref.dtype) == 0) return error("unknown dtype code ", ref.dtype);
  if (!ref.shape.empty() && ref.shape.size() != ref.strides.size())
    return error(ref.strides.size(), " strides for a shape of ", ref.shape.size(), " dims");
  for (int64_t n : ref.shape)
    if (n < 0) return error("negative extent ", n, " in its shape");
  if (ref.grain < 1) return error("grain must be >= 1, got ", ref.grain);
  if (ref.codec == 0 && (ref.side != 0 || ref.arg != 0 || ref.grain != 1))
    return error("side, arg and grain are a codec's fields, but codec is 0");
  return {};
}

namespace {

// Strides of a piece's coordinates: a codec reading blocks steps `grain` elements along
// the last dim.
std::vector<int64_t> coord_strides(const TensorRef& t) {
  std::vector<int64_t> s = t.strides;
  if (!s.empty()) s.back() = checked_mul(s.back(), t.grain, "stride");
  return s;
}

uint64_t element_addr(const TensorRef& t, const std::vector<int64_t>& strides, const std::vector<int64_t>& start) {
  RX_HOST_ASSERT(strides.size() == start.size(), "bind: tensor rank differs from its layout");
  int64_t off = 0;
  for (size_t d = 0; d < start.size(); ++d)
    off = checked_add(off, checked_mul(start[d], strides[d], "offset"), "offset");
  return t.ptr + static_cast<uint64_t>(checked_mul(off, dtype_size(t.dtype), "byte offset"));
}

// A box's codec from the refs it joins (at most one side has one).
int32_t box_codec(const TensorRef* s, const TensorRef* d) {
  RX_HOST_ASSERT(!(s && s->codec && d && d->codec), "bind: a codec on both ends of a box");
  return (s && s->codec) ? s->codec : (d ? d->codec : 0);
}

// The parameters of a codec's box whose first element is at `at` in the memory of `t`, the
// end that carries the codec (TensorRef): a dst codec's (MXFP8's scales) or a src codec's
// (blockwise FP8's per-block scales, read by the pack and copy boxes of its source).
BoxParams box_params(const TensorRef& t, uint64_t at) {
  if (t.codec == 0 || t.side == 0) return {};
  BoxParams p;
  p.p[0] = static_cast<int64_t>(t.side);
  p.p[1] = static_cast<int64_t>(at - t.ptr) / dtype_size(t.dtype);
  p.p[2] = t.arg;
  return p;
}

// The parameters of a box between src piece `s` (first element at `from`) and dst piece `d`
// (first element at `at`): those of the end with the codec (at most one has one).
BoxParams box_params(const TensorRef& s, uint64_t from, const TensorRef& d, uint64_t at) {
  return s.codec ? box_params(s, from) : box_params(d, at);
}

// Cuts one batch's ops (in canonical order, `boxes` and `index` - their plan op - aligned
// with them) into messages and drops the boxes of direct messages from the table, their
// ops going to `direct`. `staging_side_is_dst`: pack boxes write staging (dst side),
// unpack boxes read it (src side). Ops of `aliased` pieces (table indices) stay staged.
void cut_messages(const std::vector<const TransferOp*>& ops, std::vector<rx_box>& boxes, std::vector<int32_t>& index,
                  bool staging_is_dst, int64_t direct_bytes, const std::unordered_set<int32_t>& aliased,
                  std::vector<Message>& out, std::vector<int32_t>& direct) {
  std::vector<rx_box> kept;
  std::vector<int32_t> kept_index;
  kept.reserve(boxes.size());
  kept_index.reserve(boxes.size());
  Message cur{-1, 0, 0};
  auto flush = [&] {
    if (cur.peer >= 0 && cur.bytes > 0) out.push_back(cur);
    cur = Message{-1, 0, 0};
  };
  auto keep = [&](size_t i) {
    kept.push_back(boxes[i]);
    kept_index.push_back(index[i]);
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const TransferOp& op = *ops[i];
    const rx_box& box = boxes[i];
    const uint64_t staging = staging_is_dst ? box.dst : box.src;
    // The cut looks at op size alone, which the peer knows too; whether the message then
    // reads / writes the tensor in place is this end's own choice. A piece sharing memory
    // with the other side stays staged (its reads then all happen at the pack, before any
    // write lands) but keeps its own message: aliasing is known to this rank only.
    if (direct_bytes > 0 && op.nbytes >= direct_bytes) {
      flush();
      const int64_t tensor_stride = staging_is_dst ? box.src_stride[0] : box.dst_stride[0];
      const bool flat = box.ndim == 1 && tensor_stride == 1 && box.src_dtype == box.dst_dtype &&
                        box.codec == RX_CODEC_NONE && !aliased.count(staging_is_dst ? op.src_name : op.dst_name);
      if (flat) {
        out.push_back({op.peer, staging_is_dst ? box.src : box.dst, op.nbytes, true});
        direct.push_back(index[i]);
      } else {
        out.push_back({op.peer, staging, op.nbytes, true});
        keep(i);
      }
      continue;
    }
    if (cur.peer != op.peer) {
      flush();
      cur = Message{op.peer, staging, 0};
    }
    cur.bytes = static_cast<int64_t>(staging - cur.ptr) + op.nbytes;
    keep(i);
  }
  flush();
  boxes.swap(kept);
  index.swap(kept_index);
}

// rx_box.digest of an op's box (core/box.h), so that verify digests cover what the
// receiver holds. A tensor the receiver converts with a codec (codec_receivers) is
// digested as the codec writes it where the op's box is whole blocks of the logical last
// dim arriving in the codec's input dtype - a test on the op alone, so both ends make it
// alike; a box that converts on its own (a codec box) is digested so anyway, while a
// copy box into a staging piece (converted later, in one pass over the whole piece) or a
// pack box computes the conversion in the digest. Elsewhere a pack of a wire dtype the
// receiver casts hashes the cast value.
int32_t digest_of(const TransferOp& op, const rx_box& box, int32_t reads,
                  const std::unordered_map<int32_t, ReceiverCodec>& codec_receivers) {
  const auto rc = codec_receivers.find(op.dst_name);
  if (rc != codec_receivers.end()) {
    const ReceiverCodec& r = rc->second;
    const bool whole = !op.mine.size.empty() && op.mine.size.back() > 0 && op.mine.size.back() % r.grain == 0 &&
                       op.global.back() % r.grain == 0;
    if (whole && reads == r.dtype && box.codec == RX_CODEC_NONE && box.dst_dtype == r.dtype) return r.digest;
  }
  if (box.codec == RX_CODEC_NONE && box.dst_dtype != op.dst_dtype && dtype_castable(box.dst_dtype, op.dst_dtype))
    return RX_DIGEST_CAST | op.dst_dtype << 8;
  return RX_DIGEST_AS_WRITTEN;
}

bool same_memory(const rx_box& b) {
  if (b.src != b.dst || b.src_dtype != b.dst_dtype || b.codec != RX_CODEC_NONE) return false;
  for (int i = 0; i < b.ndim; ++i)
    if (b.src_stride[i] != b.dst_stride[i]) return false;
  return true;
}

// The memory the plan's ops read and write on this rank, checked against the rules of
// ExecTables::bind before any table is built. Fills the table indices of src and dst
// pieces that share memory with the other side (their ops then never go direct).
struct Aliasing {
  std::unordered_set<int32_t> src, dst;
};

View view_of(const TensorRef& t) {
  if (t.shape.size() != t.strides.size()) return View{t.ptr, {0}, {0}, 1};  // shape not given: not checked
  View v{t.ptr, t.shape, t.strides, dtype_size(t.dtype)};
  // A codec reading blocks reads `grain` elements at each coordinate of the last dim.
  if (!v.shape.empty()) v.shape.back() = checked_mul(v.shape.back(), t.grain, "piece extent");
  return v;
}

Aliasing check_memory(const RankPlan& plan, const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst,
                      const std::vector<int32_t>& src_used, const std::vector<int32_t>& dst_used,
                      const std::unordered_map<int32_t, const TensorRef*>& src_of,
                      const std::unordered_map<int32_t, const TensorRef*>& dst_of,
                      const std::function<uint64_t(const TensorRef&, const std::vector<int64_t>&)>& addr) {
  Aliasing out;
  std::vector<View> views;  // dst pieces, then src pieces
  views.reserve(dst.size() + src.size());
  for (const auto* side : {&dst, &src})
    for (const TensorRef& t : *side) views.push_back(view_of(t));
  for (size_t i = 0; i < dst.size(); ++i)
    RX_USER_CHECK(!self_overlaps(views[i]), "dst tensor '", dst[i].name, "' on rank ", plan.rank,
                  ": its elements overlap in memory (a stride-0 / expanded view, or interleaving strides); every "
                  "destination element needs memory of its own");

  // What each piece's ops really do: a copy onto the same memory changes nothing.
  std::unordered_set<const TensorRef*> written, read, copy_written, copy_read, peer_written, peer_read;
  std::vector<bool> identity(plan.copies.size(), false);
  for (size_t i = 0; i < plan.copies.size(); ++i) {
    const TransferOp& op = plan.copies[i];
    const TensorRef& s = *src_of.at(op.src_name);
    const TensorRef& d = *dst_of.at(op.dst_name);
    identity[i] = s.codec == 0 && d.codec == 0 && s.dtype == d.dtype && s.strides == d.strides &&
                  addr(s, op.theirs.start) == addr(d, op.mine.start);
    if (identity[i]) continue;
    written.insert(&d);
    read.insert(&s);
    copy_written.insert(&d);
    copy_read.insert(&s);
  }
  for (const TransferOp& op : plan.recvs) written.insert(dst_of.at(op.dst_name));
  for (const TransferOp& op : plan.sends) read.insert(src_of.at(op.src_name));
  // Direct-backend ops (a peer writes into my dst, or I write into a peer's) run at no
  // fixed point relative to my other reads and writes.
  for (const TransferOp& op : plan.direct_recvs) peer_written.insert(dst_of.at(op.dst_name));
  for (const TransferOp& op : plan.direct_sends) peer_read.insert(src_of.at(op.src_name));
  written.insert(peer_written.begin(), peer_written.end());
  read.insert(peer_read.begin(), peer_read.end());

  // The boxes an op writes (on dst) or reads (on src): tensors that share memory are
  // fine where no written box meets a read one (a relay gather reads a replica's own
  // share of the tensor it writes the other shares of).
  auto box_view = [&](const TensorRef& t, const std::vector<int64_t>& start, const std::vector<int64_t>& size) {
    return View{addr(t, start), size, coord_strides(t), dtype_size(t.dtype)};
  };
  auto boxes_meet = [&](const TensorRef& d, const TensorRef& s) {
    if (d.codec || s.codec) return true;  // codec coordinates: no box-level answer, assume they meet
    std::vector<View> w, r;
    for (const auto* ops : {&plan.recvs, &plan.direct_recvs})
      for (const TransferOp& op : *ops)
        if (dst_of.at(op.dst_name) == &d) w.push_back(box_view(d, op.mine.start, op.mine.size));
    for (const auto* ops : {&plan.sends, &plan.direct_sends})
      for (const TransferOp& op : *ops)
        if (src_of.at(op.src_name) == &s) r.push_back(box_view(s, op.mine.start, op.mine.size));
    for (size_t i = 0; i < plan.copies.size(); ++i) {
      const TransferOp& op = plan.copies[i];
      if (identity[i]) continue;
      if (dst_of.at(op.dst_name) == &d) w.push_back(box_view(d, op.mine.start, op.mine.size));
      if (src_of.at(op.src_name) == &s) r.push_back(box_view(s, op.theirs.start, op.mine.size));
    }
    std::vector<const View*> all;
    for (const View& v : w) all.push_back(&v);
    for (const View& v : r) all.push_back(&v);
    for (const auto& [a, b] : overlapping_pairs(all))
      if (a < w.size() && b >= w.size()) return true;
    return false;
  };

  std::vector<const View*> ptrs;
  for (const View& v : views) ptrs.push_back(&v);
  const size_t nd = dst.size();
  const int32_t batches = static_cast<int32_t>(plan.batches.size());
  for (const auto& [i, j] : overlapping_pairs(ptrs)) {
    if (j < nd) {
      throw ReshardError(detail::format("dst tensors '", dst[i].name, "' and '", dst[j].name, "' on rank ", plan.rank,
                                        " share memory; every destination piece needs memory of its own"));
    }
    if (i >= nd) continue;  // two sources: reads only
    const TensorRef& d = dst[i];
    const TensorRef& s = src[j - nd];
    if (!written.count(&d) || !read.count(&s) || !boxes_meet(d, s)) continue;
    RX_USER_CHECK(!peer_written.count(&d) && !peer_read.count(&s), "dst tensor '", d.name, "' and src tensor '",
                  s.name, "' on rank ", plan.rank, " share memory and peers access them directly (direct backend): "
                  "writes could land before reads. Pass separate tensors");
    RX_USER_CHECK(batches <= 1, "dst tensor '", d.name, "' and src tensor '", s.name, "' on rank ", plan.rank,
                  " share memory and the plan has ", batches, " batches: one batch would overwrite source bytes that "
                  "a later one still sends. Pass separate tensors, or a max_batch_bytes that keeps the plan in one batch");
    RX_USER_CHECK(!(copy_written.count(&d) && copy_read.count(&s)), "dst tensor '", d.name, "' and src tensor '",
                  s.name, "' on rank ", plan.rank, " share memory and same-rank copies write the one and read the "
                  "other: the result would depend on their order. Pass separate tensors");
    out.dst.insert(dst_used[i]);
    out.src.insert(src_used[j - nd]);
  }
  return out;
}

void check_cut(int32_t r, int32_t rounds, int64_t piece) {
  RX_HOST_ASSERT(rounds >= 1 && r >= 0 && r < rounds, "bad verify round");
  RX_HOST_ASSERT(piece >= 0 && piece % ExecTables::kRoundAlign == 0, "bad verify round piece");
}

// Bytes of each pair's own messages in `msgs` (their stream, ExecTables::round_messages).
std::unordered_map<int32_t, int64_t> pair_bytes(const std::vector<Message>& msgs) {
  std::unordered_map<int32_t, int64_t> total;
  for (const Message& m : msgs)
    if (m.own) total[m.peer] = checked_add(total[m.peer], m.bytes, "bytes of a batch's messages to one peer");
  return total;
}

// The bytes [begin, end) of each message of `msgs` that round r carries (ExecTables::
// round_messages): stream bytes [c(r), c(r + 1)) of its pair, c(q) = floor(T q / rounds)
// (or q piece) for a stream of T bytes, cut inside a message down to a multiple of
// kRoundAlign from its start; other messages whole in round 0.
std::vector<std::pair<int64_t, int64_t>> round_pieces(const std::vector<Message>& msgs, int32_t r, int32_t rounds,
                                                      int64_t piece) {
  check_cut(r, rounds, piece);
  const auto total = pair_bytes(msgs);
  std::unordered_map<int32_t, int64_t> done;  // stream bytes before the message, per pair
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(msgs.size());
  for (const Message& m : msgs) {
    if (!m.own) {
      out.push_back({0, r == 0 ? m.bytes : 0});
      continue;
    }
    int64_t& before = done[m.peer];
    const int64_t t = total.at(m.peer);
    const auto cut = [&](int32_t q) -> int64_t {  // stream boundary q, as an offset into m
      int64_t c = t;
      if (q < rounds && piece > 0)
        c = q > t / piece ? t : q * piece;  // q * piece <= t: no overflow
      else if (q < rounds)
        c = t / rounds * q + t % rounds * q / rounds;  // floor(t q / rounds), no overflow
      const int64_t in = std::clamp<int64_t>(c - before, 0, m.bytes);
      return in == m.bytes ? in : in / ExecTables::kRoundAlign * ExecTables::kRoundAlign;
    };
    out.push_back({cut(r), cut(r + 1)});
    before += m.bytes;
  }
  return out;
}

}  // namespace

std::vector<Message> ExecTables::round_messages(int32_t b, bool send, int32_t r, int32_t rounds, int64_t piece) const {
  const std::vector<Message>& msgs = send ? send_msgs_[b] : recv_msgs_[b];
  const auto pieces = round_pieces(msgs, r, rounds, piece);
  std::vector<Message> out;
  for (size_t i = 0; i < msgs.size(); ++i)
    if (pieces[i].first < pieces[i].second)
      out.push_back({msgs[i].peer, msgs[i].ptr + static_cast<uint64_t>(pieces[i].first),
                     pieces[i].second - pieces[i].first});
  return out;
}

std::vector<rx_box> ExecTables::direct_round(int32_t b, bool send, int32_t r, int32_t rounds, int64_t piece) const {
  const std::vector<int32_t>& ops = send ? direct_sends_[b] : direct_recvs_[b];
  const auto& plan_ops = send ? plan_->sends : plan_->recvs;
  const std::vector<Message>& msgs = send ? send_msgs_[b] : recv_msgs_[b];
  const auto pieces = round_pieces(msgs, r, rounds, piece);
  std::vector<rx_box> out;
  // A direct op's message is the one to its peer at its box's tensor end (src for a send,
  // dst for a receive: cut_messages), in op order: a source sent to several peers, or
  // twice to one, has a message per op.
  std::map<std::pair<int32_t, uint64_t>, std::vector<size_t>> at;
  for (int32_t op : ops) {
    rx_box box = (send ? send_boxes_ : recv_boxes_)[static_cast<size_t>(op)];
    at[{plan_ops[static_cast<size_t>(op)].peer, send ? box.src : box.dst}].push_back(out.size());
    box.shape[0] = 0;  // no piece in this round unless one is found below
    out.push_back(box);
  }
  std::map<std::pair<int32_t, uint64_t>, size_t> taken;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const auto it = at.find({msgs[i].peer, msgs[i].ptr});
    if (it == at.end()) continue;  // a staging message
    size_t& next = taken[it->first];
    if (next == it->second.size()) continue;
    rx_box& box = out[it->second[next++]];
    const auto [begin, end] = pieces[i];
    if (begin == end) continue;
    const int64_t es = dtype_size(box.dst_dtype);
    box.src += static_cast<uint64_t>(begin);
    box.dst += static_cast<uint64_t>(begin);
    box.shape[0] = (end - begin) / es;
    box.param[0] = begin / es;  // its first verify ordinal (RX_BOX_FIRST_ORDINAL): a direct op is a copy
  }
  return out;
}

int32_t ExecTables::piece_rounds(int32_t b, int64_t piece) const {
  check_cut(0, 1, piece);
  RX_HOST_ASSERT(piece > 0, "bad verify round piece");
  int64_t rounds = 1;
  for (const auto* msgs : {&send_msgs_[b], &recv_msgs_[b]})
    for (const auto& [peer, t] : pair_bytes(*msgs)) rounds = std::max(rounds, t / piece + (t % piece != 0));
  RX_USER_CHECK(rounds <= INT32_MAX, "a batch of ", rounds, " verify rounds: pass a larger piece");
  return static_cast<int32_t>(rounds);
}

std::vector<std::vector<rx_box>> ExecTables::copies_split(int32_t parts) const {
  RX_USER_CHECK(parts >= 1, "copies_split: parts must be >= 1, got ", parts);
  auto bytes_of = [](const rx_box& b) {
    int64_t n = dtype_size(b.dst_dtype);
    for (int d = 0; d < b.ndim; ++d) n = checked_mul(n, b.shape[d], "bytes of a copy");
    return n;
  };
  int64_t total = 0;
  for (const rx_box& b : copies_) total = checked_add(total, bytes_of(b), "bytes of the same-rank copies");
  std::vector<std::vector<rx_box>> out(parts);
  int64_t done = 0;
  for (const rx_box& b : copies_) {
    // The part whose byte range holds this box's midpoint, shared like the batches'
    // bytes (tapered ends included): each part runs beside one batch's transfer.
    out[batch_at(done + bytes_of(b) / 2, total, parts, plan_->taper)].push_back(b);
    done += bytes_of(b);
  }
  return out;
}

void ExecTables::bind(const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst,
                      const std::vector<uint64_t>& send_bufs, const std::vector<uint64_t>& recv_bufs,
                      int64_t direct_bytes, const std::unordered_map<int32_t, ReceiverCodec>& codec_receivers) {
  RX_HOST_ASSERT(src.size() == src_used_.size() && dst.size() == dst_used_.size(), "bind: wrong tensor count");
  std::unordered_map<int32_t, const TensorRef*> src_of, dst_of;
  for (size_t i = 0; i < src.size(); ++i) src_of[src_used_[i]] = &src[i];
  for (size_t i = 0; i < dst.size(); ++i) dst_of[dst_used_[i]] = &dst[i];

  std::unordered_map<const TensorRef*, std::vector<int64_t>> strides_of;
  for (const auto* side : {&src, &dst})
    for (const TensorRef& t : *side) strides_of[&t] = coord_strides(t);
  auto addr = [&](const TensorRef& t, const std::vector<int64_t>& start) {
    return element_addr(t, strides_of.at(&t), start);
  };
  const Aliasing aliasing = check_memory(*plan_, src, dst, src_used_, dst_used_, src_of, dst_of, addr);
  // Offsets of each peer's region in each batch.
  const int32_t nb = num_batches();
  auto region_offsets = [&](bool send) {
    std::vector<std::unordered_map<int32_t, int64_t>> out(nb);
    for (int32_t b = 0; b < nb; ++b)
      for (const PeerRegion& r : send ? plan_->batches[b].sends : plan_->batches[b].recvs) out[b][r.peer] = r.offset;
    return out;
  };
  const auto send_regions = region_offsets(true), recv_regions = region_offsets(false);

  pack_.assign(nb, {});
  unpack_.assign(nb, {});
  pack_ops_.assign(nb, {});
  unpack_ops_.assign(nb, {});
  direct_sends_.assign(nb, {});
  direct_recvs_.assign(nb, {});
  send_boxes_.clear();
  recv_boxes_.clear();
  copies_.clear();
  if (nb > 0) RX_HOST_ASSERT(!send_bufs.empty() && !recv_bufs.empty(), "bind: no staging buffers");
  for (size_t i = 0; i < plan_->sends.size(); ++i) {
    const TransferOp& op = plan_->sends[i];
    const TensorRef& t = *src_of.at(op.src_name);
    const uint64_t buf = send_bufs[op.batch % send_bufs.size()] + send_regions[op.batch].at(op.peer) + op.offset;
    const uint64_t from = addr(t, op.mine.start);
    rx_box box = make_box(op.mine.size, from, strides_of.at(&t).data(), t.dtype, buf, nullptr, op.wire_dtype,
                          box_codec(&t, nullptr), box_params(t, from));
    box.digest = digest_of(op, box, op.wire_dtype, codec_receivers);
    send_boxes_.push_back(box);
    pack_[op.batch].push_back(box);
    pack_ops_[op.batch].push_back(static_cast<int32_t>(i));
  }
  for (size_t i = 0; i < plan_->recvs.size(); ++i) {
    const TransferOp& op = plan_->recvs[i];
    const TensorRef& t = *dst_of.at(op.dst_name);
    const uint64_t buf = recv_bufs[op.batch % recv_bufs.size()] + recv_regions[op.batch].at(op.peer) + op.offset;
    const uint64_t at = addr(t, op.mine.start);
    rx_box box = make_box(op.mine.size, buf, nullptr, op.wire_dtype, at, t.strides.data(), t.dtype,
                          box_codec(nullptr, &t), box_params(t, at));
    box.digest = digest_of(op, box, op.wire_dtype, codec_receivers);
    recv_boxes_.push_back(box);
    unpack_[op.batch].push_back(box);
    unpack_ops_[op.batch].push_back(static_cast<int32_t>(i));
  }
  // Messages per batch, in the canonical op order both ends share.
  send_msgs_.assign(nb, {});
  recv_msgs_.assign(nb, {});
  std::vector<std::vector<const TransferOp*>> send_ops(nb), recv_ops(nb);
  for (const TransferOp& op : plan_->sends) send_ops[op.batch].push_back(&op);
  for (const TransferOp& op : plan_->recvs) recv_ops[op.batch].push_back(&op);
  for (int32_t b = 0; b < nb; ++b) {
    cut_messages(send_ops[b], pack_[b], pack_ops_[b], /*staging_is_dst=*/true, direct_bytes, aliasing.src,
                 send_msgs_[b], direct_sends_[b]);
    cut_messages(recv_ops[b], unpack_[b], unpack_ops_[b], /*staging_is_dst=*/false, direct_bytes, aliasing.dst,
                 recv_msgs_[b], direct_recvs_[b]);
  }

  for (const TransferOp& op : plan_->copies) {
    const TensorRef& s = *src_of.at(op.src_name);
    const TensorRef& d = *dst_of.at(op.dst_name);
    const uint64_t at = addr(d, op.mine.start), from = addr(s, op.theirs.start);
    rx_box box = make_box(op.mine.size, from, strides_of.at(&s).data(), s.dtype, at, d.strides.data(), d.dtype,
                          box_codec(&s, &d), box_params(s, from, d, at));
    box.digest = digest_of(op, box, box.dst_dtype, codec_receivers);
    // A copy of memory onto itself (a relay replica's own share) is dropped.
    if (!same_memory(box)) copies_.push_back(box);
  }
}

void ExecTables::bind_direct(const std::vector<TensorRef>& src, const std::vector<PeerPiece>& pieces,
                             int64_t stage_bytes) {
  RX_HOST_ASSERT(src.size() == src_used_.size(), "bind_direct: wrong tensor count");
  std::unordered_map<int32_t, const TensorRef*> src_of;
  for (size_t i = 0; i < src.size(); ++i) src_of[src_used_[i]] = &src[i];
  auto key = [](int32_t peer, int32_t name) { return (static_cast<int64_t>(peer) << 32) | static_cast<uint32_t>(name); };
  std::unordered_map<int64_t, const TensorRef*> dst_of;
  for (const PeerPiece& p : pieces) dst_of[key(p.peer, p.dst_name)] = &p.ref;
  direct_.clear();
  direct_ops_.clear();
  direct_stageable_.clear();
  direct_ordinals_.clear();
  std::vector<TransferOp> parts;
  for (size_t i = 0; i < plan_->direct_sends.size(); ++i) {
    const TransferOp& op = plan_->direct_sends[i];
    const TensorRef& s = *src_of.at(op.src_name);
    auto it = dst_of.find(key(op.peer, op.dst_name));
    RX_HOST_ASSERT(it != dst_of.end(), "bind_direct: no piece of dst tensor ", op.dst_name, " from rank ", op.peer);
    const TensorRef& d = *it->second;
    const bool stageable = s.codec != 0;  // box_codec: then d is plain
    const std::vector<int64_t> ss = coord_strides(s), ds = coord_strides(d);
    parts.clear();
    if (stageable && stage_bytes > 0) {
      TransferOp written = op;  // cut by the bytes it writes (d's elements)
      written.nbytes = checked_mul(op.numel, dtype_size(d.dtype), "bytes of a box");
      split_op(written, stage_bytes, dtype_size(d.dtype), parts);
    } else {
      parts.push_back(op);
    }
    int64_t ordinal = 0;  // split_op's pieces are consecutive runs of the op's row-major order
    for (const TransferOp& part : parts) {
      const uint64_t at = element_addr(d, ds, part.theirs.start), from = element_addr(s, ss, part.mine.start);
      direct_.push_back(make_box(part.mine.size, from, ss.data(), s.dtype, at, d.strides.data(), d.dtype,
                                 box_codec(&s, &d), box_params(s, from, d, at)));
      direct_ops_.push_back(static_cast<int32_t>(i));
      direct_stageable_.push_back(stageable ? 1 : 0);
      direct_ordinals_.push_back(ordinal);
      ordinal += part.numel;
    }
  }
}

std::vector<std::pair<int32_t, int32_t>> ExecTables::direct_recv_pieces() const {
  std::unordered_map<int32_t, int32_t> pos;
  for (size_t i = 0; i < dst_used_.size(); ++i) pos[dst_used_[i]] = static_cast<int32_t>(i);
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const TransferOp& op : plan_->direct_recvs) out.emplace_back(op.peer, pos.at(op.dst_name));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int32_t> ExecTables::whole_group_dsts(const std::vector<int32_t>& src_dtypes, int64_t group,
                                                  int32_t dtype) const {
  RX_HOST_ASSERT(src_dtypes.size() == src_used_.size() && group > 0, "whole_group_dsts: bad arguments");
  std::unordered_map<int32_t, int32_t> src_dtype;
  for (size_t i = 0; i < src_used_.size(); ++i) src_dtype[src_used_[i]] = src_dtypes[i];
  std::unordered_map<int32_t, bool> whole;  // by dst table index
  auto note = [&](const TransferOp& op, int32_t reads) {
    const std::vector<int64_t>& start = op.mine.start;
    const bool ok = !start.empty() && reads == dtype && start.back() % group == 0 && op.mine.size.back() % group == 0;
    auto it = whole.emplace(op.dst_name, true).first;
    it->second = it->second && ok;
  };
  // A direct receive reads the source tensor itself: split_direct made its wire_dtype that.
  for (const auto* ops : {&plan_->recvs, &plan_->direct_recvs})
    for (const TransferOp& op : *ops) note(op, op.wire_dtype);
  for (const TransferOp& op : plan_->copies) note(op, src_dtype.at(op.src_name));
  std::vector<int32_t> out;
  for (size_t i = 0; i < dst_used_.size(); ++i) {
    auto it = whole.find(dst_used_[i]);
    if (it == whole.end() || it->second) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

}  // namespace rx
