#include "comm/process_alive.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace rx {
namespace {

// State (field 3) and start time (field 22) of /proc/<pid>/stat; false if it is gone.
bool read_stat(int64_t pid, char* state, uint64_t* start) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  unsigned long long t = 0;
  if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", state,
                  &t) != 2)
    return false;
  *start = t;
  return true;
}

}  // namespace

uint64_t this_pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

ProcessId this_process() {
  ProcessId p;
  p.pid = static_cast<int64_t>(getpid());
  p.pid_ns = this_pid_namespace();
  char state = 0;
  uint64_t start = 0;
  if (read_stat(p.pid, &state, &start)) p.start = start;
  return p;
}

bool process_gone(const ProcessId& p) {
  // start 0: the process could not read its own /proc entry, so nothing here can be trusted
  if (p.pid <= 0 || p.start == 0 || p.pid_ns == 0 || p.pid_ns != this_pid_namespace()) return false;
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(p.pid, &state, &start)) return true;  // no such process
  return state == 'Z' || state == 'X' || (p.start != 0 && start != p.start);
}

}  // namespace rx
