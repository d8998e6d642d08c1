#include "python/register.h"

namespace rx::python {
void register_cuda(pybind11::module_&) {}
}  // namespace rx::python
