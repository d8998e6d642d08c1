// DataPtrWatch: the data pointers of a plan's bound tensors, re-checked before every execute
// in one C++ loop. The authority is torch's C shim (aoti_torch_get_data_ptr, whose address
// Python passes in: no torch headers or link, DESIGN section 3), called on each tensor's
// TensorImpl (Tensor._cdata). A shim call per tensor costs more than the memory it reads, so
// with a RawLayout the loop first compares the words that data_ptr is computed from (the
// TensorImpl's storage, storage offset and numel, the StorageImpl's data pointer) at offsets
// that Python found and tested on probe tensors, and calls the shim only where a word moved.
// Both objects are prefetched ahead, the StorageImpl from the pointer read at binding.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "python/register.h"

namespace py = pybind11;

namespace rx::python {
namespace {

using DataPtrFn = int32_t (*)(void* tensor_handle, void** ret);  // the shim's: 0 on success

// Prefetch distance, in tensors (TensorImpl and StorageImpl lines alike).
constexpr size_t kAhead = 16;
// Every offset must fall inside a TensorImpl (192 bytes in c10) / the StorageImpl head.
constexpr int64_t kImplBytes = 192;
constexpr int64_t kStorageBytes = 64;

// Below this many tensors one thread checks them all: waking helpers would cost more.
constexpr size_t kParallelMin = 4096;
// Tensors per chunk that a thread takes at a time: many chunks per thread, so that threads
// waking late still share the work; long enough for the prefetch to pay within a chunk.
constexpr size_t kChunk = 512;

// Helper threads for the check of large watches: its loop is bound by the memory latency one
// core can hide, so chunks checked on several cores at once finish sooner. Made on first use,
// asleep between checks, kept for the process (a forked child makes its own).
class CheckPool {
 public:
  // The pool, with at least `helpers` threads (it grows to the most any call asked for).
  static CheckPool& get(size_t helpers) {
    static std::mutex made;
    static CheckPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || owner != getpid()) {  // after fork() the parent's threads are gone
      pool = new CheckPool();                    // never deleted: its threads live until exit
      owner = getpid();
    }
    for (; pool->helpers_ < helpers; ++pool->helpers_) std::thread([p = pool] { p->work(); }).detach();
    return *pool;
  }

  // Runs chunk(0) .. chunk(chunks - 1), each once, on the caller and up to `helpers` helpers
  // that wake while chunks remain (they take the next one as they come: a helper that wakes late
  // leaves the caller no idle wait). Returns when every chunk has run.
  void run(size_t chunks, size_t helpers, const std::function<void(size_t)>& chunk) {
    std::lock_guard<std::mutex> one_run(run_mu_);
    auto job = std::make_shared<Job>(chunk, chunks, helpers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      ++generation_;
    }
    cv_.notify_all();
    job->drain();
    while (job->done.load(std::memory_order_acquire) != chunks) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu_);
    job_.reset();
  }

 private:
  // One run's chunks. A helper that wakes after the run ended finds none left to take, so
  // it never calls `chunk` (a reference into the finished caller's frame).
  struct Job {
    Job(const std::function<void(size_t)>& c, size_t n, size_t h) : chunk(c), chunks(n), helpers(h) {}
    void drain() {
      for (size_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
        chunk(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    const std::function<void(size_t)>& chunk;
    const size_t chunks;
    const size_t helpers;  // how many helpers may join
    std::atomic<size_t> next{0}, done{0}, joined{0};
  };

  CheckPool() = default;

  void work() {
    uint64_t seen = 0;
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (job && job->joined.fetch_add(1) < job->helpers) job->drain();
    }
  }

  size_t helpers_ = 0;  // threads started (under get()'s lock)
  std::mutex run_mu_;  // one check at a time (two plans may check from two threads)
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  std::shared_ptr<Job> job_;  // the run in progress, if any
};

// Byte offsets of the words data_ptr is computed from.
struct RawLayout {
  int64_t storage;         // TensorImpl: the StorageImpl pointer
  int64_t storage_offset;  // TensorImpl: storage offset, in elements
  int64_t numel;           // TensorImpl: element count (an empty tensor's data_ptr is null)
  int64_t data;            // StorageImpl: the data pointer
};

uintptr_t cdata(PyObject* o) {
  PyObject* c = PyObject_GetAttrString(o, "_cdata");
  if (c == nullptr) throw py::error_already_set();
  const uintptr_t v = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(c));
  Py_DECREF(c);
  if (PyErr_Occurred()) throw py::error_already_set();
  return v;
}

template <class T>
T word(const void* base, int64_t offset) {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + offset, sizeof(v));
  return v;
}

