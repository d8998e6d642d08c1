// NcclComm: see nccl_comm.h for the contract.
#include "comm/nccl_comm.h"

#ifdef RX_WITH_CUDA

#include "common/check.h"

namespace rx {

void stream_wait(cudaStream_t waiter, cudaStream_t signaller) {
  if (waiter == signaller) return;
  // A fresh event per call: destroying it right after the wait is legal (CUDA defers
  // the release), and nothing is shared between concurrent callers.
  cudaEvent_t ev;
  RX_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const cudaError_t rec = cudaEventRecord(ev, signaller);
  const cudaError_t wait = rec == cudaSuccess ? cudaStreamWaitEvent(waiter, ev, 0) : rec;
  cudaEventDestroy(ev);
  RX_CUDA_CHECK(wait);
}

}  // namespace rx

#endif  // RX_WITH_CUDA

#ifdef RX_WITH_NCCL

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

#include "comm/host_wait.h"

namespace rx {

namespace {

std::vector<int32_t> peers(const std::vector<NcclTransfer>& v) {
  std::vector<int32_t> out;
  for (const auto& t : v)
    if (t.bytes > 0) out.push_back(t.peer);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  RX_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

std::tuple<int, int, int> nccl_version() {
  int code = 0;
  RX_NCCL_CHECK(ncclGetVersion(&code));
  // NCCL_VERSION(): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9 on.
  if (code >= 10000) return {code / 10000, (code % 10000) / 100, code % 100};
  return {code / 1000, (code % 1000) / 100, code % 100};
}

NcclComm::NcclComm(int rank, int world, const std::string& unique_id, int device, double timeout_s)
    : rank_(rank), world_(world), device_(device), timeout_s_(timeout_s) {
  RX_USER_CHECK(world >= 1 && rank >= 0 && rank < world, "NcclComm: rank ", rank, " is not in a group of ", world);
  RX_HOST_ASSERT(unique_id.size() == sizeof(ncclUniqueId), "NcclComm: unique id has ", unique_id.size(),
                 " bytes, expected ", sizeof(ncclUniqueId));
  DeviceGuard guard(device_);
  RX_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  RX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming));
  RX_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  RX_NCCL_CHECK_CTX(ncclCommInitRankConfig(&comm_, world_, id, rank_, &config), where());
}

NcclComm::~NcclComm() {
  try {
    close(10.0);
  } catch (...) {
    // A destructor must not throw; close() has already aborted on failure.
  }
  // The driver may already be shutting down at process exit: ignore errors here.
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (ev_in_ != nullptr) cudaEventDestroy(ev_in_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
}

std::string NcclComm::where() const {
  return detail::format("rank ", rank_, " of ", world_, " on cuda:", device_);
}

std::string NcclComm::peers_of_last() const {
  return detail::format("sending to ranks ", ranks_text(last_send_peers_), ", receiving from ranks ",
                        ranks_text(last_recv_peers_));
}

bool NcclComm::usable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return comm_ != nullptr && error_.empty();
}

void NcclComm::check_usable_locked() const {
  RX_USER_CHECK(error_.empty(), "NCCL communicator is unusable after an earlier failure: ", error_);
  RX_USER_CHECK(comm_ != nullptr, "NCCL communicator (", where(), ") is closed");
}

void NcclComm::fail_locked(const std::string& msg) {
  if (error_.empty()) error_ = msg;
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // local; also stops NCCL kernels still waiting on a peer
    comm_ = nullptr;
  }
  pending_ = false;
  throw ReshardError(msg);
}

NcclComm::Poll NcclComm::poll_state_locked(const What& what) {
  check_usable_locked();
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) state = r;
  if (state == ncclInProgress) return Poll::kPending;
  if (state != ncclSuccess) {
    const char* last = ncclGetLastError(comm_);
    fail_locked(detail::format("NCCL error ", static_cast<int>(state), " (", ncclGetErrorString(state), ") on ",
                               where(), " while ", what(), (last && last[0] ? ": " : ""), (last ? last : ""),
                               ". The communicator was aborted."));
  }
  return Poll::kDone;
}

