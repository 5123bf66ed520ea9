// The build's code version (version.h); DFLASH_VERSION comes from the generated
// dflash_version.inc in the build tree (core/CMakeLists.txt, cmake/version.cmake).
#include "core/version.h"

#include "dflash_version.inc"

namespace dflash {

const char* version() { return DFLASH_VERSION; }

}  // namespace dflash
