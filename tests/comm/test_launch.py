"""dflash_rank as users launch it: schedules, faults, bad input, identity under every launcher.

Run by ctest (tests/comm/CMakeLists.txt) with DFLASH_BUILD_DIR / DFLASH_SOURCE_DIR set, or by
hand: DFLASH_BUILD_DIR=build python -m pytest tests/comm/test_launch.py -k schedule.
Multi-process cases use mpirun with the settings of tools/mpi_env.sh (root, oversubscribed).
No timed assertions: the 30 s bound of the fault tests is the contract of docs/comm.md.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build")).resolve()
SOURCE = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = BUILD / "trainer" / "dflash_rank"
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_mpi_yield_when_idle": "1",
}
LAUNCHER_VARS = re.compile(r"^(OMPI_|PMIX_|PMI_|SLURM_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|"
                           r"MASTER_ADDR$|MASTER_PORT$|TORCHELASTIC_)")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update(MPI_ENV)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, timeout=120, **env):
    t0 = time.monotonic()
    p = subprocess.run([str(c) for c in cmd], env=clean_env(**env), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=timeout)
    p.elapsed = time.monotonic() - t0
    p.all = p.stdout + p.stderr
    return p


def mpirun(np_, *args, timeout=120, **env):
    return run(["mpirun", "-np", np_, BIN, *args], timeout=timeout, **env)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftovers(marker):
    """PIDs of live processes whose command line carries `marker` (our own runs only)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            st = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and st != "Z" and int(d.name) != os.getpid():
            out.append(int(d.name))
    return out


# ---- the schedule over real processes -----------------------------------------------------
@pytest.mark.parametrize("t,d", [(5, 3), (1, 1), (2, 1), (1, 2)])
def test_schedule_moves_200_batches(t, d):
    p = mpirun(t + d, "--comm-check", "200", f"layout.target_ranks={t}", f"layout.drafter_ranks={d}",
               "comm.timeout_s=30")
    assert p.returncode == 0, p.all
    # every receiver verified its batches bit-exactly (else non-zero); the totals match
    assert re.search(r"comm-check OK: 200 batches, [\d.]+ MB from %d target\(s\) to %d drafter\(s\)" % (t, d),
                     p.stdout), p.all
    assert "error" not in p.all, p.all


def test_colocated_single_process():
    p = run([BIN, "--comm-check", "30", "layout.colocated=true"])
    assert p.returncode == 0, p.all
    assert "comm-check OK: 30 batches" in p.stdout and "colocated" in p.stdout, p.all


def test_per_rank_log_files(tmp_path):
    p = mpirun(2, "--comm-check", "10", f"run.dir={tmp_path}", "log.per_rank_files=true", "log.console_rank=1")
    assert p.returncode == 0, p.all
    for r, role in ((0, "target"), (1, "drafter")):
        text = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert f"[dflash r{r}/2 {role}]" in text and "comm-check" in text
    # the console shows rank 1 only
    assert "[dflash r1/2 drafter] comm-check OK" in p.stdout and "r0/2" not in p.stdout, p.all


# ---- faults: every rank ends non-zero within 30 s, survivors name the peer, nothing left ----
def check_fault(p, marker, dead, world):
    assert p.returncode != 0, p.all
    assert p.elapsed < 30, f"took {p.elapsed:.1f} s\n{p.all}"
    survivors = [r for r in range(world) if r != dead]
    for r in survivors:  # every survivor says why it ended
        assert re.search(rf"\[dflash r{r}/{world} \w+\] error: ", p.all), f"rank {r} silent\n{p.all}"
    named = [r for r in survivors
             if re.search(rf"\[dflash r{r}/{world} \w+\] error: .*(rank {dead} \(|group \[[\d, ]*\b{dead}\b)", p.all)]
    assert named, f"no survivor names rank {dead}\n{p.all}"
    time.sleep(3)  # mpirun's ranks can outlive it by 2-3 s (notes on launchers)
    assert leftovers(marker) == [], p.all


