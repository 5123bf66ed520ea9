"""The start-up agreement of a training run (trainer/roles/training.cpp over comm/agree.h):
when ONE rank cannot start, every rank exits non-zero within comm.startup_timeout_s and the
ranks that could start name the failing rank and its cause; nothing is written to run.dir.

Launches, with a tiny target (tools/make_tiny_target.py) and a small random shard made here:
- torchrun-style (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, the c10d store; no MPI)
  and SLURM-without-MPI-style (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID + MASTER_ADDR/PORT)
  environments, one process per rank started here, rank 2 given a target.model_dir that does
  not exist (as if the model were missing on its node);
- mpirun in MPMD form (`mpirun -np 3 ... : -np 1 ... target.model_dir=<missing>`): the MPI path;
- a rank that never starts: the others end with the rendezvous naming it.
Timing: the deadline is comm.startup_timeout_s = STARTUP_S; the failure cases must end well
before it (the agreement completes as soon as every rank has reported), the missing-rank case
within it plus SLACK_S for process start and exit on a loaded 2-core machine.
"""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", SRC / "build")).resolve()
BIN = BUILD / "trainer" / "dflash_rank"
sys.path.insert(0, str(SRC / "tools"))

STARTUP_S = 30
SLACK_S = 15
LAUNCHER_VARS = re.compile(r"^(OMPI_|PMIX_|PMI_|SLURM_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|"
                           r"MASTER_ADDR$|MASTER_PORT$|TORCHELASTIC_)")
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_orte_allowed_exit_without_sync": "1",  # tools/mpi_env.sh says why
}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update(MPI_ENV)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    if not BIN.exists():
        pytest.skip(f"{BIN} not built")
    import dflash_shard
    import make_tiny_target
    import numpy as np
    root = tmp_path_factory.mktemp("startup")
    target = make_tiny_target.make(str(root / "target"), seed=0)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(1, 500, 48).tolist(), [0] * 8 + [1] * 40) for _ in range(64)]
    dflash_shard.write_shard(str(root / "data.dfshard"), docs, 512)
    return root, target, str(root / "data.dfshard")


def args(assets, run_dir, **extra):
    root, target, data = assets
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
         "data.batch_tokens": 384, "train.max_steps": 4, "layout.target_ranks": 2, "layout.drafter_ranks": 2,
         "log.console_rank": -1, "comm.startup_timeout_s": STARTUP_S, "comm.timeout_s": 20}
    o.update(extra)
    return ["--config", str(SRC / "configs" / "demo.yaml")] + [f"{k}={v}" for k, v in o.items()]


def launcher_env(kind, rank, world, port):
    if kind == "torchrun":
        return dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return dict(SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=world, SLURM_STEP_TASKS_PER_NODE=world,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def spawn(kind, ranks, world, argv_of):
    """One process per rank in `ranks` with the launcher's environment; returns
    (returncodes by rank, output by rank, seconds until the last one ended)."""
    port = free_port()
    t0 = time.monotonic()
    procs = {r: subprocess.Popen([str(BIN), *argv_of(r)], env=clean_env(**launcher_env(kind, r, world, port)),
                                 cwd=str(SRC), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for r in ranks}
    outs = {r: p.communicate(timeout=STARTUP_S + 60)[0] for r, p in procs.items()}
    return {r: p.returncode for r, p in procs.items()}, outs, time.monotonic() - t0


def check_named(text_of, failing, cause):
    """The failing rank prints its own error; every other rank names it and the cause."""
    for r, text in text_of.items():
        errors = [l for l in text.splitlines() if re.search(rf"\[dflash r{r}/4 \w+\] error: ", l)]
        assert errors, f"rank {r} printed no error\n{text}"
        if r == failing:
            assert any(cause in l for l in errors), f"rank {r}: {errors}"
        else:
            assert any(re.search(rf"rank {failing} \(\w+ \d\) could not start: .*{re.escape(cause)}", l)
                       for l in errors), f"rank {r} does not name rank {failing} and the cause: {errors}"
        assert "Traceback" not in text and "terminate called" not in text and "frame #" not in text, text


@pytest.mark.parametrize("kind", ["torchrun", "slurm"])
def test_one_rank_fails_without_mpi(assets, tmp_path, kind):
    run_dir = tmp_path / "run"
    missing = tmp_path / "no-such-model"
    codes, outs, secs = spawn(kind, range(4), 4,
                              lambda r: args(assets, run_dir, **({"target.model_dir": missing} if r == 2 else {})))
    assert all(c == 2 for c in codes.values()), (codes, outs)
    assert secs < STARTUP_S, f"took {secs:.1f} s\n{outs}"
    check_named(outs, 2, str(missing))
    assert not run_dir.exists()


def test_one_rank_fails_under_mpirun(assets, tmp_path):
    run_dir = tmp_path / "run"
    missing = tmp_path / "no-such-model"
    ok = args(assets, run_dir)
    cmd = ["mpirun", "-np", "3", str(BIN), *ok, ":", "-np", "1", str(BIN), *args(assets, run_dir, **{
        "target.model_dir": missing})]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=clean_env(), cwd=str(SRC), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=STARTUP_S + 60)
    secs = time.monotonic() - t0
    text = p.stdout + p.stderr
    assert p.returncode == 2, text
    assert secs < STARTUP_S, f"took {secs:.1f} s\n{text}"
    check_named({r: text for r in range(4)}, 3, str(missing))
    assert not run_dir.exists()


def test_a_rank_that_never_starts_is_named(assets, tmp_path):
    run_dir = tmp_path / "run"
    codes, outs, secs = spawn("torchrun", [0, 1, 2], 4, lambda r: args(assets, run_dir, **{
        "comm.startup_timeout_s": 3}))
    assert all(c != 0 for c in codes.values()), (codes, outs)
    assert secs < 3 + SLACK_S, f"took {secs:.1f} s\n{outs}"
    assert "rank 3 of 4 did not arrive within 3 s" in outs[0], outs[0]
    assert not run_dir.exists()
