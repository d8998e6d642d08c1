// The NCCL transport. Pointers and cudaStream_t handles cross as Python ints
// (tensor.data_ptr(), torch.cuda.current_stream().cuda_stream); _C links no torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/check.h"
#include "python/register.h"

#ifdef RX_WITH_CUDA
#include "comm/host_wait.h"
#include "comm/nccl_comm.h"
#endif
#ifdef RX_WITH_NCCL
#include "comm/nccl_loader.h"
#endif

namespace py = pybind11;

namespace rx::python {

#ifdef RX_WITH_NCCL
namespace {

std::vector<NcclTransfer> transfers_from_py(const py::iterable& items) {
  std::vector<NcclTransfer> out;
  for (const auto& item : items) {
    auto t = item.cast<py::tuple>();
    RX_HOST_ASSERT(t.size() == 3, "exchange entries are (peer, device_ptr, nbytes) tuples");
    out.push_back(NcclTransfer{t[0].cast<int32_t>(), t[1].cast<uint64_t>(), t[2].cast<int64_t>()});
  }
  return out;
}

// The destructor may wait (bounded) for NCCL to finalize: do it without the GIL so other
// Python threads keep running, except while the interpreter itself is shutting down.
bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void delete_comm(NcclComm* c) {
  if (PyGILState_Check() && !finalizing()) {
    py::gil_scoped_release release;
    delete c;
  } else {
    delete c;
  }
}

}  // namespace
#endif

void register_comm(py::module_& m) {
#ifdef RX_WITH_CUDA
  m.def(
      "stream_wait",
      [](uint64_t waiter, uint64_t signaller) { stream_wait(as_stream(waiter), as_stream(signaller)); },
      py::arg("waiter"), py::arg("signaller"),
      "Makes stream `waiter` wait on the GPU for the work already enqueued on `signaller`.");
#endif
#ifdef RX_WITH_NCCL
  m.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); }, "ncclGetUniqueId, as bytes.");
  m.def("nccl_version", &nccl_version, "(major, minor, patch) of the libnccl this module loaded.");
  m.def("nccl_library_path", &nccl_library_path, "The file the NCCL calls resolve to (loads NCCL first).");
  m.def("nccl_load", &nccl_load, py::arg("candidates"),
        "Loads libnccl once: the one already in the process, else the first candidate path that opens.");
  m.def("nccl_loaded", &nccl_loaded, "Whether a libnccl has been loaded by this module.");

  py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
      .def(py::init([](int rank, int world, const py::bytes& id, int device, double timeout_s) {
             std::string s = id;
             py::gil_scoped_release release;
             return std::shared_ptr<NcclComm>(new NcclComm(rank, world, s, device, timeout_s), delete_comm);
           }),
           py::arg("rank"), py::arg("world"), py::arg("unique_id"), py::arg("device"), py::arg("timeout_s") = 600.0,
           "Starts creating a non-blocking communicator; call wait_ready() before the first exchange.")
      .def("wait_ready", &NcclComm::wait_ready, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def(
          "exchange",
          [](NcclComm& c, const py::iterable& sends, const py::iterable& recvs, uint64_t stream, uint64_t side) {
            auto s = transfers_from_py(sends);
            auto r = transfers_from_py(recvs);
            py::gil_scoped_release release;
            c.exchange(s, r, as_stream(stream), as_stream(side));
          },
          py::arg("sends"), py::arg("recvs"), py::arg("stream"), py::arg("side_stream") = 0,
          "sends/recvs: (peer, device_ptr, nbytes) tuples; one NCCL group, zero-byte entries skipped, entries for "
          "one peer matched in order. With side_stream (!= stream) the transfer runs there, after the work on "
          "`stream`, and `stream` waits for it.")
      .def("register_buffer", &NcclComm::register_buffer, py::arg("ptr"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "ncclCommRegister of a device range; returns a handle for deregister_buffer. Register on every rank "
           "by the same rule: a transfer must be registered at both ends or at neither.")
      .def("deregister_buffer", &NcclComm::deregister_buffer, py::arg("handle"),
           py::call_guard<py::gil_scoped_release>())
      .def("poll", &NcclComm::poll, py::call_guard<py::gil_scoped_release>(),
           "True when the last exchange finished; raises ReshardError on an asynchronous NCCL error.")
      .def("wait", &NcclComm::wait, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Host wait for the last exchange; raises ReshardError (and aborts) on error or timeout.")
      .def("abort", &NcclComm::abort, py::call_guard<py::gil_scoped_release>())
      .def("close", &NcclComm::close, py::arg("timeout_s") = 10.0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("usable", &NcclComm::usable)
      .def_property_readonly("error", &NcclComm::error)
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("world", &NcclComm::world)
      .def_property_readonly("device", &NcclComm::device)
      .def_property("timeout", &NcclComm::timeout, &NcclComm::set_timeout)
      .def_property_readonly(
          "side_stream", [](const NcclComm& c) { return reinterpret_cast<uintptr_t>(c.side_stream()); },
          "The communicator's own non-blocking stream (a cudaStream_t as int).");
#endif
}

}  // namespace rx::python
