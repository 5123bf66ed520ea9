# Writes OUT (a C++ string literal line) with the code version: `git describe --always --dirty`
# of SRC, else $DFLASH_COMMIT (device copies have no .git), else "unknown". Run at every build
# (core/CMakeLists.txt: target dflash_version_check); the file changes only when the version does, so
# an unchanged tree recompiles nothing.
execute_process(COMMAND git describe --always --dirty WORKING_DIRECTORY "${SRC}"
                OUTPUT_VARIABLE _v OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0 OR _v STREQUAL "")
  if(DEFINED ENV{DFLASH_COMMIT} AND NOT "$ENV{DFLASH_COMMIT}" STREQUAL "")
    set(_v "$ENV{DFLASH_COMMIT}")
  else()
    set(_v "unknown")
  endif()
endif()
set(_text "\"${_v}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" _old)
  if(_old STREQUAL _text)
    return()
  endif()
endif()
file(WRITE "${OUT}" "${_text}")
