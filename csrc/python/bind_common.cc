// The dtype table (common/dtype.h) for Python: _C.DType, _C.dtype_info, size and castability.
#include <pybind11/pybind11.h>

#include "common/dtype.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

void register_common(py::module_& m) {
  py::enum_<rx_dtype> dtype(m, "DType", "rx element type codes (common/dtype.h); member names are torch's.");
#define RX_DTYPE_VALUE_(e, code, bytes, name, is_float) dtype.value(name, e);
  RX_DTYPE_TABLE(RX_DTYPE_VALUE_)
#undef RX_DTYPE_VALUE_
  m.def(
      "dtype_info",
      [] {
        py::list rows;
        for (int32_t d = 0; d < RX_NUM_DTYPES; ++d)
          rows.append(py::make_tuple(d, dtype_name(d), dtype_size(d), dtype_is_float(d)));
        return rows;
      },
      "The dtype table: one (code, torch name, bytes, is_float) per type.");
  m.def("dtype_size", &dtype_size, "Bytes per element of an rx dtype code (0 if unknown).");
  m.def("dtype_castable", &dtype_castable, "Whether boxes may convert dtype s to d.");
}

}  // namespace rx::python