@pytest.mark.parametrize("kind", ["throw", "sigkill", "hang"])
def test_fault_injected(kind):
    marker = f"fault{uuid.uuid4().hex[:8]}"
    p = mpirun(3, "--comm-check", "200", "layout.target_ranks=1", "layout.drafter_ranks=2",
               "comm.timeout_s=10", f"run.name={marker}", timeout=60, DFLASH_TEST_FAIL_AT=f"1:40:{kind}")
    check_fault(p, marker, dead=1, world=3)
    if kind == "hang":  # nobody killed anything: our own deadline fired and named the peer
        assert re.search(r"timed out after 1\d\.\d s in send with rank 1 \(drafter 0\), batch 40", p.all), p.all


def test_fault_kill9_from_outside():
    """kill -9 of rank 2 (a drafter) while the stream runs: rank 2 stalls at batch 41 (hook),
    the test finds its PID through /proc and SIGKILLs it."""
    marker = f"kill{uuid.uuid4().hex[:8]}"
    cmd = ["mpirun", "-np", "3", str(BIN), "--comm-check", "200", "layout.target_ranks=1",
           "layout.drafter_ranks=2", "comm.timeout_s=10", f"run.name={marker}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=clean_env(DFLASH_TEST_FAIL_AT="2:41:hang"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # until rank 2 reports that it stalls mid-stream
        seen.append(line)
        if "injecting 'hang' at batch 41" in line:
            break
    victim = None
    for pid in leftovers(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK=2\0" in env and b"dflash_rank" in cmd:
            victim = pid
    assert victim, "rank 2 not found\n" + "".join(seen)
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    proc.elapsed = time.monotonic() - t0
    proc.all = "".join(seen) + out
    check_fault(proc, marker, dead=2, world=3)


# ---- bad input: exit 2, one clear line, no stack trace ------------------------------------
def bad(tmp_path, text, *args):
    cfg = tmp_path / "c.yaml"
    if text is not None:
        cfg.write_text(text)
    p = run([BIN, "--config", cfg, *args])
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.all
    assert len(lines) == 1, p.all
    assert not re.search(r"frame #|Traceback|terminate called|Aborted", p.all), p.all
    return lines[0]


def test_bad_yaml(tmp_path):
    assert "c.yaml" in bad(tmp_path, "layout: {target_ranks: 1\n")


def test_bad_unknown_key(tmp_path):
    line = bad(tmp_path, "layout:\n  target_rank: 1\n")
    assert "layout.target_rank" in line and "target_ranks" in line


def test_bad_wrong_type(tmp_path):
    line = bad(tmp_path, "comm:\n  timeout_s: soon\n")
    assert "comm.timeout_s" in line and "soon" in line


def test_bad_missing_file(tmp_path):
    assert "c.yaml" in bad(tmp_path, None)


def test_bad_world_size_mismatch(tmp_path):
    line = bad(tmp_path, "layout: {target_ranks: 5, drafter_ranks: 3}\n", "--comm-check", "1")
    assert "layout.target_ranks=5" in line and "world size 1" in line


def test_bad_world_size_under_mpirun():
    p = mpirun(3, "--comm-check", "1", "layout.target_ranks=1", "layout.drafter_ranks=1")
    assert p.returncode == 2, p.all
    assert "layout.drafter_ranks=1" in p.all and "world size 3" in p.all, p.all
    assert "frame #" not in p.all


def test_bad_launcher_environment():
    p = run([BIN, "--whoami"], RANK="1", WORLD_SIZE="x", LOCAL_RANK="0")
    assert p.returncode == 2 and "WORLD_SIZE='x'" in p.stderr, p.all


# ---- identity under every launcher --------------------------------------------------------
def identities(text, world, source):
    found = {}
    for m in re.finditer(r"identity: rank (\d+)/(\d+) \(local (\d+)/(\d+), (\w+),", text):
        r, w, l, lw, src = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
        assert (w, src) == (world, source), text
        found[r] = (l, lw)
    assert sorted(found) == list(range(world)), text
    return found


def test_identity_mpirun():
    p = mpirun(4, "--whoami")
    assert p.returncode == 0, p.all
    ids = identities(p.stdout, 4, "mpi")
    assert all(ids[r] == (r, 4) for r in range(4)), p.all
    assert "4 ranks met at an MPI barrier" in p.stdout


def spawn_torchrun_style(world, port, ranks=None, timeout_s=60):
    procs = []
    for r in (range(world) if ranks is None else ranks):
        env = clean_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([str(BIN), "--whoami", f"comm.startup_timeout_s={timeout_s}"], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    return procs, "".join(o + e for o, e in outs)


def test_identity_torchrun_style_env_tcp_store():
    procs, text = spawn_torchrun_style(4, free_port())
    assert all(p.returncode == 0 for p in procs), text
    ids = identities(text, 4, "torchrun")
    assert all(ids[r] == (r, 4) for r in range(4)), text
    # rank 0 served c10d's TCPStore; every rank registered
    assert len(re.findall(r"rendezvous: \d local \d/4 torchrun", text)) == 4, text


def test_rendezvous_timeout_names_missing_rank():
    procs, text = spawn_torchrun_style(4, free_port(), ranks=[0, 1, 2], timeout_s=3)
    assert procs[0].returncode == 3, text
    assert "rank 3 of 4 did not arrive within 3 s" in text, text
    assert all(p.returncode != 0 for p in procs), text


def torchrun_exe():
    for cand in (Path(sys.executable).parent / "torchrun", shutil.which("torchrun")):
        if cand and Path(cand).exists():
            return str(cand)
    return None


@pytest.mark.skipif(torchrun_exe() is None, reason="torchrun not installed next to the test python")
def test_identity_torchrun():
    port = free_port()
    p = run([torchrun_exe(), "--nproc-per-node", "4", "--no-python", "--master-addr", "127.0.0.1",
             "--master-port", port, BIN, "--whoami"], timeout=180)
    assert p.returncode == 0, p.all
    ids = identities(p.all, 4, "torchrun")
    assert all(ids[r] == (r, 4) for r in range(4)), p.all
    assert len(re.findall(r"rendezvous: \d local \d/4 torchrun", p.all)) == 4, p.all


# ---- SLURM (a real slurmctld + slurmd on localhost, started and stopped here) -------------
@pytest.fixture(scope="module")
def slurm():
    if not shutil.which("slurmctld", path="/usr/sbin:/usr/bin:/sbin:/bin"):
        pytest.skip("slurm is not installed (tools/setup.sh installs it)")
    script = SOURCE / "tests" / "comm" / "local_slurm.sh"
    d = f"/tmp/dflash-slurm-{uuid.uuid4().hex[:6]}"
    senv = dict(os.environ, DFLASH_SLURM_DIR=d, DFLASH_SLURM_PORT=str(7000 + os.getpid() % 2000))
    subprocess.run(["bash", str(script), "start"], env=senv, check=True, capture_output=True, timeout=120)
    try:
        yield {"SLURM_CONF": f"{d}/slurm.conf"}
    finally:
        subprocess.run(["bash", str(script), "stop"], env=senv, capture_output=True, timeout=120)
        shutil.rmtree(d, ignore_errors=True)


def test_identity_srun_pmix(slurm):
    p = run(["timeout", "120", "srun", "--mpi=pmix", "-n", "4", BIN, "--whoami"], timeout=150, **slurm)
    assert p.returncode == 0, p.all
    ids = identities(p.stdout, 4, "mpi")
    assert all(ids[r] == (r, 4) for r in range(4)), p.all


def test_identity_srun_without_mpi(slurm):
    p = run(["timeout", "120", "srun", "-n", "4", BIN, "--whoami"], timeout=150,
            MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), **slurm)
    assert p.returncode == 0, p.all
    ids = identities(p.stdout, 4, "slurm")
    assert all(ids[r] == (r, 4) for r in range(4)), p.all


def test_identity_mpirun_inside_sbatch(slurm, tmp_path):
    """The trap: under mpirun inside sbatch every rank sees SLURM_PROCID=0."""
    out = tmp_path / "job.out"
    job = tmp_path / "job.sh"
    job.write_text(f"#!/bin/bash\n#SBATCH --ntasks=4\n#SBATCH --output={out}\nmpirun {BIN} --whoami\n")
    p = run(["sbatch", "--parsable", job], timeout=60, **slurm)
    assert p.returncode == 0, p.all
    jobid = p.stdout.strip().split(";")[0]
    t0 = time.monotonic()
    state = ""
    while time.monotonic() - t0 < 120:
        s = run(["scontrol", "show", "job", jobid], timeout=30, **slurm).stdout
        state = re.search(r"JobState=(\w+)", s)[1] if "JobState=" in s else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.2)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"{state}\n{text}"
    ids = identities(text, 4, "mpi")
    assert all(ids[r] == (r, 4) for r in range(4)), text