void NcclComm::wait_state(double timeout_s, const What& what) {
  const auto deadline = deadline_after(timeout_s);
  Backoff backoff;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (poll_state_locked(what) == Poll::kDone) return;
      if (Clock::now() > deadline)
        fail_locked(detail::format("NCCL did not finish ", what(), " within ", timeout_s, " s on ", where(),
                                   ". The communicator was aborted."));
    }
    backoff.pause();  // without the lock, so abort() from another thread gets in
  }
}

void NcclComm::wait_ready(double timeout_s) {
  wait_state(timeout_s, [] {
    return std::string("creating the communicator (a rank of the group died, never joined, or joined with another "
                       "unique id)");
  });
}

void NcclComm::exchange(const std::vector<NcclTransfer>& sends, const std::vector<NcclTransfer>& recvs,
                        cudaStream_t stream, cudaStream_t side) {
  for (const auto* list : {&sends, &recvs}) {
    for (const auto& t : *list) {
      RX_HOST_ASSERT(t.peer >= 0 && t.peer < world_, "exchange: peer ", t.peer, " is not in a group of ", world_);
      RX_HOST_ASSERT(t.bytes >= 0, "exchange: negative byte count ", t.bytes, " for peer ", t.peer);
      RX_HOST_ASSERT(t.bytes == 0 || t.ptr != 0, "exchange: null pointer for ", t.bytes, " bytes, peer ", t.peer);
    }
  }
  const bool any = std::any_of(sends.begin(), sends.end(), [](const NcclTransfer& t) { return t.bytes > 0; }) ||
                   std::any_of(recvs.begin(), recvs.end(), [](const NcclTransfer& t) { return t.bytes > 0; });
  const cudaStream_t s = (side != nullptr && side != stream) ? side : stream;
  DeviceGuard guard(device_);
  bool posted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (poll_state_locked([] { return std::string("checking for earlier errors"); }) == Poll::kPending)
      fail_locked(detail::format("exchange called on ", where(), " while the communicator is still being created; "
                                 "call wait_ready() first"));
    last_send_peers_ = peers(sends);
    last_recv_peers_ = peers(recvs);
    if (any) {
      if (s != stream) {
        RX_CUDA_CHECK(cudaEventRecord(ev_in_, stream));
        RX_CUDA_CHECK(cudaStreamWaitEvent(s, ev_in_, 0));
      }
      // Post everything before checking: a failed call inside a group must still be
      // closed by ncclGroupEnd, or this thread's group state would leak into the next.
      ncclResult_t first = ncclSuccess;
      const char* first_what = "";
      auto keep = [&](ncclResult_t r, const char* what) {
        if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
          first = r;
          first_what = what;
        }
      };
      keep(ncclGroupStart(), "ncclGroupStart");
      for (const auto& t : sends)
        if (t.bytes > 0)
          keep(ncclSend(reinterpret_cast<const void*>(t.ptr), static_cast<size_t>(t.bytes), ncclUint8, t.peer, comm_, s),
               "ncclSend");
      for (const auto& t : recvs)
        if (t.bytes > 0)
          keep(ncclRecv(reinterpret_cast<void*>(t.ptr), static_cast<size_t>(t.bytes), ncclUint8, t.peer, comm_, s),
               "ncclRecv");
      keep(ncclGroupEnd(), "ncclGroupEnd");
      if (first != ncclSuccess) {
        const char* last = ncclGetLastError(comm_);
        fail_locked(detail::format("NCCL error ", static_cast<int>(first), " (", ncclGetErrorString(first), ") in ",
                                   first_what, " on ", where(), " (", peers_of_last(), ")",
                                   (last && last[0] ? ": " : ""), (last ? last : ""),
                                   ". The communicator was aborted."));
      }
      posted = true;
    }
  }
  if (posted) {
    // Non-blocking: connection setup to new peers may still be running.
    wait_state(timeout_s_, [this] {
      return "posting the exchange (" + peers_of_last() + "); a peer died or never posted its half";
    });
  }
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked();
  if (!any) return;
  RX_CUDA_CHECK(cudaEventRecord(done_, s));
  if (s != stream) RX_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
  pending_ = true;
}

