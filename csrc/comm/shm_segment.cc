#include "comm/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>

#include "comm/process_alive.h"
#include "common/check.h"

namespace rx {
namespace {

void* map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void sweep_dead(unsigned long long ns) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  char prefix[48];
  const int n = std::snprintf(prefix, sizeof prefix, "reshard_ext.%llu.", ns);
  while (const dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix, static_cast<size_t>(n)) != 0) continue;
    const long pid = std::strtol(e->d_name + n, nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      shm_unlink((std::string("/") + e->d_name).c_str());
  }
  closedir(dir);
}

}  // namespace

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : name_(std::move(o.name_)), base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_), owner_(o.owner_) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = o.bytes_;
    owner_ = o.owner_;
  }
  return *this;
}

void ShmSegment::release() {
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
  if (owner_ != 0 && static_cast<int>(getpid()) == owner_) shm_unlink(name_.c_str());
  owner_ = 0;
}

ShmSegment ShmSegment::create(size_t bytes, bool reserve, const char* what) {
  std::random_device rd;
  const uint64_t salt = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  const unsigned long long ns = this_pid_namespace();
  sweep_dead(ns);
  char buf[96];
  std::snprintf(buf, sizeof buf, "/reshard_ext.%llu.%d.%016llx", ns, static_cast<int>(getpid()),
                static_cast<unsigned long long>(salt));
  ShmSegment s;
  s.name_ = buf;
  const int fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  RX_USER_CHECK(fd >= 0, what, ": shm_open(", s.name_, "): ", std::strerror(errno));
  s.owner_ = static_cast<int>(getpid());  // from here on the destructor removes it
  int err = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err == 0 && reserve) err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == 0) {
    s.base_ = map(fd, bytes);
    if (s.base_ == nullptr) err = errno;
  }
  close(fd);
  RX_USER_CHECK(err == 0, what, ": cannot size or map ", bytes, " bytes of /dev/shm (", s.name_, "): ",
                std::strerror(err));
  s.bytes_ = bytes;
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes, const std::string& what) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  RX_USER_CHECK(fd >= 0, "cannot open ", what, " ", name, ": ", std::strerror(errno));
  struct stat st;
  const bool big = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= bytes;
  void* p = big ? map(fd, bytes) : nullptr;
  close(fd);
  RX_USER_CHECK(p != nullptr, "cannot map ", what, " ", name, big ? "" : " (too small: not one of this group's)");
  ShmSegment s;
  s.name_ = name;
  s.base_ = p;
  s.bytes_ = bytes;
  return s;
}

}  // namespace rx
