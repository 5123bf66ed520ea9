"""Shared pieces of the tests/ops process tests: the demo's tiny target and data (made once per
test module in a temporary directory), a small config, and launchers for dflash_rank alone
(one process, layout.colocated) and under mpirun (the settings of tools/mpi_env.sh)."""
import json
import os
import shutil
import re
import signal
import subprocess
import sys
import time

SRC = os.environ.get("DFLASH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build"))
RANK_BIN = os.path.abspath(os.path.join(BUILD, "trainer", "dflash_rank"))
DEMO = os.path.abspath(os.path.join(SRC, "configs", "demo.yaml"))
sys.path.insert(0, os.path.join(SRC, "tools"))

LAUNCHER_VARS = re.compile(r"^(OMPI_|PMIX_|PMI_|SLURM_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|"
                           r"MASTER_ADDR$|MASTER_PORT$|TORCHELASTIC_)")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
           "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_mpi_yield_when_idle": "1",
           "OMPI_MCA_orte_allowed_exit_without_sync": "1",  # tools/mpi_env.sh says why
           "PYTHONDONTWRITEBYTECODE": "1"}


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    e.update(MPI_ENV)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def make_assets(root):
    import make_demo_data
    import make_tiny_target
    target = make_tiny_target.make(os.path.join(root, "target"), seed=0)
    data = make_demo_data.make(target, os.path.join(root, "data"), num_docs=96, new_tokens=40, prompt_lens=(8, 16))
    return target, data


def mpi_assets(tmp_path_factory, name):
    """The body of the module fixtures of the mpirun tests: (root, target, data), or a skip when
    dflash_rank is not built or mpirun is missing."""
    import pytest
    if not os.path.exists(RANK_BIN):
        pytest.skip(f"{RANK_BIN} not built")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    root = str(tmp_path_factory.mktemp(name))
    target, data = make_assets(root)
    return root, target, data


def overrides(target, data, run_dir, **extra):
    """A demo-like run of a few seconds: 2+2 ranks, G = 2 batches per step."""
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
         "data.batch_tokens": 384, "drafter.num_anchors": 24, "train.max_steps": 12, "train.lr": 1e-2,
         "log.interval": 1, "log.console_rank": -1, "checkpoint.export_every": 0, "checkpoint.state_every": 4,
         "comm.timeout_s": 60}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def run_rank(args, cwd=None, timeout=120, limit_as=None, **e):
    """dflash_rank alone (no launcher); limit_as: address-space limit in bytes."""
    def pre():
        if limit_as:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    t0 = time.monotonic()
    p = subprocess.run([RANK_BIN, *args], capture_output=True, text=True, timeout=timeout, env=env(**e), cwd=cwd,
                       stdin=subprocess.DEVNULL, preexec_fn=pre)
    p.elapsed = time.monotonic() - t0
    p.all = p.stdout + p.stderr
    return p


def mpirun_cmd(np_, args, resume=False):
    return ["mpirun", "-np", str(np_), RANK_BIN, "--config", DEMO, *args] + (["--resume"] if resume else [])


def mpirun(np_, args, resume=False, timeout=300, **e):
    p = subprocess.run(mpirun_cmd(np_, args, resume), capture_output=True, text=True, timeout=timeout, env=env(**e),
                       cwd=SRC, stdin=subprocess.DEVNULL)
    p.all = p.stdout + p.stderr
    return p


def uninterrupted(root, np_, args_for, name="straight"):
    """The reference run of a module: `args_for(run_dir)` under mpirun -np np_ in root/name, which
    must succeed; returns the run directory."""
    run_dir = os.path.join(root, name)
    p = mpirun(np_, args_for(run_dir))
    assert p.returncode == 0, p.all[-3000:]
    return run_dir


def session_pids(sid):
    """Live processes of session `sid` (a launcher started with start_new_session=True and all it
    started: Open MPI puts every rank into a process group of its own, so killpg reaches mpirun
    alone, but the ranks stay in its session)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            out.append(int(d))
    return out


def kill_session(proc, timeout=30):
    """kill -9 of the launcher `proc` and every process of its session (a node that dies), then
    wait until none is left: nothing of the killed run may write into its directory afterwards."""
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout)
    t0 = time.monotonic()
    while session_pids(proc.pid):
        assert time.monotonic() - t0 < timeout, f"still alive after kill -9: {session_pids(proc.pid)}"
        time.sleep(0.05)


def step_losses(run_dir):
    """step -> loss from metrics.jsonl (log.interval = 1); a step written twice keeps its last value."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "step" in m:
                out[m["step"]] = m["loss"]
    return out


def export_bytes(run_dir):
    with open(os.path.join(run_dir, "exports", "final", "model.safetensors"), "rb") as f:
        return f.read()


def error_lines(text):
    return [l for l in text.splitlines() if " error: " in l]