class DataPtrWatch {
 public:
  DataPtrWatch(uintptr_t fn, const py::list& tensors, std::optional<std::tuple<int64_t, int64_t, int64_t, int64_t>> raw,
               int64_t threads)
      : fn_(reinterpret_cast<DataPtrFn>(fn)), threads_(static_cast<size_t>(threads)) {
    RX_HOST_ASSERT(fn != 0, "DataPtrWatch: no data_ptr function");
    RX_HOST_ASSERT(threads >= 1 && threads <= 64, "DataPtrWatch: threads must be 1..64, got ", threads);
    if (raw) {
      const auto [s, o, n, d] = *raw;
      for (int64_t off : {s, o, n})
        RX_HOST_ASSERT(off >= 0 && off % 8 == 0 && off + 8 <= kImplBytes, "DataPtrWatch: TensorImpl offset ", off);
      RX_HOST_ASSERT(d >= 0 && d % 8 == 0 && d + 8 <= kStorageBytes, "DataPtrWatch: StorageImpl offset ", d);
      raw_ = RawLayout{s, o, n, d};
    }
    owned_.reserve(tensors.size());
    entries_.reserve(tensors.size());
    for (const auto& t : tensors) {
      const std::string item = "DataPtrWatch: item " + std::to_string(entries_.size());
      if (!py::hasattr(t, "_cdata") || !py::hasattr(t, "untyped_storage"))
        throw py::type_error(item + " is not a tensor");
      Entry e{};
      e.impl = reinterpret_cast<void*>(cdata(t.ptr()));
      if (e.impl == nullptr || !shim_read(e.impl, &e.ptr)) throw py::type_error(item + " has no readable data_ptr");
      if (raw_) snapshot(e, true);
      owned_.push_back(py::reinterpret_borrow<py::object>(t));
      entries_.push_back(e);
    }
  }

  // Indices of the tensors whose data pointer differs from the one read at construction.
  std::vector<int64_t> changed() {
    const size_t n = entries_.size();
    if (threads_ < 2 || n < kParallelMin) return changed_in(0, n);
    CheckPool& pool = CheckPool::get(threads_ - 1);
    const size_t chunks = (n + kChunk - 1) / kChunk;
    std::vector<std::vector<int64_t>> found(chunks);
    pool.run(chunks, threads_ - 1,
             [&](size_t c) { found[c] = changed_in(c * kChunk, std::min(n, (c + 1) * kChunk)); });
    std::vector<int64_t> out;
    for (const auto& f : found) out.insert(out.end(), f.begin(), f.end());
    return out;
  }

