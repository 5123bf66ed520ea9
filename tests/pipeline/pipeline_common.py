"""What the pipeline tests (test_e2e.py, test_e2e_targets.py, test_run_outputs.py, test_speed.py,
test_profile.py) share: where the source tree and the build are, the dflash_rank binary, tools/ on
the import path, the environment of mpirun on one machine as root (tools/mpi_env.sh's settings),
the skip when either is missing, and a demo-sized run (the tiny target, one shard, a launch)."""
import os
import shutil
import subprocess
import sys
import time

SRC = os.environ.get("DFLASH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build"))
RANK_BIN = os.path.join(BUILD, "trainer", "dflash_rank")
sys.path.insert(0, os.path.join(SRC, "tools"))

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_tcp_if_include="lo",
           OMPI_MCA_oob_tcp_if_include="lo", OMPI_MCA_mpi_yield_when_idle="1", PYTHONDONTWRITEBYTECODE="1",
           OMPI_MCA_orte_allowed_exit_without_sync="1")  # tools/mpi_env.sh says why


def skip_without_rank_and_mpirun():
    """In a module fixture: skip the module when dflash_rank is not built or mpirun is missing."""
    import pytest
    if not os.path.exists(RANK_BIN):
        pytest.skip(f"{RANK_BIN} not built")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")


def tiny_run_inputs(root, n_docs):
    """The tiny target (seed 0) and one shard of n_docs random 64-token documents (8 prompt
    tokens, 56 supervised) under root: {"root", "target", "data"}."""
    import numpy as np
    import dflash_shard
    import make_tiny_target
    target = make_tiny_target.make(str(root / "target"), seed=0)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(1, 500, 64).tolist(), [0] * 8 + [1] * 56) for _ in range(n_docs)]
    dflash_shard.write_shard(str(root / "data.dfshard"), docs, 512)
    return {"root": root, "target": target, "data": str(root / "data.dfshard")}


def launch_demo(inputs, name, np_, steps, extra, overrides=None):
    """configs/demo.yaml on tiny_run_inputs for `steps` steps, metrics every step, no states or
    exports, run directory root/name; np_ > 1 under mpirun. Returns (result, wall seconds, run dir)."""
    run_dir = str(inputs["root"] / name)
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": inputs["target"],
         "data.shards": f"[{inputs['data']}]", "data.batch_tokens": 384, "train.max_steps": steps,
         "log.interval": 1, "checkpoint.export_every": 0, "checkpoint.state_every": 0, "comm.timeout_s": 60}
    o.update(overrides or {})
    cmd = [RANK_BIN, "--config", os.path.join(SRC, "configs", "demo.yaml")] + [f"{k}={v}" for k, v in o.items()]
    cmd += extra
    if np_ > 1:
        cmd = ["mpirun", "-np", str(np_)] + cmd
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=SRC)
    return r, time.monotonic() - t0, run_dir
