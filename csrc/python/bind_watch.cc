// DataPtrWatch: the data pointers of a plan's bound tensors, re-read before every execute
// in one C++ loop. Reading them through Python (Tensor.data_ptr per tensor) cost more than
// the rest of a 10,000-tensor execute; here each costs one call into torch through a plain
// function `void* (PyObject*)` that torch exports for Inductor's generated wrappers, whose
// address Python passes in (no torch headers or link, DESIGN section 3).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/check.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

using DataPtrFn = void* (*)(PyObject*);

// The Python object of the tensor this many places ahead is prefetched: of each read's
// dependent chain (object -> tensor -> storage), the one address known without torch's layouts.
constexpr size_t kAhead = 8;

class DataPtrWatch {
 public:
  DataPtrWatch(uintptr_t fn, const py::list& tensors) : fn_(reinterpret_cast<DataPtrFn>(fn)) {
    RX_HOST_ASSERT(fn != 0, "DataPtrWatch: no data_ptr function");
    owned_.reserve(tensors.size());
    entries_.reserve(tensors.size());
    for (const auto& t : tensors) {
      owned_.push_back(py::reinterpret_borrow<py::object>(t));
      // torch's function throws a C++ exception for anything but a tensor (or a tensor
      // without storage): refused here, so the loop in changed() only meets tensors.
      Entry e{t.ptr(), 0};
      try {
        e.ptr = read(e.obj);
      } catch (...) {
        throw py::type_error("DataPtrWatch: item " + std::to_string(entries_.size()) + " has no readable data_ptr");
      }
      entries_.push_back(e);
    }
  }

  // Indices of the tensors whose data pointer differs from the one read at construction.
  std::vector<int64_t> changed() const {
    std::vector<int64_t> out;
    const size_t n = entries_.size();
    const Entry* e = entries_.data();
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(e[i + kAhead].obj);
      uintptr_t p;
      try {
        p = read(e[i].obj);
      } catch (...) {  // a tensor that lost its storage: changed, whatever torch says why
        p = ~e[i].ptr;
      }
      if (p != e[i].ptr) out.push_back(static_cast<int64_t>(i));
    }
    return out;
  }

  std::vector<uintptr_t> ptrs() const {
    std::vector<uintptr_t> out;
    out.reserve(entries_.size());
    for (const Entry& e : entries_) out.push_back(e.ptr);
    return out;
  }

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    PyObject* obj;  // kept alive by owned_
    uintptr_t ptr;  // its data pointer at construction
  };

  uintptr_t read(PyObject* t) const { return reinterpret_cast<uintptr_t>(fn_(t)); }

  DataPtrFn fn_;
  std::vector<py::object> owned_;  // the references that keep the watched objects alive
  std::vector<Entry> entries_;     // what the loop reads, in order, in one array
};

}  // namespace

void register_watch(py::module_& m) {
  py::class_<DataPtrWatch>(m, "DataPtrWatch",
                           "The data pointers of a list of tensors, read with `fn` (the address of a C function "
                           "void* fn(PyObject* tensor)) now and again by changed().")
      .def(py::init<uintptr_t, const py::list&>(), py::arg("fn"), py::arg("tensors"))
      .def("changed", &DataPtrWatch::changed, "Indices of the tensors whose data_ptr differs from construction time.")
      .def_property_readonly("ptrs", &DataPtrWatch::ptrs, "The data pointers read at construction.")
      .def("__len__", &DataPtrWatch::size);
}

}  // namespace rx::python
