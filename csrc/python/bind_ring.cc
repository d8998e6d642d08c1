// _C.HostRing (comm/host_ring.h): the CPU transport's data between the processes of one host.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <tuple>
#include <utility>

#include "comm/host_ring.h"
#include "common/check.h"
#include "core/exec_tables.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

using Msg = std::tuple<int32_t, uint64_t, int64_t>;  // peer, ptr, bytes
using Digests = py::array_t<uint64_t, py::array::c_style>;

std::vector<HostRing::Piece> pieces(const std::vector<Msg>& v) {
  std::vector<HostRing::Piece> out;
  out.reserve(v.size());
  for (const auto& [peer, ptr, bytes] : v) out.push_back(HostRing::Piece{peer, ptr, bytes, -1});
  return out;
}

// Marks each message of `ps` that is a direct op's whole message (batch b of `t`) to be
// hashed as it is copied, into out[op]: what the round digests of a gloo exchange compute
// (ExecTables::direct_round with one round), read from the cache instead of memory.
void mark_direct(const ExecTables& t, int32_t b, bool send, std::vector<HostRing::Piece>& ps, Digests& out,
                 std::vector<HostRing::Digest>& digests) {
  const std::vector<int32_t>& ops = send ? t.direct_sends(b) : t.direct_recvs(b);
  const std::vector<rx_box> boxes = t.direct_round(b, send, 0, 1, 0);
  const auto& plan_ops = send ? t.plan().sends : t.plan().recvs;
  uint64_t* d = out.mutable_data();
  std::map<std::pair<int32_t, uint64_t>, std::vector<size_t>> at;  // (peer, tensor end) -> boxes, in op order
  for (size_t k = 0; k < ops.size(); ++k) {
    RX_HOST_ASSERT(ops[k] >= 0 && ops[k] < out.shape(0), "HostRing: digest array too short");
    at[{plan_ops[static_cast<size_t>(ops[k])].peer, send ? boxes[k].src : boxes[k].dst}].push_back(k);
  }
  std::map<std::pair<int32_t, uint64_t>, size_t> taken;
  for (HostRing::Piece& p : ps) {
    const auto it = at.find({p.peer, p.ptr});
    if (it == at.end()) continue;  // a staging buffer's message: its pack or unpack hashes it
    size_t& next = taken[it->first];
    if (next == it->second.size()) continue;
    const size_t k = it->second[next++];
    p.digest = static_cast<int32_t>(digests.size());
    digests.push_back(HostRing::Digest{boxes[k], d + ops[k]});
  }
}

}  // namespace

void register_ring(py::module_& m) {
  py::class_<HostRing>(m, "HostRing",
                       "The CPU transport's data between the processes of one host through POSIX shared memory "
                       "(comm/host_ring.h): begin(), poll() until done or a deadline, end().")
      .def(py::init<int32_t, std::vector<int32_t>, int32_t, int64_t>(), py::arg("rank"), py::arg("locals"),
           py::arg("slots"), py::arg("slot_bytes"))
      .def_property_readonly("name", &HostRing::name, "The segment's name, for the peers' attach()")
      .def("attach", &HostRing::attach, py::arg("peer"), py::arg("name"))
      .def("attached", &HostRing::attached, py::arg("peer"))
      .def(
          "begin",
          [](HostRing& r, uint64_t token, const std::vector<Msg>& sends, const std::vector<Msg>& recvs) {
            r.begin(token, pieces(sends), pieces(recvs), {});
          },
          py::arg("token"), py::arg("sends"), py::arg("recvs"),
          "Starts an exchange: (peer, ptr, bytes) messages in stream order per peer; token: the execute's (never 0).")
      .def(
          "begin_verified",
          [](HostRing& r, uint64_t token, const std::vector<Msg>& sends, const std::vector<Msg>& recvs,
             const ExecTables& t, int32_t b, Digests& send_digests, Digests& recv_digests) {
            std::vector<HostRing::Piece> s = pieces(sends), v = pieces(recvs);
            std::vector<HostRing::Digest> digests;
            mark_direct(t, b, true, s, send_digests, digests);
            mark_direct(t, b, false, v, recv_digests, digests);
            r.begin(token, s, v, std::move(digests));
          },
          py::arg("token"), py::arg("sends"), py::arg("recvs"), py::arg("tables"), py::arg("batch"),
          py::arg("send_digests"), py::arg("recv_digests"),
          "begin() of batch `batch`'s messages that also adds the digests of its direct messages into "
          "send_digests[op] / recv_digests[op] as it copies them (the arrays must outlive the exchange).",
          py::keep_alive<1, 7>(), py::keep_alive<1, 8>())
      .def(
          "poll",
          [](HostRing& r, double seconds) {
            py::gil_scoped_release release;
            return r.poll(seconds);
          },
          py::arg("seconds"), "Moves what it can for at most `seconds`; True once every stream is done or failed.")
      .def("unfinished", &HostRing::unfinished, "[(peer, why)] of the streams not done (why: '' if merely late)")
      .def("end", &HostRing::end, "Closes the exchange, whatever its state.")
      .def_property_readonly("open", &HostRing::open);
}

}  // namespace rx::python
