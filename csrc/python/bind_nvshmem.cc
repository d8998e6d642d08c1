// The NVSHMEM transport (csrc/comm/nvshmem_comm.h). Pointers and streams cross as
// Python ints; _C links neither torch nor NVSHMEM.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/check.h"
#include "python/register.h"

#ifdef RX_WITH_CUDA
#include "comm/host_wait.h"
#include "comm/nvshmem_comm.h"
#endif

namespace py = pybind11;

namespace rx::python {

void register_nvshmem(py::module_& m) {
#ifdef RX_WITH_CUDA
  m.def("nvshmem_load", &nvshmem_load, py::arg("candidates"),
        "Loads libnvshmem_host.so.3 once: the one already in the process, else the first candidate that opens.");
  m.def("nvshmem_loaded", &nvshmem_loaded);
  m.def("nvshmem_library_path", &nvshmem_library_path, "The loaded libnvshmem_host file, or ''.");
  m.def("nvshmem_version", &nvshmem_version, "Vendor (major, minor, patch) of the loaded library.");
  m.def("nvshmem_unique_id", [] { return py::bytes(nvshmem_unique_id()); });
  m.def(
      "nvshmem_init",
      [](int rank, int world, const py::bytes& uid, int device) {
        std::string s = uid;
        py::gil_scoped_release release;
        nvshmem_init(rank, world, s, device);
      },
      py::arg("rank"), py::arg("world"), py::arg("unique_id"), py::arg("device"),
      "Joins the NVSHMEM world (collective; host API init with the unique id).");
  m.def("nvshmem_initialized", &nvshmem_initialized);
  m.def("nvshmem_my_pe", &nvshmem_my_pe);
  m.def("nvshmem_n_pes", &nvshmem_n_pes);
  m.def("nvshmem_alloc", &nvshmem_alloc, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
        "nvshmem_malloc (collective, same size on every PE); returns the symmetric address.");
  m.def("nvshmem_barrier", &nvshmem_barrier, py::call_guard<py::gil_scoped_release>());

  py::class_<NvshmemExchange, std::shared_ptr<NvshmemExchange>>(m, "NvshmemExchange")
      .def(py::init<uint64_t, int64_t, int, int, int, double>(), py::arg("region"), py::arg("signal_offset"),
           py::arg("npes"), py::arg("nslots"), py::arg("device"), py::arg("timeout_s"))
      .def(
          "set_batches",
          [](NvshmemExchange& x, const std::vector<std::vector<py::tuple>>& sends,
             std::vector<std::vector<int32_t>> recvs) {
            std::vector<std::vector<NvshmemSend>> out(sends.size());
            for (size_t b = 0; b < sends.size(); ++b)
              for (const py::tuple& t : sends[b]) {
                RX_HOST_ASSERT(t.size() == 4, "NVSHMEM sends are (pe, src_ptr, dst_symmetric_ptr, nbytes)");
                out[b].push_back(NvshmemSend{t[0].cast<int32_t>(), t[1].cast<uint64_t>(), t[2].cast<uint64_t>(),
                                             t[3].cast<int64_t>()});
              }
            x.set_batches(std::move(out), std::move(recvs));
          },
          py::arg("sends"), py::arg("recvs"),
          "sends[b]: (pe, src_ptr, dst_symmetric_ptr, nbytes); recvs[b]: the source PE of each message.")
      .def(
          "send", [](NvshmemExchange& x, int b, uint64_t s) { x.send(b, as_stream(s)); }, py::arg("batch"),
          py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait", [](NvshmemExchange& x, int b, uint64_t s) { x.wait(b, as_stream(s)); }, py::arg("batch"),
          py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "release", [](NvshmemExchange& x, int b, uint64_t s) { x.release(b, as_stream(s)); }, py::arg("batch"),
          py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_idle", [](NvshmemExchange& x, uint64_t s, double t) { x.wait_idle(as_stream(s), t); },
          py::arg("stream"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("usable", &NvshmemExchange::usable)
      .def_property_readonly("error", &NvshmemExchange::error)
      .def("abort", &NvshmemExchange::abort, "From any thread: a host wait in progress gives up and raises.")
      .def("rearm", &NvshmemExchange::rearm, "Takes an abort back before an execute.");
#else
  (void)m;
#endif
}

}  // namespace rx::python
