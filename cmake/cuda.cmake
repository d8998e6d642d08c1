# Decides RX_HAVE_CUDA and RX_HAVE_NCCL from RESHARD_EXT_CUDA / RESHARD_EXT_NCCL.
set(RX_HAVE_CUDA OFF)
set(RX_HAVE_NCCL OFF)

string(TOUPPER "${RESHARD_EXT_CUDA}" RESHARD_EXT_CUDA)
if(NOT RESHARD_EXT_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "RESHARD_EXT_CUDA=${RESHARD_EXT_CUDA}: expected AUTO, ON or OFF")
endif()
# Why the CUDA parts are not built ('' when they are; no semicolons, it becomes a C string):
# rx.build_info()["cuda_skipped"].
set(RX_CUDA_SKIPPED "")
if(RESHARD_EXT_CUDA STREQUAL "OFF")
  set(RX_CUDA_SKIPPED "RESHARD_EXT_CUDA=OFF")
elseif(RESHARD_EXT_CUDA STREQUAL "AUTO")
  # AUTO compiles kernels only where a driver can run them (tools/cuda_driver.py says how
  # it decides): the kernels take minutes to compile. Decided before check_language, which
  # compiles a CUDA test program.
  execute_process(COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/tools/cuda_driver.py"
                  OUTPUT_VARIABLE _rx_driver OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT _rx_driver MATCHES "^yes")
    set(RX_CUDA_SKIPPED "no NVIDIA driver at build time (RESHARD_EXT_CUDA=ON builds the kernels)")
    message(STATUS "reshard_ext: no NVIDIA driver on this machine, so no CUDA kernels: the CPU parts only "
                   "(RESHARD_EXT_CUDA=ON builds them, e.g. in a container that builds for GPU machines)")
  endif()
endif()

if(NOT RX_CUDA_SKIPPED)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The runtime CMake links for CUDA sources follows RESHARD_EXT_CUDART (default static:
    # _C then imports where no libcudart exists, e.g. beside a CPU-only torch).
    if(RESHARD_EXT_CUDART STREQUAL "static")
      set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    else()
      set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(RX_HAVE_CUDA ON)
  elseif(RESHARD_EXT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RESHARD_EXT_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    set(RX_CUDA_SKIPPED "no CUDA compiler (nvcc) at build time")
    message(STATUS "reshard_ext: no CUDA compiler found; building the CPU parts only")
  endif()
endif()

if(RX_HAVE_CUDA AND NOT RESHARD_EXT_NCCL STREQUAL "OFF")
  # Only nccl.h is needed at build time: libnccl is resolved at run time
  # (csrc/comm/nccl_loader.cc). 1. NCCL_HOME, 2. the nvidia-nccl-cu* wheel in the Python
  # that builds us (pip's isolated build environment gets it from the build backend).
  set(_rx_nccl_hints "")
  if(DEFINED ENV{NCCL_HOME})
    list(APPEND _rx_nccl_hints "$ENV{NCCL_HOME}")
  endif()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util as u; s = u.find_spec('nvidia.nccl'); print(list(s.submodule_search_locations)[0] if s else '')"
    OUTPUT_VARIABLE _rx_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_rx_nccl_wheel)
    list(APPEND _rx_nccl_hints "${_rx_nccl_wheel}")
  endif()
  find_path(RX_NCCL_INCLUDE_DIR nccl.h HINTS ${_rx_nccl_hints} PATH_SUFFIXES include)
  if(RX_NCCL_INCLUDE_DIR)
    set(RX_HAVE_NCCL ON)
    message(STATUS "reshard_ext: NCCL headers ${RX_NCCL_INCLUDE_DIR} (libnccl is loaded at run time)")
  elseif(RESHARD_EXT_NCCL STREQUAL "ON")
    message(FATAL_ERROR "RESHARD_EXT_NCCL=ON but nccl.h was not found (install nvidia-nccl-cu13 or set NCCL_HOME)")
  else()
    message(STATUS "reshard_ext: nccl.h not found; the C++ NCCL transport is not built")
  endif()
endif()
