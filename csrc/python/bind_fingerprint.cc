// model_fingerprint: the exact state of an nn.Module tree that a model description depends
// on, packed into bytes so a warm swap_model_weights compares two calls with one memcmp.
// It walks Python objects (modules, their tensors) through the C API: the walk is per call
// and per tensor, the hot loop of a warm swap, and Python's interpreter was most of its cost.
// A plain tensor's metadata is read through torch's C shim (TensorAbi), not its Python
// attributes: each of those built a Python object per read (shape, strides, data_ptr).
// model_snapshot records what the walk read, so that a warm swap re-checks it (unchanged())
// in a fraction of a walk: per dict one version compare, per tensor one metadata read.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

// Record tags: a value of one kind can never read as another, so equal bytes mean equal state.
enum Tag : int64_t {
  kNone = 1, kFalse, kTrue, kInt, kBigInt, kStr, kSeq, kOther,
  kModule, kChildren, kTable, kTensor, kEnd, kShimTensor,
};

// Interned, as attribute names are: dict lookups then match by pointer.
py::object interned(const char* s) { return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(s)); }

// PEP 509 dict versions: a new value on every mutation of a dict (deprecated in 3.12, gone
// in 3.14, where snapshots report "changed" and every warm call walks again).
#if PY_VERSION_HEX < 0x030E0000
constexpr bool kDictVersions = true;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
uint64_t dict_version(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#pragma GCC diagnostic pop
#else
constexpr bool kDictVersions = false;
uint64_t dict_version(PyObject*) { return 0; }
#endif

struct Names {
  py::object modules = interned("_modules"), params = interned("_parameters"), buffers = interned("_buffers"),
             non_persistent = interned("_non_persistent_buffers_set"), layer_number = interned("layer_number"),
             data_ptr = interned("data_ptr"), shape = interned("shape"), stride = interned("stride"),
             dtype = interned("dtype");
};

// torch's C shim (AOTInductor's stable C ABI, exported by libtorch), resolved by Python and
// passed as function addresses: no torch headers or link (DESIGN section 3). A handle is an
// at::Tensor*, i.e. the address of a TensorImpl pointer (checked by Python's probe).
struct TensorAbi {
  using Handle = void*;
  int32_t (*data_ptr)(Handle, void**);
  int32_t (*dim)(Handle, int64_t*);
  int32_t (*sizes)(Handle, int64_t**);
  int32_t (*strides)(Handle, int64_t**);
  int32_t (*dtype)(Handle, int32_t*);
  int32_t (*device_type)(Handle, int32_t*);
  int32_t (*device_index)(Handle, int32_t*);
  PyObject* exact[2];  // torch.Tensor and nn.Parameter: their _cdata is torch's own (a subclass may differ)
  py::object keep;     // the tuple the types came from
  py::object cdata = interned("_cdata");

  explicit TensorAbi(const py::tuple& t) : keep(t) {
    if (t.size() != 9) throw py::value_error("TensorAbi: expected 7 function addresses and 2 types");
    auto fn = [&](size_t i) { return reinterpret_cast<void*>(t[i].cast<uintptr_t>()); };
    data_ptr = reinterpret_cast<decltype(data_ptr)>(fn(0));
    dim = reinterpret_cast<decltype(dim)>(fn(1));
    sizes = reinterpret_cast<decltype(sizes)>(fn(2));
    strides = reinterpret_cast<decltype(strides)>(fn(3));
    dtype = reinterpret_cast<decltype(dtype)>(fn(4));
    device_type = reinterpret_cast<decltype(device_type)>(fn(5));
    device_index = reinterpret_cast<decltype(device_index)>(fn(6));
    exact[0] = t[7].ptr();
    exact[1] = t[8].ptr();
  }

  bool handles(PyObject* o) const { return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(exact[0]) ||
                                           Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(exact[1]); }

  struct Meta {
    int64_t head[5];  // data_ptr, device type, device index, dtype, dim
    const int64_t* sizes;
    const int64_t* strides;
  };

  // The metadata of tensor `o` (an exact torch.Tensor or Parameter); false when torch refuses.
  bool meta(PyObject* o, Meta& m) const {
    PyObject* c = PyObject_GetAttr(o, cdata.ptr());
    if (c == nullptr) throw py::error_already_set();
    void* impl = PyLong_AsVoidPtr(c);
    Py_DECREF(c);
    if (impl == nullptr) {
      PyErr_Clear();
      return false;
    }
    Handle h = &impl;  // an at::Tensor is one TensorImpl pointer
    void* ptr = nullptr;
    int64_t *sz = nullptr, *st = nullptr;
    int32_t dt = 0, dev = 0, idx = 0;
    if (data_ptr(h, &ptr) || device_type(h, &dev) || device_index(h, &idx) || dtype(h, &dt) ||
        dim(h, &m.head[4]) || sizes(h, &sz) || strides(h, &st)) {
      return false;
    }
    m.head[0] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr));
    m.head[1] = dev;
    m.head[2] = idx;
    m.head[3] = dt;
    m.sizes = sz;
    m.strides = st;
    return true;
  }

  // Appends (data_ptr, device type, device index, dtype, dim, sizes, strides) of tensor `o`;
  // false, with `out` as it was, when torch refuses.
  bool read(PyObject* o, std::vector<int64_t>& out) const {
    Meta m;
    if (!meta(o, m)) return false;
    const int64_t n = m.head[4];
    out.insert(out.end(), m.head, m.head + 5);
    out.insert(out.end(), m.sizes, m.sizes + n);
    out.insert(out.end(), m.strides, m.strides + n);
    return true;
  }

  // Whether read(o) would append exactly w[0, len): compared in place, the warm check's hot loop.
  bool reads_as(PyObject* o, const int64_t* w, size_t len) const {
    Meta m;
    if (len < 5 || !meta(o, m)) return false;
    const int64_t n = m.head[4];
    if (n < 0 || len != 5 + 2 * static_cast<size_t>(n)) return false;
    for (int i = 0; i < 5; ++i) {
      if (w[i] != m.head[i]) return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (w[5 + i] != m.sizes[i] || w[5 + n + i] != m.strides[i]) return false;
    }
    return true;
  }
};

