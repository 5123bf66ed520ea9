// What the gtest binaries that run as one process or under mpirun share: their main().
//   int main(int argc, char** argv) {
//     return dflash::test::mpi_test_main(argc, argv, g_comm, [](const comm::Identity& id) {
//       return id.world_size > 1 ? comm::make_mpi_communicator(id, 60) : nullptr; });
//   }
// `make` returns the communicator the tests use (nullptr: none, the one-process cases); it is
// published in `slot` while the tests run, with a 60 s timeout, and every rank meets at a barrier
// after them. An exception while setting up ends every rank at once (comm::fail_fast).
#pragma once

#include <functional>
#include <memory>

#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "comm/identity.h"
#include "comm/watchdog.h"

namespace dflash::test {

inline int mpi_test_main(int argc, char** argv, comm::Communicator*& slot,
                         const std::function<std::unique_ptr<comm::Communicator>(const comm::Identity&)>& make) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    std::unique_ptr<comm::Communicator> c = make(comm::detect());
    if (c) c->set_timeout(60);
    slot = c.get();
    rc = RUN_ALL_TESTS();
    if (c) c->barrier();
    slot = nullptr;
  } catch (const std::exception& e) {
    comm::fail_fast(e);
  }
  comm::finalize_mpi();
  return rc;
}

}  // namespace dflash::test
