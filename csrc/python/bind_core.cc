// Layouts, the planner, metadata encoding and descriptor tables.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "common/check.h"
#include "common/dtype.h"
#include "core/direct.h"
#include "core/exec_tables.h"
#include "core/layout.h"
#include "core/metadata.h"
#include "core/planner.h"
#include "core/relay.h"
#include "kernels/api.h"
#include "kernels/codecs/registry.h"
#include "kernels/digest.h"
#include "python/box_table.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

namespace {

py::list piece_to_py(const Piece& piece) {
  py::list dims;
  for (const Runs& runs : piece) {
    py::list l;
    for (const Run& r : runs) l.append(py::make_tuple(r.start, r.len));
    dims.append(l);
  }
  return dims;
}

py::list ops_to_py(const std::vector<TransferOp>& ops) {
  py::list l(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) l[i] = py::cast(ops[i]);  // PlannedOp copies
  return l;
}

// The fields Python reads (what the digest check, the plan summary and the tests compare).
auto op_fields(const TransferOp& op) {
  return std::tie(op.dst_name, op.src_name, op.peer, op.mine.start, op.mine.size, op.theirs.start, op.global,
                  op.nbytes, op.batch, op.offset, op.wire_dtype);
}

void bind_planned_op(py::module_& m) {
  py::class_<TransferOp>(m, "PlannedOp", "One op of a RankPlan (read-only): a send, a receive or a same-rank copy")
      .def_readonly("dst_name", &TransferOp::dst_name, "index into the dst layout table")
      .def_readonly("src_name", &TransferOp::src_name, "index into the src layout table")
      .def_readonly("peer", &TransferOp::peer, "the other rank (this rank for a copy)")
      .def_property_readonly("mine_start", [](const TransferOp& op) { return op.mine.start; },
                             "the box's origin in this rank's piece (the src piece of a send, else the dst piece)")
      .def_property_readonly("size", [](const TransferOp& op) { return op.mine.size; })
      .def_property_readonly("theirs_start", [](const TransferOp& op) { return op.theirs.start; },
                             "the box's origin in the peer's piece (a copy: the src piece)")
      .def_readonly("global_start", &TransferOp::global, "the box's origin in the global tensor")
      .def_readonly("nbytes", &TransferOp::nbytes, "bytes on the wire")
      .def_readonly("batch", &TransferOp::batch)
      .def_readonly("offset", &TransferOp::offset, "byte offset in the peer's region of its batch's staging")
      .def_readonly("wire_dtype", &TransferOp::wire_dtype)
      .def("__eq__", [](const TransferOp& a, const TransferOp& b) { return op_fields(a) == op_fields(b); })
      .def("__repr__", [](const TransferOp& op) {
        return "PlannedOp(dst_name=" + std::to_string(op.dst_name) + ", peer=" + std::to_string(op.peer) +
               ", nbytes=" + std::to_string(op.nbytes) + ", batch=" + std::to_string(op.batch) + ")";
      });
}

BoxTable box_table(std::vector<rx_box> v) { return BoxTable{std::move(v)}; }

void run_cpu(const std::vector<rx_box>& v) {
  int32_t rc;
  {
    py::gil_scoped_release release;
    rc = rx_copy_boxes_cpu(v.data(), static_cast<int64_t>(v.size()));
  }
  RX_HOST_ASSERT(rc == 0, "bad box in table");
}

// A verify pass of the CPU twin over `v`, writing box k's digest into out[ops[k]]
// (ops: the plan op of each box; empty: box k is op k). out: a writable uint64 array.
void digest_cpu(const std::vector<rx_box>& v, int32_t pass, const std::vector<int32_t>& ops, py::array_t<uint64_t>& out,
                bool accumulate = false) {
  auto o = out.mutable_unchecked<1>();
  std::vector<uint64_t> d(v.size(), 0);
  int32_t rc;
  {
    py::gil_scoped_release release;
    rc = rx_digest_boxes_cpu(v.data(), static_cast<int64_t>(v.size()), pass, d.data());
  }
  RX_HOST_ASSERT(rc == 0, "bad box in table");
  for (size_t k = 0; k < v.size(); ++k) {
    const int64_t at = ops.empty() ? static_cast<int64_t>(k) : ops[k];
    RX_HOST_ASSERT(at < o.shape(0), "digest array too short");
    o(at) = accumulate ? digest::add(o(at), d[k]) : d[k];
  }
}

// The boxes of `ops` (plan op indices) out of a per-op box list.
std::vector<rx_box> pick(const std::vector<rx_box>& boxes, const std::vector<int32_t>& ops) {
  std::vector<rx_box> v;
  v.reserve(ops.size());
  for (int32_t i : ops) v.push_back(boxes[static_cast<size_t>(i)]);
  return v;
}

TensorRef checked_ref(TensorRef r) {
  const std::string why = tensor_ref_error(r);
  if (!why.empty()) throw ReshardError(why);
  return r;
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string ints(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string ref_repr(const TensorRef& r) {
  std::string out = "TensorRef(" + hex(r.ptr) + ", " + ints(r.strides) + ", " + std::to_string(r.dtype) + " (" +
                    dtype_name(r.dtype) + ")";
  if (r.codec) out += ", codec=" + hex(static_cast<uint32_t>(r.codec)) + ", side=" + hex(r.side) +
                      ", arg=" + std::to_string(r.arg) + ", grain=" + std::to_string(r.grain);
  if (!r.shape.empty()) out += ", shape=" + ints(r.shape);
  if (!r.name.empty()) out += ", name=" + py::repr(py::str(r.name)).cast<std::string>();
  return out + ")";
}

auto ref_fields(const TensorRef& r) {
  return std::tie(r.ptr, r.strides, r.dtype, r.codec, r.side, r.arg, r.grain, r.shape, r.name);
}

// The records that cross between Python and the tables: a bound tensor piece, a receiver's
// piece as a direct sender maps it, a receiver-side conversion and a message of a batch.
void register_pieces(py::module_& m) {
  py::class_<TensorRef>(m, "TensorRef",
                        "One bound tensor piece as the kernels address it (TensorRef, core/exec_tables.h); checked "
                        "when made: raises ReshardError for an unknown dtype code, strides that do not match "
                        "`shape`, grain < 1 or codec fields without a codec.")
      // shape and name, which every bound piece has, may go by position
      .def(py::init([](uint64_t ptr, std::vector<int64_t> strides, int32_t dtype, std::vector<int64_t> shape,
                       std::string name, int32_t codec, uint64_t side, int64_t arg, int64_t grain) {
             return checked_ref(TensorRef{ptr, std::move(strides), dtype, std::move(shape), std::move(name), codec,
                                          side, arg, grain});
           }),
           py::arg("ptr"), py::arg("strides"), py::arg("dtype"), py::arg("shape") = std::vector<int64_t>{},
           py::arg("name") = "", py::kw_only(), py::arg("codec") = 0, py::arg("side") = 0, py::arg("arg") = 0,
           py::arg("grain") = 1)
      .def_static(
          "many",
          [](const std::vector<uint64_t>& ptrs, std::vector<std::vector<int64_t>> strides,
             const std::vector<int32_t>& dtypes, std::vector<std::vector<int64_t>> shapes,
             std::vector<std::string> names) {
            const size_t n = ptrs.size();
            RX_HOST_ASSERT(strides.size() == n && dtypes.size() == n && shapes.size() == n && names.size() == n,
                           "TensorRef.many: field lists of different lengths");
            py::list out(n);
            for (size_t i = 0; i < n; ++i)
              out[i] = py::cast(checked_ref(TensorRef{ptrs[i], std::move(strides[i]), dtypes[i], std::move(shapes[i]),
                                                      std::move(names[i])}));
            return out;
          },
          py::arg("ptrs"), py::arg("strides"), py::arg("dtypes"), py::arg("shapes"), py::arg("names"),
          "The plain refs of many pieces, field by field (one call: a plan makes one per bound tensor, and "
          "each constructor call costs pybind11's dispatch); each checked as the constructor checks it")
      .def_readonly("ptr", &TensorRef::ptr, "address of element 0")
      .def_readonly("strides", &TensorRef::strides, "in elements")
      .def_readonly("dtype", &TensorRef::dtype, "rx dtype code")
      .def_readonly("codec", &TensorRef::codec, "rx_box.codec fused into the piece's boxes (0: plain)")
      .def_readonly("side", &TensorRef::side, "a dst codec's side buffer (MXFP8: scales)")
      .def_readonly("arg", &TensorRef::arg, "a dst codec's argument (MXFP8: the data rows' length)")
      .def_readonly("grain", &TensorRef::grain, "elements at ptr per coordinate of the last dim")
      .def_readonly("shape", &TensorRef::shape, "the piece's shape; empty: unknown (no memory checks)")
      .def_readonly("name", &TensorRef::name)
      .def(
          "replace",
          [](const TensorRef& r, std::optional<uint64_t> ptr, std::optional<uint64_t> side,
             std::optional<std::vector<int64_t>> shape, std::optional<std::string> name) {
            TensorRef out = r;
            if (ptr) out.ptr = *ptr;
            if (side) out.side = *side;
            if (shape) out.shape = std::move(*shape);
            if (name) out.name = std::move(*name);
            return checked_ref(std::move(out));
          },
          py::kw_only(), py::arg("ptr") = py::none(), py::arg("side") = py::none(), py::arg("shape") = py::none(),
          py::arg("name") = py::none(),
          "A copy with the given fields replaced: the piece at a peer's mapping of its memory, or named")
      .def("__repr__", &ref_repr)
      .def("__eq__", [](const TensorRef& a, const TensorRef& b) { return ref_fields(a) == ref_fields(b); },
           py::is_operator())
      .def(py::pickle(
          [](const TensorRef& r) {
            return py::make_tuple(r.ptr, r.strides, r.dtype, r.codec, r.side, r.arg, r.grain, r.shape, r.name);
          },
          [](const py::tuple& t) {
            RX_HOST_ASSERT(t.size() == 9, "TensorRef state has 9 fields, got ", t.size());
            return checked_ref(TensorRef{t[0].cast<uint64_t>(), t[1].cast<std::vector<int64_t>>(),
                                         t[2].cast<int32_t>(), t[7].cast<std::vector<int64_t>>(),
                                         t[8].cast<std::string>(), t[3].cast<int32_t>(), t[4].cast<uint64_t>(),
                                         t[5].cast<int64_t>(), t[6].cast<int64_t>()});
          }));

  py::class_<PeerPiece>(m, "PeerPiece",
                        "A receiver's dst piece as a direct sender writes it (ExecTables.bind_direct): ref in the "
                        "sender's mapping of the receiver's memory")
      .def(py::init([](int32_t peer, int32_t dst_name, TensorRef ref) {
             return PeerPiece{peer, dst_name, std::move(ref)};
           }),
           py::arg("peer"), py::arg("dst_name"), py::arg("ref"))
      .def_readonly("peer", &PeerPiece::peer, "the receiver's group rank")
      .def_readonly("dst_name", &PeerPiece::dst_name, "dst table index")
      .def_readonly("ref", &PeerPiece::ref)
      .def("__repr__", [](const PeerPiece& p) {
        return "PeerPiece(" + std::to_string(p.peer) + ", " + std::to_string(p.dst_name) + ", " + ref_repr(p.ref) +
               ")";
      });

  py::class_<ReceiverCodec>(m, "ReceiverCodec",
                            "How the receiver of a dst converts it after it lands (ReceiverCodec, "
                            "core/exec_tables.h): what verify digests of the boxes into it cover")
      .def(py::init([](int32_t digest, int64_t grain, int32_t dtype) {
             RX_USER_CHECK(grain >= 1, "ReceiverCodec: grain must be >= 1, got ", grain);
             RX_USER_CHECK(dtype_size(dtype) != 0, "ReceiverCodec: unknown dtype code ", dtype);
             return ReceiverCodec{digest, grain, dtype};
           }),
           py::arg("digest"), py::arg("grain"), py::arg("dtype"))
      .def_readonly("digest", &ReceiverCodec::digest, "rx_box.digest of a copy into the tensor (RX_DIGEST_CODEC)")
      .def_readonly("grain", &ReceiverCodec::grain, "the codec's block along the last dim")
      .def_readonly("dtype", &ReceiverCodec::dtype, "the rx dtype code the boxes must read")
      .def("__repr__", [](const ReceiverCodec& c) {
        return "ReceiverCodec(digest=" + hex(static_cast<uint32_t>(c.digest)) + ", grain=" + std::to_string(c.grain) +
               ", dtype=" + std::to_string(c.dtype) + ")";
      })
      .def("__eq__", [](const ReceiverCodec& a, const ReceiverCodec& b) {
        return std::tie(a.digest, a.grain, a.dtype) == std::tie(b.digest, b.grain, b.dtype);
      }, py::is_operator());

  py::class_<Message>(m, "Message", "One point-to-point message of a batch (Message, core/exec_tables.h)")
      .def(py::init([](int32_t peer, uint64_t ptr, int64_t bytes, bool own) { return Message{peer, ptr, bytes, own}; }),
           py::arg("peer"), py::arg("ptr"), py::arg("bytes"), py::kw_only(), py::arg("own") = false)
      .def_readonly("peer", &Message::peer, "group rank of the other end")
      .def_readonly("ptr", &Message::ptr, "address of the bytes: staging, or the tensor itself")
      .def_readonly("bytes", &Message::bytes)
      .def_readonly("own", &Message::own, "one op of at least direct_bytes alone")
      .def("__repr__", [](const Message& x) {
        return "Message(peer=" + std::to_string(x.peer) + ", ptr=" + hex(x.ptr) + ", bytes=" + std::to_string(x.bytes) +
               (x.own ? ", own=True)" : ")");
      })
      .def("__eq__", [](const Message& a, const Message& b) {
        return std::tie(a.peer, a.ptr, a.bytes, a.own) == std::tie(b.peer, b.ptr, b.bytes, b.own);
      }, py::is_operator());
}

// Core builds codec boxes without reading their codec's fields: the codec's own checks
// (kernels/codecs/registry.h) run here, at bind, before any box is used.
void check_codec_boxes(const std::vector<rx_box>& v) {
  for (const rx_box& b : v)
    RX_HOST_ASSERT(rx_codec_valid(&b), "bind: bad box for codec ", b.codec, ": innermost extent ",
                   b.shape[b.ndim - 1], ", strides ", b.src_stride[b.ndim - 1], "/", b.dst_stride[b.ndim - 1],
                   ", dtypes ", b.src_dtype, "->", b.dst_dtype, ", params ", b.param[0], "/", b.param[1], "/",
                   b.param[2]);
}

void check_codec_boxes(const ExecTables& t) {
  check_codec_boxes(t.send_boxes());
  check_codec_boxes(t.recv_boxes());
  check_codec_boxes(t.copies());
}

}  // namespace

void register_core(py::module_& m) {
  register_pieces(m);
  bind_planned_op(m);
  py::class_<Mesh, std::shared_ptr<Mesh>>(m, "Mesh")
      .def(py::init<std::vector<int64_t>, std::vector<int32_t>>(), py::arg("shape"), py::arg("ranks"))
      .def_property_readonly("shape", &Mesh::shape)
      .def_property_readonly("ranks", &Mesh::ranks)
      .def_property_readonly("error", &Mesh::error)
      .def("position", &Mesh::position)
      .def("describe", &Mesh::describe);

  py::class_<Placement>(m, "Placement")
      .def(py::init([](int32_t dim, int64_t stride, std::vector<int64_t> blocks, std::vector<int64_t> sizes) {
             return Placement{dim, stride, std::move(blocks), std::move(sizes)};
           }),
           py::arg("shard_dim"), py::arg("stride") = 1, py::arg("blocks") = std::vector<int64_t>{},
           py::arg("sizes") = std::vector<int64_t>{})
      .def_readonly("shard_dim", &Placement::shard_dim)
      .def_readonly("stride", &Placement::stride)
      .def_readonly("blocks", &Placement::blocks)
      .def_readonly("sizes", &Placement::sizes)
      .def_static("replicate", [] { return Placement{}; }, "The placement of a Replicate mesh dim.");

  py::class_<Layout, std::shared_ptr<Layout>>(m, "Layout")
      .def(py::init([](std::vector<int64_t> shape, int32_t dtype, std::shared_ptr<Mesh> mesh,
                       std::vector<Placement> placements) {
             return std::make_shared<Layout>(std::move(shape), dtype, std::move(mesh), std::move(placements));
           }),
           py::arg("shape"), py::arg("dtype"), py::arg("mesh"), py::arg("placements"))
      .def_property_readonly("error", &Layout::error)
      .def_property_readonly("num_classes", &Layout::num_classes)
      .def_property_readonly("numel", &Layout::numel)
      .def_property_readonly("dtype", &Layout::dtype)
      .def("describe", &Layout::describe)
      .def("same_as", &Layout::same_as)
      .def(
          "piece",
          [](const Layout& l, int32_t rank) -> py::object {
            RX_USER_CHECK(l.error().empty(), "invalid layout: ", l.error());
            Piece p;
            if (!l.piece_of(rank, &p)) return py::none();
            return piece_to_py(p);
          },
          "Per-dim runs [(global_start, len), ...] of `rank`'s piece, or None outside the mesh.");

  py::class_<LayoutTable, std::shared_ptr<LayoutTable>>(m, "LayoutTable")
      .def(py::init([](const std::vector<std::pair<std::string, std::shared_ptr<Layout>>>& entries) {
        std::vector<std::pair<std::string, std::shared_ptr<const Layout>>> e(entries.begin(), entries.end());
        return std::make_shared<LayoutTable>(std::move(e));
      }))
      .def("__len__", &LayoutTable::size)
      .def("name", &LayoutTable::name)
      .def("find", &LayoutTable::find)
      .def("names", [](const LayoutTable& t) {
        std::vector<std::string> v;
        for (int32_t i = 0; i < t.size(); ++i) v.push_back(t.name(i));
        return v;
      })
      .def("held_by", [](const LayoutTable& t, int32_t rank) {
        std::vector<std::string> v;
        for (int32_t i = 0; i < t.size(); ++i)
          if (t.layout(i).mesh().position(rank) >= 0) v.push_back(t.name(i));
        return v;
      }, "Names whose mesh contains `rank`.")
      .def("layout", [](const LayoutTable& t, int32_t i) { return std::const_pointer_cast<Layout>(t.layout_ptr(i)); });

  m.def("check_tables", &check_tables, py::arg("src"), py::arg("dst"), py::arg("world_size"));
  m.def("relay_splits", &relay_splits, py::arg("src"), py::arg("dst"),
        "(dst table index, split dim) of every dst tensor whose refit relays (core/relay.h).");

  py::class_<RankPlan, std::shared_ptr<RankPlan>>(m, "RankPlan")
      .def_readonly("rank", &RankPlan::rank)
      .def_readonly("send_digest", &RankPlan::send_digest)
      .def_readonly("recv_digest", &RankPlan::recv_digest)
      .def_readwrite("taper", &RankPlan::taper)
      .def_readwrite("region_align", &RankPlan::region_align)
      .def_readwrite("fineness", &RankPlan::fineness)
      .def_property_readonly_static("max_batches", [](py::object) { return RankPlan::kMaxBatches; })
      .def("wanted_batches", &RankPlan::wanted_batches)
      .def("staging_bytes", &RankPlan::staging_bytes, py::arg("buffers") = 1)
      .def("batches_within", &RankPlan::batches_within, py::arg("limit"), py::arg("buffers") = 1,
           py::call_guard<py::gil_scoped_release>(),
           "The fewest batches found whose staging (buffers x (largest send + largest receive batch)) fits "
           "`limit`; 0 when none does.")
      .def("fitting_counts", &RankPlan::fitting_counts, py::arg("limit"), py::arg("buffers"), py::arg("first"),
           py::call_guard<py::gil_scoped_release>(),
           "Bit i set: first + i batches fit `limit` (batches_within's rule), for i < 64.")
      .def("assign_batches", &RankPlan::assign_batches)
      .def_property_readonly("num_batches", [](const RankPlan& p) { return p.batches.size(); })
      .def("send_total", &RankPlan::send_total)
      .def("recv_total", &RankPlan::recv_total)
      .def("copy_total", &RankPlan::copy_total)
      .def_property_readonly("num_ops", [](const RankPlan& p) {
        return py::make_tuple(p.sends.size(), p.recvs.size(), p.copies.size());
      })
      .def("sends", [](const RankPlan& p) { return ops_to_py(p.sends); }, "[PlannedOp], sorted by peer")
      .def("recvs", [](const RankPlan& p) { return ops_to_py(p.recvs); })
      .def("copies", [](const RankPlan& p) { return ops_to_py(p.copies); })
      .def("direct_sends", [](const RankPlan& p) { return ops_to_py(p.direct_sends); })
      .def("direct_recvs", [](const RankPlan& p) { return ops_to_py(p.direct_recvs); })
      .def("batch_bytes", [](const RankPlan& p, int32_t k) {
        py::list l;
        for (const auto& b : p.batch_layouts(k)) l.append(py::make_tuple(b.send_bytes, b.recv_bytes));
        return l;
      }, py::arg("k"), "(send, recv) staging bytes of each batch that assign_batches(k) would give, without cutting ops")
      .def("fanout", [](const RankPlan& p) {
        std::vector<int64_t> sizes, bytes;
        std::vector<int32_t> receivers;
        for (const auto& f : send_fanout(p)) {
          sizes.push_back(static_cast<int64_t>(f.receivers.size()));
          bytes.push_back(f.bytes);
          receivers.insert(receivers.end(), f.receivers.begin(), f.receivers.end());
        }
        return py::make_tuple(sizes, bytes, receivers);
      }, "(sizes, bytes, receivers): sends grouped by the boxes they carry (rx::send_fanout), group i going to "
         "the next sizes[i] ranks of receivers, bytes[i] to each")
      .def("send_pairs", [](const RankPlan& p) {
        std::vector<int32_t> peers;
        std::vector<int64_t> bytes;
        for (const auto& d : p.digests)
          if (d.from == p.rank) peers.push_back(d.to), bytes.push_back(d.bytes);
        return py::make_tuple(peers, bytes);
      }, "(peers, bytes): what this rank sends to each other rank")
      .def("digests", [](const RankPlan& p) {
        py::list l;
        for (const auto& d : p.digests) l.append(py::make_tuple(d.from, d.to, d.count, d.bytes, d.hash));
        return l;
      });

  m.def(
      "plan_rank",
      [](const LayoutTable& src, const LayoutTable& dst, int32_t rank, int64_t max_batch_bytes,
         const std::unordered_map<int32_t, int64_t>& grains) {
        py::gil_scoped_release release;
        return std::make_shared<RankPlan>(plan_rank(src, dst, rank, max_batch_bytes, grains));
      },
      py::arg("src"), py::arg("dst"), py::arg("rank"), py::arg("max_batch_bytes") = 0,
      py::arg("grains") = std::unordered_map<int32_t, int64_t>{},
      "grains: {dst table index: cut grain of its last dim} (a codec's block; PLAIN_GRAIN for the others).");
  m.attr("PLAIN_GRAIN") = kPlainGrain;

  m.def(
      "split_direct",
      [](const RankPlan& plan, const LayoutTable& src, const std::vector<int32_t>& peers) {
        return std::make_shared<RankPlan>(split_direct(plan, src, peers));
      },
      py::arg("plan"), py::arg("src"), py::arg("peers"),
      "A copy of `plan` whose ops with `peers` are direct (written straight into the receiver's tensor); "
      "call assign_batches on it with the agreed batch count.");

  m.def("encode_entries", [](const std::vector<std::tuple<int, std::string, std::shared_ptr<Layout>>>& entries) {
    std::vector<LayoutEntry> e;
    e.reserve(entries.size());
    for (const auto& [side, name, layout] : entries) e.push_back({static_cast<uint8_t>(side), name, layout});
    return py::bytes(encode_entries(e));
  });
  m.def("decode_entries", [](const std::vector<std::string>& blobs) {
    std::vector<LayoutEntry> e;
    {
      py::gil_scoped_release release;
      e = decode_entries(blobs);
    }
    py::list out;
    for (auto& x : e) out.append(py::make_tuple(static_cast<int>(x.side), x.name, std::const_pointer_cast<Layout>(x.layout)));
    return out;
  });


  py::class_<ExecTables, std::shared_ptr<ExecTables>>(m, "ExecTables")
      .def(py::init<std::shared_ptr<const RankPlan>>())
      .def_property_readonly("src_used", &ExecTables::src_used)
      .def_property_readonly("dst_used", &ExecTables::dst_used)
      .def_property_readonly("num_batches", &ExecTables::num_batches)
      .def_property_readonly("send_buffer_bytes", &ExecTables::send_buffer_bytes)
      .def_property_readonly("recv_buffer_bytes", &ExecTables::recv_buffer_bytes)
      .def("bind",
           [](ExecTables& t, const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst,
              const std::vector<uint64_t>& send_bufs, const std::vector<uint64_t>& recv_bufs, int64_t direct_bytes,
              const std::unordered_map<int32_t, ReceiverCodec>& codec_receivers) {
             t.bind(src, dst, send_bufs, recv_bufs, direct_bytes, codec_receivers);
             check_codec_boxes(t);
           },
           py::arg("src"), py::arg("dst"), py::arg("send_bufs"), py::arg("recv_bufs"), py::arg("direct_bytes") = 0,
           py::arg("codec_receivers") = std::unordered_map<int32_t, ReceiverCodec>{},
           "src/dst: TensorRefs aligned with src_used/dst_used; codec_receivers: {dst table index: "
           "ReceiverCodec} of the tensors the receiver converts with a codec after they land "
           "(verify digests cover the converted bytes); raises ReshardError where pieces break the memory rules")
      .def("whole_group_dsts", &ExecTables::whole_group_dsts, py::arg("src_dtypes"), py::arg("group"),
           py::arg("dtype"),
           "Positions in dst_used of the pieces whose every incoming box reads `dtype` and keeps "
           "`group`-element blocks of the last dim whole (where a block codec's dst may bind).")
      .def("messages", [](const ExecTables& t, int32_t b) {
        // copies: the tables rebuild their message lists when the plan binds again
        const auto copy = py::return_value_policy::copy;
        return py::make_tuple(py::cast(t.send_messages(b), copy), py::cast(t.recv_messages(b), copy));
      }, py::arg("b"), "([Message] sends, [Message] recvs) of batch b, in the order both ends post them")
      .def("round_messages", [](const ExecTables& t, int32_t b, int32_t r, int32_t rounds, int64_t piece) {
        return py::make_tuple(t.round_messages(b, true, r, rounds, piece), t.round_messages(b, false, r, rounds, piece));
      }, py::arg("b"), py::arg("r"), py::arg("rounds"), py::arg("piece") = 0,
      "messages(b) of verify round r of `rounds` (or of `piece` bytes: ExecTables::round_messages)")
      .def("piece_rounds", &ExecTables::piece_rounds, py::arg("b"), py::arg("piece"),
           "This rank's verify rounds of batch b when messages are cut into `piece` bytes")
      .def("direct_recv_round_boxes",
           [](const ExecTables& t, int32_t b, int32_t r, int32_t rounds, int64_t piece) {
             return box_table(t.direct_round(b, false, r, rounds, piece));
           },
           py::arg("b"), py::arg("r"), py::arg("rounds"), py::arg("piece") = 0,
           "Aligned with direct_recvs(b): the piece of each direct receive landing in verify round r")
      .def("direct_send_round_boxes",
           [](const ExecTables& t, int32_t b, int32_t r, int32_t rounds, int64_t piece) {
             return box_table(t.direct_round(b, true, r, rounds, piece));
           },
           py::arg("b"), py::arg("r"), py::arg("rounds"), py::arg("piece") = 0,
           "Aligned with direct_sends(b): the piece of each direct send leaving in verify round r")
      .def("digest_direct_recv_round_cpu",
           [](const ExecTables& t, int32_t b, int32_t r, int32_t rounds, py::array_t<uint64_t>& recv, int64_t piece) {
             digest_cpu(t.direct_round(b, false, r, rounds, piece), RX_PASS_DST, t.direct_recvs(b), recv, true);
           },
           py::arg("b"), py::arg("r"), py::arg("rounds"), py::arg("recv"), py::arg("piece") = 0,
           "Adds the digests of the direct-receive pieces that landed in verify round r into recv[op]")
      .def("digest_direct_send_round_cpu",
           [](const ExecTables& t, int32_t b, int32_t r, int32_t rounds, py::array_t<uint64_t>& send, int64_t piece) {
             digest_cpu(t.direct_round(b, true, r, rounds, piece), RX_PASS_SRC, t.direct_sends(b), send, true);
           },
           py::arg("b"), py::arg("r"), py::arg("rounds"), py::arg("send"), py::arg("piece") = 0,
           "Adds the digests of the direct-send pieces that leave in verify round r (reading their source) into "
           "send[op]")
      .def_property_readonly("send_total", [](const ExecTables& t) { return t.plan().send_total(); })
      .def_property_readonly("recv_total", [](const ExecTables& t) { return t.plan().recv_total(); })
      .def_property_readonly("copy_total", [](const ExecTables& t) { return t.plan().copy_total(); })
      .def_property_readonly("num_ops", [](const ExecTables& t) {
        return py::make_tuple(t.plan().sends.size(), t.plan().recvs.size(), t.plan().copies.size());
      })
      .def("pack_boxes", [](const ExecTables& t, int32_t b) { return box_table(t.pack(b)); })
      .def("unpack_boxes", [](const ExecTables& t, int32_t b) { return box_table(t.unpack(b)); })
      .def("copy_boxes", [](const ExecTables& t) { return box_table(t.copies()); })
      .def("copy_boxes_split", [](const ExecTables& t, int32_t parts) {
        py::list l;
        for (const auto& part : t.copies_split(parts)) l.append(box_table(part));
        return l;
      }, py::arg("parts"), "copy_boxes cut into `parts` tables of about equal bytes, in order")
      .def(
          "bind_direct",
          [](ExecTables& t, const std::vector<TensorRef>& src, const std::vector<PeerPiece>& pieces,
             int64_t stage_bytes) {
            t.bind_direct(src, pieces, stage_bytes);
            check_codec_boxes(t.direct());
          },
          py::arg("src"), py::arg("pieces"), py::arg("stage_bytes") = 0,
          "src: as for bind; pieces: the PeerPiece of every receiver piece this rank writes into directly, its ref "
          "in this process's addresses; stage_bytes > 0: ops of stageable boxes cut to write at most that much each")
      .def("direct_boxes", [](const ExecTables& t) { return box_table(t.direct()); })
      .def("direct_stageable", [](const ExecTables& t) { return t.direct_stageable(); },
           "Whether each direct box (aligned with direct_boxes) may be staged: its codec belongs to its source")
      .def("direct_ordinals", [](const ExecTables& t) { return t.direct_ordinals(); },
           "The verify ordinal of each direct box's first element within its send op (0: a whole op)")
      .def("direct_ops", [](const ExecTables& t) { return t.direct_ops(); },
           "The direct send op (index into the plan's direct sends) each direct box moves (part of)")
      .def("direct_landing_groups",
           [](const ExecTables& t, int32_t groups) {
             const std::vector<int32_t> of_op = landing_groups(t.plan().direct_sends, groups);
             std::vector<int32_t> out;
             for (int32_t op : t.direct_ops()) out.push_back(of_op[static_cast<size_t>(op)]);
             return out;
           },
           py::arg("groups"), "The landing group of each direct box (that of its send op; core/direct.h)")
      .def("landing_runs",
           [](const ExecTables& t, const std::vector<int32_t>& senders, int32_t groups) {
             return landing_runs(t.plan().recvs, senders, groups);
           },
           py::arg("senders"), py::arg("groups"),
           "[begin, end) runs of recv ops per landing group of the direct `senders`; the last entry: other peers")
      .def("direct_recv_pieces", &ExecTables::direct_recv_pieces,
           "(peer, position in dst_used) of every dst piece a peer writes into directly")
      .def_property_readonly("direct_send_total", [](const ExecTables& t) { return t.plan().direct_send_total(); })
      .def_property_readonly("direct_recv_total", [](const ExecTables& t) { return t.plan().direct_recv_total(); })
      .def_property_readonly("num_direct_ops", [](const ExecTables& t) {
        return py::make_tuple(t.plan().direct_sends.size(), t.plan().direct_recvs.size());
      })
      .def("run_direct_cpu", [](const ExecTables& t) { run_cpu(t.direct()); })
      .def("run_copies_cpu", [](const ExecTables& t) { run_cpu(t.copies()); })
      .def("run_pack_cpu", [](const ExecTables& t, int32_t b) { run_cpu(t.pack(b)); })
      .def("run_unpack_cpu", [](const ExecTables& t, int32_t b) { run_cpu(t.unpack(b)); })
      // verify (ExecTables: digests per plan op)
      .def("pack_ops", &ExecTables::pack_ops, "Plan send op of each pack_boxes(b) box")
      .def("unpack_ops", &ExecTables::unpack_ops, "Plan recv op of each unpack_boxes(b) box")
      .def("direct_sends", &ExecTables::direct_sends, "Send ops of batch b moved as direct messages (no pack box)")
      .def("direct_recvs", &ExecTables::direct_recvs, "Recv ops of batch b moved as direct messages (no unpack box)")
      .def("send_boxes", [](const ExecTables& t) { return box_table(t.send_boxes()); }, "One pack box per send op")
      .def("recv_boxes", [](const ExecTables& t) { return box_table(t.recv_boxes()); }, "One unpack box per recv op")
      .def("direct_send_boxes", [](const ExecTables& t, int32_t b) { return box_table(pick(t.send_boxes(), t.direct_sends(b))); })
      .def("direct_recv_boxes", [](const ExecTables& t, int32_t b) { return box_table(pick(t.recv_boxes(), t.direct_recvs(b))); })
      .def("run_pack_cpu_verified",
           [](const ExecTables& t, int32_t b, py::array_t<uint64_t>& send) {
             digest_cpu(t.pack(b), RX_PASS_COPY, t.pack_ops(b), send);
           },
           "run_pack_cpu, digesting each packed send op as it is written into send[op]")
      .def("run_unpack_cpu_verified",
           [](const ExecTables& t, int32_t b, py::array_t<uint64_t>& recv) {
             digest_cpu(t.unpack(b), RX_PASS_COPY_COLD, t.unpack_ops(b), recv);
           },
           "run_unpack_cpu, digesting each unpacked recv op as it is written into recv[op] (direct receives: "
           "digest_direct_recv_round_cpu)")
      .def("read_digests_cpu",
           [](const ExecTables& t, py::array_t<uint64_t>& send, py::array_t<uint64_t>& recv,
              py::array_t<uint64_t>& copy_src, py::array_t<uint64_t>& copy_dst) {
             digest_cpu(t.send_boxes(), RX_PASS_SRC, {}, send);
             digest_cpu(t.recv_boxes(), RX_PASS_DST, {}, recv);
             digest_cpu(t.copies(), RX_PASS_SRC, {}, copy_src);
             digest_cpu(t.copies(), RX_PASS_DST, {}, copy_dst);
           },
           "rx.verify on the CPU: digests of what every op would send (re-reading the sources) and of what every "
           "destination holds, moving nothing");
}

}  // namespace rx::python
