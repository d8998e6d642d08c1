// The NCCL transport: one communicator per process group and device, and a grouped
// point-to-point exchange of byte ranges on a CUDA stream.
//
// The communicator is non-blocking (ncclConfig_t.blocking = 0): NCCL calls return at
// once and every wait in this class is a host poll with a deadline, so a peer that died
// or never posts its half turns into a ReshardError naming the ranks instead of a hang.
// After any failure the communicator is aborted (which also stops NCCL kernels spinning
// on the GPU) and every later call raises the first error again.
#pragma once

#ifdef RX_WITH_CUDA
#include <cuda_runtime_api.h>

namespace rx {
// `waiter` waits (on the GPU) for the work enqueued so far on `signaller`. Needs no NCCL.
void stream_wait(cudaStream_t waiter, cudaStream_t signaller);
}  // namespace rx
#endif  // RX_WITH_CUDA

#ifdef RX_WITH_NCCL
#include <nccl.h>

#include "comm/nccl_loader.h"

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace rx {

// One byte range to send to / receive from `peer` (a rank of the communicator).
// Several entries for the same peer are matched with the peer's entries in list order.
struct NcclTransfer {
  int32_t peer;
  uint64_t ptr;   // device pointer
  int64_t bytes;  // 0: skipped
};

std::string nccl_unique_id();                  // ncclGetUniqueId, NCCL_UNIQUE_ID_BYTES bytes
std::tuple<int, int, int> nccl_version();      // (major, minor, patch) of the loaded libnccl

class NcclComm {
 public:
  // Starts creating the communicator and returns; wait_ready() finishes it. `timeout_s`
  // bounds every later wait that is not given its own timeout.
  NcclComm(int rank, int world, const std::string& unique_id, int device, double timeout_s);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Blocks until every rank has joined; throws (and aborts) on error or timeout.
  void wait_ready(double timeout_s);

  // One NCCL group with a send/recv per non-empty entry. With side != 0 and side !=
  // stream the transfer runs on `side`, after the work already on `stream`, and `stream`
  // waits for it; otherwise it runs on `stream` itself. Returns once the group is posted;
  // the data moves asynchronously on the stream.
  void exchange(const std::vector<NcclTransfer>& sends, const std::vector<NcclTransfer>& recvs,
                cudaStream_t stream, cudaStream_t side);

  // ncclCommRegister of [ptr, ptr + bytes): NCCL (>= 2.23) then moves intra-node
  // point-to-point data straight between registered buffers, without its own staging
  // FIFOs (fewer HBM passes and SMs). Local, not collective; but a transfer must be
  // registered on both ends or on neither, so every rank registers by the same rule.
  // Returns the handle for deregister_buffer. torch's cudaMalloc'd memory registers
  // only with NCCL_LEGACY_CUDA_REGISTER=1 in the environment (else NCCL quietly skips
  // the zero-copy path on that buffer).
  uint64_t register_buffer(uint64_t ptr, int64_t bytes);
  void deregister_buffer(uint64_t handle);

  // True when the last exchange has finished on the GPU; throws on an asynchronous NCCL
  // error (peer died, network failure), after aborting the communicator.
  bool poll();
  // Host wait for the last exchange; throws and aborts on error or after timeout_s.
  void wait(double timeout_s);

  // Local and immediate: frees the communicator and stops its kernels. Safe to call more
  // than once and from another thread while a wait is in progress.
  void abort();
  // Orderly shutdown (finalize + destroy), falling back to abort after timeout_s.
  void close(double timeout_s);

  bool usable() const;
  const std::string& error() const { return error_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double timeout_s) { timeout_s_ = timeout_s; }
  cudaStream_t side_stream() const { return side_; }

 private:
  enum class Poll { kDone, kPending };
  // What a wait was doing, for its error message: formatted only when it fails (the polls
  // of every execute would otherwise build it each time).
  using What = std::function<std::string()>;
  Poll poll_state_locked(const What& what);
  void wait_state(double timeout_s, const What& what);
  [[noreturn]] void fail_locked(const std::string& msg);
  void check_usable_locked() const;
  std::string where() const;
  std::string peers_of_last() const;

  int rank_;
  int world_;
  int device_;
  double timeout_s_;
  mutable std::mutex mu_;        // guards comm_ against abort() from another thread
  ncclComm_t comm_ = nullptr;
  std::string error_;            // first failure; non-empty means unusable
  cudaStream_t side_ = nullptr;  // owned; offered as the default side stream
  cudaEvent_t ev_in_ = nullptr;  // caller stream -> side stream
  cudaEvent_t done_ = nullptr;   // end of the last exchange
  bool pending_ = false;         // done_ recorded and not yet seen complete
  std::vector<int32_t> last_send_peers_, last_recv_peers_;
};

}  // namespace rx

#endif  // RX_WITH_NCCL
