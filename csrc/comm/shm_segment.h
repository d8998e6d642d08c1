// A POSIX shared-memory segment of reshard_ext in /dev/shm, made by one process and mapped
// by the others of its host (the header mailbox, the CPU transport's rings).
//
// Names carry the creator's pid namespace and pid ("/reshard_ext.<ns>.<pid>.<salt>"): a
// new segment first removes those of dead processes of its namespace (killed before they
// could remove their own). The creating process removes its segment when it is destroyed;
// a forked child's copy does not.
#pragma once

#include <cstddef>
#include <string>

namespace rx {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // A new zero-filled segment of `bytes`. `reserve`: allocate its pages now, so that a full
  // /dev/shm is a ReshardError here rather than a SIGBUS at a later first touch.
  static ShmSegment create(size_t bytes, bool reserve, const char* what);
  // Maps another process's segment; ReshardError where it cannot (`what` names it).
  static ShmSegment open(const std::string& name, size_t bytes, const std::string& what);

  void* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  explicit operator bool() const { return base_ != nullptr; }

 private:
  void release();
  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int owner_ = 0;  // pid of the creating process (0: a mapping of someone else's)
};

}  // namespace rx
