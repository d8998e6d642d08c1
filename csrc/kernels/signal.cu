// The signal kernels of the direct transport (signal_api.h): one warp, one lane per word.
#include <cuda_runtime.h>

#include <stdint.h>

#include "kernels/signal_api.h"

namespace rx {
namespace {

constexpr int kWordsPerLaunch = 32;  // one warp; the addresses travel as kernel parameters

struct Words {
  unsigned long long addr[kWordsPerLaunch];
};

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void store_kernel(Words w, int n, unsigned long long value) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= n) return;
  // Writes of earlier kernels and copies on the stream precede this one; the full fence
  // makes sure a peer that sees the word also sees them.
  __threadfence_system();
  store_release_sys(reinterpret_cast<unsigned long long*>(w.addr[i]), value);
}

__global__ void wait_kernel(Words w, int n, unsigned long long value, unsigned long long timeout_ns,
                            unsigned long long* error, int first) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= n) return;
  const auto* word = reinterpret_cast<const unsigned long long*>(w.addr[i]);
  if (load_acquire_sys(error) != 0) return;  // an earlier wait of this execute gave up: one timeout in all
  const unsigned long long start = global_ns();
  unsigned sleep_ns = 64;
  while (load_acquire_sys(word) < value) {
    if (load_acquire_sys(error) != 0) return;  // another wait gave up, or the host stopped the execute
    if (global_ns() - start > timeout_ns) {
      store_release_sys(error, static_cast<unsigned long long>(first + i + 1));
      return;
    }
    __nanosleep(sleep_ns);  // polls a peer's or the host's memory: leave the link alone
    if (sleep_ns < 4096) sleep_ns *= 2;
  }
}

template <typename Launch>
int32_t in_chunks(const uint64_t* words, int32_t n, Launch launch) {
  if (n < 0 || (n > 0 && words == nullptr)) return cudaErrorInvalidValue;
  for (int32_t base = 0; base < n; base += kWordsPerLaunch) {
    Words w{};
    const int32_t m = n - base < kWordsPerLaunch ? n - base : kWordsPerLaunch;
    for (int32_t i = 0; i < m; ++i) {
      if (words[base + i] == 0) return cudaErrorInvalidValue;
      w.addr[i] = words[base + i];
    }
    launch(w, m, base);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace rx

extern "C" int32_t rx_signal_store_cuda(const uint64_t* words, int32_t n, uint64_t value, void* stream) {
  return rx::in_chunks(words, n, [&](const rx::Words& w, int32_t m, int32_t) {
    rx::store_kernel<<<1, rx::kWordsPerLaunch, 0, static_cast<cudaStream_t>(stream)>>>(w, m, value);
  });
}

extern "C" int32_t rx_signal_wait_cuda(const uint64_t* words, int32_t n, uint64_t value, uint64_t timeout_ns,
                                       uint64_t error, int32_t first, void* stream) {
  if (error == 0) return cudaErrorInvalidValue;
  return rx::in_chunks(words, n, [&](const rx::Words& w, int32_t m, int32_t base) {
    rx::wait_kernel<<<1, rx::kWordsPerLaunch, 0, static_cast<cudaStream_t>(stream)>>>(
        w, m, value, timeout_ns, reinterpret_cast<unsigned long long*>(error), first + base);
  });
}
