// Tables of rx_box records as one typed Python object, _C.BoxTable, instead of bytes.
// Every binding that reads a table takes any bytes-like object (a BoxTable, or the numpy
// records tests build), through boxes_from.
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "core/box.h"

namespace rx::python {

struct BoxTable {
  std::vector<rx_box> boxes;
};

// A copy of a bytes-like table of whole rx_box records (aligned whatever the source).
std::vector<rx_box> boxes_from(const pybind11::buffer& table);

}  // namespace rx::python
