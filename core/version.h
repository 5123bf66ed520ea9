// The code version of this build: `git describe --always --dirty` at build time (cmake/version.cmake),
// e.g. "456f0cb-dirty"; $DFLASH_COMMIT or "unknown" where the source tree has no .git.
// Thread-safety: returns a string literal.
#pragma once

namespace dflash {

const char* version();

}  // namespace dflash
