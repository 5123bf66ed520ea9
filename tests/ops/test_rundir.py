"""Run directories that cannot be mixed up (trainer/roles/run_dir.h), under mpirun with the demo's
tiny target, 2 target + 2 drafter ranks, 12 steps (a few seconds each run):

- a run records itself in run.json (run id, identity hash, resolved config, code version);
- a second run with another config into the same run.dir is refused by every rank (exit 2),
  saying how to resume and where to start instead; nothing in the directory changes;
- run.overwrite=true starts over: a new run id, metrics.jsonl holds only the new run's steps;
- --resume with a changed train.max_steps is refused naming the key and both values; with
  run.accept_changes=true it continues and logs the consequence (the new learning rate);
- a run recorded by an older build (a key it lacked, another default of an execution key) is requeued
  as the same run; an identity key changed in its record is still another run;
- stale checkpoints/*.tmp and exports/*.tmp / *.old directories are removed at start;
- the same launch again (a requeued job) auto-resumes: after kill -9 of every rank, the same
  command without --resume continues from the newest state, and the per-step losses and the final
  export's bytes equal those of an uninterrupted run (same layout, one thread per rank:
  deterministic, so equality is exact);
- a second launch while one runs is refused (run.lock): metrics.jsonl is never interleaved.
"""
import json
import os
import shutil
import subprocess
import time

import pytest

import ops_common as oc

NP = 4
STEPS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return oc.mpi_assets(tmp_path_factory, "rundir")


def args(assets, run_dir, **extra):
    root, target, data = assets
    return oc.overrides(target, data, run_dir, **{"train.max_steps": STEPS, **extra})


@pytest.fixture(scope="module")
def straight(assets):
    return oc.uninterrupted(assets[0], NP, lambda run_dir: args(assets, run_dir))


def snapshot(run_dir):
    out = {}
    for dp, dn, fn in os.walk(run_dir):
        for f in fn:
            path = os.path.join(dp, f)
            if f != "run.lock":
                out[os.path.relpath(path, run_dir)] = open(path, "rb").read()
    return out


def test_run_json_records_the_run(straight):
    rj = json.load(open(os.path.join(straight, "run.json")))
    assert rj["format"] == "dflash-run" and len(rj["run_id"]) == 16 and len(rj["config_hash"]) == 16
    assert rj["code_version"] and rj["code_version"] != "unknown"
    assert f"max_steps: {STEPS}" in rj["config"]
    assert "new run" in rj["history"][0]
    meta = json.load(open(os.path.join(straight, "checkpoints", f"step-{STEPS:08d}", "meta.json")))
    assert meta["config_hash"] == rj["config_hash"]


