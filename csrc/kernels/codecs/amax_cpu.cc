// CPU twin of the partial-amax kernel (the reference the CUDA kernel matches, and the CPU
// refit's pre-pass) and the block-grid geometry of a piece (codecs/amax.h).
#include <string.h>

#include <algorithm>

#include "common/check.h"
#include "kernels/codecs/amax.h"
#include "kernels/codecs/amax_api.h"

namespace rx::amax {

namespace {

// One row: runs of consecutive columns that share a cell fold into one max each.
template <typename T>
void partial_row(const T* row, int64_t cols, int32_t dtype, const int32_t* colmap, int32_t nan, uint32_t* cells) {
  int64_t c = 0;
  while (c < cols) {
    const int32_t cell = colmap[c];
    uint32_t m = 0;
    for (; c < cols && colmap[c] == cell; ++c) {
      const uint32_t a = abs_bits(static_cast<uint32_t>(row[c]), dtype, nan);
      m = a > m ? a : m;
    }
    cells[cell] = m > cells[cell] ? m : cells[cell];
  }
}

template <typename T>
void partial(const T* src, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride, const int32_t* rowmap,
             const int32_t* colmap, int32_t nan, uint32_t* grid) {
  for (int64_t r = 0; r < rows; ++r) partial_row(src + r * row_stride, cols, dtype, colmap, nan, grid + rowmap[r]);
}

// The cell index along one dim of every local index, and the touched ones (ascending, once).
void dim_cells(const Runs& runs, int64_t block, std::vector<int64_t>* per_local, std::vector<int64_t>* touched) {
  per_local->clear();
  for (const Run& r : runs)
    for (int64_t i = 0; i < r.len; ++i) per_local->push_back((r.start + i) / block);
  *touched = *per_local;
  std::sort(touched->begin(), touched->end());
  touched->erase(std::unique(touched->begin(), touched->end()), touched->end());
}

}  // namespace

Runs block_runs(const Runs& runs, int64_t extent, int64_t block, bool* aligned) {
  Runs out;
  bool ok = true;
  for (const Run& r : runs) {
    if (r.len <= 0) continue;
    const int64_t end = r.start + r.len;
    ok = ok && r.start % block == 0 && (end % block == 0 || end == extent);
    append_run(out, Run{r.start / block, (end + block - 1) / block - r.start / block});
  }
  if (aligned) *aligned = ok;
  return out;
}

std::string piece_grid(const std::vector<Runs>& runs, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& block, PieceGrid* out) {
  const size_t nd = shape.size();
  if (nd == 0) return "a 0-d tensor has no block grid";
  if (runs.size() != nd || block.size() != nd) return "runs, shape and block differ in length";
  *out = PieceGrid{};
  int64_t cells = 1;
  for (size_t d = 0; d < nd; ++d) {
    if (block[d] < 1) return detail::format("block ", block[d], " along dim ", d, " is not positive");
    out->grid.push_back((shape[d] + block[d] - 1) / block[d]);
    cells *= out->grid.back() > 0 ? out->grid.back() : 1;
    if (cells > INT32_MAX) return "the block grid has more than 2^31 cells";
    for (const Run& r : runs[d])
      if (r.start < 0 || r.len < 0 || r.start + r.len > shape[d])
        return detail::format("a run [", r.start, ", ", r.start + r.len, ") outside dim ", d, " of extent ", shape[d]);
  }
  std::vector<int64_t> stride(nd, 1);  // of the flat grid
  for (size_t d = nd - 1; d > 0; --d) stride[d - 1] = stride[d] * out->grid[d];
  std::vector<std::vector<int64_t>> per_local(nd), touched(nd);
  for (size_t d = 0; d < nd; ++d) {
    bool ok = true;
    block_runs(runs[d], shape[d], block[d], &ok);
    out->aligned = out->aligned && ok;
    dim_cells(runs[d], block[d], &per_local[d], &touched[d]);
  }
  for (int64_t c : per_local[nd - 1]) out->colmap.push_back(static_cast<int32_t>(c));
  // rowmap: every dim but the last, odometer in local (row-major) order.
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < nd; ++d) rows *= static_cast<int64_t>(per_local[d].size());
  out->rowmap.reserve(static_cast<size_t>(rows));
  std::vector<size_t> at(nd, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t cell = 0;
    for (size_t d = 0; d + 1 < nd; ++d) cell += per_local[d][at[d]] * stride[d];
    out->rowmap.push_back(static_cast<int32_t>(cell));
    for (size_t d = nd - 1; d-- > 0;) {
      if (++at[d] < per_local[d].size()) break;
      at[d] = 0;
    }
  }
  // The touched cells: the product of the per-dim lists, row-major (ascending).
  int64_t n = 1;
  for (size_t d = 0; d < nd; ++d) n *= static_cast<int64_t>(touched[d].size());
  out->cells.reserve(static_cast<size_t>(n));
  std::fill(at.begin(), at.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t cell = 0;
    for (size_t d = 0; d < nd; ++d) cell += touched[d][at[d]] * stride[d];
    out->cells.push_back(cell);
    for (size_t d = nd; d-- > 0;) {
      if (++at[d] < touched[d].size()) break;
      at[d] = 0;
    }
  }
  return "";
}

}  // namespace rx::amax

extern "C" int32_t rx_amax_partial_cpu(const void* src, int32_t dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const int32_t* rowmap, const int32_t* colmap,
                                       int32_t nan, uint32_t* grid) {
  namespace am = rx::amax;
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols) || !am::readable(dtype)) return -1;
  if (nan != RX_AMAX_NAN_PROPAGATE && nan != RX_AMAX_NAN_IGNORE) return -1;
  if (dtype == RX_F32)
    am::partial(static_cast<const uint32_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, grid);
  else
    am::partial(static_cast<const uint16_t*>(src), dtype, rows, cols, row_stride, rowmap, colmap, nan, grid);
  return 0;
}
