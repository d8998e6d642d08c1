// Check macros. Two kinds of failure, two exception types:
//   rx::ReshardError - the caller's input is wrong (bad layout, shape mismatch, ...);
//                      surfaced in Python as reshard_ext.ReshardError.
//   rx::InternalError - an invariant of this library broke; a bug, never the user's fault.
// Both carry file:line so a report points at the check that fired.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  format_into(os, rest...);
}
template <typename... Args>
std::string format(const Args&... args) {
  std::ostringstream os;
  format_into(os, args...);
  return os.str();
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
