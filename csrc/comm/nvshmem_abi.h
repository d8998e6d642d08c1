// The slice of NVSHMEM's host ABI the NVSHMEM transport calls, declared here so that the
// build needs no NVSHMEM headers (libnvshmem_host is resolved at run time, nvshmem_comm.cc).
//
// Only entry points exported by libnvshmem_host.so.3 since 3.x are used (checked against
// the 3.4.5 and 3.8.0 wheels); nvshmemx_init_attr is a header inline over an internal
// symbol of the device library, so initialisation goes through nvshmemx_hostlib_init_attr.
// The structs are NVSHMEM's versioned "v1" records: fixed sizes, a version word first.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace rx::nvshmem_abi {

struct UniqueId {  // nvshmemx_uniqueid_v1
  int version;
  char internal[124];
};
static_assert(sizeof(UniqueId) == 128, "nvshmemx_uniqueid_v1 is 128 bytes");

struct UniqueIdArgs {  // nvshmemx_uniqueid_args_v1
  int version;
  UniqueId* id;
  int myrank;
  int nranks;
};
static_assert(sizeof(UniqueIdArgs) == 24, "nvshmemx_uniqueid_args_v1 is 24 bytes");

struct InitArgs {  // nvshmemx_init_args_v1
  int version;
  UniqueIdArgs uid_args;
  char content[96];
};
static_assert(sizeof(InitArgs) == 128, "nvshmemx_init_args_v1 is 128 bytes");

struct InitAttr {  // nvshmemx_init_attr_v1
  int version;
  void* mpi_comm;
  InitArgs args;
};
static_assert(sizeof(InitAttr) == 144, "nvshmemx_init_attr_v1 is 144 bytes");

// Version words: (struct version << 16) + sizeof(struct).
constexpr int version_v1(size_t size) { return (1 << 16) + static_cast<int>(size); }

constexpr unsigned kInitWithUniqueId = 1u << 3;  // NVSHMEMX_INIT_WITH_UNIQUEID
constexpr int kSignalSet = 9;                    // NVSHMEM_SIGNAL_SET
constexpr int kCmpGe = 5;                        // NVSHMEM_CMP_GE
constexpr int kStatusIsInitialized = 2;          // NVSHMEM_STATUS_IS_INITIALIZED

using HostlibInitAttr = int (*)(unsigned int, InitAttr*);
using HostlibFinalize = void (*)();
using GetUniqueId = int (*)(UniqueId*);
using SetAttrUniqueIdArgs = int (*)(int, int, const UniqueId*, InitAttr*);
using InitStatus = int (*)();
using IntQuery = int (*)();
using Malloc = void* (*)(size_t);
using Free = void (*)(void*);
using Ptr = void* (*)(const void*, int);
using PutmemSignalOnStream = void (*)(void*, const void*, size_t, uint64_t*, uint64_t, int, int, cudaStream_t);
using SignalOpOnStream = void (*)(uint64_t*, uint64_t, int, int, cudaStream_t);
using SignalWaitUntilOnStream = void (*)(uint64_t*, int, uint64_t, cudaStream_t);
using BarrierAll = void (*)();
using VendorVersion = void (*)(int*, int*, int*);

}  // namespace rx::nvshmem_abi
