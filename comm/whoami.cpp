// comm/whoami.h: --whoami.
#include "comm/whoami.h"

#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/log.h"

namespace dflash::comm {

int run_whoami(const Identity& id, double startup_timeout_s) {
  std::string line = fmt::format("identity: {}", id.describe());
  std::fprintf(stdout, "%s %s\n", log::prefix().c_str(), line.c_str());
  std::fflush(stdout);
  std::vector<std::string> all;
  std::string info = fmt::format("{} local {}/{} {} host {}", id.rank, id.local_rank, id.local_world_size,
                                 source_name(id.source), id.host);
  if (id.world_size > 1) {
    if (id.source == Source::Mpi) {
      auto comm = make_mpi_communicator(id, startup_timeout_s);
      comm->barrier();
      all.push_back(fmt::format("{} ranks met at an MPI barrier", id.world_size));
    } else {
      auto store = make_store(id, startup_timeout_s);
      all = rendezvous(*store, "whoami", id.rank, id.world_size, info, startup_timeout_s);
      sign_off(*store, "whoami", id.rank, id.world_size, startup_timeout_s);  // rank 0 serves until all read
    }
  }
  if (id.rank == 0)
    for (const auto& a : all) log::info("rendezvous: {}", a);
  return kExitOk;
}

}  // namespace dflash::comm
