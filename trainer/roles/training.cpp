#include "trainer/roles/training.h"

#include <algorithm>
#include <optional>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/agree.h"
#include "comm/communicator.h"
#include "comm/preempt.h"
#include "comm/identity.h"
#include "comm/progress.h"
#include "comm/startup_watchdog.h"
#include "comm/store.h"
#include "comm/watchdog.h"
#include "core/error.h"
#include "core/log.h"
#include "core/random.h"
#include "trainer/roles/eval_hooks.h"
#include "trainer/roles/roles.h"
#include "trainer/roles/run_dir.h"
#include "trainer/roles/run_info.h"

namespace dflash {
namespace {

// Every rank resolves the plan, then the ranks agree on whether all succeeded (comm/agree.h:
// through MPI under an MPI launch, through the run's store under torchrun-style or SLURM
// launches), so that each rank reports its own error and the others name the rank(s) that
// failed and the cause, and all exit with the failure's code (2 for bad input) before anything
// is written, instead of the first failure tearing the others down or leaving them waiting.
// Every rank accepted the run: world rank 0 claims and prepares run.dir (roles/run_dir.h: the
// lock, overwrite, stale .tmp, run.json), and the ranks agree on its outcome before anything else
// writes there.
std::optional<roles::RunPlan> prepare_on_rank0(const Config& cfg, const roles::RankContext& ctx,
                                               const roles::RunDirDecision& run_dir, std::optional<roles::RunPlan> plan,
                                               comm::Store* store, int* exit_code) {
  comm::Report mine;
  if (ctx.id.rank == 0) {
    try {
      roles::prepare_run_dir(cfg, run_dir, *plan);
    } catch (const std::exception& e) {
      if (ctx.id.world_size == 1) throw;
      mine = {comm::exit_code_of(e), e.what()};
    }
  }
  if (ctx.id.world_size == 1) return plan;
  const std::vector<comm::Report> all = comm::agree(ctx.id, "rundir", mine, cfg.comm.startup_timeout_s, store);
  if (all[0].ok()) return plan;
  if (ctx.id.rank == 0) log::error("{}", mine.what);
  else log::error("{} could not prepare run.dir: {}", comm::name_rank(0), all[0].what);
  *exit_code = all[0].code;
  return std::nullopt;
}

std::optional<roles::RunPlan> plan_on_every_rank(const Config& cfg, const roles::RankContext& ctx, bool resume,
                                                 comm::Store* store, int* exit_code) {
  std::optional<roles::RunPlan> plan;
  comm::Report mine;
  roles::RunDirDecision run_dir;
  try {
    check_paths(cfg);  // a missing path is the first thing to fix, before which run the directory holds
    run_dir = roles::inspect_run_dir(cfg, resume);  // reads only; may turn into an auto-resume
    plan = roles::make_plan(cfg, ctx.schedule, ctx.id.world_size, ctx.id.gpu, run_dir.resume);
  } catch (const std::exception& e) {
    if (ctx.id.world_size == 1) throw;
    mine = {comm::exit_code_of(e), e.what()};
  }
  std::vector<comm::Report> all;
  {
    // a backstop at the deadline + 3 s (agree() reports a timeout better itself)
    comm::StartupPhase phase("the plan agreement", 3.0);
    all = comm::agree(ctx.id, "startup", mine, cfg.comm.startup_timeout_s, store);
  }
  std::vector<int> bad;
  for (int r = 0; r < ctx.id.world_size; ++r)
    if (!all[static_cast<size_t>(r)].ok()) bad.push_back(r);
  if (bad.empty()) return prepare_on_rank0(cfg, ctx, run_dir, std::move(plan), store, exit_code);
  if (!mine.ok()) {
    log::error("{}", mine.what);
    *exit_code = mine.code;
  } else {
    const comm::Report& first = all[static_cast<size_t>(bad[0])];
    log::error("{} could not start: {}{}; nothing was written", comm::name_rank(bad[0]), first.what,
               bad.size() > 1 ? fmt::format(" (ranks [{}] failed too)", fmt::join(bad.begin() + 1, bad.end(), ", "))
                              : "");
    *exit_code = first.code;
  }
  return std::nullopt;
}

}  // namespace

int run_training(const Config& cfg, const roles::RankContext& ctx, bool resume) {
  // From here on SIGTERM/SIGUSR1 ask for a state and exit 4 (comm/preempt.h, roles/preempt.h).
  comm::arm_preemption(cfg.comm.timeout_s);
  // CPU threads: share the cores among the ranks of this node (the CPU demo runs 4 ranks on 2).
  if (ctx.id.gpu < 0) {
    int threads = static_cast<int>(cfg.run.cpu_threads);
    if (threads <= 0)
      threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, ctx.id.local_world_size));
    at::set_num_threads(threads);
  }
  // The default CPU generator: nothing in training draws from it (initialisation, anchors and the
  // data order have their own keyed streams), but torch seeds it differently in every process and a
  // training state saves it per rank; seeded from (run.seed, rank), identical runs write identical
  // states, and whatever might draw from it later repeats and resumes exactly.
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(splitmix64(splitmix64(static_cast<uint64_t>(cfg.run.seed)) ^ static_cast<uint64_t>(ctx.id.rank)));
  }
  int rc = kExitOk;
  // One store for the start-up of a launch without MPI (the agreement, then NCCL's rendezvous).
  std::shared_ptr<comm::Store> store = comm::startup_store(ctx.id, cfg.comm.startup_timeout_s);
  std::optional<roles::RunPlan> plan = plan_on_every_rank(cfg, ctx, resume, store.get(), &rc);
  if (!plan) return rc;
  comm::progress::publish("plan done");
  comm::progress::maybe_fail(ctx.id.rank, "plan");  // the fault tests' hook (comm/progress.h)
  const roles::RunPlan& p = *plan;
  if (ctx.id.rank == 0) {
    for (const auto& line : roles::run_header(cfg, ctx, p)) log::info("{}", line);
    roles::copy_data_record(cfg);
  }

  auto outcome = [&] {
    if (comm::preempted_at() < 0) return kExitOk;
    log::warn("preempted: stopped after step {} with its state in {}; exit code {} (launch again with the same "
              "config to resume)",
              comm::preempted_at(), ckpt::checkpoints_dir(cfg.run.dir), comm::kExitPreempted);
    return comm::kExitPreempted;
  };
  if (p.colocated) {
    roles::RoleContext rc_ctx{cfg, ctx, p, nullptr, nullptr, nullptr};
    roles::run_colocated(rc_ctx);
    return outcome();
  }
  std::unique_ptr<comm::Communicator> c = comm::make_communicator(roles::comm_options(cfg), ctx.id, store);
  std::shared_ptr<comm::Group> drafters = c->new_group(ctx.schedule.drafter_ranks());
  roles::RoleContext role{cfg, ctx, p, c.get(), drafters, nullptr};  // eval_group: below
  if (const int e = roles::eval_rank(cfg, ctx.schedule, ctx.id.world_size); e >= 0)  // collective
    role.eval_group = c->new_group({ctx.schedule.drafter_rank(0) < e ? ctx.schedule.drafter_rank(0) : e,
                                    ctx.schedule.drafter_rank(0) < e ? e : ctx.schedule.drafter_rank(0)});
  if (ctx.schedule.is_target(ctx.id.rank))
    roles::run_target_role(role);
  else
    roles::run_drafter_role(role);
  return outcome();
}

}  // namespace dflash
