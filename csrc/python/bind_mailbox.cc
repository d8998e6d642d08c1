// _C.HostMailbox (comm/host_mailbox.h): execute headers between the processes of one host.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "comm/host_mailbox.h"
#include "common/check.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

using Rows = py::array_t<int64_t, py::array::c_style>;

// The rows an exchange's headers land in: at least one per peer of it, `words` wide.
int64_t* rows_of(const HostMailbox& mb, Rows& rows) {
  RX_HOST_ASSERT(rows.ndim() == 2 && static_cast<size_t>(rows.shape(0)) >= mb.pending() && rows.shape(1) == mb.words(),
                 "HostMailbox: rows must be int64 [peers, words]");
  return rows.mutable_data();
}

}  // namespace

void register_mailbox(py::module_& m) {
  py::class_<HostMailbox>(m, "HostMailbox",
                          "Execute headers between the processes of one host through POSIX shared memory "
                          "(comm/host_mailbox.h): post(), poll() until done or a deadline, finish().")
      .def(py::init<int32_t, int32_t, int32_t>(), py::arg("rank"), py::arg("size"), py::arg("words"))
      .def_property_readonly("name", &HostMailbox::name, "The segment's name, for the peers' attach()")
      .def("attach", &HostMailbox::attach, py::arg("peer"), py::arg("name"))
      .def("attached", &HostMailbox::attached, py::arg("peer"))
      .def(
          "post",
          [](HostMailbox& mb, const std::vector<int32_t>& peers, const py::array_t<int64_t, py::array::c_style>& h) {
            RX_HOST_ASSERT(h.ndim() == 1 && h.shape(0) == mb.words(), "HostMailbox.post: the header is one int64 row of ",
                           mb.words());
            mb.post(peers, h.data());
          },
          py::arg("peers"), py::arg("header"), "Posts the header to each peer (one exchange at a time).")
      .def(
          "poll",
          [](HostMailbox& mb, double seconds, Rows& rows) {
            int64_t* out = rows_of(mb, rows);
            py::gil_scoped_release release;
            return mb.poll(seconds, out);
          },
          py::arg("seconds"), py::arg("rows"),
          "Takes the peers' headers into rows (post order) and waits for ours to be taken, at most `seconds`; "
          "True once every pair is done.")
      .def(
          "finish", [](HostMailbox& mb, Rows& rows) { return mb.finish(rows_of(mb, rows)); }, py::arg("rows"),
          "Ends the exchange: per peer in post order 0 (done), 1 (it posted nothing) or 2 (it took nothing).")
      .def("unfinished", &HostMailbox::unfinished, "The peers of the open exchange whose pair is not done yet.")
      .def("raise_alarm", &HostMailbox::raise_alarm, py::arg("token"), py::arg("attempt"), py::arg("text"),
           py::arg("left"),
           "Sets this rank's alarm (read by the peers): the token and attempt of the execute it failed in, why, and "
           "whether it left that execute without its final exchange.")
      .def("begin", &HostMailbox::begin, py::arg("token"), py::arg("attempt") = 0,
           "This rank enters the execute of `token` (its `attempt`-th call with it): clears its alarm, then says "
           "which execute it is in.")
      .def("behind", &HostMailbox::behind, py::arg("peers"), py::arg("token"), py::arg("attempt"),
           "The attached peers among `peers` still in an earlier attempt of the execute of `token`.")
      .def("end", &HostMailbox::end, "This rank is in no execute now.")
      .def(
          "read_alarm",
          [](const HostMailbox& mb, int32_t peer, uint64_t token) -> py::object {
            std::string text;
            bool left = false;
            uint64_t attempt = 0;
            if (!mb.read_alarm(peer, token, &text, &left, &attempt)) return py::none();
            return py::make_tuple(py::bytes(text), left, attempt);
          },
          py::arg("peer"), py::arg("token"), "(text, left, attempt) of peer's alarm if it holds `token`, else None.")
      .def("alarmed", &HostMailbox::alarmed, py::arg("peers"), py::arg("token"),
           "The attached peers among `peers` whose alarm holds `token` and who are in that execute (or left it).")
      .def("gone", &HostMailbox::gone, py::arg("peers"),
           "The attached peers among `peers` whose process has exited (same pid namespace only).");
}

}  // namespace rx::python