def test_second_run_refused_then_overwrite(assets, straight, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(straight, run_dir)  # a moved run directory is the same run (run.dir is not identity)
    before = snapshot(run_dir)
    first_id = json.load(open(os.path.join(run_dir, "run.json")))["run_id"]
    p = oc.mpirun(NP, args(assets, run_dir, **{"train.lr": 5e-3}))
    assert p.returncode == 2, p.all[-3000:]
    lines = [l for l in oc.error_lines(p.all) if "holds another run" in l]
    assert len({l.split("]")[0] for l in lines}) == NP, p.all[-3000:]  # every rank says it
    line = lines[0]
    for needle in (f"run.dir {run_dir} holds another run: run {first_id}", "train.lr 0.01 -> 0.005",
                   "add --resume", "run.overwrite=true", f"e.g. {run_dir}-2", f"state at step {STEPS}"):
        assert needle in line, (needle, line)
    assert snapshot(run_dir) == before, "the refused run changed the directory"
    # overwrite: a new run; metrics.jsonl holds only its steps
    p = oc.mpirun(NP, args(assets, run_dir, **{"train.lr": 5e-3, "run.overwrite": "true"}))
    assert p.returncode == 0, p.all[-3000:]
    rj = json.load(open(os.path.join(run_dir, "run.json")))
    assert rj["run_id"] != first_id and "train:" in rj["config"] and "lr: 0.005" in rj["config"]
    steps = [json.loads(l)["step"] for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == list(range(1, STEPS + 1)), steps


def test_changed_schedule_on_resume(assets, straight, tmp_path):
    run_dir = str(tmp_path / "run")
    p = oc.mpirun(NP, args(assets, run_dir, **{"train.max_steps": 8}))
    assert p.returncode == 0, p.all[-3000:]
    before = snapshot(run_dir)
    p = oc.mpirun(NP, args(assets, run_dir), resume=True)  # max_steps 12
    assert p.returncode == 2, p.all[-3000:]
    line = [l for l in oc.error_lines(p.all) if "--resume" in l][0]
    assert "--resume: this launch changes the run in" in line and "train.max_steps 8 -> 12" in line, line
    assert "run.accept_changes=true" in line, line
    assert snapshot(run_dir) == before
    p = oc.mpirun(NP, args(assets, run_dir, **{"run.accept_changes": "true"}), resume=True)
    assert p.returncode == 0, p.all[-3000:]
    assert "run.accept_changes: continuing" in p.all and "the run now has 12 steps (was 8)" in p.all, p.all[-3000:]
    assert sorted(oc.step_losses(run_dir)) == list(range(1, 13))


def test_overwrite_in_a_requeued_slurm_job_resumes(assets, straight, tmp_path):
    """sbatch ... run.overwrite=true, preempted and requeued: the restart (SLURM_RESTART_COUNT=1)
    must continue the run, not delete it (it would start over at every requeue)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(straight, run_dir)
    before = oc.step_losses(run_dir)
    p = oc.mpirun(NP, args(assets, run_dir, **{"run.overwrite": "true"}), SLURM_RESTART_COUNT=1, SLURM_JOB_ID=77)
    assert p.returncode == 0, p.all[-3000:]
    assert "run.overwrite=true ignored: this is restart 1 of SLURM job 77" in p.all, p.all[-3000:]
    assert "auto-resume:" in p.all and "deleted the previous run" not in p.all, p.all[-3000:]
    assert oc.step_losses(run_dir) == before
    assert oc.export_bytes(run_dir) == oc.export_bytes(straight)


def test_run_of_an_older_build_auto_resumes(assets, straight, tmp_path):
    """A run recorded by an older dflash, requeued under this one: a key that build did not have (drafter.init_from,
    at its default now) and an execution choice with another default then (drafter.attention_backward: split, before
    auto) leave it the same run; the relaunch resumes it instead of calling the directory another run's."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(straight, run_dir)
    path = os.path.join(run_dir, "run.json")
    rj = json.load(open(path))
    lines = rj["config"].splitlines(keepends=True)
    assert any(l.strip().startswith("init_from:") for l in lines) and 'attention_backward: "auto"' in rj["config"]
    rj["config"] = "".join(l for l in lines if not l.strip().startswith("init_from:")).replace(
        'attention_backward: "auto"', 'attention_backward: "split"')
    rj["config_hash"] = "0123456789abcdef"  # that build's hash: not compared, the recorded config is
    json.dump(rj, open(path, "w"), indent=2)
    p = oc.mpirun(NP, args(assets, run_dir))
    assert p.returncode == 0, p.all[-3000:]
    assert "auto-resume:" in p.all and "holds another run" not in p.all, p.all[-3000:]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)
    # an identity key changed in the record is still another run
    rj["config"] = rj["config"].replace(f"max_steps: {STEPS}", f"max_steps: {STEPS + 1}")
    json.dump(rj, open(path, "w"), indent=2)
    p = oc.mpirun(NP, args(assets, run_dir))
    assert p.returncode == 2 and f"train.max_steps {STEPS + 1} -> {STEPS}" in p.all, p.all[-3000:]


def test_stale_tmp_cleaned_and_requeue_auto_resumes(assets, straight, tmp_path):
    run_dir = str(tmp_path / "run")
    over = args(assets, run_dir, **{"checkpoint.state_every": 4})
    proc = subprocess.Popen(oc.mpirun_cmd(NP, over), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=oc.env(), cwd=oc.SRC, start_new_session=True)
    latest = os.path.join(run_dir, "checkpoints", "latest")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(latest) and open(latest).read().strip() >= "step-00000004":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    oc.kill_session(proc)  # mpirun and every rank (each rank is a process group of its own)
    ck = os.path.join(run_dir, "checkpoints")
    states = sorted(n for n in os.listdir(ck) if n.startswith("step-") and not n.endswith(".tmp"))
    assert states and int(states[-1][5:]) < STEPS, states
    # leftovers of a crash: a state and an export that never completed
    for d in (os.path.join(ck, "step-00000011.tmp"), os.path.join(run_dir, "exports", "step-00000003.tmp"),
              os.path.join(run_dir, "exports", "final.old")):
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, "junk"), "w").write("x")
    # the requeued job: the same command, no --resume
    p = oc.mpirun(NP, over)
    assert p.returncode == 0, p.all[-3000:]
    assert "auto-resume:" in p.all and f"resuming from {os.path.join(ck, states[-1])}" in p.all, p.all[-3000:]
    assert "removing stale" in p.all
    assert not os.path.exists(os.path.join(ck, "step-00000011.tmp"))
    assert not [n for n in os.listdir(os.path.join(run_dir, "exports")) if n.endswith((".tmp", ".old"))]
    assert oc.step_losses(run_dir) == oc.step_losses(straight)
    assert oc.export_bytes(run_dir) == oc.export_bytes(straight)
    rj = json.load(open(os.path.join(run_dir, "run.json")))
    assert "auto-resumed" in rj["history"][-1], rj["history"]


def test_second_launch_while_one_runs_is_refused(assets, tmp_path):
    run_dir = str(tmp_path / "run")
    over = args(assets, run_dir, **{"train.max_steps": 2000})
    proc = subprocess.Popen(oc.mpirun_cmd(NP, over), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=oc.env(), cwd=oc.SRC, start_new_session=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not os.path.exists(metrics):
        time.sleep(0.02)
    try:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        p = oc.mpirun(NP, over)  # the same command: it would auto-resume, but the first one holds run.lock
        assert p.returncode == 2 and "is in use by another launch (pid" in p.all, p.all[-3000:]
        assert proc.poll() is None, "the first launch was disturbed"
    finally:
        oc.kill_session(proc)
    lines = open(metrics).read().split("\n")[:-1]  # complete lines (kill -9 may cut the last)
    steps = [json.loads(l)["step"] for l in lines]
    assert steps == list(range(1, len(steps) + 1)), steps  # one run's lines only
