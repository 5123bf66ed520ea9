// The code version of this build: `git describe --always --dirty --tags` of the source tree,
// taken at build time (cmake/version.cmake regenerates it on every build; the compiled file
// changes only when the version does), or "unknown" outside a git checkout.
//
// Owns nothing but the string. Recorded in every run directory (run.json) and printed by
// --version. Thread-safety: a constant.
#pragma once

namespace dflash {

const char* version();

}  // namespace dflash
