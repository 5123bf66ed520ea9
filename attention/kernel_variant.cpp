// kernel_variant_from_env (attention/kernel.h): the integer knobs of the attention kernel (tile
// variants, the forward's rescale slack), checked. Host code only, built with and without CUDA (its
// test runs on the CPU).
#include <cstdlib>
#include <string>

#include "attention/kernel.h"
#include "core/error.h"

namespace dflash::attention {

int kernel_variant_from_env(const char* name, const int* allowed, int n, int fallback) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  for (int i = 0; *end == '\0' && i < n; ++i)
    if (v == allowed[i]) return allowed[i];
  std::string list;
  for (int i = 0; i < n; ++i) list += (i ? ", " : "") + std::to_string(allowed[i]);
  throw_user("{}={}: not a setting of the attention kernel (one of {}, or unset for the default {}; "
             "docs/environment.md, attention/kernel/NOTES.md)",
             name, e, list, fallback);
}

}  // namespace dflash::attention
