// The extension module: registration only. Each area binds itself in its own file.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/check.h"
#include "python/register.h"

#ifdef RX_WITH_NCCL
#include <nccl.h>
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "reshard_ext compiled core (links no torch)";
  py::register_exception<rx::ReshardError>(m, "ReshardError", PyExc_RuntimeError);
  py::register_exception<rx::InternalError>(m, "InternalError", PyExc_RuntimeError);

  rx::python::register_common(m);
  rx::python::register_box_table(m);
  rx::python::register_core(m);
  rx::python::register_kernels(m);
  rx::python::register_cuda(m);
  rx::python::register_comm(m);
  rx::python::register_mxfp8(m);
  rx::python::register_amax(m);
  rx::python::register_fp8block(m);
  rx::python::register_nvfp4(m);
  rx::python::register_direct(m);
  rx::python::register_fingerprint(m);
  rx::python::register_nvshmem(m);
  rx::python::register_executor(m);
  rx::python::register_watch(m);
  rx::python::register_mailbox(m);
  rx::python::register_ring(m);

  py::dict info;
  info["version"] = RX_VERSION_INFO;
#ifdef RX_WITH_CUDA
  info["cuda"] = true;
  info["cuda_arch"] = RX_CUDA_ARCH_INFO;
#else
  info["cuda"] = false;
  info["cuda_arch"] = "";
#endif
  info["cuda_skipped"] = RX_CUDA_SKIPPED_INFO;  // why no CUDA kernels ('' when built)
#ifdef RX_WITH_CUDA
  info["cudart"] = RX_CUDART_INFO;
  info["nvshmem"] = true;  // host API, libnvshmem_host loaded at run time
#else
  info["nvshmem"] = false;
  info["cudart"] = "";
#endif
#ifdef RX_WITH_NCCL
  info["nccl"] = true;
  info["nccl_headers"] = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                         std::to_string(NCCL_PATCH);
#else
  info["nccl"] = false;
  info["nccl_headers"] = "";
#endif
  m.attr("_build_info") = info;
}
