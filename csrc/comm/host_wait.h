// Host-side helpers of the CUDA transports: bounded waits, the current device, streams
// passed as integers, rank lists in messages.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "common/check.h"

namespace rx {

using Clock = std::chrono::steady_clock;

inline Clock::time_point deadline_after(double seconds) {
  // Clamp: a huge timeout must not overflow the clock.
  const double s = std::min(std::max(seconds, 0.0), 1e7);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    RX_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) RX_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// A cudaStream_t handed over from Python as an integer (torch's Stream.cuda_stream).
inline cudaStream_t as_stream(uint64_t handle) {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle));
}

// Zeroes `bytes` at `p` on the current device and returns once they landed, or throws
// ReshardError after `timeout_s` naming `what`. The memset runs on a stream of its own that
// does not synchronize with the legacy default stream: a stream of this device blocked for
// good (a wait for a peer's signal that never came) cannot hold it, where a
// cudaDeviceSynchronize would wait forever.
inline void zero_bounded(void* p, size_t bytes, double timeout_s, const std::string& what) {
  cudaStream_t s = nullptr;
  RX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaError_t st = cudaMemsetAsync(p, 0, bytes, s);
  const auto deadline = deadline_after(timeout_s);
  Backoff backoff(1000);
  if (st == cudaSuccess)
    while ((st = cudaStreamQuery(s)) == cudaErrorNotReady && Clock::now() < deadline) backoff.pause();
  cudaStreamDestroy(s);  // returns at once; work still queued on it completes on its own
  if (st == cudaErrorNotReady)
    throw ReshardError(detail::format(what, ": zeroing its signal words did not complete within ", timeout_s,
                                      " s: the GPU does not run new work (a stream of an earlier plan blocked "
                                      "for good?); restart the processes"));
  RX_CUDA_CHECK(st);
}

// "[1, 2, 3]", for error messages that name ranks.
inline std::string ranks_text(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += detail::format(i ? ", " : "", v[i]);
  return s + "]";
}

}  // namespace rx
