// The NVFP4 codec: its box codes, wire-slice math and the quantize kernels. Python passes data_ptr()s
// (ints), shapes and the CUDA stream handle; nothing here knows torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "common/check.h"
#include "kernels/codecs/nvfp4.h"
#include "kernels/codecs/nvfp4_api.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

namespace {
void check(int32_t rc, const char* what) { RX_HOST_ASSERT(rc == 0, what, " failed with code ", rc); }
}  // namespace

void register_nvfp4(py::module_& m) {
  m.attr("NV_BLOCK") = nv::kBlock;
  m.attr("BOX_NV_DATA") = static_cast<int>(RX_CODEC_NVFP4);  // rx_box.codec ids (codecs/registry.h)
  m.attr("BOX_NV_SCALE") = static_cast<int>(RX_CODEC_NVFP4_SCALES);
  m.attr("NV_SCALE_2D") = static_cast<int>(RX_NV_SCALE_2D);
  m.attr("NV_SCALE_SWIZZLED") = static_cast<int>(RX_NV_SCALE_SWIZZLED);

  m.def(
      "nvfp4_coarse_runs",
      [](const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t extent, int64_t per) -> py::object {
        Runs in, out;
        for (auto& r : runs) in.push_back(Run{r.first, r.second});
        std::string why = nv::coarse_runs(in, extent, per, &out);
        if (!why.empty()) return py::str(why);
        py::list l;
        for (const Run& r : out) l.append(py::make_tuple(r.start, r.len));
        return l;
      },
      py::arg("runs"), py::arg("extent"), py::arg("per"),
      "Runs of a tensor whose coordinate covers `per` elements of the last dim (2: packed data, 16: "
      "block scales), or a str saying why the piece cannot be quantized on its own.");
  m.def(
      "nvfp4_tensor_scale_bits", [](uint32_t amax) { return nv::tensor_scale_bits(amax); }, py::arg("amax"),
      "FP32 bits of the per-tensor scale of an amax (its FP32 bits).");

  m.def(
      "nvfp4_quantize_cpu",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t amax, uintptr_t data,
         uintptr_t scale, int32_t scale_layout, uintptr_t tensor_scale) {
        py::gil_scoped_release release;
        check(rx_nvfp4_quantize_cpu(ptr<const uint16_t>(src), rows, cols, row_stride, ptr<const uint32_t>(amax),
                                    ptr<uint8_t>(data), ptr<uint8_t>(scale), scale_layout, ptr<float>(tensor_scale)),
              "rx_nvfp4_quantize_cpu");
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("amax"), py::arg("data"),
      py::arg("scale"), py::arg("scale_layout"), py::arg("tensor_scale"));
  m.def(
      "nvfp4_tensor_scale_cpu",
      [](uintptr_t amax, uintptr_t out) {
        check(rx_nvfp4_tensor_scale_cpu(ptr<const uint32_t>(amax), ptr<float>(out)), "rx_nvfp4_tensor_scale_cpu");
      },
      py::arg("amax"), py::arg("tensor_scale"));

#ifdef RX_WITH_CUDA
  m.def(
      "nvfp4_quantize_cuda",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t amax, uintptr_t data,
         uintptr_t scale, int32_t scale_layout, uintptr_t tensor_scale, uintptr_t stream) {
        check(rx_nvfp4_quantize_cuda(ptr<const uint16_t>(src), rows, cols, row_stride, ptr<const uint32_t>(amax),
                                     ptr<uint8_t>(data), ptr<uint8_t>(scale), scale_layout, ptr<float>(tensor_scale),
                                     ptr<void>(stream)),
              "rx_nvfp4_quantize_cuda");
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("amax"), py::arg("data"),
      py::arg("scale"), py::arg("scale_layout"), py::arg("tensor_scale"), py::arg("stream"));
  m.def(
      "nvfp4_tensor_scale_cuda",
      [](uintptr_t amax, uintptr_t out, uintptr_t stream) {
        check(rx_nvfp4_tensor_scale_cuda(ptr<const uint32_t>(amax), ptr<float>(out), ptr<void>(stream)),
              "rx_nvfp4_tensor_scale_cuda");
      },
      py::arg("amax"), py::arg("tensor_scale"), py::arg("stream"));
#endif
}

}  // namespace rx::python
