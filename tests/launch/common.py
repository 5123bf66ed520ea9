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
    "OMPI_MCA_orte_allowed_exit_without_sync": "1",  # tools/mpi_env.sh says why
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
        return {"state": field("JobState"), "restarts": int(field("Restarts") or 0), "exit": field("ExitCode"),
                "reason": field("Reason")}

    def diagnose(self, jobid, lines=20):
        """Why a job did what it did, for assertion messages: its state and Reason, and the last
        lines about it of slurmctld's log (e.g. "Killing non-startable batch JobId=N: Job
        credential revoked") and of every slurmd's (e.g. "Job N already killed, do not launch
        batch job", "[N.batch] error: ...")."""
        out = [f"job {jobid}: {self.job(jobid)}"]
        mine = re.compile(rf"\bjob(id=| ){jobid}\b|\[{jobid}\.", re.I)
        logs = Path(self.dir, "log")
        for log in [logs / "slurmctld.log", *sorted(logs.glob("slurmd-*.log"))]:
            if log.exists():
                out += [f"--- {log} (job {jobid})"] + [x for x in log.read_text(errors="replace").splitlines()
                                                      if mine.search(x)][-lines:]
        return "\n".join(out)

    def release_requeued(self, jobid, timeout=120):
        """Start a requeued job now instead of after the 120 s Slurm waits (its BeginTime; test
        speed only), once it is safe to. Fails, with the reason, when the job does not come back
        to PENDING (restart >= 1) within `timeout` s.

        - A job that requeued itself (launch/*.sbatch on exit 4) is PENDING, and its node idle,
          while the old step's slurmstepd still ends (PMIx clean-up, ~3 s); a step started beside
          it fails to launch ("aborted before step completely launched"): wait until no
          slurmstepd of the job is left.
        - slurmd revokes the job's credential at the requeue in whole seconds (revoked when
          created <= the second of the kill request): a relaunch that slurmctld schedules within
          that same second is refused (slurmd "Job N already killed, do not launch batch job",
          slurmctld "Killing non-startable batch JobId=N: Job credential revoked"), and the job
          ends FAILED 1:0 without a line of output. The kill request precedes the PENDING state,
          so releasing after the second in which PENDING was seen is safe. Slurm's own
          BeginTime (requeue + 121 s) keeps real requeues clear of both."""
        t0 = time.monotonic()
        j = {}
        while time.monotonic() - t0 < timeout:
            j = self.job(jobid)
            if j["restarts"] >= 1 and j["state"] == "PENDING" and not leftovers(f"slurmstepd: [{jobid}."):
                seen = time.time()
                time.sleep(int(seen) + 1.05 - seen)  # a credential made from now on is newer than the revocation
                p = run(["scontrol", "update", f"jobid={jobid}", "StartTime=now"], env=self.environ(), timeout=30)
                assert p.returncode == 0, f"scontrol update jobid={jobid} StartTime=now failed: {p.all}"
                return
            if j["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.3)
        left = leftovers(f"slurmstepd: [{jobid}.")
        raise AssertionError(f"job {jobid} was not requeued (PENDING with restart >= 1 and no slurmstepd of its "
                             f"previous incarnation) within {time.monotonic() - t0:.0f} s: {j}, slurmstepd pids "
                             f"left {left}\n{self.diagnose(jobid)}")

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
