# Optional backends, each AUTO|ON|OFF. A backend that is ON but missing stops the configure step;
# AUTO builds it when found. The results land in build_info.h (MOERUN_HAVE_*), and the run-time
# registry still probes for the device, so one binary runs on machines without GPUs.
function(moerun_backend_result name found)
  set(opt MOERUN_WITH_${name})
  if(${opt} STREQUAL "OFF")
    set(MOERUN_HAVE_${name} 0 PARENT_SCOPE)
  elseif(found)
    set(MOERUN_HAVE_${name} 1 PARENT_SCOPE)
  elseif(${opt} STREQUAL "ON")
    message(FATAL_ERROR "${opt}=ON but ${name} was not found")
  else()
    set(MOERUN_HAVE_${name} 0 PARENT_SCOPE)
  endif()
endfunction()

# CUDA: nvcc may not be on PATH (Debian + NVIDIA's toolkit in /usr/local/cuda).
set(_cuda_found FALSE)
if(NOT MOERUN_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  # The architectures, chosen before enable_language(CUDA) (which otherwise fills the cache with
  # the compiler's default: sm_75 for CUDA 13, where the tensor-core kernels are only a trap):
  # SASS for sm_80 and sm_90 and compute_90 PTX, which newer GPUs compile at load time. A user's
  # -DCMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable wins.
  set(_moerun_cuda_archs "80-real;90")
  set(_moerun_cuda_archs_help
      "CUDA architectures (moerun's default: sm_80 and sm_90 SASS, compute_90 PTX)")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "${_moerun_cuda_archs}" CACHE STRING "${_moerun_cuda_archs_help}")
  elseif(DEFINED CACHE{CMAKE_CUDA_ARCHITECTURES} AND NOT DEFINED ENV{CUDAARCHS})
    # A build directory configured before moerun chose its default holds CMake's own choice (its
    # help string is "CUDA architectures"; a user's -D has another): replace it when it is below
    # sm_80, so an old build/ does not keep building trap-only tensor-core kernels.
    get_property(_help CACHE CMAKE_CUDA_ARCHITECTURES PROPERTY HELPSTRING)
    set(_old FALSE)
    foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
      if(_arch MATCHES "^([0-9]+)" AND CMAKE_MATCH_1 LESS 80)
        set(_old TRUE)
      endif()
    endforeach()
    if(_help STREQUAL "CUDA architectures" AND _old)
      message(STATUS "CMAKE_CUDA_ARCHITECTURES: replacing CMake's default "
                     "${CMAKE_CUDA_ARCHITECTURES} with ${_moerun_cuda_archs}")
      set(CMAKE_CUDA_ARCHITECTURES "${_moerun_cuda_archs}" CACHE STRING
          "${_moerun_cuda_archs_help}" FORCE)
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND)
      set(_cuda_found TRUE)
    endif()
  endif()
endif()
moerun_backend_result(CUDA ${_cuda_found})
if(MOERUN_HAVE_CUDA)
  # CMake 3.25 knows no C++20 dialect flag for nvcc (nvcc 12+ takes -std=c++20).
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA_STANDARD 20)
endif()

set(_nccl_found FALSE)
if(MOERUN_HAVE_CUDA AND NOT MOERUN_WITH_NCCL STREQUAL "OFF")
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
    set(_nccl_found TRUE)
  endif()
endif()
moerun_backend_result(NCCL ${_nccl_found})

set(_ucx_found FALSE)
if(NOT MOERUN_WITH_UCX STREQUAL "OFF")
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(UCX QUIET IMPORTED_TARGET ucx)
    if(UCX_FOUND)
      set(_ucx_found TRUE)
    endif()
  endif()
endif()
moerun_backend_result(UCX ${_ucx_found})

set(_mpi_found FALSE)
if(NOT MOERUN_WITH_MPI STREQUAL "OFF")
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(_mpi_found TRUE)
  endif()
endif()
moerun_backend_result(MPI ${_mpi_found})
