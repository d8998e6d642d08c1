#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "common/check.h"
#include "python/box_table.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {

std::vector<rx_box> boxes_from(const py::buffer& table) {
  if (py::isinstance<BoxTable>(table)) return table.cast<const BoxTable&>().boxes;
  const py::buffer_info info = table.request();
  const size_t n = static_cast<size_t>(info.size * info.itemsize);
  RX_HOST_ASSERT(n % sizeof(rx_box) == 0, "table of ", n, " bytes is not a whole number of ", sizeof(rx_box),
                 "-byte boxes");
  std::vector<rx_box> v(n / sizeof(rx_box));
  if (n) std::memcpy(v.data(), info.ptr, n);
  return v;
}

void register_box_table(py::module_& m) {
  m.attr("BOX_BYTES") = sizeof(rx_box);
  py::class_<BoxTable>(m, "BoxTable", py::buffer_protocol(),
                       "rx_box records (csrc/core/box.h) of a bound plan: len() boxes; its buffer is the records' "
                       "bytes (numpy.frombuffer with the record dtype reads them).")
      .def(py::init<>())
      .def_buffer([](BoxTable& t) {
        return py::buffer_info(t.boxes.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(t.boxes.size() * sizeof(rx_box))}, {1}, true);
      })
      .def("__len__", [](const BoxTable& t) { return t.boxes.size(); })
      .def("__eq__", [](const BoxTable& a, const BoxTable& b) {
        return a.boxes.size() == b.boxes.size() &&
               (a.boxes.empty() || std::memcmp(a.boxes.data(), b.boxes.data(), a.boxes.size() * sizeof(rx_box)) == 0);
      })
      .def("__repr__", [](const BoxTable& t) { return "BoxTable(" + std::to_string(t.boxes.size()) + " boxes)"; });
}

}  // namespace rx::python
