// Whether another process of this host is still running: a rank waiting for a peer learns
// in milliseconds that the peer's process is gone, instead of at the refit's timeout.
//
// A process is named by its pid, its pid namespace and its start time (clock ticks since
// boot): a pid reused by a new process, or a zombie that has exited but was not reaped
// yet, reads as gone. From another pid namespace nothing can be told: such a process
// reads as running.
#pragma once

#include <cstdint>

namespace rx {

struct ProcessId {
  int64_t pid = 0;
  uint64_t pid_ns = 0;  // inode of /proc/<pid>/ns/pid (0: unknown)
  uint64_t start = 0;   // /proc/<pid>/stat field 22 (0: unknown)
};

ProcessId this_process();
uint64_t this_pid_namespace();
// True only where it is certain: same pid namespace and the process exited (or the pid now
// names another process).
bool process_gone(const ProcessId& p);

}  // namespace rx