// What a warm call re-checks instead of walking the trees again: every dict the walk read,
// by version (and, for an object's __dict__, that it still is that object's), and a re-read
// of what no dict version sees: tensors' metadata and the items of lists, tuples and sets.
struct Snapshot {
  struct Dict {
    py::object owner;  // the object whose __dict__ it is, or null for a dict held in one
    py::object dict;
    mutable uint64_t version;
    // Of an object's __dict__, the items the walk read: when its version moved (an attribute
    // the walk never reads was set, or eval() flipped `training`), these alone decide.
    std::vector<std::pair<PyObject*, py::object>> items;  // (interned key, value or null)
  };
  struct Reread {
    py::object obj;
    bool tensor;
    size_t begin, end;  // its words in the fingerprint
  };
  std::vector<Dict> dicts;
  std::vector<Reread> rereads;
  std::vector<int64_t> words;  // the fingerprint
  py::tuple attrs;
  py::object abi;  // a TensorAbi or None

  void dict(PyObject* owner, PyObject* d, std::initializer_list<PyObject*> keys = {}) {
    dicts.push_back({py::reinterpret_borrow<py::object>(owner), py::reinterpret_borrow<py::object>(d),
                     dict_version(d), {}});
    for (PyObject* k : keys) {
      PyObject* v = PyDict_GetItemWithError(d, k);
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      dicts.back().items.emplace_back(k, py::reinterpret_borrow<py::object>(v));
    }
  }
  void dict(PyObject* owner, PyObject* d, const py::tuple& keys) {
    dict(owner, d);
    for (const auto& k : keys) {
      PyObject* v = PyDict_GetItemWithError(d, k.ptr());
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      dicts.back().items.emplace_back(k.ptr(), py::reinterpret_borrow<py::object>(v));
    }
  }
  bool unchanged() const;
};

class Packer {
 public:
  // `out` is kept between calls (cleared here) so that a warm swap does not map and
  // page-fault a fresh buffer of the fingerprint's size each time.
  Packer(const Names& n, const py::tuple& attrs, const TensorAbi* abi, std::vector<int64_t>& out,
         Snapshot* snap = nullptr)
      : n_(n), attrs_(attrs), abi_(abi), out_(out), snap_(snap) {
    out_.clear();
  }

