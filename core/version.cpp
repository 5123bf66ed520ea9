// core/version.h: the version string generated into the build tree by cmake/version.cmake.
#include "core/version.h"

namespace dflash {

const char* version() {
  return
#include "dflash_version.inc"
      ;
}

}  // namespace dflash
