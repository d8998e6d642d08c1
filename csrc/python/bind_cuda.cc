// The CUDA box copy: DeviceBoxTable (plan time: build + upload; every execute: launch).
// The tile planner is bound in every build so CPU CI tests it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "core/direct.h"
#include "kernels/api.h"
#include "python/box_table.h"
#include "python/register.h"
#ifdef RX_WITH_CUDA
#include "kernels/device_table.h"
#endif

namespace py = pybind11;

namespace rx::python {

void register_cuda(py::module_& m) {
  m.attr("TILE_RECORD_BYTES") = sizeof(rx_tile);
  m.def(
      "plan_tiles",
      [](const py::buffer& table, int64_t tile_bytes, bool geometry) {
        const std::vector<rx_box> boxes = boxes_from(table);
        const int64_t n = rx_plan_tiles(boxes.data(), static_cast<int64_t>(boxes.size()), tile_bytes, nullptr, 0);
        RX_HOST_ASSERT(n >= 0, "box table has a bad box (ndim, extent, dtype pair or alignment)");
        std::vector<rx_tile> tiles(static_cast<size_t>(n));
        rx_plan_tiles(boxes.data(), static_cast<int64_t>(boxes.size()), tile_bytes, tiles.data(), n);
        py::list out;
        for (const rx_tile& t : tiles) {
          py::tuple base = py::make_tuple(t.box, t.unit, t.src_size, t.dst_size, t.begin, t.end);
          out.append(geometry ? py::tuple(base + py::make_tuple(t.flags, t.src, t.dst, t.row_items, t.src_pitch,
                                                                 t.dst_pitch))
                              : base);
        }
        return out;
      },
      py::arg("boxes"), py::arg("tile_bytes") = 0, py::arg("geometry") = false,
      "Tiles of a box table as (box, unit, src_size, dst_size, begin, end); tile_bytes <= 0 picks a size. "
      "geometry: append (flags, src, dst, row_items, src_pitch, dst_pitch), the flat tile fields of api.h.");

  m.def(
      "split_engines",
      [](const py::buffer& table, int64_t min_bytes) {
        std::vector<EngineCopy> engine;
        std::vector<rx_box> kernel;
        split_engines(boxes_from(table), min_bytes, &engine, &kernel);
        py::list copies;
        for (const EngineCopy& c : engine)
          copies.append(py::make_tuple(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height));
        return py::make_tuple(copies, BoxTable{std::move(kernel)});
      },
      py::arg("boxes"), py::arg("min_bytes"),
      "The direct transport's split of a box table: ([(dst, dpitch, src, spitch, width, height)] copy-engine "
      "copies, the other boxes as a table).");
  using CopyTuple = std::tuple<uint64_t, int64_t, uint64_t, int64_t, int64_t, int64_t>;
  auto copies_in = [](const std::vector<CopyTuple>& copies) {
    std::vector<EngineCopy> in;
    for (const auto& [dst, dpitch, src, spitch, width, height] : copies)
      in.push_back(EngineCopy{dst, src, dpitch, spitch, width, height});
    return in;
  };
  auto copies_out = [](const std::vector<EngineCopy>& v) {
    py::list l;
    for (const EngineCopy& c : v) l.append(py::make_tuple(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height));
    return l;
  };
  m.def(
      "batch_engines",
      [=](const std::vector<CopyTuple>& copies, std::vector<uint64_t> allocations) {
        std::sort(allocations.begin(), allocations.end());
        const auto start = [&](uint64_t p) {  // the allocation start at or below p (0: none)
          auto it = std::upper_bound(allocations.begin(), allocations.end(), p);
          return it == allocations.begin() ? uint64_t{0} : *(it - 1);
        };
        SameAllocation same = nullptr;
        if (!allocations.empty()) same = [=](uint64_t a, uint64_t b) { return start(a) == start(b); };
        const EngineBatches b = batch_engines(copies_in(copies), same);
        return py::make_tuple(copies_out(b.runs), copies_out(b.pitched));
      },
      py::arg("copies"), py::arg("allocations") = std::vector<uint64_t>{},
      "split_engines' copies as the executor submits them: (runs, pitched), adjacent runs merged "
      "(within one allocation where `allocations`, their start addresses, are given).");
  m.def(
      "spread_engines",
      [=](const std::vector<CopyTuple>& copies, int n) {
        py::list out;
        for (const auto& part : spread_engines(copies_in(copies), n)) out.append(copies_out(part));
        return out;
      },
      py::arg("copies"), py::arg("n"),
      "split_engines' copies spread over n streams of about equal bytes (n <= 0: auto_engine_streams).");
  m.def("auto_engine_streams", &auto_engine_streams, py::arg("num_copies"),
        "The streams spread_engines uses for that many copies when n <= 0.");
  m.attr("STAGE_SLOTS") = kStageSlots;
  m.attr("STAGE_STREAMS") = kStageStreams;
  m.attr("STAGE_ALIGN") = kStageAlign;
  m.attr("STAGE_DIGEST") = static_cast<int>(kStageDigest);
  m.attr("STAGE_START") = kStageStart;
  m.attr("STAGE_LANDED") = kStageLanded;
  m.attr("STAGE_SOURCES") = kStageSources;
  m.attr("STAGE_PREP0") = stage_prep_event(0);
  py::class_<StagingPlan>(m, "StagingPlan", "Staged codec boxes of a direct send (core/direct.h, plan_staging).")
      .def_readonly("slot_bytes", &StagingPlan::slot_bytes)
      .def_readonly("slots", &StagingPlan::slots)
      .def_property_readonly("ring_bytes", &StagingPlan::ring_bytes)
      .def_property_readonly("num_chunks", [](const StagingPlan& p) { return p.chunks.size(); })
      .def(
          "chunk",
          [=](const StagingPlan& p, size_t c) {
            const StagedChunk& k = p.chunks.at(c);
            return py::make_tuple(k.group, k.slot, k.bytes, BoxTable{k.pack}, copies_out(k.copies), k.boxes,
                                  BoxTable{k.digest});
          },
          py::arg("c"),
          "(group, slot, bytes, pack boxes, copies as split_engines gives them, box indices, digest boxes)")
      .def("relocate", [](StagingPlan& p, uint64_t base) { relocate_staging(&p, base); }, py::arg("base"))
      .def(
          "script",
          [](const StagingPlan& p, int32_t groups, int32_t streams, bool digest, const std::vector<int32_t>& gates) {
            const StageScript sc = stage_script(p, groups, streams, digest, gates);
            auto acts = [](const std::vector<StageAction>& v) {
              py::list l;
              for (const StageAction& a : v) l.append(py::make_tuple(a.op, a.stream, a.arg));
              return l;
            };
            py::list parts;
            for (const auto& part : sc.parts) parts.append(acts(part));
            return py::make_tuple(sc.streams, sc.events, acts(sc.prefill), parts);
          },
          py::arg("groups"), py::arg("streams") = kStageStreams, py::arg("digest") = false,
          py::arg("gates") = std::vector<int32_t>{},
          "stage_script: (streams, events, prefill, parts), actions as (op, stream, arg); op 0 pack, 1 copy, "
          "2 wait, 3 record, 4 digest; gates (prep_schedule's): the pack of chunk c first waits for prep event "
          "gates[c] (STAGE_PREP0 - k), the prefill for STAGE_SOURCES.")
      .def(
          "prep_schedule",
          [](const StagingPlan& p, const std::vector<std::pair<uint64_t, int64_t>>& regions) {
            std::vector<PrepRegion> in;
            for (const auto& [addr, bytes] : regions) in.push_back({addr, bytes});
            const PrepSchedule s = prep_schedule(p, in);
            return py::make_tuple(s.order, s.gates);
          },
          py::arg("regions"),
          "(order, gates) of deferred pre-pass work over source regions [(address, bytes)] (core/direct.h): the "
          "regions the chunks read, in first-read order, and per chunk the position in it of the last one it "
          "reads (-1: none).");
  m.def(
      "plan_staging",
      [](const py::buffer& table, const std::vector<int32_t>& groups, const std::vector<uint8_t>& stageable,
         int64_t slot_bytes, const std::vector<int64_t>& ordinals, int32_t slots) {
        std::vector<int32_t> rest;
        StagingPlan p = plan_staging(boxes_from(table), groups, stageable, slot_bytes, &rest, ordinals, slots);
        return py::make_tuple(std::move(p), rest);
      },
      py::arg("boxes"), py::arg("groups"), py::arg("stageable"), py::arg("slot_bytes"),
      py::arg("ordinals") = std::vector<int64_t>{}, py::arg("slots") = kStageSlots,
      "The direct transport's staging of a sender's codec boxes: (StagingPlan, indices of the boxes not staged); "
      "ordinals: each box's first verify ordinal in its op (ExecTables.direct_ordinals; empty: 0).");
  auto spans = [](std::pair<uint64_t, uint64_t> (*span)(const rx_box&)) {
    return [span](const py::buffer& table) {
      py::list out;
      for (const rx_box& b : boxes_from(table)) {
        const auto s = span(b);
        out.append(py::make_tuple(s.first, s.second));
      }
      return out;
    };
  };
  m.def("dst_spans", spans(&dst_span), py::arg("boxes"),
        "[lo, hi) of the dst bytes each box writes (codec side bytes such as MXFP8 scales aside).");
  m.def("src_spans", spans(&src_span), py::arg("boxes"),
        "[lo, hi) of the src bytes each box reads (core/direct.h src_span).");

#ifdef RX_WITH_CUDA
  py::class_<DeviceBoxTable>(m, "DeviceBoxTable")
      .def(py::init([](const py::buffer& table, int64_t tile_bytes, bool flat) {
             return DeviceBoxTable(boxes_from(table), tile_bytes, flat);
           }),
           py::arg("boxes"), py::arg("tile_bytes") = 0, py::arg("flat") = true,
           "flat=False: every tile reads its box record (the kernel's general path; for comparisons).")
      .def_property_readonly("nbytes", &DeviceBoxTable::bytes_needed, "Device bytes upload() fills (16-byte aligned).")
      .def_property_readonly("num_boxes", &DeviceBoxTable::num_boxes)
      .def_property_readonly("num_tiles", &DeviceBoxTable::num_tiles)
      .def_property_readonly("warp_shift", &DeviceBoxTable::warp_shift,
                             "log2 of the warps an uncapped launch puts on each tile.")
      .def(
          "upload",
          [](DeviceBoxTable& t, uint64_t dev_ptr, uint64_t stream) {
            t.upload(reinterpret_cast<void*>(dev_ptr), reinterpret_cast<cudaStream_t>(stream));
          },
          py::arg("dev_ptr"), py::arg("stream"))
      .def(
          "launch",
          [](const DeviceBoxTable& t, uint64_t stream, int32_t max_blocks, uint64_t digests, int32_t pass,
             int32_t warp_shift) {
            if (pass == RX_PASS_NONE)
              t.launch(reinterpret_cast<cudaStream_t>(stream), max_blocks, warp_shift);
            else
              t.launch_digest(reinterpret_cast<cudaStream_t>(stream), max_blocks, reinterpret_cast<uint64_t*>(digests),
                              pass, warp_shift);
          },
          py::arg("stream"), py::arg("max_blocks") = 0, py::arg("digests") = 0, py::arg("pass_") = 0,
          py::arg("warp_shift") = -1,
          "Copies every box: one kernel launch, no allocation, no sync. max_blocks > 0 caps the grid. pass_ "
          "(PASS_COPY/SRC/DST): a verify pass adding each box's digest into the uint64 at digests + 8 * box "
          "(device memory, zeroed by the caller). warp_shift >= 0: the warps per tile, overriding the table's "
          "(benchmarks, tests).")
      .def(
          "run_emulated",
          [](const DeviceBoxTable& t, int32_t pass, int32_t warp_shift) -> py::object {
            if (pass == RX_PASS_NONE) {
              py::gil_scoped_release release;
              t.run_emulated(warp_shift);
              return py::none();
            }
            std::vector<uint64_t> d;
            {
              py::gil_scoped_release release;
              d = t.run_emulated_digest(pass, warp_shift);
            }
            return py::cast(d);
          },
          py::arg("pass_") = 0, py::arg("warp_shift") = -1,
          "Runs the kernel's per-lane code on the host; the boxes must point at host memory (tests). pass_: a "
          "verify pass, returning one digest per box. warp_shift >= 0: the warps per tile, overriding the table's.");
#endif
}

}  // namespace rx::python