  void module_tree(PyObject* root) {
    seen_.reserve(512);
    std::vector<PyObject*> stack{root};
    while (!stack.empty()) {
      PyObject* mod = stack.back();
      stack.pop_back();
      if (mod == Py_None || !seen_.insert(mod).second) continue;  // shared submodules: once, as Module.modules()
      py::object d = dict_of(mod);
      PyObject* children = item(d.ptr(), n_.modules);
      if (snap_ != nullptr) {
        snap_->dict(mod, d.ptr(), {n_.modules.ptr(), n_.layer_number.ptr(), n_.non_persistent.ptr(),
                                   n_.params.ptr(), n_.buffers.ptr()});
      }
      if (snap_ != nullptr && children != nullptr) snap_->dict(nullptr, children);
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
      const size_t begin = out_.size();
      put(kSeq);
      put(reinterpret_cast<intptr_t>(Py_TYPE(v)));
      if (PyAnySet_Check(v) && PySet_GET_SIZE(v) == 0) {  // most modules' non-persistent buffer names
        put(0);
      } else {
        // a set's order may differ between equal sets: at worst a needless re-description
        py::object seq =
            py::reinterpret_steal<py::object>(PyAnySet_Check(v) ? PySequence_List(v) : PySequence_Fast(v, ""));
        if (!seq) throw py::error_already_set();
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
        put(n);
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        for (Py_ssize_t i = 0; i < n; ++i) value(items[i]);
      }
      if (snap_ != nullptr) {
        snap_->rereads.push_back({py::reinterpret_borrow<py::object>(v), false, begin, out_.size()});
      }
    } else {
      put(kOther);
      put(reinterpret_cast<intptr_t>(Py_TYPE(v)));
      put(reinterpret_cast<intptr_t>(v));
    }
  }

  void tensor(PyObject* t) {
    const size_t begin = out_.size();
    if (snap_ != nullptr) snap_->rereads.push_back({py::reinterpret_borrow<py::object>(t), true, begin, 0});
    tensor_words(t);
    if (snap_ != nullptr) snap_->rereads.back().end = out_.size();
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
    if (snap_ != nullptr) snap_->dict(nullptr, t);
    Py_ssize_t pos = 0;
    PyObject *key, *t_obj;
    while (PyDict_Next(t, &pos, &key, &t_obj)) {
      if (t_obj == Py_None) continue;
      value(key);
      tensor(t_obj);
      py::object d = dict_of(t_obj);
      if (snap_ != nullptr) snap_->dict(t_obj, d.ptr(), attrs_);
      for (const auto& a : attrs_) value(item(d.ptr(), py::reinterpret_borrow<py::object>(a)));
    }
    if (PyErr_Occurred()) throw py::error_already_set();
  }

  void tensor_words(PyObject* t) {
    if (abi_ != nullptr && abi_->handles(t)) {
      put(kShimTensor);
      put(reinterpret_cast<intptr_t>(t));
      if (abi_->read(t, out_)) return;
      out_.pop_back();
      out_.pop_back();
    }
    put(kTensor);
    put(reinterpret_cast<intptr_t>(t));
    put(reinterpret_cast<intptr_t>(Py_TYPE(t)));  // a tensor whose class changed (swap_tensors)
    py::object ptr = call(t, n_.data_ptr);
    put(static_cast<int64_t>(PyLong_AsUnsignedLongLongMask(ptr.ptr())));
    ints(attr(t, n_.shape).ptr());
    ints(call(t, n_.stride).ptr());
    put(reinterpret_cast<intptr_t>(attr(t, n_.dtype).ptr()));  // torch dtypes are singletons
  }

