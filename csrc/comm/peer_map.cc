// Peer mappings for the direct transport: see peer_map.h.
#include "comm/peer_map.h"

#ifdef RX_WITH_CUDA

#include <cuda.h>  // driver types only: the one driver call is resolved at run time
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "common/check.h"

namespace rx {

namespace {

std::string cuda_why(const char* what, cudaError_t e) {
  cudaGetLastError();  // these failures are answers, not sticky errors: clear them
  return detail::format(what, " failed: ", detail::cuda_error_text(e));
}

using PointerGetAttribute = CUresult (*)(void* data, CUpointer_attribute attribute, CUdeviceptr ptr);

// cuPointerGetAttribute through the runtime's driver entry point, so _C links no libcuda.
PointerGetAttribute pointer_get_attribute(std::string* why) {
  static PointerGetAttribute fn = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &p, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuPointerGetAttribute", &p, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr)
      failure = e != cudaSuccess ? cuda_why("looking up cuPointerGetAttribute", e) : "the driver has no cuPointerGetAttribute";
    else
      fn = reinterpret_cast<PointerGetAttribute>(p);
  });
  if (fn == nullptr) *why = failure;
  return fn;
}

}  // namespace

uint64_t allocation_start(uint64_t ptr) {
  std::string why;
  const PointerGetAttribute get = pointer_get_attribute(&why);
  CUdeviceptr base = 0;
  if (get == nullptr || get(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
    return 0;
  return static_cast<uint64_t>(base);
}

namespace {

// Opened handles, shared by every IpcMapping of this process: handle bytes -> (base, users).
struct OpenHandle {
  uint64_t base;
  int users;
  int device;
};
std::mutex g_handles_mu;
std::map<std::string, OpenHandle>& handles() {
  static auto* m = new std::map<std::string, OpenHandle>();  // leaked: outlives static destructors
  return *m;
}

}  // namespace

bool ipc_export(uint64_t ptr, IpcExport* out, std::string* why) {
  if (ptr == 0) {
    *why = "null pointer";
    return false;
  }
  PointerGetAttribute get = pointer_get_attribute(why);
  if (get == nullptr) return false;
  const auto dptr = static_cast<CUdeviceptr>(ptr);
  unsigned int type = 0;
  int capable = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = get(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr);
  if (r == CUDA_SUCCESS && type != CU_MEMORYTYPE_DEVICE) {
    *why = detail::format("address ", ptr, " is not device memory (CUmemorytype ", type, ")");
    return false;
  }
  if (r == CUDA_SUCCESS) r = get(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, dptr);
  if (r == CUDA_SUCCESS && !capable) {
    *why = detail::format("the allocation holding address ", ptr,
                          " cannot be shared with cudaIpcGetMemHandle (memory from a cuMem/VMM pool such as torch's "
                          "expandable segments, or from cudaMallocAsync)");
    return false;
  }
  if (r == CUDA_SUCCESS) r = get(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, dptr);
  if (r == CUDA_SUCCESS) r = get(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, dptr);
  if (r != CUDA_SUCCESS) {
    *why = detail::format("cuPointerGetAttribute on address ", ptr, " failed with CUresult ", static_cast<int>(r));
    return false;
  }
  cudaIpcMemHandle_t h;
  const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(base)));
  if (e != cudaSuccess) {
    *why = cuda_why("cudaIpcGetMemHandle", e);
    return false;
  }
  out->handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  out->offset = ptr - static_cast<uint64_t>(base);
  out->size = static_cast<uint64_t>(size);
  return true;
}

IpcMapping::IpcMapping(const std::string& handle) : handle_(handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    why_ = detail::format("an IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, got ", handle.size());
    return;
  }
  int device = 0;
  RX_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = handles().find(handle);
  if (it != handles().end()) {
    if (it->second.device != device) {
      why_ = detail::format("handle already opened on cuda:", it->second.device, ", not cuda:", device);
      return;
    }
    ++it->second.users;
    base_ = it->second.base;
    return;
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    why_ = cuda_why("cudaIpcOpenMemHandle", e);
    return;
  }
  base_ = reinterpret_cast<uintptr_t>(p);
  handles().emplace(handle, OpenHandle{base_, 1, device});
}

IpcMapping::~IpcMapping() {
  if (base_ == 0) return;
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = handles().find(handle_);
  if (it == handles().end() || --it->second.users > 0) return;
  int prev = -1;
  // Close on the device that opened it; errors are ignored (the driver may be shutting down).
  if (cudaGetDevice(&prev) == cudaSuccess && prev != it->second.device) cudaSetDevice(it->second.device);
  cudaIpcCloseMemHandle(reinterpret_cast<void*>(static_cast<uintptr_t>(it->second.base)));
  if (prev >= 0 && prev != it->second.device) cudaSetDevice(prev);
  cudaGetLastError();
  handles().erase(it);
}

std::unique_ptr<SharedPage> SharedPage::create() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const std::string path = detail::format("/dev/shm/reshard_ext-direct-", static_cast<long long>(getpid()), "-",
                                          counter.fetch_add(1), "-", static_cast<uint64_t>(rd()));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  RX_USER_CHECK(fd >= 0, "direct transport: cannot create ", path, ": ", std::strerror(errno));
  const bool sized = ftruncate(fd, kBytes) == 0;
  void* p = sized ? mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::unlink(path.c_str());
    RX_USER_CHECK(false, "direct transport: cannot map ", path, ": ", std::strerror(err));
  }
  std::unique_ptr<SharedPage> page(new SharedPage());
  page->path_ = path;
  page->owner_ = true;
  page->words_ = static_cast<volatile uint64_t*>(p);
  std::memset(p, 0, kBytes);
  cudaError_t e = cudaHostRegister(p, kBytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e == cudaSuccess) {
    page->registered_ = true;
    void* dev = nullptr;
    e = cudaHostGetDevicePointer(&dev, p, 0);
    page->device_ = reinterpret_cast<uintptr_t>(dev);
  }
  RX_USER_CHECK(e == cudaSuccess, "direct transport: ", cuda_why("page-locking a shared page for the GPU", e));
  return page;
}

std::unique_ptr<SharedPage> SharedPage::open(const std::string& path, std::string* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *why = detail::format("cannot open ", path, ": ", std::strerror(errno));
    return nullptr;
  }
  struct stat st;
  const bool big_enough = fstat(fd, &st) == 0 && st.st_size >= kBytes;
  void* p = big_enough ? mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    *why = detail::format("cannot map ", path, big_enough ? ": " : " (too small)", big_enough ? std::strerror(err) : "");
    return nullptr;
  }
  std::unique_ptr<SharedPage> page(new SharedPage());
  page->path_ = path;
  page->words_ = static_cast<volatile uint64_t*>(p);
  return page;
}

void SharedPage::unlink() {
  if (owner_ && !path_.empty()) ::unlink(path_.c_str());
  owner_ = false;
}

SharedPage::~SharedPage() {
  unlink();
  if (registered_) {
    cudaHostUnregister(const_cast<uint64_t*>(words_));
    cudaGetLastError();
  }
  if (words_ != nullptr) munmap(const_cast<uint64_t*>(words_), kBytes);
}

}  // namespace rx

#endif  // RX_WITH_CUDA
