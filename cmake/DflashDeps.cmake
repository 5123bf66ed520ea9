# Finds every dependency once and exposes them as targets:
#   dflash::torch     LibTorch (torch + torch_library), CXX11 ABI as LibTorch was built
#   dflash::deps      MPI, yaml-cpp, fmt (header-only), plus NCCL and CUDA runtime when DFLASH_CUDA
#   dflash::warnings  -Wall -Wextra (-Werror with DFLASH_WERROR) for our own code only
#   dflash_pch        precompiled LibTorch headers shared by every library (build time on 2 cores)
# Sets DFLASH_CUDA (ON/OFF) and DFLASH_PYTHON_EXE.

# ---- the Python whose torch is our LibTorch ---------------------------------------------
if(DFLASH_PYTHON)
  set(DFLASH_PYTHON_EXE ${DFLASH_PYTHON})
elseif(EXISTS ${CMAKE_SOURCE_DIR}/.venv/bin/python)
  set(DFLASH_PYTHON_EXE ${CMAKE_SOURCE_DIR}/.venv/bin/python)
else()
  find_program(DFLASH_PYTHON_EXE NAMES python3 python REQUIRED)
endif()
message(STATUS "dflash: Python ${DFLASH_PYTHON_EXE}")

if(NOT Torch_DIR)
  execute_process(COMMAND ${DFLASH_PYTHON_EXE} -c "import torch; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
  endif()
endif()

# ---- CUDA: decide before LibTorch, whose config needs the toolkit when it has CUDA -----
include(CheckLanguage)
set(DFLASH_CUDA OFF)
if(NOT DFLASH_WITH_CUDA STREQUAL "OFF")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(DFLASH_CUDA ON)
  elseif(DFLASH_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DFLASH_WITH_CUDA=ON but no nvcc was found (set CMAKE_CUDA_COMPILER)")
  endif()
endif()
if(DFLASH_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES ${DFLASH_CUDA_ARCHS})
  set(CMAKE_CUDA_STANDARD 17)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")   # LibTorch's own flags; ours are DFLASH_CUDA_ARCHS
  endif()
endif()

# LibTorch's CMake warns about CMAKE_CUDA_ARCHITECTURES and uses TORCH_CUDA_ARCH_LIST instead.
set(_dflash_archs ${CMAKE_CUDA_ARCHITECTURES})
unset(CMAKE_CUDA_ARCHITECTURES)
find_package(Torch REQUIRED)
if(DFLASH_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES ${_dflash_archs})
endif()
if(DFLASH_CUDA AND NOT TARGET torch_cuda AND NOT TORCH_CUDA_LIBRARIES)
  message(STATUS "dflash: LibTorch has no CUDA; building without CUDA parts")
  set(DFLASH_CUDA OFF)
endif()
message(STATUS "dflash: CUDA parts ${DFLASH_CUDA}")

find_package(MPI REQUIRED COMPONENTS CXX)
find_package(yaml-cpp REQUIRED)
if(TARGET yaml-cpp::yaml-cpp)
  set(DFLASH_YAML yaml-cpp::yaml-cpp)   # yaml-cpp 0.8 (GPU image)
else()
  set(DFLASH_YAML yaml-cpp)             # yaml-cpp 0.7 (Debian 12)
endif()
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)

add_library(dflash_torch INTERFACE)
add_library(dflash::torch ALIAS dflash_torch)
target_link_libraries(dflash_torch INTERFACE ${TORCH_LIBRARIES})
# LibTorch's flags (ABI define) without its -Wno-... noise
target_compile_options(dflash_torch INTERFACE ${TORCH_CXX_FLAGS})

# What every library of ours may use (core/ uses nothing more): fmt, threads, the CUDA runtime.
# fmt header-only: LibTorch's include dir carries fmt headers of another version that can
# shadow the system's; header-only mode is consistent whichever is found first.
add_library(dflash_base INTERFACE)
add_library(dflash::base ALIAS dflash_base)
target_link_libraries(dflash_base INTERFACE fmt::fmt-header-only Threads::Threads)
# The communication libraries (comm/ links them; the trainer and tools get them through it).
add_library(dflash_comm_deps INTERFACE)
add_library(dflash::comm_deps ALIAS dflash_comm_deps)
target_link_libraries(dflash_comm_deps INTERFACE MPI::MPI_CXX)
# Everything, for executables (tests, benchmarks, dflash_rank).
add_library(dflash_deps INTERFACE)
add_library(dflash::deps ALIAS dflash_deps)
target_link_libraries(dflash_deps INTERFACE dflash::base dflash::comm_deps ${DFLASH_YAML})

if(DFLASH_CUDA)
  include(FindDflashNCCL)
  target_link_libraries(dflash_base INTERFACE CUDA::cudart)
  target_compile_definitions(dflash_base INTERFACE DFLASH_CUDA=1)
  target_link_libraries(dflash_comm_deps INTERFACE dflash::nccl)
endif()

option(DFLASH_WERROR "Treat warnings in our code as errors" OFF)
add_library(dflash_warnings INTERFACE)
add_library(dflash::warnings ALIAS dflash_warnings)
target_compile_options(dflash_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra $<$<BOOL:${DFLASH_WERROR}>:-Werror>>)

# Precompiled LibTorch headers: the ATen headers dominate every translation unit.
file(WRITE ${CMAKE_BINARY_DIR}/dflash_pch_dummy.cpp "")
add_library(dflash_pch STATIC ${CMAKE_BINARY_DIR}/dflash_pch_dummy.cpp)
target_link_libraries(dflash_pch PUBLIC dflash::torch dflash::base)
target_precompile_headers(dflash_pch PUBLIC
  $<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>
  $<$<COMPILE_LANGUAGE:CXX>:<torch/csrc/autograd/custom_function.h$<ANGLE-R>>
  $<$<COMPILE_LANGUAGE:CXX>:<fmt/format.h$<ANGLE-R>>)

# Helper: a library of ours with the shared PCH and warnings. It links LibTorch and dflash::base;
# each library adds its own further dependencies (the layering of docs/architecture.md).
function(dflash_library name)
  add_library(${name} STATIC ${ARGN})
  target_include_directories(${name} PUBLIC ${CMAKE_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC dflash::torch dflash::base PRIVATE dflash::warnings)
  target_precompile_headers(${name} REUSE_FROM dflash_pch)
endfunction()

function(dflash_executable name)
  add_executable(${name} ${ARGN})
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE dflash::torch dflash::deps dflash::warnings)
  target_precompile_headers(${name} REUSE_FROM dflash_pch)
endfunction()
