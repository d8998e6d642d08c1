// One register function per area; python_api.cpp only calls them.
#pragma once

#include <pybind11/pybind11.h>

#include <stdint.h>

namespace rx::python {

// A device or host address Python passed as an int (a tensor's data_ptr()).
template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

void register_common(pybind11::module_& m);   // the dtype table (bind_common.cc)
void register_box_table(pybind11::module_& m);  // _C.BoxTable (bind_box_table.cc)
void register_core(pybind11::module_& m);     // layouts, planner, exec tables (bind_core.cc)
void register_kernels(pybind11::module_& m);  // CPU box copy and verify (bind_kernels.cc)
void register_cuda(pybind11::module_& m);     // CUDA kernels and device tables (bind_cuda.cc)
void register_comm(pybind11::module_& m);     // NCCL communicator (bind_comm.cc)
void register_mxfp8(pybind11::module_& m);    // MXFP8 scale math and quantize (bind_mxfp8.cc)
void register_amax(pybind11::module_& m);     // partial amaxes over block grids (bind_amax.cc)
void register_fp8block(pybind11::module_& m);  // blockwise FP8 scales and quantize (bind_fp8block.cc)
void register_nvfp4(pybind11::module_& m);    // NVFP4 wire geometry, amax and quantize (bind_nvfp4.cc)
void register_direct(pybind11::module_& m);   // direct transport: IPC, signals (bind_direct.cc)
void register_fingerprint(pybind11::module_& m);  // module-tree fingerprint of a warm swap (bind_fingerprint.cc)
void register_nvshmem(pybind11::module_& m);  // NVSHMEM transport, host API (bind_nvshmem.cc)
void register_executor(pybind11::module_& m);  // the executor of a bound plan (bind_executor.cc)
void register_watch(pybind11::module_& m);    // bound tensors' data pointers, read per execute (bind_watch.cc)
void register_mailbox(pybind11::module_& m);  // execute headers through shared memory (bind_mailbox.cc)
void register_ring(pybind11::module_& m);     // the CPU transport's data through shared memory (bind_ring.cc)
}  // namespace rx::python
