#include "python/register.h"

namespace rx::python {
void register_mxfp8(pybind11::module_&) {}
}  // namespace rx::python
