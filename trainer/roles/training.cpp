#include "trainer/roles/training.h"

#include <mpi.h>

#include <algorithm>
#include <optional>
#include <thread>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "comm/check.h"
#include "comm/preempt.h"
#include "core/error.h"
#include "comm/identity.h"
#include "core/log.h"
#include "trainer/roles/roles.h"
#include "trainer/roles/run_dir.h"

namespace dflash {
namespace {

// Every rank resolves the plan; under MPI the ranks then agree on whether all succeeded, so
// that each rank reports its own error (or names the ranks that failed) and all exit cleanly
// with code 2, instead of the first failure tearing the others down before they can speak.
std::optional<roles::RunPlan> plan_on_every_rank(const Config& cfg, const comm::RankContext& ctx, bool resume,
                                                 int* exit_code) {
  std::optional<roles::RunPlan> plan;
  std::string error;
  roles::RunDirDecision run_dir;
  try {
    run_dir = roles::inspect_run_dir(cfg, resume);  // reads only; may turn into an auto-resume
    plan = roles::make_plan(cfg, ctx.schedule, ctx.id.world_size, ctx.id.gpu, run_dir.resume);
  } catch (const UserError& e) {
    if (!comm::mpi_active() || ctx.id.world_size == 1) throw;
    error = e.what();
  }
  if (comm::mpi_active() && ctx.id.world_size > 1) {
    int failed = error.empty() ? 0 : 1;
    std::vector<int> all(static_cast<size_t>(ctx.id.world_size), 0);
    DFLASH_CHECK_MPI(MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD));
    std::vector<int> bad;
    for (int r = 0; r < ctx.id.world_size; ++r)
      if (all[static_cast<size_t>(r)]) bad.push_back(r);
    if (!bad.empty()) {
      if (!error.empty())
        log::error("{}", error);
      else
        log::error("rank(s) [{}] rejected the run's input (see their messages); nothing was written", fmt::join(bad, ", "));
      *exit_code = kExitUser;
      return std::nullopt;
    }
  }
  // Every rank accepted the run: world rank 0 claims and prepares run.dir (roles/run_dir.h), the
  // others wait for its verdict before anything writes there.
  std::string dir_error;
  if (ctx.id.rank == 0) {
    try {
      roles::prepare_run_dir(cfg, run_dir, *plan);
    } catch (const UserError& e) {
      if (!comm::mpi_active() || ctx.id.world_size == 1) throw;
      dir_error = e.what();
    }
  }
  if (comm::mpi_active() && ctx.id.world_size > 1) {
    int failed = dir_error.empty() ? 0 : 1;
    DFLASH_CHECK_MPI(MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD));
    if (failed) {
      if (!dir_error.empty()) log::error("{}", dir_error);
      else log::error("rank 0 could not prepare run.dir {} (see its message)", cfg.run.dir);
      *exit_code = kExitUser;
      return std::nullopt;
    }
  }
  return plan;
}

}  // namespace

int run_training(const Config& cfg, const comm::RankContext& ctx, bool resume) {
  // From here on SIGTERM/SIGUSR1 ask for a state and exit 4 (comm/preempt.h, roles/preempt.h).
  comm::arm_preemption(cfg.comm.timeout_s);
  // CPU threads: share the cores among the ranks of this node (the CPU demo runs 4 ranks on 2).
  if (ctx.id.gpu < 0) {
    int threads = static_cast<int>(cfg.run.cpu_threads);
    if (threads <= 0)
      threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, ctx.id.local_world_size));
    at::set_num_threads(threads);
  }
  int rc = kExitOk;
  std::optional<roles::RunPlan> plan = plan_on_every_rank(cfg, ctx, resume, &rc);
  if (!plan) return rc;
  const roles::RunPlan& p = *plan;
  if (ctx.id.rank == 0)
    log::info("plan: {} target + {} drafter rank(s){}, {} batches/step ({} x grad_accum {}), steps {}..{}, "
              "{} documents / {} tokens, target layers [{}]{}",
              p.target_ranks, p.drafter_ranks, p.colocated ? " (colocated)" : "", p.batches_per_step,
              p.drafter_ranks, p.grad_accum, p.start_step, p.total_steps, p.data->num_docs(), p.data->num_tokens(),
              fmt::join(p.layer_ids, ", "), p.resume ? fmt::format(", resuming from {}", p.resume_dir) : "");

  auto outcome = [&] {
    if (comm::preempted_at() < 0) return kExitOk;
    log::warn("preempted: stopped after step {} with its state in {}; exit code {} (launch again with the same "
              "config to resume)",
              comm::preempted_at(), ckpt::checkpoints_dir(cfg.run.dir), comm::kExitPreempted);
    return comm::kExitPreempted;
  };
  if (p.colocated) {
    roles::RoleContext rc_ctx{cfg, ctx, p, nullptr, nullptr};
    roles::run_colocated(rc_ctx);
    return outcome();
  }
  comm::CommOptions co;
  co.backend = cfg.comm.backend;
  co.timeout_s = cfg.comm.timeout_s;
  co.startup_timeout_s = cfg.comm.startup_timeout_s;
  std::unique_ptr<comm::Communicator> c = comm::make_communicator(co, ctx.id);
  std::shared_ptr<comm::Group> drafters = c->new_group(ctx.schedule.drafter_ranks());
  roles::RoleContext role{cfg, ctx, p, c.get(), drafters};
  if (ctx.schedule.is_target(ctx.id.rank))
    roles::run_target_role(role);
  else
    roles::run_drafter_role(role);
  return outcome();
}

}  // namespace dflash
