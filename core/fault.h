#pragma once
// The fault-injection hook of the tests (tests/launch/test_faults.py, tests/real/test_regenerate.py):
// DFLASH_TEST_FAIL_AT=<rank>:<point>:<kind> makes the named rank fail at the named point.
// Points are named by their callers ("init", "plan", "b<K>" in comm/, "item<N>" in regenerate);
// kinds are throw (std::runtime_error), sigkill, stop (SIGSTOP, then sleep forever once continued)
// and hang (sleep forever). Unset or empty: nothing happens, at the cost of one getenv.
#include <functional>
#include <string>

namespace dflash::fault {

// Fails here when DFLASH_TEST_FAIL_AT names (rank, point); `announce(kind)` runs first (the
// progress board publishes the injection there). Throws UserError on a malformed spec.
void point(int rank, const std::string& where, const std::function<void(const std::string&)>& announce = {});

// Whether DFLASH_TEST_FAIL_AT is set at all (callers that build point names skip the work).
bool armed();

}  // namespace dflash::fault
