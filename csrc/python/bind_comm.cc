#include "python/register.h"

namespace rx::python {
void register_comm(pybind11::module_&) {}
}  // namespace rx::python
