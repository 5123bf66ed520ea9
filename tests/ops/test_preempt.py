"""Preemption (comm/preempt.h, trainer/roles/preempt.h) under mpirun on CPU with the demo's tiny
target, 2 target + 2 drafter ranks, 16 steps, states only at the end (checkpoint.state_every =
1000), so that the only state before the end is the one the signal causes.

For each of SIGUSR1 / SIGTERM sent to one target rank, to one drafter rank, to every rank, and
SIGUSR1 to mpirun (OpenMPI 4.1 forwards SIGUSR1 and SIGUSR2 to the ranks): once a few steps are
done the signal arrives; every rank says it stopped after
the same step N, the job exits with 4, checkpoints/step-N is a complete state, and the same
command launched again (auto-resume) finishes with per-step losses (metrics.jsonl) and final
export bytes (model.safetensors) equal to an uninterrupted run's. Equality is exact: same layout,
one thread per rank, so the computation is deterministic (the e2e resume test relies on it too).
A second signal (0.25 s or more after the first) ends a rank at once (exit 3) without a state;
the same signal twice within microseconds (GNU timeout: the child, then its group) is one request.

SIGTERM to mpirun cannot be a preemption: OpenMPI 4.1 cannot forward it (ess_base_forward_signals
refuses SIGTERM); it sends SIGTERM to every rank and SIGKILL odls_base_sigkill_timeout (1) s
later, and stops forwarding the ranks' output (with a longer timeout a rank blocks writing its
log and the others time out). The test checks what dflash promises then: the job ends non-zero,
the run directory holds no partial state, and the same command launched again finishes with the
losses and export of an uninterrupted run.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

import ops_common as oc

NP = 4
STEPS = 16


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return oc.mpi_assets(tmp_path_factory, "preempt")


def args(assets, run_dir):
    root, target, data = assets
    return oc.overrides(target, data, run_dir, **{"train.max_steps": STEPS, "checkpoint.state_every": 1000})


@pytest.fixture(scope="module")
def straight(assets):
    return oc.uninterrupted(assets[0], NP, lambda run_dir: args(assets, run_dir))


def ranks_of(mpirun_pid):
    """world rank -> pid of mpirun's children."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != mpirun_pid:
                continue
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            for e in env:
                if e.startswith(b"OMPI_COMM_WORLD_RANK="):
                    out[int(e.split(b"=")[1])] = int(p)
        except (OSError, IndexError, ValueError):
            pass
    return out


def steps_done(run_dir):
    try:
        return sum(1 for _ in open(os.path.join(run_dir, "metrics.jsonl")))
    except OSError:
        return 0


