// model_fingerprint: the exact state of an nn.Module tree that a model description depends
// on, packed into bytes so a warm swap_model_weights compares two calls with one memcmp.
// It walks Python objects (modules, their tensors) through the C API: the walk is per call
// and per tensor, the hot loop of a warm swap, and Python's interpreter was most of its cost.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

// Record tags: a value of one kind can never read as another, so equal bytes mean equal state.
enum Tag : int64_t {
  kNone = 1, kFalse, kTrue, kInt, kBigInt, kStr, kSeq, kOther,
  kModule, kChildren, kTable, kTensor, kEnd,
};

// Interned, as attribute names are: dict lookups then match by pointer.
py::object interned(const char* s) { return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(s)); }

struct Names {
  py::object modules = interned("_modules"), params = interned("_parameters"), buffers = interned("_buffers"),
             non_persistent = interned("_non_persistent_buffers_set"), layer_number = interned("layer_number"),
             data_ptr = interned("data_ptr"), shape = interned("shape"), stride = interned("stride"),
             dtype = interned("dtype");
};

class Packer {
 public:
  Packer(const Names& n, const py::tuple& attrs) : n_(n), attrs_(attrs) { out_.reserve(1 << 14); }

  void module_tree(PyObject* root) {
    std::vector<PyObject*> stack{root};
    while (!stack.empty()) {
      PyObject* mod = stack.back();
      stack.pop_back();
      if (mod == Py_None || !seen_.insert(mod).second) continue;  // shared submodules: once, as Module.modules()
      py::object d = dict_of(mod);
      PyObject* children = item(d.ptr(), n_.modules);
      put(kModule);
      put(reinterpret_cast<intptr_t>(mod));
      value(item(d.ptr(), n_.layer_number));
      value(item(d.ptr(), n_.non_persistent));
      put(kChildren);
      size_t first = stack.size();
      Py_ssize_t pos = 0;
      PyObject *key, *child;
      while (PyDict_Next(children, &pos, &key, &child)) {
        value(key);
        put(reinterpret_cast<intptr_t>(child));
        stack.push_back(child);
      }
      std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());  // visit children in order
      table(item(d.ptr(), n_.params));
      table(item(d.ptr(), n_.buffers));
    }
  }

  void end_root() {
    put(kEnd);
    seen_.clear();  // per root, as Module.modules() of each chunk
  }

  py::bytes bytes() const {
    return py::bytes(reinterpret_cast<const char*>(out_.data()), out_.size() * sizeof(int64_t));
  }

 private:
  static py::object attr(PyObject* o, const py::object& name) {
    PyObject* r = PyObject_GetAttr(o, name.ptr());
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }
  static py::object dict_of(PyObject* o) {  // the instance __dict__, without Module.__getattr__'s detour
    PyObject* r = PyObject_GenericGetDict(o, nullptr);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }
  static py::object call(PyObject* o, const py::object& name) {
    PyObject* r = PyObject_CallMethodNoArgs(o, name.ptr());
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }
  // A module's own dict entry (borrowed), nullptr when absent; the dict itself must be one.
  static PyObject* item(PyObject* d, const py::object& key) {
    if (!PyDict_Check(d)) throw py::type_error("model_fingerprint: __dict__ is not a dict");
    return PyDict_GetItemWithError(d, key.ptr());
  }

  void put(int64_t v) { out_.push_back(v); }

  void str(PyObject* s) {
    Py_ssize_t len = 0;
    const char* p = PyUnicode_AsUTF8AndSize(s, &len);
    if (p == nullptr) throw py::error_already_set();
    put(kStr);
    put(len);
    size_t at = out_.size();
    out_.resize(at + (static_cast<size_t>(len) + 7) / 8, 0);
    std::memcpy(out_.data() + at, p, static_cast<size_t>(len));
  }

  // Exact for what Megatron stamps (None, bools, ints, strings, lists and tuples of them);
  // any other object by identity.
  void value(PyObject* v) {
    if (v == nullptr || v == Py_None) {
      if (PyErr_Occurred()) throw py::error_already_set();
      put(kNone);
    } else if (v == Py_False || v == Py_True) {
      put(v == Py_True ? kTrue : kFalse);
    } else if (PyLong_Check(v)) {
      int overflow = 0;
      long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
      if (overflow != 0) {
        put(kBigInt);
        py::object s = py::reinterpret_steal<py::object>(PyObject_Str(v));
        if (!s) throw py::error_already_set();
        str(s.ptr());
      } else {
        put(kInt);
        put(x);
      }
    } else if (PyUnicode_Check(v)) {
      str(v);
    } else if (PyTuple_Check(v) || PyList_Check(v) || PyAnySet_Check(v)) {
      // a set's order may differ between equal sets: at worst a needless re-description
      py::object seq = py::reinterpret_steal<py::object>(PyAnySet_Check(v) ? PySequence_List(v) : PySequence_Fast(v, ""));
      if (!seq) throw py::error_already_set();
      Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
      put(kSeq);
      put(reinterpret_cast<intptr_t>(Py_TYPE(v)));
      put(n);
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) value(items[i]);
    } else {
      put(kOther);
      put(reinterpret_cast<intptr_t>(Py_TYPE(v)));
      put(reinterpret_cast<intptr_t>(v));
    }
  }

  void ints(PyObject* seq) {  // torch.Size / stride tuples
    if (!PyTuple_Check(seq)) throw py::type_error("model_fingerprint: expected a tuple of ints");
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    put(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
      if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
      put(x);
    }
  }

  void table(PyObject* t) {  // _parameters or _buffers: name -> tensor or None
    put(kTable);
    if (t == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return;
    }
    if (!PyDict_Check(t)) throw py::type_error("model_fingerprint: a parameter table is not a dict");
    Py_ssize_t pos = 0;
    PyObject *key, *t_obj;
    while (PyDict_Next(t, &pos, &key, &t_obj)) {
      if (t_obj == Py_None) continue;
      value(key);
      put(kTensor);
      put(reinterpret_cast<intptr_t>(t_obj));
      py::object ptr = call(t_obj, n_.data_ptr);
      put(static_cast<int64_t>(PyLong_AsUnsignedLongLongMask(ptr.ptr())));
      ints(attr(t_obj, n_.shape).ptr());
      ints(call(t_obj, n_.stride).ptr());
      put(reinterpret_cast<intptr_t>(attr(t_obj, n_.dtype).ptr()));  // torch dtypes are singletons
      py::object d = dict_of(t_obj);
      for (const auto& a : attrs_) value(item(d.ptr(), py::reinterpret_borrow<py::object>(a)));
    }
    if (PyErr_Occurred()) throw py::error_already_set();
  }

  const Names& n_;
  const py::tuple& attrs_;
  std::unordered_set<PyObject*> seen_;
  std::vector<int64_t> out_;
};

// Pauses the cyclic GC during the walk: the shape and stride tuples it allocates and frees
// would otherwise trigger collections that scan torch's many live objects.
class GcPause {
 public:
  GcPause() : was_enabled_(PyGC_Disable()) {}
  ~GcPause() {
    if (was_enabled_) PyGC_Enable();
  }

 private:
  int was_enabled_;
};

}  // namespace

void register_fingerprint(py::module_& m) {
  m.def(
      "model_fingerprint",
      [](const py::list& roots, const py::tuple& attrs) {
        static const Names* names = new Names();  // interned once; never freed (outlives the interpreter's teardown)
        GcPause pause;
        Packer p(*names, attrs);
        for (const auto& r : roots) {
          p.module_tree(r.ptr());
          p.end_root();
        }
        return p.bytes();
      },
      py::arg("roots"), py::arg("attrs"),
      "Bytes equal between two calls iff every module of the trees (object, children, layer_number, "
      "non-persistent buffer names) and every parameter and buffer (name, object, data_ptr, shape, strides, "
      "dtype, the tensor attributes named in `attrs`) are the same.");
}

}  // namespace rx::python