  const Names& n_;
  const py::tuple& attrs_;
  const TensorAbi* abi_;
  std::unordered_set<PyObject*> seen_;
  std::vector<int64_t>& out_;
  Snapshot* snap_;
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

const Names& names() {
  static const Names* n = new Names();  // interned once; never freed (outlives the interpreter's teardown)
  return *n;
}

bool Snapshot::unchanged() const {
  if (!kDictVersions) return false;
  for (const Dict& d : dicts) {
    if (d.owner) {
      PyObject* now = PyObject_GenericGetDict(d.owner.ptr(), nullptr);
      if (now == nullptr) {
        PyErr_Clear();
        return false;
      }
      const bool same = now == d.dict.ptr();
      Py_DECREF(now);
      if (!same) return false;
    }
    if (dict_version(d.dict.ptr()) == d.version) continue;
    if (!d.owner) return false;
    for (const auto& [key, value] : d.items) {
      PyObject* now = PyDict_GetItemWithError(d.dict.ptr(), key);
      if (now == nullptr && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      if (now != value.ptr()) return false;
    }
    d.version = dict_version(d.dict.ptr());  // the same items: this version reads as the recorded one
  }
  std::vector<int64_t> now;
  const TensorAbi* shim = abi.is_none() ? nullptr : abi.cast<const TensorAbi*>();
  Packer p(names(), attrs, shim, now);
  for (const Reread& r : rereads) {
    const int64_t* w = words.data() + r.begin;
    PyObject* o = r.obj.ptr();
    // The usual cases compared in place: a tensor the shim read, an empty set (most modules'
    // non-persistent buffer names); the words are those Packer::tensor and value() write.
    if (r.tensor && shim != nullptr && r.end - r.begin > 2 && w[0] == kShimTensor && shim->handles(o)) {
      if (w[1] != reinterpret_cast<intptr_t>(o)) return false;
      try {
        if (!shim->reads_as(o, w + 2, r.end - r.begin - 2)) return false;
      } catch (py::error_already_set&) {
        return false;
      }
      continue;
    }
    if (!r.tensor && PyAnySet_Check(o) && PySet_GET_SIZE(o) == 0 && r.end - r.begin == 3) {
      if (w[0] != kSeq || w[1] != reinterpret_cast<intptr_t>(Py_TYPE(o)) || w[2] != 0) return false;
      continue;
    }
    now.clear();
    try {
      if (r.tensor) {
        p.tensor(r.obj.ptr());
      } else {
        p.value(r.obj.ptr());
      }
    } catch (py::error_already_set&) {  // a subclass's Python reads raising: changed, whatever it says
      return false;
    }
    if (now.size() != r.end - r.begin || !std::equal(now.begin(), now.end(), words.begin() + r.begin)) return false;
  }
  return true;
}

}  // namespace

void register_fingerprint(py::module_& m) {
  py::class_<Snapshot>(m, "ModelSnapshot",
                       "model_fingerprint's bytes of some module trees, and what a later unchanged() re-checks "
                       "to tell, without walking the trees again, that they would still give those bytes.")
      .def_property_readonly("fingerprint",
                             [](const Snapshot& s) {
                               return py::bytes(reinterpret_cast<const char*>(s.words.data()),
                                                s.words.size() * sizeof(int64_t));
                             })
      .def(
          "unchanged",
          [](const Snapshot& s) {
            GcPause pause;
            return s.unchanged();
          },
          "True only if model_fingerprint of the same roots would return `fingerprint` (False where "
          "this Python has no dict versions).")
      .def("__len__", [](const Snapshot& s) { return s.dicts.size() + s.rereads.size(); });
  m.def(
      "model_snapshot",
      [](const py::list& roots, const py::tuple& attrs, const py::object& abi) {
        auto snap = std::make_unique<Snapshot>();
        snap->attrs = attrs;
        snap->abi = abi;
        GcPause pause;
        Packer p(names(), attrs, abi.is_none() ? nullptr : abi.cast<const TensorAbi*>(), snap->words, snap.get());
        for (const auto& r : roots) {
          p.module_tree(r.ptr());
          p.end_root();
        }
        return snap;
      },
      py::arg("roots"), py::arg("attrs"), py::arg("abi") = py::none(),
      "model_fingerprint(roots, attrs, abi) as a ModelSnapshot.");
  py::class_<TensorAbi>(m, "TensorAbi",
                        "torch's C shim functions (addresses of aoti_torch_get_data_ptr, _dim, _sizes, _strides, "
                        "_dtype, _device_type, _device_index) and the exact tensor types they read.")
      .def(py::init<const py::tuple&>(), py::arg("fns_and_types"))
      .def(
          "read",
          [](const TensorAbi& abi, const py::object& t) -> py::object {
            std::vector<int64_t> v;
            if (!abi.handles(t.ptr()) || !abi.read(t.ptr(), v)) return py::none();
            return py::cast(v);
          },
          py::arg("tensor"),
          "[data_ptr, device type, device index, dtype, dim, *sizes, *strides] as the fingerprint reads them, "
          "or None where it reads the tensor through Python.");
  m.def(
      "model_fingerprint",
      [](const py::list& roots, const py::tuple& attrs, const TensorAbi* abi) {
        // The buffer of the last call, unless a call is in flight (a tensor subclass's Python
        // data_ptr could call back in): then one of its own.
        static std::vector<int64_t> kept;
        static bool busy = false;
        std::vector<int64_t> own;
        const bool reuse = !busy;
        busy = true;
        struct Release {
          bool reuse;
          ~Release() {
            if (reuse) busy = false;
          }
        } release{reuse};
        GcPause pause;
        Packer p(names(), attrs, abi, reuse ? kept : own);
        for (const auto& r : roots) {
          p.module_tree(r.ptr());
          p.end_root();
        }
        return p.bytes();
      },
      py::arg("roots"), py::arg("attrs"), py::arg("abi") = nullptr,
      "Bytes equal between two calls iff every module of the trees (object, children, layer_number, "
      "non-persistent buffer names) and every parameter and buffer (name, object, data_ptr, shape, strides, "
      "dtype, the tensor attributes named in `attrs`) are the same. With `abi` (a TensorAbi), plain tensors' "
      "metadata is read through torch's C shim.");
}

}  // namespace rx::python
