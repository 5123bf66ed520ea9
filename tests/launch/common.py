"""Shared by the tests of tests/launch: paths, a launcher-free environment, the tiny demo assets,
per-step losses and exports of a run directory, leftover processes, the project's local SLURM.

The demo assets (tools/make_tiny_target.py seed 0, tools/make_demo_data.py) are made once per
build directory under <build>/test-assets/launch (deterministic; a lock file serialises the ctest
entries that need them).
"""
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build")).resolve()
SOURCE = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2])).resolve()
BIN = BUILD / "trainer" / "dflash_rank"
DEMO = SOURCE / "configs" / "demo.yaml"
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_mpi_yield_when_idle": "1",
}
LAUNCHER_VARS = re.compile(r"^(OMPI_|PMIX_|PMI_|SLURM_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|"
                           r"MASTER_ADDR$|MASTER_PORT$|TORCHELASTIC_|DFLASH_TEST_)")
STEPS = 8  # demo steps of the launcher tests: states at 4 and 8 (checkpoint.state_every=4)


def clean_env(mpi=True, **extra):
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    if mpi:
        env.update(MPI_ENV)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, timeout=180, env=None, **kw):
    t0 = time.monotonic()
    p = subprocess.run([str(c) for c in cmd], env=env if env is not None else clean_env(),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, **kw)
    p.elapsed = time.monotonic() - t0
    p.all = p.stdout + p.stderr
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_binary():
    if not BIN.exists():
        pytest.skip(f"{BIN} not built")


@pytest.fixture(scope="session")
def assets():
    """(target_dir, data_dir) of the tiny demo, made once per build directory."""
    need_binary()
    root = BUILD / "test-assets" / "launch"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        target, data = root / "target", root / "data"
        if not (root / ".done").exists():
            shutil.rmtree(target, ignore_errors=True)
            shutil.rmtree(data, ignore_errors=True)
            sys.path.insert(0, str(SOURCE / "tools"))
            import make_demo_data
            import make_tiny_target
            make_tiny_target.make(str(target), seed=0)
            make_demo_data.make(str(target), str(data), num_docs=96, new_tokens=32, prompt_lens=(8, 16))
            (root / ".done").write_text("ok\n")
    return str(target), str(data)


def demo_overrides(assets, run_dir, steps=STEPS, **extra):
    """configs/demo.yaml made small: 2 target + 2 drafter ranks, one thread each, a loss per
    step in metrics.jsonl, states every 4 steps, the final export only."""
    target, data = assets
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
         "data.batch_tokens": 256, "drafter.num_anchors": 16, "train.max_steps": steps,
         "log.interval": 1, "checkpoint.export_every": 0, "checkpoint.state_every": 4,
         "comm.timeout_s": 30, "comm.startup_timeout_s": 60}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def step_losses(run_dir):
    """step -> loss from metrics.jsonl; a step written twice keeps its last value."""
    out = {}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            out[m["step"]] = m["loss"]
    return out


def export_digest(run_dir):
    """sha256 of every file of exports/final (name -> digest)."""
    d = Path(run_dir) / "exports" / "final"
    assert d.is_dir(), f"no final export in {run_dir}"
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


def leftovers(marker):
    """PIDs of live processes whose command line or environment carries `marker`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            st = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and st != "Z":
            out.append(int(d.name))
    return out


def wait_gone(marker, timeout=15):
    """Leftover processes of `marker` after up to `timeout` s (mpirun's ranks can outlive it 2-3 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = leftovers(marker)
        if not left:
            return []
        time.sleep(0.5)
    return leftovers(marker)


# ---- the project's own SLURM (tests/comm/local_slurm.sh) ------------------------------------
class Slurm:
    def __init__(self, nodes):
        self.dir = f"/tmp/dflash-slurm-{uuid.uuid4().hex[:6]}"
        self.script = SOURCE / "tests" / "comm" / "local_slurm.sh"
        self.senv = dict(os.environ, DFLASH_SLURM_DIR=self.dir, DFLASH_SLURM_NODES=str(nodes),
                         DFLASH_SLURM_PORT=str(7000 + (os.getpid() * 7 + nodes * 13) % 2500))
        self.nodes = nodes

    def start(self):
        p = subprocess.run(["bash", str(self.script), "start"], env=self.senv, capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0:
            pytest.skip(f"local SLURM did not start: {p.stderr.strip().splitlines()[-1:] or p.returncode}")
        self.env = {}
        for line in Path(self.dir, "env.sh").read_text().splitlines():
            for kv in line.replace("export ", "").split():
                k, v = kv.split("=", 1)
                self.env[k] = v

    def stop(self):
        subprocess.run(["bash", str(self.script), "stop"], env=self.senv, capture_output=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)

    def environ(self, **extra):
        return clean_env(**self.env, **extra)

    def sbatch(self, args, **extra):
        p = run(["sbatch", "--parsable", *args], env=self.environ(**extra), timeout=60, cwd=SOURCE)
        assert p.returncode == 0, p.all
        return p.stdout.strip().split(";")[0]

    def job(self, jobid):
        s = run(["scontrol", "show", "job", jobid], env=self.environ(), timeout=30).stdout
        def field(name):
            m = re.search(rf"\b{name}=(\S+)", s)
            return m[1] if m else ""
        return {"state": field("JobState"), "restarts": int(field("Restarts") or 0), "exit": field("ExitCode")}

    def release_requeued(self, jobid, timeout=120):
        """A requeued job waits 120 s (Slurm sets its BeginTime); start it now (test speed only),
        once no slurmstepd of the job's previous incarnation is left: a job that requeued itself
        (launch/*.sbatch on exit 4) is PENDING, and its node idle, while the old step's slurmstepd
        still ends (PMIx clean-up, ~3 s); a step started beside it fails to launch ("aborted before
        step completely launched"). Slurm's own 120 s wait covers that in real use."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            j = self.job(jobid)
            if j["restarts"] >= 1 and j["state"] == "PENDING" and not leftovers(f"slurmstepd: [{jobid}."):
                run(["scontrol", "update", f"jobid={jobid}", "StartTime=now"], env=self.environ(), timeout=30)
                return True
            if j["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
                return False
            time.sleep(0.3)
        return False

    def wait(self, jobid, timeout=300, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")):
        t0 = time.monotonic()
        j = {}
        while time.monotonic() - t0 < timeout:
            j = self.job(jobid)
            if j["state"] in until:
                return j
            time.sleep(0.3)
        return j


def slurm_available():
    return shutil.which("slurmctld", path="/usr/sbin:/usr/bin:/sbin:/bin") is not None


def make_reference(assets, tmp_path_factory, steps=STEPS):
    """The uninterrupted one-node run, started directly: mpirun -np 4 dflash_rank --config
    configs/demo.yaml (2 target + 2 drafter ranks). Returns (step -> loss, export digest)."""
    d = tmp_path_factory.mktemp("ref") / "run"
    p = run(["mpirun", "-np", 4, BIN, "--config", DEMO, *demo_overrides(assets, str(d), steps=steps)], cwd=SOURCE,
            timeout=300)
    assert p.returncode == 0, p.all[-4000:]
    losses = step_losses(d)
    assert len(losses) == steps, losses
    return losses, export_digest(d)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    return make_reference(assets, tmp_path_factory)
