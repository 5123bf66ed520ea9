"""The sbatch scripts of launch/ run by a real SLURM: the project's own one-node and two-node
clusters on localhost (tests/comm/local_slurm.sh: munged, slurmctld, one slurmd per node, each
with its own NodeName and port), the tiny CPU demo (tests/launch/common.py), 2 target + 2 drafter
ranks.

- one node, srun --mpi=pmix: the job completes and gives the per-step losses and the final
  export (bytes) of the same run started directly with mpirun;
- two nodes (2 ranks on each), srun --mpi=pmix and mpirun inside the allocation: the same
  per-step losses as the one-node run (rtol 0: same layout, same order of every sum);
- preemption: `scontrol requeue` (SIGTERM to the ranks) and `scancel --signal=USR1` (what
  `#SBATCH --signal=USR1@120` sends) once the first state exists: the job writes a state, is
  requeued, resumes by itself (auto-resume) and completes with the per-step losses and the
  export of the uninterrupted run.
Skipped with the reason when SLURM is not installed or slurmctld cannot start.
"""
import re
import time
from pathlib import Path

import pytest

from common import (BIN, SOURCE, STEPS, Slurm, assets, demo_overrides, export_digest,  # noqa: F401
                    make_reference, reference, run, slurm_available, step_losses)

pytestmark = pytest.mark.skipif(not slurm_available(), reason="slurm is not installed (tools/setup.sh installs it)")

# what the demo needs of the 8-GPU job scripts: 4 CPU tasks, no GPUs, a short limit
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]


@pytest.fixture(scope="module")
def slurm1():
    s = Slurm(1)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slurm2():
    s = Slurm(2)
    s.start()
    yield s
    s.stop()


def submit(slurm, script, run_dir, out, assets, extra_sbatch=(), steps=STEPS, **env):
    args = [*CPU_JOB, *extra_sbatch, f"--output={out}", str(SOURCE / "launch" / script), "configs/demo.yaml",
            *demo_overrides(assets, str(run_dir), steps=steps)]
    return slurm.sbatch(args, DFLASH_BIN=BIN, **env)


def finished(slurm, jobid, out, timeout=300):
    j = slurm.wait(jobid, timeout=timeout)
    text = Path(out).read_text() if Path(out).exists() else ""
    return j, text


def test_sbatch_one_node_runs_the_demo(slurm1, assets, reference, tmp_path):
    out = tmp_path / "job.out"
    jobid = submit(slurm1, "slurm_1node.sbatch", tmp_path / "run", out, assets, ["--ntasks-per-node=4"])
    j, text = finished(slurm1, jobid, out)
    assert j["state"] == "COMPLETED" and j["exit"] == "0:0", f"{j}\n{text[-4000:]}\n{slurm1.diagnose(jobid)}"
    assert "srun" in text and f"dflash job {jobid}" in text, text[-2000:]
    assert step_losses(tmp_path / "run") == reference[0]
    assert export_digest(tmp_path / "run") == reference[1]


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_two_nodes_gives_the_one_node_losses(slurm2, assets, reference, tmp_path, launcher):
    out = tmp_path / "job.out"
    jobid = submit(slurm2, "slurm_multinode.sbatch", tmp_path / "run", out, assets,
                   ["--nodes=2", "--ntasks-per-node=2"], DFLASH_LAUNCHER=launcher)
    j, text = finished(slurm2, jobid, out)
    assert j["state"] == "COMPLETED", f"{j}\n{text[-4000:]}\n{slurm2.diagnose(jobid)}"
    assert "on n[1-2]" in text, text[-2000:]
    assert step_losses(tmp_path / "run") == reference[0]
    assert export_digest(tmp_path / "run") == reference[1]


# The preempted runs are longer: a signal stops the run after the steps whose batches may be in
# flight (data.prefetch + 2, docs/training.md "Preemption"), so that a signal after the first
# state (step 4) must stop a 16-step run before its end, with a state of its own.
PREEMPT_STEPS = 16


@pytest.fixture(scope="module")
def reference16(assets, tmp_path_factory):
    return make_reference(assets, tmp_path_factory, steps=PREEMPT_STEPS)


def wait_for_state(run_dir, jobid, slurm, timeout=240):
    """Until the run has its first complete state (checkpoint.state_every=4)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = Path(run_dir) / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 5:
            return True
        if slurm.job(jobid)["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return False
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("how", ["scontrol_requeue", "usr1"])
def test_sbatch_preempted_requeues_and_resumes(slurm1, assets, reference16, tmp_path, how):
    out = tmp_path / "job.out"
    run_dir = tmp_path / "run"
    jobid = submit(slurm1, "slurm_1node.sbatch", run_dir, out, assets, ["--ntasks-per-node=4"], steps=PREEMPT_STEPS)
    assert wait_for_state(run_dir, jobid, slurm1), \
        f"{Path(out).read_text() if Path(out).exists() else ''}\n{slurm1.diagnose(jobid)}"
    if how == "scontrol_requeue":
        p = run(["scontrol", "requeue", jobid], env=slurm1.environ(), timeout=30)
    else:  # what --signal=USR1@120 does 120 s before the limit: USR1 to the job's steps
        p = run(["scancel", "--signal=USR1", jobid], env=slurm1.environ(), timeout=30)
    assert p.returncode == 0, p.all
    slurm1.release_requeued(jobid)  # fails with the job's state and the SLURM logs if it was not requeued
    j, text = finished(slurm1, jobid, out, timeout=400)
    assert j["state"] == "COMPLETED" and j["restarts"] >= 1, f"{j}\n{text[-4000:]}\n{slurm1.diagnose(jobid)}"
    assert re.search(r"restart 1\)", text), text[-3000:]
    sig = "SIGTERM" if how == "scontrol_requeue" else "SIGUSR1"
    assert f"received {sig}: the run saves a state" in text, text[-3000:]
    if how == "usr1":  # exit 4 -> the script requeues the job itself (scontrol requeue does that for SIGTERM)
        assert "preempted, state written; requeueing" in text, f"the job was not preempted\n{text[-3000:]}"
    assert re.search(r"auto-resume", text), f"the requeued job did not resume\n{text[-3000:]}"
    assert step_losses(run_dir) == reference16[0]
    assert export_digest(run_dir) == reference16[1]
