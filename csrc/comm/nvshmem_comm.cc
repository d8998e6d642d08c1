// NVSHMEM resolved at run time, host API only.
//
// Like libnccl (nccl_loader.cc), libnvshmem_host is not linked: _C must import where none
// exists, and must share the one torch may already have mapped. Only host entry points
// are called (puts and signals "on stream" launch NVSHMEM's own kernels), so no device
// library, no relocatable device code and no NVSHMEM headers are needed to build.
#include "comm/nvshmem_comm.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "comm/dl_library.h"
#include "comm/host_wait.h"
#include "comm/nvshmem_abi.h"
#include "common/check.h"

namespace rx {
namespace {

namespace abi = nvshmem_abi;

// Every entry point called: (member, type in nvshmem_abi.h, exported symbol).
#define RX_NVSHMEM_ENTRY_POINTS(X)                                 \
  X(init_attr, HostlibInitAttr, "nvshmemx_hostlib_init_attr")      \
  X(get_uniqueid, GetUniqueId, "nvshmemx_get_uniqueid")            \
  X(set_uid_args, SetAttrUniqueIdArgs, "nvshmemx_set_attr_uniqueid_args") \
  X(init_status, InitStatus, "nvshmemx_init_status")               \
  X(my_pe, IntQuery, "nvshmem_my_pe")                              \
  X(n_pes, IntQuery, "nvshmem_n_pes")                              \
  X(malloc, Malloc, "nvshmem_malloc")                              \
  X(putmem_signal, PutmemSignalOnStream, "nvshmemx_putmem_signal_on_stream") \
  X(signal_op, SignalOpOnStream, "nvshmemx_signal_op_on_stream")   \
  X(signal_wait, SignalWaitUntilOnStream, "nvshmemx_signal_wait_until_on_stream") \
  X(barrier_all, BarrierAll, "nvshmem_barrier_all")                \
  X(vendor_version, VendorVersion, "nvshmemx_vendor_get_version_info")

struct NvshmemApi {
#define RX_NVSHMEM_MEMBER(member, type, symbol) abi::type member = nullptr;
  RX_NVSHMEM_ENTRY_POINTS(RX_NVSHMEM_MEMBER)
#undef RX_NVSHMEM_MEMBER
};

std::mutex g_mutex;
NvshmemApi g_nv;

// Resolves every entry point from `h` into g_nv, or names the first one missing.
std::string resolve(void* h) {
  NvshmemApi a;
#define RX_NVSHMEM_BIND(member, type, symbol)                                  \
  a.member = reinterpret_cast<abi::type>(dlsym(h, symbol));                    \
  if (a.member == nullptr) return detail::format("has no ", symbol, " (NVSHMEM >= 3 needed)");
  RX_NVSHMEM_ENTRY_POINTS(RX_NVSHMEM_BIND)
#undef RX_NVSHMEM_BIND
  g_nv = a;
  return "";
}

DlLibrary g_lib("libnvshmem_host.so.3", "nvshmem_malloc", resolve);

const NvshmemApi& nv() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_lib.open()) {
    throw ReshardError(detail::format(
        "reshard_ext's NVSHMEM transport found no usable ", g_lib.soname(), " at run time; tried:", g_lib.tried(),
        "\ninstall the nvidia-nvshmem-cu<N> wheel matching torch's CUDA, or set NVSHMEM_HOME, "
        "or use backend='nccl'"));
  }
  return g_nv;
}

}  // namespace

std::string nvshmem_load(const std::vector<std::string>& candidates) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_lib.load(candidates);
  }
  nv();
  return nvshmem_library_path();
}

bool nvshmem_loaded() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_lib.loaded();
}

std::string nvshmem_library_path() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_lib.path();
}

std::array<int, 3> nvshmem_version() {
  std::array<int, 3> v{0, 0, 0};
  nv().vendor_version(&v[0], &v[1], &v[2]);
  return v;
}

