// Check macros, one header for the whole library. Two kinds of failure, two exception types:
//   rx::ReshardError - the caller's input is wrong (bad layout, shape mismatch, ...);
//                      surfaced in Python as reshard_ext.ReshardError.
//   rx::InternalError - an invariant of this library broke; a bug, never the user's fault.
// Both carry file:line so a report points at the check that fired.
// RX_CUDA_CHECK / RX_NCCL_CHECK exist only in targets built with the CUDA runtime / NCCL
// headers (RX_WITH_CUDA / RX_WITH_NCCL), so the CPU-only core never sees them.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace rx {

class ReshardError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InternalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Message formatting without iostreams: snprintf/std::to_string only. An extension
// module must not depend on libstdc++'s locale state being initialised in its copy of
// the library (a toolchain that links a static libstdc++ copy crashes on the first ostream use).
inline void append(std::string& out, const std::string& v) { out += v; }
inline void append(std::string& out, const char* v) { out += v ? v : "(null)"; }
inline void append(std::string& out, char v) { out += v; }
inline void append(std::string& out, bool v) { out += v ? "true" : "false"; }
template <typename T>
typename std::enable_if<std::is_integral<T>::value>::type append(std::string& out, T v) {
  out += std::to_string(v);
}
template <typename T>
typename std::enable_if<std::is_floating_point<T>::value>::type append(std::string& out, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  out += buf;
}
template <typename T>
typename std::enable_if<std::is_enum<T>::value>::type append(std::string& out, T v) {
  out += std::to_string(static_cast<long long>(v));
}
inline void format_into(std::string&) {}
template <typename T, typename... Rest>
void format_into(std::string& out, const T& first, const Rest&... rest) {
  append(out, first);
  format_into(out, rest...);
}
template <typename... Args>
std::string format(const Args&... args) {
  std::string out;
  format_into(out, args...);
  return out;
}
}  // namespace detail

}  // namespace rx

// User error: message only (the message names the tensor and ranks; file:line would be noise).
#define RX_USER_CHECK(cond, ...)                                  \
  do {                                                            \
    if (!(cond)) throw ::rx::ReshardError(::rx::detail::format(__VA_ARGS__)); \
  } while (0)

// Internal invariant: file:line, the condition and a message.
#define RX_HOST_ASSERT(cond, ...)                                                        \
  do {                                                                                   \
    if (!(cond))                                                                         \
      throw ::rx::InternalError(::rx::detail::format(__FILE__, ":", __LINE__,             \
                                                     ": assertion failed: " #cond " ", \
                                                     ##__VA_ARGS__));                    \
  } while (0)

#if defined(RX_WITH_CUDA)
// A failing CUDA call in this library is a bug (or a broken device), never bad user input.
#include <cuda_runtime_api.h>

namespace rx::detail {
// "cudaErrorX (text)" for a message.
inline std::string cuda_error_text(cudaError_t e) {
  return format(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
}  // namespace rx::detail

#define RX_CUDA_CHECK(expr)                                                                       \
  do {                                                                                            \
    const cudaError_t rx_err_ = static_cast<cudaError_t>(expr);                                   \
    if (rx_err_ != cudaSuccess)                                                                   \
      throw ::rx::InternalError(::rx::detail::format(__FILE__, ":", __LINE__, ": CUDA error ",    \
                                                     ::rx::detail::cuda_error_text(rx_err_),      \
                                                     " in " #expr));                              \
  } while (0)
#endif  // RX_WITH_CUDA

#if defined(RX_WITH_NCCL)
// NCCL failures from outside this process (a peer died, the network, a CUDA error inside
// NCCL) are rx::ReshardError, caught like any refit failure; ncclInvalidArgument and
// ncclInvalidUsage mean we called NCCL wrongly: rx::InternalError.
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
