// The partial-amax kernels and the block-grid geometry of a piece (codecs/amax.h): the pre-pass
// of the codecs whose scales depend on blocks several ranks share. Python passes data_ptr()s
// (ints), shapes and the CUDA stream handle; nothing here knows torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/check.h"
#include "kernels/codecs/amax.h"
#include "kernels/codecs/amax_api.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

namespace {

template <typename T>
py::bytes raw_bytes(const std::vector<T>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

Runs to_runs(const std::vector<std::pair<int64_t, int64_t>>& runs) {
  Runs out;
  for (const auto& r : runs) out.push_back(Run{r.first, r.second});
  return out;
}

}  // namespace

void register_amax(py::module_& m) {
  m.attr("AMAX_NAN_PROPAGATE") = static_cast<int>(RX_AMAX_NAN_PROPAGATE);
  m.attr("AMAX_NAN_IGNORE") = static_cast<int>(RX_AMAX_NAN_IGNORE);

  m.def(
      "amax_piece_grid",
      [](const std::vector<std::vector<std::pair<int64_t, int64_t>>>& runs, const std::vector<int64_t>& shape,
         const std::vector<int64_t>& block) -> py::object {
        std::vector<Runs> in;
        for (const auto& r : runs) in.push_back(to_runs(r));
        amax::PieceGrid g;
        const std::string why = amax::piece_grid(in, shape, block, &g);
        if (!why.empty()) return py::str(why);
        return py::make_tuple(g.grid, raw_bytes(g.rowmap), raw_bytes(g.colmap), raw_bytes(g.cells), g.aligned);
      },
      py::arg("runs"), py::arg("shape"), py::arg("block"),
      "The block grid of a piece (per-dim runs): (cells per dim, rowmap int32 bytes, colmap int32 bytes, "
      "touched cells int64 bytes, aligned), or a str saying why there is none.");
  m.def(
      "amax_block_runs",
      [](const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t extent, int64_t block) {
        RX_USER_CHECK(block >= 1 && extent >= 0, "amax_block_runs: bad block ", block, " or extent ", extent);
        bool aligned = true;
        const Runs out = amax::block_runs(to_runs(runs), extent, block, &aligned);
        std::vector<std::pair<int64_t, int64_t>> l;
        for (const Run& r : out) l.emplace_back(r.start, r.len);
        return py::make_tuple(l, aligned);
      },
      py::arg("runs"), py::arg("extent"), py::arg("block"),
      "(block runs of a piece's runs along one dim, whether every run lies on the block grid).");

  m.def(
      "amax_partial_cpu",
      [](uintptr_t src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t rowmap,
         uintptr_t colmap, int32_t nan, uintptr_t grid) {
        int32_t rc;
        {
          py::gil_scoped_release release;
          rc = rx_amax_partial_cpu(reinterpret_cast<const void*>(src), dtype, rows, cols, row_stride,
                                   reinterpret_cast<const int32_t*>(rowmap), reinterpret_cast<const int32_t*>(colmap),
                                   nan, reinterpret_cast<uint32_t*>(grid));
        }
        RX_HOST_ASSERT(rc == 0, "rx_amax_partial_cpu: bad arguments");
      },
      py::arg("src"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("rowmap"),
      py::arg("colmap"), py::arg("nan"), py::arg("grid"));
#ifdef RX_WITH_CUDA
  m.def(
      "amax_partial_cuda",
      [](uintptr_t src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t rowmap,
         uintptr_t colmap, int32_t nan, uintptr_t grid, uintptr_t stream) {
        const int32_t rc = rx_amax_partial_cuda(reinterpret_cast<const void*>(src), dtype, rows, cols, row_stride,
                                                reinterpret_cast<const int32_t*>(rowmap),
                                                reinterpret_cast<const int32_t*>(colmap), nan,
                                                reinterpret_cast<uint32_t*>(grid), reinterpret_cast<void*>(stream));
        RX_HOST_ASSERT(rc == 0, "rx_amax_partial_cuda failed with code ", rc);
      },
      py::arg("src"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("rowmap"),
      py::arg("colmap"), py::arg("nan"), py::arg("grid"), py::arg("stream"));
#endif
}

}  // namespace rx::python
