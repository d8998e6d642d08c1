// The blockwise FP8 codec: its box code, the per-block scales and the whole-piece quantize
// (codecs/fp8block.h). Python passes data_ptr()s (ints), shapes and the CUDA stream handle;
// nothing here knows torch.
#include <pybind11/pybind11.h>

#include "common/check.h"
#include "kernels/codecs/fp8block.h"
#include "kernels/codecs/fp8block_api.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

void register_fp8block(py::module_& m) {
  m.attr("FP8B_BLOCK") = fp8b::kBlock;
  m.attr("FP8B_ITEM") = fp8b::kItem;
  m.attr("BOX_FP8B") = static_cast<int>(RX_CODEC_FP8BLOCK);  // rx_box.codec id (| scales << 8)
  m.attr("FP8B_FP32") = static_cast<int>(RX_FP8B_FP32);
  m.attr("FP8B_POW2") = static_cast<int>(RX_FP8B_POW2);
  m.attr("FP8B_SIDE_BYTES") = static_cast<int>(sizeof(fp8b::Side));

  m.def(
      "fp8block_scales_cpu",
      [](uintptr_t amax, int64_t cells, int32_t scales, uintptr_t scale_inv, uintptr_t mult) {
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_fp8block_scales_cpu(ptr<const uint32_t>(amax), cells, scales, ptr<float>(scale_inv),
                                      ptr<uint32_t>(mult));
        }
        RX_HOST_ASSERT(rc == 0, "rx_fp8block_scales_cpu: bad arguments");
      },
      py::arg("amax"), py::arg("cells"), py::arg("scales"), py::arg("scale_inv"), py::arg("mult"));
  m.def(
      "fp8block_quantize_cpu",
      [](uintptr_t src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t rowmap,
         uintptr_t colmap, uintptr_t mult, int32_t scales, uintptr_t data) {
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_fp8block_quantize_cpu(ptr<const void>(src), dtype, rows, cols, row_stride, ptr<const int32_t>(rowmap),
                                        ptr<const int32_t>(colmap), ptr<const uint32_t>(mult), scales,
                                        ptr<uint8_t>(data));
        }
        RX_HOST_ASSERT(rc == 0, "rx_fp8block_quantize_cpu: bad arguments");
      },
      py::arg("src"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("rowmap"),
      py::arg("colmap"), py::arg("mult"), py::arg("scales"), py::arg("data"));
#ifdef RX_WITH_CUDA
  m.def(
      "fp8block_scales_cuda",
      [](uintptr_t amax, int64_t cells, int32_t scales, uintptr_t scale_inv, uintptr_t mult, uintptr_t stream) {
        const int32_t rc = rx_fp8block_scales_cuda(ptr<const uint32_t>(amax), cells, scales, ptr<float>(scale_inv),
                                                   ptr<uint32_t>(mult), ptr<void>(stream));
        RX_HOST_ASSERT(rc == 0, "rx_fp8block_scales_cuda failed with code ", rc);
      },
      py::arg("amax"), py::arg("cells"), py::arg("scales"), py::arg("scale_inv"), py::arg("mult"), py::arg("stream"));
  m.def(
      "fp8block_quantize_cuda",
      [](uintptr_t src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t rowmap,
         uintptr_t colmap, uintptr_t mult, int32_t scales, uintptr_t data, uintptr_t stream) {
        const int32_t rc = rx_fp8block_quantize_cuda(
            ptr<const void>(src), dtype, rows, cols, row_stride, ptr<const int32_t>(rowmap), ptr<const int32_t>(colmap),
            ptr<const uint32_t>(mult), scales, ptr<uint8_t>(data), ptr<void>(stream));
        RX_HOST_ASSERT(rc == 0, "rx_fp8block_quantize_cuda failed with code ", rc);
      },
      py::arg("src"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("rowmap"),
      py::arg("colmap"), py::arg("mult"), py::arg("scales"), py::arg("data"), py::arg("stream"));
#endif
}

}  // namespace rx::python
