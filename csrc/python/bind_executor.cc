// The executor of a bound plan (csrc/comm/executor.h): streams, events and pointers cross
// as Python ints. The recording device and transport are bound in every build (CPU tests
// of the schedule); the CUDA device and the NCCL / NVSHMEM transports where built.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/executor.h"
#include "common/check.h"
#include "python/register.h"
#include "python/trace_rows.h"

#ifdef RX_WITH_CUDA
#include "comm/nvshmem_comm.h"
#endif
#ifdef RX_WITH_NCCL
#include "comm/nccl_comm.h"
#endif

namespace py = pybind11;

namespace rx::python {

namespace {

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

}  // namespace

void register_executor(py::module_& m) {
  m.def("verify_rounds", &Executor::verify_rounds, py::arg("num_batches"),
        "The rounds a verified NCCL execute cuts its last batch into, for a plan of num_batches batches.");
  py::class_<RecordingLog, std::shared_ptr<RecordingLog>>(m, "RecordingLog",
                                                          "What a recording device and transport were asked, in order.")
      .def(py::init<>())
      .def_readonly("lines", &RecordingLog::lines)
      .def("clear", [](RecordingLog& l) { l.lines.clear(); });

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport", "What carries a batch's bytes (executor.h).")
      .def_property_readonly("rounds", &Transport::rounds);
  py::class_<RecordingTransport, Transport, std::shared_ptr<RecordingTransport>>(
      m, "RecordingTransport", "Moves nothing; logs each call and keeps the receives it was given (tests).")
      .def(py::init<std::shared_ptr<RecordingLog>, bool>(), py::arg("log"), py::arg("rounds") = false)
      .def_readonly("received", &RecordingTransport::received)
      .def_readwrite("fail_drain", &RecordingTransport::fail_drain, "Non-empty: drain raises ReshardError(this).");
  py::class_<HostFabric, std::shared_ptr<HostFabric>>(
      m, "HostFabric", "In-process point-to-point between the host transports of `world` ranks (CPU tests).")
      .def(py::init<int>(), py::arg("world"))
      .def("transport", &HostFabric::transport, py::arg("rank"), py::arg("rounds") = false,
           py::arg("timeout_s") = 30.0, "Rank `rank`'s transport; use it from one thread.");
#ifdef RX_WITH_NCCL
  m.def("nccl_transport", &make_nccl_transport, py::arg("comm"), "The executor's transport over an NcclComm.");
#endif
#ifdef RX_WITH_CUDA
  m.def("nvshmem_transport", &make_nvshmem_transport, py::arg("puts"),
        "The executor's transport over an NvshmemExchange (its batches set).");
#endif

  py::class_<Executor, std::shared_ptr<Executor>>(m, "Executor", "The pipelined run of one bound plan (executor.h).")
#ifdef RX_WITH_CUDA
      .def_static(
          "cuda", [](int device) { return std::make_shared<Executor>(make_cuda_device(device)); }, py::arg("device"),
          "On CUDA device `device` (its side stream and events are made there).")
#endif
      .def_static(
          "host", [] { return std::make_shared<Executor>(std::make_unique<HostDevice>()); },
          "Runs each launch at once on the host (CPU twins of the kernels; tables over host memory).")
      .def_static(
          "recording", [](std::shared_ptr<RecordingLog> log) { return std::make_shared<Executor>(std::make_unique<RecordingDevice>(log)); },
          py::arg("log"), "Runs nothing; logs each launch, event and wait (main stream: 1).")
      .def(
          "prepare",
          [](Executor& e, std::shared_ptr<ExecTables> tables, bool sliced, int32_t max_blocks,
             const std::vector<std::pair<uint64_t, int64_t>>& recv_staging) {
            e.prepare(std::move(tables), sliced, max_blocks, recv_staging);
          },
          py::arg("tables"), py::arg("sliced"), py::arg("max_blocks"), py::arg("recv_staging"),
          "Builds the tables of a binding; then upload pending_bytes().")
      .def_property_readonly("pending_bytes", [](Executor& e) { return e.device().pending_bytes(); })
      .def(
          "upload", [](Executor& e, uint64_t dev, uint64_t stream) { e.device().upload(dev, stream); },
          py::arg("dev_ptr"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
          "Uploads the tables built since the last upload into dev_ptr (pending_bytes bytes) and waits.")
      .def("set_transport", &Executor::set_transport, py::arg("transport"))
      .def_property_readonly("peers", &Executor::peers)
      .def_property_readonly("num_batches", &Executor::num_batches)
      .def_property_readonly("num_copy_slices", &Executor::num_copy_slices)
      .def_property_readonly("max_blocks", &Executor::max_blocks)
      .def_property("verify_max_blocks", &Executor::verify_max_blocks, &Executor::set_verify_max_blocks,
                    "Grid cap of verified executes' kernels (0: none).")
      .def_property_readonly("verify_built", &Executor::verify_built)
      .def("build_verify", &Executor::build_verify,
           "Builds the verify digest tables (once); returns the digest slots set_digests needs.")
      .def(
          "set_digests", [](Executor& e, uint64_t dev) { e.device().set_digests(dev); }, py::arg("dev_ptr"))
      .def(
          "digest_signs", [](const Executor& e) { return to_array(e.digest_signs()); },
          "Per digest slot: +1 a send op's, -1 a receive op's, 0 neither (int64).")
      .def(
          "collect",
          [](const Executor& e, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& host) {
            auto [send, recv] = e.collect(host.data(), static_cast<int64_t>(host.size()));
            return py::make_tuple(to_array(send), to_array(recv));
          },
          py::arg("digests"), "(send, recv) digests by op from the digest buffer's host copy.")
      .def("begin", &Executor::begin, py::arg("main"), py::arg("verify"), py::arg("trace"),
           py::call_guard<py::gil_scoped_release>())  // it may drain an earlier execute's transfers
      .def("pack_first", &Executor::pack_first, py::call_guard<py::gil_scoped_release>())
      .def("run", &Executor::run, py::arg("good"), py::arg("writes"), py::arg("timeout_s"),
           py::arg("defer_drain") = false, py::call_guard<py::gil_scoped_release>(),
           "The pipelined rest of the execute (after begin and pack_first); raises ReshardError where a "
           "transfer fails or times out. defer_drain: leaves the host wait for the transfers to drain().")
      .def("drain", &Executor::drain, py::call_guard<py::gil_scoped_release>(),
           "The host wait run(defer_drain=True) left; raises ReshardError where a transfer failed or timed out.")
      .def("pack", &Executor::pack, py::arg("batch"))
      .def("digest_direct_sends", &Executor::digest_direct_sends, py::arg("batch"))
      .def("copy", &Executor::copy, py::arg("slice"))
      .def("unpack", &Executor::unpack, py::arg("batch"))
      .def(
          "timeline",
          [](Executor& e) { return trace_rows([&] { return e.timeline(); }); },
          "[(kind, batch, begin ms, end ms)] of the steps traced since begin (waits for the last).")
      .def("abort", &Executor::abort, py::call_guard<py::gil_scoped_release>())
      .def("set_time_host", &Executor::set_time_host, py::arg("on"),
           "Whether run() measures its host time (last_run_times).")
      .def_property_readonly("last_run_times", &Executor::last_run_times,
                             "(posting and launching: thread CPU, wall; host wait for the transfers: thread CPU, "
                             "wall) of the last run, in seconds, with set_time_host(True).")
      .def(
          "set_post_hook",
          [](Executor& e, const py::object& fn) {
            if (fn.is_none()) {
              e.set_post_hook(nullptr);
              return;
            }
            auto f = std::make_shared<py::object>(fn);
            e.set_post_hook([f](int32_t b, int32_t r, StreamHandle side, const std::vector<Message>& recvs) {
              py::gil_scoped_acquire gil;
              (*f)(b, r, side, recvs);
            });
          },
          py::arg("hook"), "Tests: hook(batch, round, side_stream, recvs) after each post; None removes it.");
}

}  // namespace rx::python
