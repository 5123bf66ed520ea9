"""launch/local.sh: N ranks with a torchrun-style environment and the c10d store, no MPI.

- `-n 4 "" --whoami`: four ranks meet at the store; every line of a rank carries "[local rN] ",
  stdout stays stdout;
- a rank that dies (the test hook DFLASH_TEST_FAIL_AT=1:init:sigkill / :throw, comm/progress.h)
  while the others wait in the rendezvous: the launcher stops the others and exits with the
  failing rank's code (137 = 128 + SIGKILL, 1 for an internal error), within seconds, nothing left;
- SIGTERM / SIGUSR1 to the launcher reach every rank (the ranks are held in the rendezvous by a
  rank that is not yet there; each reports the signal) and the launcher returns their code;
- a wrong -n or config file: one line, exit 2.
"""
import os
import re
import signal
import subprocess
import time
import uuid

from common import BIN, SOURCE, clean_env, run, wait_gone

LOCAL = SOURCE / "launch" / "local.sh"


def local(*args, timeout=120, **env):
    return run(["bash", LOCAL, *args], env=clean_env(mpi=False, DFLASH_BIN=BIN, **env), timeout=timeout, cwd=SOURCE)


def test_four_ranks_meet_with_prefixed_output():
    p = local("-n", "4", "", "--whoami")
    assert p.returncode == 0, p.all
    for r in range(4):
        assert re.search(rf"^\[local r{r}\] \[dflash r{r}/4\] identity: rank {r}/4 \(local {r}/4, torchrun",
                         p.stdout, re.M), p.all
    assert len(re.findall(r"^\[local r0\] .*rendezvous: \d local \d/4 torchrun", p.all, re.M)) == 4, p.all
    # every line of the ranks is prefixed
    assert all(l.startswith("[local r") for l in p.stdout.splitlines()), p.stdout


def test_one_rank_dies_the_group_stops_with_its_code():
    for kind, code in (("sigkill", 137), ("throw", 1)):
        marker = f"lk{uuid.uuid4().hex[:6]}"
        p = local("-n", "3", "", "--whoami", "comm.startup_timeout_s=60", f"run.name={marker}",
                  DFLASH_TEST_FAIL_AT=f"1:init:{kind}", DFLASH_LOCAL_GRACE_S=5)
        assert p.returncode == code, f"{kind}: {p.returncode}\n{p.all}"
        assert p.elapsed < 20, p.elapsed  # not the 60 s start-up deadline
        assert f"rank 1 exited with code {code}; stopping the other rank(s)" in p.stderr, p.all
        assert wait_gone(marker) == [], p.all


def test_signals_are_forwarded_to_every_rank():
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        marker = f"ls{uuid.uuid4().hex[:6]}"
        # rank 2 sleeps before it joins: ranks 0 and 1 wait in the rendezvous
        proc = subprocess.Popen(["bash", str(LOCAL), "-n", "3", "", "--whoami", "comm.startup_timeout_s=60",
                                 f"run.name={marker}"], cwd=SOURCE, stdin=subprocess.DEVNULL,
                                env=clean_env(mpi=False, DFLASH_BIN=BIN, DFLASH_TEST_FAIL_AT="2:init:hang"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(3)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, out
        assert f"forwarding SIG{sig.name[3:]} to 3 rank(s)" in out, out
        if sig == signal.SIGTERM:  # the ranks say what they were doing when the signal came
            for r in (0, 1):
                assert re.search(rf"\[local r{r}\] \[dflash r{r}/3\] error: terminated by SIGTERM", out), out
        assert wait_gone(marker) == [], out


def test_bad_arguments():
    p = local("-n", "x")
    assert p.returncode == 2 and "-n needs a rank count" in p.stderr, p.all
    p = local("-n", "2", "no-such.yaml")
    assert p.returncode == 2 and "no-such.yaml" in p.stderr, p.all
