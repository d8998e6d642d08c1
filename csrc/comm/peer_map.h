// Mapping another process's memory on the same host, for the direct transport:
//   - device allocations through CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle);
//   - a small page of host memory through a file in /dev/shm, page-locked and mapped
//     into the owner's GPU so that its kernels can store into it while peers' hosts read.
// Anything that cannot be mapped says why (a string) instead of throwing: the caller
// then moves that pair's bytes over NCCL.
#pragma once

#ifdef RX_WITH_CUDA

#include <cstdint>
#include <memory>
#include <string>

namespace rx {

// The CUDA IPC handle of the allocation that holds a device pointer.
struct IpcExport {
  std::string handle;   // cudaIpcMemHandle_t bytes
  uint64_t offset = 0;  // of the pointer from the allocation's base
  uint64_t size = 0;    // bytes of the allocation
};

// Exports the allocation holding `ptr` (device memory of the current device). False, with
// `why` set, when it cannot be shared: memory from cuMem/VMM pools (e.g. torch's
// expandable segments) or cudaMallocAsync pools, host or managed memory.
bool ipc_export(uint64_t ptr, IpcExport* out, std::string* why);

// The start of the allocation (or IPC mapping) holding device address `ptr`; 0 where the
// driver cannot tell.
uint64_t allocation_start(uint64_t ptr);

// An opened IPC handle: the allocation's base in this process. CUDA refuses to open a
// handle twice in one process, so opened handles are shared process-wide and closed when
// the last IpcMapping of them goes away.
class IpcMapping {
 public:
  // Opens `handle` on the current device (peer access enabled lazily). On failure,
  // ok() is false and why() says why.
  explicit IpcMapping(const std::string& handle);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  bool ok() const { return base_ != 0; }
  uint64_t base() const { return base_; }
  const std::string& why() const { return why_; }

 private:
  std::string handle_;
  uint64_t base_ = 0;
  std::string why_;
};

// A page of host memory shared by the processes of one host through a file in /dev/shm.
class SharedPage {
 public:
  static constexpr int64_t kBytes = 4096;
  // Creates a fresh page (zeroed), page-locked and mapped into the current device.
  // Throws ReshardError when that fails.
  static std::unique_ptr<SharedPage> create();
  // Maps an existing page read-only (another process's). nullptr, with `why`, on failure.
  static std::unique_ptr<SharedPage> open(const std::string& path, std::string* why);
  ~SharedPage();
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;

  const std::string& path() const { return path_; }
  volatile uint64_t* words() const { return words_; }
  // The page in the device's address space (created pages only; 0 otherwise).
  uint64_t device_address() const { return device_; }
  // Removes the file; the mappings stay valid. Safe to call more than once.
  void unlink();

 private:
  SharedPage() = default;
  std::string path_;
  volatile uint64_t* words_ = nullptr;
  uint64_t device_ = 0;
  bool owner_ = false;
  bool registered_ = false;
};

}  // namespace rx

#endif  // RX_WITH_CUDA
