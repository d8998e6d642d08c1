// The direct transport's CUDA side: IPC exports and mappings, signal words, per-execute
// steps. Pointers and streams cross as Python ints; _C links no torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <vector>

#include "common/check.h"
#include "python/box_table.h"
#include "python/register.h"
#include "python/trace_rows.h"

#ifdef RX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "comm/direct_exec.h"
#include "comm/host_wait.h"
#include "comm/peer_map.h"
#endif

namespace py = pybind11;

namespace rx::python {

#ifdef RX_WITH_CUDA
namespace {

py::tuple export_to_py(const IpcExport& e) { return py::make_tuple(py::bytes(e.handle), e.offset, e.size); }

IpcExport export_from_py(const py::tuple& t) {
  RX_HOST_ASSERT(t.size() == 3, "an IPC export is (handle, offset, size)");
  return IpcExport{t[0].cast<std::string>(), t[1].cast<uint64_t>(), t[2].cast<uint64_t>()};
}

}  // namespace
#endif

void register_direct(py::module_& m) {
#ifdef RX_WITH_CUDA
  m.def(
      "ipc_export",
      [](uint64_t ptr) -> py::object {
        IpcExport e;
        std::string why;
        if (!ipc_export(ptr, &e, &why)) return py::str(why);
        return export_to_py(e);
      },
      py::arg("ptr"),
      "(handle, offset, size) of the CUDA allocation holding device address `ptr`, or a str saying why it cannot "
      "be shared.");
  m.def(
      "device_pci_bus_id",
      [](int device) {
        char id[32] = {0};
        RX_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), device));
        return std::string(id);
      },
      py::arg("device"));
  m.def(
      "peer_access",
      [](int device, const std::string& pci_bus_id) {
        int other = -1;
        if (cudaDeviceGetByPCIBusId(&other, pci_bus_id.c_str()) != cudaSuccess) {
          cudaGetLastError();
          return -1;  // not visible in this process (CUDA_VISIBLE_DEVICES): CUDA IPC decides
        }
        if (other == device) return 1;
        int can = 0;
        RX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, other));
        return can;
      },
      py::arg("device"), py::arg("pci_bus_id"),
      "1 when `device` can access the GPU with that PCI bus id, 0 when not, -1 when that GPU is not visible here.");

  py::class_<IpcMapping, std::shared_ptr<IpcMapping>>(m, "IpcMapping")
      .def(py::init([](const py::bytes& handle) { return std::make_shared<IpcMapping>(std::string(handle)); }),
           py::arg("handle"), "Opens an IPC handle on the current device (shared per process, closed with the last user).")
      .def_property_readonly("ok", &IpcMapping::ok)
      .def_property_readonly("base", &IpcMapping::base)
      .def_property_readonly("why", &IpcMapping::why);

  py::class_<DirectSignals, std::shared_ptr<DirectSignals>>(m, "DirectSignals")
      .def(py::init<int, int, int, double>(), py::arg("rank"), py::arg("world"), py::arg("device"),
           py::arg("timeout_s"))
      .def_property_readonly("flags_export", [](const DirectSignals& s) { return export_to_py(s.flags_export()); })
      .def_property_readonly("page_path", &DirectSignals::page_path)
      .def_property_readonly("seq", &DirectSignals::seq)
      .def("unlink_page", &DirectSignals::unlink_page)
      .def(
          "attach",
          [](DirectSignals& s, int peer, const py::tuple& flags, const std::string& page) {
            return s.attach(peer, export_from_py(flags), page);
          },
          py::arg("peer"), py::arg("flags_export"), py::arg("page_path"), "'' or why the peer cannot be attached.")
      .def("attached", &DirectSignals::attached, py::arg("peer"));

  py::class_<DirectExec, std::shared_ptr<DirectExec>>(m, "DirectExec")
      .def(py::init([](std::shared_ptr<DirectSignals> sig, const py::buffer& boxes, const py::buffer& local,
                       int64_t engine_bytes, int64_t local_engine_bytes, int32_t local_blocks, bool batch,
                       int32_t engine_streams, std::vector<int32_t> receivers, std::vector<int32_t> senders,
                       double timeout_s, const std::vector<int32_t>& box_groups, int32_t landing_groups,
                       const std::vector<uint8_t>& box_stageable, int64_t stage_slot_bytes,
                       const std::vector<int64_t>& box_ordinals, int32_t stage_slots, int32_t stage_streams) {
             DirectConfig config;
             config.engine_bytes = engine_bytes;
             config.local_engine_bytes = local_engine_bytes;
             config.local_blocks = local_blocks;
             config.batch = batch;
             config.engine_streams = engine_streams;
             config.landing_groups = landing_groups;
             config.stage_slot_bytes = stage_slot_bytes;
             config.stage_slots = stage_slots;
             config.stage_streams = stage_streams;
             RX_USER_CHECK(stage_slots >= 1 && stage_streams >= 1, "direct staging: ", stage_slots, " slots and ",
                           stage_streams, " copy streams (at least 1 each)");
             return std::make_shared<DirectExec>(std::move(sig), boxes_from(boxes), boxes_from(local), config,
                                                 std::move(receivers), std::move(senders), timeout_s, box_groups,
                                                 box_stageable, box_ordinals);
           }),
           py::arg("signals"), py::arg("boxes"), py::arg("local"), py::arg("engine_bytes"),
           py::arg("local_engine_bytes"), py::arg("local_blocks"), py::arg("batch"), py::arg("engine_streams"),
           py::arg("receivers"), py::arg("senders"), py::arg("timeout_s"), py::arg("box_groups"),
           py::arg("landing_groups"), py::arg("box_stageable") = std::vector<uint8_t>{},
           py::arg("stage_slot_bytes") = 0, py::arg("box_ordinals") = std::vector<int64_t>{},
           py::arg("stage_slots") = kStageSlots, py::arg("stage_streams") = kStageStreams,
           "boxes: the direct sends; local: same-rank copies it runs beside them (an empty BoxTable for none); "
           "box_groups: each box's landing group (ExecTables.direct_landing_groups) of landing_groups; "
           "box_stageable (ExecTables.direct_stageable), stage_slot_bytes, stage_slots: the boxes it stages "
           "(plan_staging), stage_streams the copy streams carrying them; box_ordinals "
           "(ExecTables.direct_ordinals): their verify ordinals.")
      .def_property_readonly("table_bytes", &DirectExec::table_bytes)
      .def_property_readonly("staging_bytes", &DirectExec::staging_bytes, "Bytes of the ring upload() takes.")
      .def_property_readonly("num_staged_chunks", &DirectExec::num_staged_chunks)
      .def_property_readonly("num_staged_boxes", &DirectExec::num_staged_boxes)
      .def_property_readonly("staged_boxes", &DirectExec::staged_boxes,
                             "Indices (in `boxes`) of the staged boxes, in the order of begin's stage_digests.")
      .def_property_readonly("num_engine_copies", &DirectExec::num_engine_copies)
      .def_property_readonly("num_kernel_boxes", &DirectExec::num_kernel_boxes)
      .def_property_readonly("num_local_engine_copies", &DirectExec::num_local_engine_copies)
      .def_property_readonly("num_local_kernel_boxes", &DirectExec::num_local_kernel_boxes)
      .def_property_readonly("engine_mode", &DirectExec::engine_mode,
                             "'batched', 'per copy', or 'per copy (why the batched calls are not used)'.")
      .def_property_readonly("error", &DirectExec::error)
      .def(
          "upload",
          [](DirectExec& d, uint64_t dev, uint64_t staging, uint64_t stream) {
            d.upload(reinterpret_cast<void*>(static_cast<uintptr_t>(dev)),
                     reinterpret_cast<void*>(static_cast<uintptr_t>(staging)), as_stream(stream));
          },
          py::arg("dev_ptr"), py::arg("staging_ptr"), py::arg("stream"),
          "Uploads the tables into dev_ptr (table_bytes) and binds the staged boxes to the ring at staging_ptr "
          "(staging_bytes; 0 when that is 0).")
      .def(
          "set_prep",
          [](DirectExec& d, const std::vector<std::pair<uint64_t, int64_t>>& regions) {
            std::vector<PrepRegion> in;
            for (const auto& [addr, bytes] : regions) in.push_back({addr, bytes});
            return d.set_prep(in);
          },
          py::arg("regions"),
          "Deferred pre-pass work over source regions [(address, bytes)]: the regions the staged chunks read, in "
          "the order to run their work (prep_done(k) after the k-th); [] for none.")
      .def_property_readonly("num_prep", &DirectExec::num_prep)
      .def(
          "prep_start", [](DirectExec& d, uint64_t main, uint64_t prep) { d.prep_start(as_stream(main), as_stream(prep)); },
          py::arg("stream"), py::arg("prep"), "Makes the prep stream start where `stream` is now (sources ready).")
      .def(
          "prep_done", [](DirectExec& d, int32_t k, uint64_t prep) { d.prep_done(k, as_stream(prep)); },
          py::arg("k"), py::arg("prep"), "Records prep event k on the prep stream (after region k's work).")
      .def(
          "begin",
          [](DirectExec& d, uint64_t stream, bool landing, uint64_t stage_digests, bool prep) {
            d.begin(as_stream(stream), landing, stage_digests, prep);
          },
          py::arg("stream"), py::arg("landing") = false, py::arg("stage_digests") = 0, py::arg("prep") = false,
          py::call_guard<py::gil_scoped_release>(),
          "Signals this rank's destinations free, waits (host, bounded) for its receivers', queues its writes "
          "(landing: group by group, each signalled; stage_digests: the device address of num_staged_boxes zeroed "
          "uint64 that receive the staged boxes' send digests; prep: this execute's deferred work was queued "
          "(prep_start, prep_done): the packs wait for it tensor by tensor, the rest for all of it).")
      .def("set_trace", &DirectExec::set_trace, py::arg("on"),
           "Whether executes record CUDA timing events around their steps (timeline).")
      .def(
          "timeline",
          [](DirectExec& d) { return trace_rows([&] { return d.timeline(); }); },
          "[(kind, index, begin ms, end ms)] of the last traced execute's steps (waits for them).")
      .def(
          "wait_landed", [](DirectExec& d, uint64_t stream, int32_t k) { d.wait_landed(as_stream(stream), k); },
          py::arg("stream"), py::arg("k"),
          "Queues on `stream` a wait until landing group k of every sender is in this rank.")
      .def(
          "end", [](DirectExec& d, uint64_t stream, bool wait) { d.end(as_stream(stream), wait); },
          py::arg("stream"), py::arg("wait") = true, py::call_guard<py::gil_scoped_release>(),
          "Queues the wait for its senders' signals and waits (host, bounded) for the refit's end on `stream` "
          "(wait=False: only queues; finish() waits).")
      .def("finish", &DirectExec::finish, py::call_guard<py::gil_scoped_release>(),
           "The host wait of end(stream, wait=False); raises ReshardError when a sender never signalled.")
      .def("abort", &DirectExec::abort, "From any thread: this execute's host and GPU waits give up and raise.")
      .def("rearm", &DirectExec::rearm, "Takes an abort back before an execute.");
#else
  (void)m;
#endif
}

}  // namespace rx::python
