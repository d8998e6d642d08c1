// Check macros. Two kinds of failure, two exception types:
//   rx::ReshardError - the caller's input is wrong (bad layout, shape mismatch, ...);
//                      surfaced in Python as reshard_ext.ReshardError.
//   rx::InternalError - an invariant of this library broke; a bug, never the user's fault.
// Both carry file:line so a report points at the check that fired.
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
// the library (seen crash: a GPU image whose toolchain linked a static libstdc++ copy;
// the first ostream << long segfaulted).
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
