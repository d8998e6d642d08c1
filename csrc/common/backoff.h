// Polling with a short backoff, for host waits on memory another thread or process writes.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace rx {

// One spin of a busy-wait loop (lets the sibling hyperthread run).
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

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
  void reset() { us_ = 10; }  // progress was made: the next wait starts short again

 private:
  static constexpr int kSlackNs = 1000;
  int us_ = 10;
  int max_us_;
  long saved_slack_ = 0;  // the thread's slack before the first pause (-1: left as it was)
};

}  // namespace rx
