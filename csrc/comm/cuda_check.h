// CUDA and NCCL check macros, for the transports and the kernels alike.
//
// Which exception a failure becomes:
//   RX_CUDA_CHECK  -> rx::InternalError: a failing CUDA call in this library is a bug
//                     (or a broken device), never bad user input.
//   RX_NCCL_CHECK  -> rx::ReshardError for failures that come from outside this process
//                     (a peer died, the network or the system failed, a CUDA error inside
//                     NCCL), so callers catch them like any other refit failure;
//                     rx::InternalError for ncclInvalidArgument/ncclInvalidUsage, which
//                     mean we called NCCL wrongly.
// Both carry file:line, the failing expression and the library's own error string.
#pragma once

#include <cuda_runtime_api.h>

#include "core/check.h"

#define RX_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    const cudaError_t rx_err_ = static_cast<cudaError_t>(expr);                                \
    if (rx_err_ != cudaSuccess)                                                                \
      throw ::rx::InternalError(::rx::detail::format(__FILE__, ":", __LINE__, ": CUDA error ", \
                                                     cudaGetErrorName(rx_err_), " (",          \
                                                     cudaGetErrorString(rx_err_), ") in " #expr)); \
  } while (0)

#ifdef RX_WITH_NCCL
#include <nccl.h>

namespace rx::detail {
[[noreturn]] inline void throw_nccl(ncclResult_t r, const char* file, int line, const char* expr,
                                    const std::string& context) {
  std::string msg = format(file, ":", line, ": NCCL error ", static_cast<int>(r), " (",
                           ncclGetErrorString(r), ") in ", expr);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') msg += format(": ", last);
  if (!context.empty()) msg += format(" [", context, "]");
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) throw ::rx::InternalError(msg);
  throw ::rx::ReshardError(msg);
}
}  // namespace rx::detail

// ncclInProgress is not an error: non-blocking communicators return it while work is
// still being set up; the caller then waits on ncclCommGetAsyncError.
#define RX_NCCL_CHECK_CTX(expr, context)                                        \
  do {                                                                          \
    const ncclResult_t rx_res_ = (expr);                                        \
    if (rx_res_ != ncclSuccess && rx_res_ != ncclInProgress)                    \
      ::rx::detail::throw_nccl(rx_res_, __FILE__, __LINE__, #expr, (context));  \
  } while (0)
#define RX_NCCL_CHECK(expr) RX_NCCL_CHECK_CTX(expr, std::string())
#endif  // RX_WITH_NCCL