def launch_and_signal(assets, run_dir, who, sig, second=None, stall_targets=False):
    """second: None, or the seconds after which the same signal goes again to the same ranks.
    stall_targets: SIGSTOP the target ranks first (SIGCONT after the signals), so that the drafters
    cannot reach the stop step and write a state before the second signal."""
    e = oc.env()
    proc = subprocess.Popen(oc.mpirun_cmd(NP, args(assets, run_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=e, cwd=oc.SRC, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and steps_done(run_dir) < 3:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the signal:\n" + proc.stdout.read()[-3000:]
    ranks = ranks_of(proc.pid)
    assert sorted(ranks) == list(range(NP)), ranks
    at = steps_done(run_dir)
    pids = {"launcher": [proc.pid], "target": [ranks[1]], "drafter": [ranks[3]], "all": list(ranks.values())}[who]
    stalled = [ranks[0], ranks[1]] if stall_targets else []
    for pid in stalled:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        os.kill(pid, sig)
    if second is not None:
        time.sleep(second)
        for pid in pids:
            os.kill(pid, sig)
    if stalled:
        time.sleep(0.5)
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, at


CASES = [("target", signal.SIGUSR1), ("target", signal.SIGTERM), ("drafter", signal.SIGUSR1),
         ("drafter", signal.SIGTERM), ("all", signal.SIGTERM), ("all", signal.SIGUSR1), ("launcher", signal.SIGUSR1)]


@pytest.mark.parametrize("who,sig", CASES, ids=[f"{w}-{s.name}" for w, s in CASES])
def test_signal_saves_a_state_and_resume_is_identical(assets, straight, tmp_path, who, sig):
    run_dir = str(tmp_path / "run")
    rc, out, at = launch_and_signal(assets, run_dir, who, sig)
    assert rc == 4, (rc, out[-4000:])
    assert f"received {sig.name}" in out, out[-4000:]
    stops = set(re.findall(r"preempted: stopped after step (\d+)", out))
    lines = [l for l in out.splitlines() if "preempted: stopped after step" in l]
    assert len(lines) == NP and len(stops) == 1, out[-4000:]  # every rank, the same step
    n = int(stops.pop())
    assert at <= n < STEPS, (at, n)
    meta = json.load(open(os.path.join(run_dir, "checkpoints", f"step-{n:08d}", "meta.json")))
    assert meta["step"] == n
    assert not os.path.exists(os.path.join(run_dir, "exports", "final"))
    assert "Traceback" not in out and "terminate called" not in out
    # the requeued job: the same command, no --resume
    p = oc.mpirun(NP, args(assets, run_dir))
    assert p.returncode == 0, p.all[-3000:]
    assert "auto-resume:" in p.all, p.all[-3000:]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)
    assert oc.export_bytes(run_dir) == oc.export_bytes(straight)


def test_second_signal_exits_at_once_without_a_state(assets, tmp_path):
    """A second SIGTERM 0.6 s after the first (the targets stopped meanwhile, so the first cannot
    complete): the drafter exits at once without a state."""
    run_dir = str(tmp_path / "run")
    rc, out, at = launch_and_signal(assets, run_dir, "drafter", signal.SIGTERM, second=0.6, stall_targets=True)
    assert rc != 0 and rc != 4, (rc, out[-4000:])
    assert "SIGTERM again: exiting now, without a state" in out, out[-4000:]
    ck = os.path.join(run_dir, "checkpoints")
    assert not os.path.exists(ck) or not [n for n in os.listdir(ck) if n.startswith("step-")], os.listdir(ck)


def test_the_same_signal_delivered_twice_is_one_request(assets, straight, tmp_path):
    """GNU timeout sends its signal to the child and then to its own process group, so a rank run
    under `timeout` gets it twice within microseconds (a 420 s cap of the GPU quality run lost 980
    steps to that). Two SIGTERMs to every rank 50 ms apart (apart enough that the kernel delivers
    both: a standard signal still pending when the same one comes again is merged with it; well
    inside the 0.25 s window) are one preemption request: exit 4 with a state, and the relaunch
    resumes to the uninterrupted run's losses. With no window the second exits 3 at once."""
    run_dir = str(tmp_path / "run")
    rc, out, at = launch_and_signal(assets, run_dir, "all", signal.SIGTERM, second=0.05)
    assert rc == 4, (rc, out[-4000:])
    assert "again: exiting now" not in out, out[-4000:]
    p = oc.mpirun(NP, args(assets, run_dir))
    assert p.returncode == 0 and "auto-resume:" in p.all, p.all[-3000:]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)


def test_sigterm_to_mpirun_loses_no_consistency(assets, straight, tmp_path):
    run_dir = str(tmp_path / "run")
    rc, out, at = launch_and_signal(assets, run_dir, "launcher", signal.SIGTERM)
    assert rc not in (0, 4), (rc, out[-4000:])
    ck = os.path.join(run_dir, "checkpoints")
    if os.path.exists(ck):  # a state the stop managed to write is complete; no partial one counts
        for n in os.listdir(ck):
            if n.startswith("step-") and not n.endswith(".tmp"):
                assert os.path.exists(os.path.join(ck, n, "meta.json")), n
    p = oc.mpirun(NP, args(assets, run_dir))
    assert p.returncode == 0, p.all[-3000:]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)
    assert oc.export_bytes(run_dir) == oc.export_bytes(straight)



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_mpirun_launcher_saves_a_state(assets, straight, tmp_path, sig):
    """launch/mpirun.sh turns SIGTERM/SIGINT (scancel, a time limit, Ctrl-C) into a SIGUSR1 for
    mpirun, so a state is written and the script returns 4, where raw mpirun (above) kills its
    ranks within a second; the relaunch resumes and matches an uninterrupted run."""
    run_dir = str(tmp_path / "run")
    e = oc.env(NP=NP, DFLASH_BIN=oc.RANK_BIN)
    proc = subprocess.Popen(["bash", os.path.join(oc.SRC, "launch", "mpirun.sh"), oc.DEMO, *args(assets, run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and steps_done(run_dir) < 3:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the signal:\n" + proc.stdout.read()[-3000:]
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 4, (proc.returncode, out[-4000:])
    assert f"launch: {sig.name}: every rank writes a state" in out, out[-4000:]
    stops = set(re.findall(r"preempted: stopped after step (\d+)", out))
    assert len(stops) == 1, out[-4000:]
    n = int(stops.pop())
    assert n < STEPS and os.path.exists(os.path.join(run_dir, "checkpoints", f"step-{n:08d}", "meta.json"))
    p = oc.mpirun(NP, args(assets, run_dir))  # the requeued job: the same command
    assert p.returncode == 0, p.all[-3000:]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)
    assert oc.export_bytes(run_dir) == oc.export_bytes(straight)
