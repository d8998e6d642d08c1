// The MXFP8 codec: its box codes, scale-slice math and the quantize/swizzle kernels. Python passes data_ptr()s
// (ints), shapes and the CUDA stream handle; nothing here knows torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "common/check.h"
#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/mxfp8_api.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

void register_mxfp8(py::module_& m) {
  m.attr("MX_BLOCK") = mx::kBlock;
  // rx_box.codec ids (codecs/registry.h) and the digest of a copy the receiver quantizes
  // (with the rounding << 8).
  m.attr("BOX_MX_DATA") = static_cast<int>(RX_CODEC_MXFP8);
  m.attr("BOX_MX_SCALE") = static_cast<int>(RX_CODEC_MXFP8_SCALES);
  m.attr("DIGEST_MX") = static_cast<int>(RX_DIGEST_CODEC | RX_CODEC_MXFP8 << 16);
  m.attr("MX_SCALE_2D") = static_cast<int>(RX_MX_SCALE_2D);
  m.attr("MX_SCALE_SWIZZLED") = static_cast<int>(RX_MX_SCALE_SWIZZLED);
  m.attr("MX_ROUND_CEIL") = static_cast<int>(RX_MX_ROUND_CEIL);
  m.attr("MX_ROUND_FLOOR") = static_cast<int>(RX_MX_ROUND_FLOOR);

  m.def("mxfp8_swizzled_size", &rx_mxfp8_swizzled_size, py::arg("rows"), py::arg("scale_cols"),
        "Bytes of a swizzled scale buffer (rows padded to 128, scale columns to 4).");
  m.def("mxfp8_swizzled_offset", [](int64_t row, int64_t col, int64_t scols) {
        RX_USER_CHECK(row >= 0 && col >= 0 && col < scols, "scale index (", row, ", ", col, ") out of range");
        return mx::swizzled_offset(row, col, scols);
      },
      py::arg("row"), py::arg("col"), py::arg("scale_cols"),
      "Byte offset of scale (row, col) in the swizzled 128x4-tile layout.");
  m.def(
      "mxfp8_scale_runs",
      [](const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t extent) -> py::object {
        Runs in, out;
        for (auto& r : runs) in.push_back(Run{r.first, r.second});
        std::string why = mx::scale_runs(in, extent, &out);
        if (!why.empty()) return py::str(why);
        py::list l;
        for (const Run& r : out) l.append(py::make_tuple(r.start, r.len));
        return l;
      },
      py::arg("runs"), py::arg("extent"),
      "Runs of scale columns owned by data runs along the last dim, or a str saying why the "
      "piece cannot be quantized on its own.");

  m.def(
      "mxfp8_quantize_cpu",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t data, uintptr_t scale,
         int32_t scale_layout, int32_t rounding) {
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_mxfp8_quantize_cpu(ptr<const uint16_t>(src), rows, cols, row_stride, ptr<uint8_t>(data),
                                     ptr<uint8_t>(scale), scale_layout, rounding);
        }
        RX_HOST_ASSERT(rc == 0, "rx_mxfp8_quantize_cpu: bad arguments");
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("data"),
      py::arg("scale"), py::arg("scale_layout"), py::arg("rounding"));
  m.def(
      "mxfp8_swizzle_cpu",
      [](uintptr_t scale2d, int64_t rows, int64_t scols, uintptr_t out) {
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_mxfp8_swizzle_cpu(ptr<const uint8_t>(scale2d), rows, scols, ptr<uint8_t>(out));
        }
        RX_HOST_ASSERT(rc == 0, "rx_mxfp8_swizzle_cpu: bad arguments");
      },
      py::arg("scale2d"), py::arg("rows"), py::arg("scale_cols"), py::arg("out"));

#ifdef RX_WITH_CUDA
  m.def(
      "mxfp8_quantize_cuda",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t data, uintptr_t scale,
         int32_t scale_layout, int32_t rounding, uintptr_t stream) {
        int32_t rc = rx_mxfp8_quantize_cuda(ptr<const uint16_t>(src), rows, cols, row_stride,
                                            ptr<uint8_t>(data), ptr<uint8_t>(scale), scale_layout,
                                            rounding, ptr<void>(stream));
        RX_HOST_ASSERT(rc == 0, "rx_mxfp8_quantize_cuda failed with code ", rc);
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("data"),
      py::arg("scale"), py::arg("scale_layout"), py::arg("rounding"), py::arg("stream"));
  m.def(
      "mxfp8_swizzle_cuda",
      [](uintptr_t scale2d, int64_t rows, int64_t scols, uintptr_t out, uintptr_t stream) {
        int32_t rc = rx_mxfp8_swizzle_cuda(ptr<const uint8_t>(scale2d), rows, scols, ptr<uint8_t>(out),
                                           ptr<void>(stream));
        RX_HOST_ASSERT(rc == 0, "rx_mxfp8_swizzle_cuda failed with code ", rc);
      },
      py::arg("scale2d"), py::arg("rows"), py::arg("scale_cols"), py::arg("out"), py::arg("stream"));
#endif
}

}  // namespace rx::python