// ncclCommRegister came with NCCL 2.19: an older libnccl registers nothing (handle 0).
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
#define RX_NCCL_HAS_REGISTER 1
#else
#define RX_NCCL_HAS_REGISTER 0
#endif

uint64_t NcclComm::register_buffer(uint64_t ptr, int64_t bytes) {
  RX_HOST_ASSERT(ptr != 0 && bytes > 0, "register_buffer: empty range (ptr ", ptr, ", ", bytes, " bytes)");
  if (!RX_NCCL_HAS_REGISTER) return 0;
  DeviceGuard guard(device_);
  void* handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked();
#if RX_NCCL_HAS_REGISTER
    const ncclResult_t r = ncclCommRegister(comm_, reinterpret_cast<void*>(ptr), static_cast<size_t>(bytes), &handle);
    if (r != ncclSuccess && r != ncclInProgress)
      fail_locked(detail::format("ncclCommRegister of ", bytes, " bytes at address ", ptr, " on ",
                                 where(), " failed: ", ncclGetErrorString(r), ". The communicator was aborted."));
#endif
  }
  wait_state(timeout_s_, [] { return std::string("registering a buffer"); });
  return reinterpret_cast<uintptr_t>(handle);
}

void NcclComm::deregister_buffer(uint64_t handle) {
  if (handle == 0) return;
  DeviceGuard guard(device_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return;  // aborted or closed: NCCL dropped its registrations
#if RX_NCCL_HAS_REGISTER
    const ncclResult_t r = ncclCommDeregister(comm_, reinterpret_cast<void*>(static_cast<uintptr_t>(handle)));
    if (r != ncclSuccess && r != ncclInProgress)
      fail_locked(detail::format("ncclCommDeregister on ", where(), " failed: ", ncclGetErrorString(r),
                                 ". The communicator was aborted."));
#endif
  }
  wait_state(timeout_s_, [] { return std::string("deregistering a buffer"); });
}

bool NcclComm::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  poll_state_locked([this] { return "running an exchange (" + peers_of_last() + ")"; });
  if (!pending_) return true;
  const cudaError_t q = cudaEventQuery(done_);
  if (q == cudaErrorNotReady) return false;
  RX_CUDA_CHECK(q);
  pending_ = false;
  return true;
}

void NcclComm::wait(double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  // A completion seen late idles the GPU until the caller's next launch: poll often.
  Backoff backoff(50);
  while (!poll()) {
    if (Clock::now() > deadline) {
      std::lock_guard<std::mutex> lock(mu_);
      fail_locked(detail::format("NCCL exchange on ", where(), " (", peers_of_last(), ") did not complete within ",
                                 timeout_s, " s: a peer died, did not post its matching send/receive, or posted "
                                 "a different byte count. The communicator was aborted."));
    }
    backoff.pause();
  }
}

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) return;
  ncclCommAbort(comm_);
  comm_ = nullptr;
  pending_ = false;
  if (error_.empty()) error_ = "the communicator (" + where() + ") was aborted";
}

void NcclComm::close(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return;
    if (!error_.empty()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return;
    }
  }
  DeviceGuard guard(device_);
  bool clean = false;
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (comm_ == nullptr) return;
      RX_NCCL_CHECK_CTX(ncclCommFinalize(comm_), where());
    }
    wait_state(timeout_s, [] { return std::string("finalizing the communicator"); });
    clean = true;
  } catch (...) {
    // wait_state aborted already on failure; fall through to the abort below otherwise.
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) return;
  if (clean)
    ncclCommDestroy(comm_);
  else
    ncclCommAbort(comm_);
  comm_ = nullptr;
  pending_ = false;
  if (error_.empty()) error_ = "the communicator (" + where() + ") was closed";
}

}  // namespace rx

#endif  // RX_WITH_NCCL
