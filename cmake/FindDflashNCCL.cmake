# dflash::nccl: the NCCL that LibTorch itself loads, so one process never holds two copies.
# LibTorch from the PyPI wheel loads site-packages/nvidia/nccl/lib/libnccl.so.2 (through its
# rpath); we link that same file (it has no unversioned link) and take headers from there,
# or from the CUDA toolkit / system when the wheel carries none. Override with NCCL_ROOT.
set(_nccl_hints)
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _nccl_hints $ENV{NCCL_ROOT})
endif()
execute_process(COMMAND ${DFLASH_PYTHON_EXE} -c
  "import nvidia.nccl as m; print(list(m.__path__)[0])"
  OUTPUT_VARIABLE _pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
if(_rc EQUAL 0 AND EXISTS ${_pip_nccl}/lib/libnccl.so.2)
  list(APPEND _nccl_hints ${_pip_nccl})
endif()
find_library(DFLASH_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
             NO_DEFAULT_PATH)
if(NOT DFLASH_NCCL_LIBRARY)
  find_library(DFLASH_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR})
endif()
find_path(DFLASH_NCCL_INCLUDE nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
if(NOT DFLASH_NCCL_INCLUDE)
  find_path(DFLASH_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(NOT DFLASH_NCCL_LIBRARY OR NOT DFLASH_NCCL_INCLUDE)
  message(FATAL_ERROR "NCCL not found (library '${DFLASH_NCCL_LIBRARY}', header '${DFLASH_NCCL_INCLUDE}'); "
                      "set NCCL_ROOT or configure with -DDFLASH_WITH_CUDA=OFF")
endif()
message(STATUS "dflash: NCCL ${DFLASH_NCCL_LIBRARY} (headers ${DFLASH_NCCL_INCLUDE})")
add_library(dflash_nccl INTERFACE)
add_library(dflash::nccl ALIAS dflash_nccl)
target_include_directories(dflash_nccl SYSTEM INTERFACE ${DFLASH_NCCL_INCLUDE})
target_link_libraries(dflash_nccl INTERFACE ${DFLASH_NCCL_LIBRARY})
