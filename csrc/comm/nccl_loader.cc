// NCCL resolved at run time, not at link time.
//
// _C must import where no libnccl exists (a CPU-only torch), and must run the libnccl
// torch already loaded where one does: two NCCLs in one process disagree on protocols.
// So _C has no DT_NEEDED on libnccl; the NCCL entry points this library calls are
// defined here (hidden, so they never interpose on torch's) and forward to the library
// found by nccl_load(): the libnccl.so.2 already mapped in the process first, else the
// candidates Python passes (NCCL_HOME, the nvidia-nccl wheel), else the loader's search.
#include "comm/nccl_loader.h"

#ifdef RX_WITH_NCCL

#include <dlfcn.h>

#include <mutex>

#include "comm/dl_library.h"
#include "common/check.h"

namespace rx {
namespace {

struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclCommRegister) CommRegister = nullptr;
  decltype(&::ncclCommDeregister) CommDeregister = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
};

template <typename F>
bool bind(void* h, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(h, name));
  return *out != nullptr;
}

std::mutex g_mutex;
NcclApi g_api;

// Fills g_api from `h`; nothing kept when a symbol is missing.
std::string bind_all(void* h) {
  NcclApi a;
  bool ok = bind(h, "ncclGetVersion", &a.GetVersion) && bind(h, "ncclGetUniqueId", &a.GetUniqueId) &&
            bind(h, "ncclCommInitRankConfig", &a.CommInitRankConfig) &&
            bind(h, "ncclCommFinalize", &a.CommFinalize) && bind(h, "ncclCommDestroy", &a.CommDestroy) &&
            bind(h, "ncclCommAbort", &a.CommAbort) && bind(h, "ncclCommGetAsyncError", &a.CommGetAsyncError) &&
            bind(h, "ncclCommRegister", &a.CommRegister) && bind(h, "ncclCommDeregister", &a.CommDeregister) &&
            bind(h, "ncclGetErrorString", &a.GetErrorString) && bind(h, "ncclGetLastError", &a.GetLastError) &&
            bind(h, "ncclGroupStart", &a.GroupStart) && bind(h, "ncclGroupEnd", &a.GroupEnd) &&
            bind(h, "ncclSend", &a.Send) && bind(h, "ncclRecv", &a.Recv);
  if (!ok) return "lacks NCCL >= 2.19 entry points";
  g_api = a;
  return "";
}

DlLibrary g_lib("libnccl.so.2", "ncclGetVersion", bind_all);

const NcclApi& api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_lib.open()) {
    throw ReshardError(detail::format(
        "reshard_ext's NCCL transport found no libnccl.so.2 at run time; tried:", g_lib.tried(),
        "\ninstall the nvidia-nccl-cu<N> wheel matching torch's CUDA (a CUDA build of torch brings it) "
        "or set NCCL_HOME, or use backend='torch'"));
  }
  return g_api;
}

}  // namespace

std::string nccl_load(const std::vector<std::string>& candidates) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_lib.load(candidates);
  }
  api();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_lib.path();
}

bool nccl_loaded() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_lib.loaded();
}

std::string nccl_library_path() { return nccl_load({}); }

}  // namespace rx

// The entry points nccl_comm.cc calls, forwarding to the loaded library. Hidden by the
// build's visibility preset, so torch's own calls never land here.
extern "C" {
ncclResult_t ncclGetVersion(int* v) { return rx::api().GetVersion(v); }
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) { return rx::api().GetUniqueId(id); }
ncclResult_t ncclCommInitRankConfig(ncclComm_t* c, int n, ncclUniqueId id, int r, ncclConfig_t* cfg) {
  return rx::api().CommInitRankConfig(c, n, id, r, cfg);
}
ncclResult_t ncclCommFinalize(ncclComm_t c) { return rx::api().CommFinalize(c); }
ncclResult_t ncclCommDestroy(ncclComm_t c) { return rx::api().CommDestroy(c); }
ncclResult_t ncclCommAbort(ncclComm_t c) { return rx::api().CommAbort(c); }
ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* e) { return rx::api().CommGetAsyncError(c, e); }
ncclResult_t ncclCommRegister(const ncclComm_t c, void* p, size_t n, void** h) {
  return rx::api().CommRegister(c, p, n, h);
}
ncclResult_t ncclCommDeregister(const ncclComm_t c, void* h) { return rx::api().CommDeregister(c, h); }
const char* ncclGetErrorString(ncclResult_t r) { return rx::api().GetErrorString(r); }
const char* ncclGetLastError(ncclComm_t c) { return rx::api().GetLastError(c); }
ncclResult_t ncclGroupStart() { return rx::api().GroupStart(); }
ncclResult_t ncclGroupEnd() { return rx::api().GroupEnd(); }
ncclResult_t ncclSend(const void* b, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  return rx::api().Send(b, n, t, peer, c, s);
}
ncclResult_t ncclRecv(void* b, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  return rx::api().Recv(b, n, t, peer, c, s);
}
}

#endif  // RX_WITH_NCCL
