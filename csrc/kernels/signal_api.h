// C-style API of the signal kernels of the direct transport: 64-bit words that one GPU
// stores and another GPU (or a host) waits on, so completion crosses processes without
// a host round trip. A word is any device-accessible address: this GPU's memory, a peer's
// memory mapped through CUDA IPC, or page-locked host memory mapped into the device.
// Values only grow (an execute's sequence number), so waiters compare with >=.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef RX_WITH_CUDA
// Stores `value` into each of the n words at the device addresses words[0..n) (a host
// array), ordered after every memory operation that precedes it on `stream` and visible
// system-wide (fence.sc.sys, then st.release.sys). Returns a cudaError_t value.
int32_t rx_signal_store_cuda(const uint64_t* words, int32_t n, uint64_t value, void* stream);

// Waits on `stream` until every word at words[0..n) holds at least `value` (ld.acquire.sys),
// so work after it on the stream sees what the signaller wrote before its store. Bounded:
// a word still short after timeout_ns (GPU global timer, from when the wait starts) makes
// the kernel store first + 1 + its index into the word at `error` (device-accessible;
// which of several late words is reported is unspecified) and end, so the stream never
// hangs; a wait that finds the error word already set ends at once. Returns a cudaError_t value.
int32_t rx_signal_wait_cuda(const uint64_t* words, int32_t n, uint64_t value, uint64_t timeout_ns, uint64_t error,
                            int32_t first, void* stream);
#endif

#ifdef __cplusplus
}
#endif