std::string nvshmem_unique_id() {
  abi::UniqueId id;
  std::memset(&id, 0, sizeof(id));
  id.version = abi::version_v1(sizeof(id));
  const int rc = nv().get_uniqueid(&id);
  if (rc != 0) throw ReshardError(detail::format("nvshmemx_get_uniqueid failed (status ", rc, ")"));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

bool nvshmem_initialized() { return nv().init_status() >= abi::kStatusIsInitialized; }

void nvshmem_init(int rank, int world, const std::string& unique_id, int device) {
  const NvshmemApi& a = nv();
  RX_HOST_ASSERT(unique_id.size() == sizeof(abi::UniqueId), "an NVSHMEM unique id is 128 bytes, got ",
                 unique_id.size());
  if (a.init_status() >= abi::kStatusIsInitialized)
    throw ReshardError("NVSHMEM is already initialised in this process (not by reshard_ext)");
  abi::UniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  abi::InitAttr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.version = abi::version_v1(sizeof(abi::InitAttr));
  attr.args.version = abi::version_v1(sizeof(abi::InitArgs));
  attr.args.uid_args.version = abi::version_v1(sizeof(abi::UniqueIdArgs));
  attr.args.uid_args.myrank = -1;
  attr.args.uid_args.nranks = -1;
  int rc = a.set_uid_args(rank, world, &id, &attr);
  if (rc != 0) throw ReshardError(detail::format("nvshmemx_set_attr_uniqueid_args failed (status ", rc, ")"));
  // NVSHMEM serves the device that is current when it initialises.
  RX_CUDA_CHECK(cudaSetDevice(device));
  rc = a.init_attr(abi::kInitWithUniqueId, &attr);
  if (rc != 0)
    throw ReshardError(detail::format("nvshmemx_hostlib_init_attr failed on PE ", rank, " of ", world, " (status ",
                                      rc, "); NVSHMEM_DEBUG=INFO says why"));
  if (a.my_pe() != rank || a.n_pes() != world)
    throw ReshardError(detail::format("NVSHMEM initialised as PE ", a.my_pe(), " of ", a.n_pes(), ", expected ",
                                      rank, " of ", world));
}

int nvshmem_my_pe() { return nv().my_pe(); }
int nvshmem_n_pes() { return nv().n_pes(); }

uint64_t nvshmem_alloc(int64_t bytes) {
  RX_HOST_ASSERT(bytes > 0, "nvshmem_alloc of ", bytes, " bytes");
  void* p = nv().malloc(static_cast<size_t>(bytes));
  if (p == nullptr)
    throw ReshardError(detail::format("nvshmem_malloc of ", bytes, " bytes failed on PE ", nv().my_pe(),
                                      ": the symmetric heap is too small (raise NVSHMEM_SYMMETRIC_SIZE) or the "
                                      "GPU is out of memory"));
  return reinterpret_cast<uint64_t>(p);
}

void nvshmem_barrier() { nv().barrier_all(); }

// --- batches -----------------------------------------------------------------------

NvshmemExchange::NvshmemExchange(uint64_t region, int64_t signal_offset, int npes, int nslots, int device,
                                 double timeout_s)
    : region_(region), signal_offset_(signal_offset), npes_(npes), nslots_(nslots), device_(device) {
  RX_HOST_ASSERT(region != 0 && signal_offset >= 0 && npes > 0 && nslots > 0, "bad NVSHMEM exchange geometry");
  me_ = nv().my_pe();
  sent_.assign(npes, 0);
  received_.assign(npes, 0);
  DeviceGuard guard(device_);
  zero_bounded(data_word(0), 2 * sizeof(uint64_t) * static_cast<size_t>(npes), timeout_s, "NVSHMEM transport");
}

uint64_t* NvshmemExchange::data_word(int pe) const {
  return reinterpret_cast<uint64_t*>(region_ + signal_offset_) + pe;
}
uint64_t* NvshmemExchange::free_word(int pe) const {
  return reinterpret_cast<uint64_t*>(region_ + signal_offset_) + npes_ + pe;
}

void NvshmemExchange::set_batches(std::vector<std::vector<NvshmemSend>> sends, std::vector<std::vector<int32_t>> recvs) {
  RX_HOST_ASSERT(sends.size() == recvs.size(), "sends and receives per batch differ in length");
  for (const auto& batch : sends)
    for (const NvshmemSend& s : batch)
      RX_HOST_ASSERT(s.pe >= 0 && s.pe < npes_ && s.pe != me_ && s.bytes > 0,
                     "bad NVSHMEM send (pe ", s.pe, ", ", s.bytes, " bytes)");
  for (const auto& batch : recvs)
    for (int32_t pe : batch) RX_HOST_ASSERT(pe >= 0 && pe < npes_ && pe != me_, "bad NVSHMEM source PE ", pe);
  sends_ = std::move(sends);
  recvs_ = std::move(recvs);
}

void NvshmemExchange::check_usable() const {
  if (!usable_) throw ReshardError("this plan's NVSHMEM exchange failed earlier (" + error_ + "); plan again");
}

void NvshmemExchange::fail(const std::string& why) {
  usable_ = false;
  error_ = why;
}

uint64_t NvshmemExchange::unpacked(int batch) const {
  return done_batches_ + static_cast<uint64_t>(batch) + 1;
}

void NvshmemExchange::send(int batch, cudaStream_t stream) {
  check_usable();
  RX_HOST_ASSERT(batch >= 0 && batch < static_cast<int>(sends_.size()), "batch ", batch, " out of range");
  const NvshmemApi& a = nv();
  for (const NvshmemSend& s : sends_[batch]) {
    // The receiver's slot holds batch - nslots (any sender's) until it unpacked that batch.
    // The first nslots batches need no wait: the previous execute ended (host wait) on
    // every PE before the header exchange that started this one.
    if (batch >= nslots_) a.signal_wait(free_word(s.pe), abi::kCmpGe, unpacked(batch - nslots_), stream);
    const uint64_t n = ++sent_[s.pe];
    a.putmem_signal(reinterpret_cast<void*>(s.dst), reinterpret_cast<const void*>(s.src),
                    static_cast<size_t>(s.bytes), data_word(me_), n, abi::kSignalSet, s.pe, stream);
  }
}

void NvshmemExchange::wait(int batch, cudaStream_t stream) {
  check_usable();
  RX_HOST_ASSERT(batch >= 0 && batch < static_cast<int>(recvs_.size()), "batch ", batch, " out of range");
  const std::vector<int32_t>& from = recvs_[batch];
  for (int32_t pe : from) ++received_[pe];
  for (size_t i = 0; i < from.size(); ++i)
    if (std::find(from.begin(), from.begin() + i, from[i]) == from.begin() + i)
      nv().signal_wait(data_word(from[i]), abi::kCmpGe, received_[from[i]], stream);
}

void NvshmemExchange::release(int batch, cudaStream_t stream) {
  check_usable();
  RX_HOST_ASSERT(batch >= 0 && batch < static_cast<int>(recvs_.size()), "batch ", batch, " out of range");
  const size_t next = static_cast<size_t>(batch) + static_cast<size_t>(nslots_);
  if (next >= recvs_.size()) return;  // the next execute's batches: covered by its header exchange
  const std::vector<int32_t>& to = recvs_[next];
  for (size_t i = 0; i < to.size(); ++i)
    if (std::find(to.begin(), to.begin() + i, to[i]) == to.begin() + i)
      nv().signal_op(free_word(me_), unpacked(batch), abi::kSignalSet, to[i], stream);
}

void NvshmemExchange::wait_idle(cudaStream_t stream, double timeout_s) {
  check_usable();
  DeviceGuard guard(device_);
  cudaEvent_t done = nullptr;
  RX_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  RX_CUDA_CHECK(cudaEventRecord(done, stream));
  const auto deadline = deadline_after(timeout_s);
  Backoff backoff;
  cudaError_t st = cudaEventQuery(done);
  while (st == cudaErrorNotReady && Clock::now() < deadline && !aborted_.load(std::memory_order_acquire)) {
    backoff.pause();
    st = cudaEventQuery(done);
  }
  if (st == cudaErrorNotReady && aborted_.load(std::memory_order_acquire)) {
    fail("stopped while it waited for its peers' signals");
    throw ReshardError(detail::format(
        "NVSHMEM transport: PE ", me_, " stopped waiting for its peers' signals (plan.abort(), or another rank "
        "failed or died); this plan is unusable, and the GPU streams involved may stay blocked: restart the "
        "processes"));
  }
  if (st == cudaErrorNotReady) {
    // The event stays recorded on a stream that may never drain: leak it rather than block.
    fail(detail::format("no progress within ", timeout_s, " s"));
    throw ReshardError(detail::format(
        "NVSHMEM transport: PE ", me_, " waited ", timeout_s,
        " s for its peers' signals (a peer did not execute this plan, or died); this plan is unusable, and the "
        "GPU streams involved may stay blocked: restart the processes (RESHARD_EXT_TIMEOUT sets the wait)"));
  }
  cudaEventDestroy(done);
  RX_CUDA_CHECK(st);
  done_batches_ += recvs_.size();
}

}  // namespace rx
