// The NVSHMEM transport: libnvshmem_host found at run time (like libnccl), one NVSHMEM
// world per process bootstrapped with a unique id, and per plan a symmetric region whose
// batches move by put-with-signal, with flow control on the GPU (no host sync per batch).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace rx {

// Loads libnvshmem_host.so.3 once: the one already in the process, else the first of
// `candidates` that opens, else the loader's search. Returns its file; throws
// ReshardError listing what was tried.
std::string nvshmem_load(const std::vector<std::string>& candidates);
bool nvshmem_loaded();
std::string nvshmem_library_path();         // "" when not loaded
std::array<int, 3> nvshmem_version();       // vendor (major, minor, patch) of the loaded library
std::string nvshmem_unique_id();            // 128 bytes, on the rank that bootstraps the world
// Joins the NVSHMEM world as PE `rank` of `world` on `device` (collective over the world).
void nvshmem_init(int rank, int world, const std::string& unique_id, int device);
bool nvshmem_initialized();
int nvshmem_my_pe();
int nvshmem_n_pes();
// Collective over the world: every PE passes the same size. Throws ReshardError on failure.
uint64_t nvshmem_alloc(int64_t bytes);
void nvshmem_barrier();

// Batches of one plan over a symmetric region. Signal words at `signal_offset`: npes
// "data" words (word s: messages PE s has put here) then npes "free" words (word r: how
// many batches PE r has unpacked, counted across executes). Batch b lands in slot
// b % nslots; a receiver's slot holds every sender's message of a batch, so a sender of
// batch b waits until its receiver unpacked batch b - nslots, whoever sent in it. Both
// counters are monotonic, so executes follow each other without resetting anything.
struct NvshmemSend {
  int32_t pe;
  uint64_t src;  // local device pointer (in the region's send slots)
  uint64_t dst;  // symmetric address (this PE's view) of the receiver's slot
  int64_t bytes;
};

class NvshmemExchange {
 public:
  // Zeroes the signal words (the caller then runs a barrier before any execute).
  NvshmemExchange(uint64_t region, int64_t signal_offset, int npes, int nslots, int device, double timeout_s);
  // Per batch: the sends and the PEs it receives from (one entry per message).
  void set_batches(std::vector<std::vector<NvshmemSend>> sends, std::vector<std::vector<int32_t>> recvs);
  void send(int batch, cudaStream_t stream);     // waits for free slots, puts with signal
  void wait(int batch, cudaStream_t stream);     // stream waits until batch's messages landed
  // Tells the senders of batch + nslots (who put into the slot batch used) that it is free.
  void release(int batch, cudaStream_t stream);
  // Host wait, bounded, for the work enqueued on `stream` (the end of an execute: every
  // batch released); throws ReshardError on timeout and the exchange stays unusable (its
  // counters no longer match the peers').
  void wait_idle(cudaStream_t stream, double timeout_s);
  bool usable() const { return usable_; }
  std::string error() const { return error_; }
  void fail(const std::string& why);
  // From any thread (plan.abort(), a peer that failed or died): a host wait in progress gives
  // up at once and raises; the exchange is unusable after (its GPU-side waits cannot be
  // cancelled). rearm() takes it back before an execute.
  void abort() { aborted_.store(true, std::memory_order_release); }
  void rearm() { aborted_.store(false, std::memory_order_release); }

 private:
  uint64_t* data_word(int pe) const;
  uint64_t* free_word(int pe) const;
  void check_usable() const;

  uint64_t region_;
  int64_t signal_offset_;
  int npes_;
  int nslots_;
  int device_;
  int me_;
  std::vector<std::vector<NvshmemSend>> sends_;
  std::vector<std::vector<int32_t>> recvs_;
  uint64_t unpacked(int batch) const;  // this execute's free count once `batch` is unpacked

  std::vector<uint64_t> sent_, received_;  // per PE: messages put to it / landed from it
  // Batches of the executes completed on every PE (each execute's host wait follows all
  // its releases, and the next execute starts after a header exchange with the peers).
  uint64_t done_batches_ = 0;
  bool usable_ = true;
  std::string error_;
  std::atomic<bool> aborted_{false};
};

}  // namespace rx
