// Host-side helpers of the CUDA transports: bounded waits, the current device, streams
// passed as integers, rank lists in messages.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

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

// Polls with a short backoff: fast when the answer is near, cheap when it is not.
// `max_us` bounds how late a completion is seen. While it sleeps, the thread's timer slack
// is 1 us: Linux's default slack would add more than the sleep itself to every short pause.
class Backoff {
 public:
  explicit Backoff(int max_us = 1000) : max_us_(max_us) {}
  ~Backoff() {
#ifdef __linux__
    if (saved_slack_ > 0) prctl(PR_SET_TIMERSLACK, saved_slack_, 0, 0, 0);
#endif
  }
  Backoff(const Backoff&) = delete;
  Backoff& operator=(const Backoff&) = delete;

  void pause() {
#ifdef __linux__
    if (saved_slack_ == 0) {  // first pause: an answer that is already there costs no syscall
      const int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
      saved_slack_ = slack > kSlackNs && prctl(PR_SET_TIMERSLACK, kSlackNs, 0, 0, 0) == 0 ? slack : -1;
    }
#endif
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    us_ = std::min(us_ * 2, max_us_);
  }

 private:
  static constexpr int kSlackNs = 1000;
  int us_ = 10;
  int max_us_;
  long saved_slack_ = 0;  // the thread's slack before the first pause (-1: left as it was)
};

// A cudaStream_t handed over from Python as an integer (torch's Stream.cuda_stream).
inline cudaStream_t as_stream(uint64_t handle) {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle));
}

// "[1, 2, 3]", for error messages that name ranks.
inline std::string ranks_text(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += detail::format(i ? ", " : "", v[i]);
  return s + "]";
}

}  // namespace rx