  // changed() over entries [begin, end): touches those entries only, so chunks run at once.
  std::vector<int64_t> changed_in(size_t begin, size_t end) {
    std::vector<int64_t> out;
    Entry* e = entries_.data();
    for (size_t i = begin; i < end; ++i) {
      if (raw_) {
        prefetch(i, end);
        if (same_words(e[i])) continue;
      }
      uintptr_t p = 0;
      // unreadable counts as changed; so does a numel that changed in place (a resize_ that
      // kept the storage: the plan would write past the tensor)
      if (!shim_read(e[i].impl, &p) || p != e[i].ptr || (raw_ && word<uintptr_t>(e[i].impl, raw_->numel) != e[i].numel)) {
        out.push_back(static_cast<int64_t>(i));
      } else if (raw_) {
        snapshot(e[i], false);  // words moved, data_ptr did not (e.g. a new storage on the same memory)
      }
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
  bool raw() const { return raw_.has_value(); }

 private:
  struct Entry {
    void* impl;      // the TensorImpl; alive while owned_ holds the tensor
    uintptr_t ptr;   // its data pointer at construction
    uintptr_t storage, storage_offset, numel, data;  // the raw words when ptr was read (numel: at construction)
  };

  bool shim_read(void* impl, uintptr_t* p) const {
    void* handle = impl;  // an at::Tensor is one TensorImpl pointer: &handle is a tensor handle
    void* out = nullptr;
    if (fn_(&handle, &out) != 0) return false;
    *p = reinterpret_cast<uintptr_t>(out);
    return true;
  }

  // first: at construction, the only time numel is read (later ones must equal it).
  void snapshot(Entry& e, bool first) const {
    e.storage = word<uintptr_t>(e.impl, raw_->storage);
    e.storage_offset = word<uintptr_t>(e.impl, raw_->storage_offset);
    if (first) e.numel = word<uintptr_t>(e.impl, raw_->numel);
    e.data = e.storage != 0 ? word<uintptr_t>(reinterpret_cast<const void*>(e.storage), raw_->data) : 0;
  }

  bool same_words(const Entry& e) const {
    const uintptr_t storage = word<uintptr_t>(e.impl, raw_->storage);
    if (storage == 0 || storage != e.storage) return false;  // no storage: the shim decides
    // e.storage, equal by now: its address is known before the TensorImpl's word arrives
    return word<uintptr_t>(e.impl, raw_->storage_offset) == e.storage_offset &&
           word<uintptr_t>(e.impl, raw_->numel) == e.numel &&
           word<uintptr_t>(reinterpret_cast<const void*>(e.storage), raw_->data) == e.data;
  }

  // The StorageImpl line comes from the snapshot's pointer, not from the TensorImpl: no load
  // waits on another, so the misses of many tensors are in flight at once. A prefetch never
  // faults, even where that storage is gone (then the TensorImpl's word differs anyway).
  void prefetch(size_t i, size_t n) const {
    if (i + kAhead >= n) return;
    const Entry& a = entries_[i + kAhead];
    const char* impl = static_cast<const char*>(a.impl);
    __builtin_prefetch(impl + raw_->storage);
    __builtin_prefetch(impl + raw_->numel);
    if (a.storage != 0) __builtin_prefetch(reinterpret_cast<const char*>(a.storage) + raw_->data);
  }

  DataPtrFn fn_;
  size_t threads_;                 // threads that check at once (the caller and pool helpers)
  std::optional<RawLayout> raw_;   // none: the shim for every tensor
  std::vector<py::object> owned_;  // the references that keep the watched tensors alive
  std::vector<Entry> entries_;     // what the loop reads, in order, in one array
};

}  // namespace

void register_watch(py::module_& m) {
  py::class_<DataPtrWatch>(m, "DataPtrWatch",
                           "The data pointers of a list of tensors (exact torch.Tensor / nn.Parameter), read with "
                           "`fn` (the address of torch's C shim aoti_torch_get_data_ptr) now and again by changed(); "
                           "`raw`: byte offsets (TensorImpl storage, storage offset, numel; StorageImpl data) of the "
                           "words compared first, each tensor's shim read only where one moved; `threads`: how many "
                           "threads check a large watch at once (the caller and helpers of a process-wide pool).")
      .def(py::init<uintptr_t, const py::list&, std::optional<std::tuple<int64_t, int64_t, int64_t, int64_t>>,
                    int64_t>(),
           py::arg("fn"), py::arg("tensors"), py::arg("raw") = py::none(), py::arg("threads") = 1)
      .def("changed", &DataPtrWatch::changed, "Indices of the tensors whose data_ptr differs from construction time.")
      .def_property_readonly("ptrs", &DataPtrWatch::ptrs, "The data pointers read at construction.")
      .def_property_readonly("raw", &DataPtrWatch::raw, "Whether the raw words are compared first.")
      .def("__len__", &DataPtrWatch::size);
}

}  // namespace rx::python
