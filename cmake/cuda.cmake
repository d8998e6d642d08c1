# Decides RX_HAVE_CUDA and RX_HAVE_NCCL from RESHARD_EXT_CUDA / RESHARD_EXT_NCCL.
set(RX_HAVE_CUDA OFF)
set(RX_HAVE_NCCL OFF)

if(NOT RESHARD_EXT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The runtime CMake links for CUDA sources follows RESHARD_EXT_CUDART (default
    # shared): some toolkits' libcudart_static.a carry their own libstdc++ objects,
    # which then shadow the process's and crash the first ostream use.
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
    message(STATUS "reshard_ext: no CUDA compiler found; building the CPU parts only")
  endif()
endif()

if(RX_HAVE_CUDA AND NOT RESHARD_EXT_NCCL STREQUAL "OFF")
  # 1. NCCL_HOME, 2. the nvidia-nccl-cu* wheel in the Python that builds us.
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
  # NAMES_PER_DIR: the wheel's lib/ holds only libnccl.so.2; without it a system
  # libnccl.so elsewhere would win over the hinted wheel.
  find_library(RX_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_rx_nccl_hints} PATH_SUFFIXES lib lib64)
  if(RX_NCCL_INCLUDE_DIR AND RX_NCCL_LIBRARY)
    get_filename_component(RX_NCCL_LIBRARY_DIR "${RX_NCCL_LIBRARY}" DIRECTORY)
    set(RX_HAVE_NCCL ON)
    message(STATUS "reshard_ext: NCCL ${RX_NCCL_LIBRARY} (headers ${RX_NCCL_INCLUDE_DIR})")
  elseif(RESHARD_EXT_NCCL STREQUAL "ON")
    message(FATAL_ERROR "RESHARD_EXT_NCCL=ON but nccl.h/libnccl were not found (install nvidia-nccl-cu13 or set NCCL_HOME)")
  else()
    message(STATUS "reshard_ext: NCCL not found; the C++ NCCL transport is not built")
  endif()
endif()
