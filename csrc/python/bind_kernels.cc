// CPU kernels: the box copy over a table passed as raw bytes (tests, CPU refit).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "common/check.h"
#include "kernels/api.h"
#include "kernels/codecs/registry.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

void register_kernels(py::module_& m) {
  m.attr("MAX_DIMS") = RX_MAX_DIMS;
  m.attr("BOX_COPY") = static_cast<int>(RX_CODEC_NONE);
  m.def(
      "codec_traits",
      [] {
        py::list l;
        for (int32_t i = 0; i < codecs::count(); ++i) {
          const codecs::Traits& t = codecs::at(i);
          py::dict d;
          d["id"] = t.id;
          d["name"] = t.name;
          d["grain"] = t.grain;
          d["item_elems"] = t.item_elems;
          d["item_bytes"] = t.item_bytes;
          d["digest"] = t.cpu_digest != nullptr;
          l.append(d);
        }
        return l;
      },
      "The codec table (kernels/codecs/registry.h): one dict per codec id (id, name, grain, item_elems, "
      "item_bytes, digest: whether the id is also a receiver digest kind).");
  m.def(
      "copy_boxes_cpu",
      [](py::buffer table) {
        py::buffer_info info = table.request();
        RX_HOST_ASSERT(info.size * info.itemsize % sizeof(rx_box) == 0, "table is not a whole number of boxes");
        const int64_t n = info.size * info.itemsize / sizeof(rx_box);
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_copy_boxes_cpu(static_cast<const rx_box*>(info.ptr), n);
        }
        RX_HOST_ASSERT(rc == 0, "bad box in table");
      },
      "Runs the CPU box copy over a table of rx_box records (bytes-like).");
  m.attr("PASS_COPY") = static_cast<int>(RX_PASS_COPY);
  m.attr("PASS_COPY_COLD") = static_cast<int>(RX_PASS_COPY_COLD);
  m.attr("PASS_SRC") = static_cast<int>(RX_PASS_SRC);
  m.attr("PASS_DST") = static_cast<int>(RX_PASS_DST);
  m.attr("DIGEST_CAST") = static_cast<int>(RX_DIGEST_CAST);
  m.attr("DIGEST_CODEC") = static_cast<int>(RX_DIGEST_CODEC);
  m.def(
      "digest_boxes_cpu",
      [](py::buffer table, int32_t pass) {
        py::buffer_info info = table.request();
        RX_HOST_ASSERT(info.size * info.itemsize % sizeof(rx_box) == 0, "table is not a whole number of boxes");
        const int64_t n = info.size * info.itemsize / sizeof(rx_box);
        std::vector<uint64_t> digests(static_cast<size_t>(n), 0);
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_digest_boxes_cpu(static_cast<const rx_box*>(info.ptr), n, pass, digests.data());
        }
        RX_HOST_ASSERT(rc == 0, "bad box in table or bad pass");
        return digests;
      },
      py::arg("boxes"), py::arg("pass_"),
      "A verify pass (PASS_COPY/SRC/DST) of the CPU twin over a table of rx_box records: one digest per box.");
}

}  // namespace rx::python
