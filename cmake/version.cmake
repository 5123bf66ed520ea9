# Writes OUT = `#define DFLASH_VERSION "<git describe>"` for the tree SRC, only when it changes
# (so that core/version.cpp recompiles only on a new version). Run at every build by the
# dflash_version target (core/CMakeLists.txt): cmake -DSRC=... -DOUT=... -P version.cmake
execute_process(COMMAND git -C "${SRC}" describe --always --dirty --tags
                OUTPUT_VARIABLE v OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR "${v}" STREQUAL "")
  set(v "unknown")
endif()
set(content "#define DFLASH_VERSION \"${v}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT "${old}" STREQUAL "${content}")
  file(WRITE "${OUT}" "${content}")
endif()
