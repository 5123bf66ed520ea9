"""log.profile_start / log.profile_steps (trainer/metrics/profile.h): every rank of a run records
the window of steps with LibTorch's profiler and writes <run.dir>/profile/rank<N>.trace.json
(a Chrome trace) and rank<N>.md (time by kind of work), with one console line per rank.

- mpirun, 1 target + 1 drafter rank (real processes): both ranks write both files; the traces are
  JSON with the operators the ranks run (the target's and the drafter's matmuls, the drafter's
  backward and AdamW), the summaries name the rank, its role and the window;
- colocated: profiling does not change the training (the losses equal an unprofiled run's, to
  the bit: the profiler only observes), a window past the last step writes nothing;
- a bad value names the key and the range.
"""
import json
import os

from pipeline_common import launch_demo, skip_without_rank_and_mpirun, tiny_run_inputs

import pytest

STEPS = 6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    skip_without_rank_and_mpirun()
    return tiny_run_inputs(tmp_path_factory.mktemp("profile"), 80)


def launch(inputs, name, np_, extra):
    r, _, run_dir = launch_demo(inputs, name, np_, STEPS, extra, {"log.console_rank": -1})
    return r, run_dir


def names_in_trace(path):
    with open(path) as f:
        trace = json.load(f)
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_every_rank_writes_its_window_under_mpirun(inputs):
    r, d = launch(inputs, "pipeline", 2, ["layout.target_ranks=1", "layout.drafter_ranks=1",
                                          "log.profile_start=3", "log.profile_steps=2"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    prof = os.path.join(d, "profile")
    assert sorted(os.listdir(prof)) == ["rank0.md", "rank0.trace.json", "rank1.md", "rank1.trace.json"], os.listdir(prof)
    roles = {}
    for rank in (0, 1):
        md = open(os.path.join(prof, f"rank{rank}.md")).read()
        first = md.splitlines()[0]
        assert first.startswith(f"rank {rank} (") and "steps 3..4" in first, first
        roles[rank] = first.split("(")[1].split(")")[0]
        assert "| matmul |" in md, md
        names = names_in_trace(os.path.join(prof, f"rank{rank}.trace.json"))
        assert "aten::mm" in names or "aten::addmm" in names, sorted(names)[:50]
        if roles[rank] == "drafter":
            assert any("Backward" in n for n in names), "the drafter's window holds its backward"
            assert any("_foreach" in n or "addcdiv" in n for n in names), "and its AdamW"
        # one console line per rank, naming the window, the role and the trace
        line = [l for l in out.splitlines() if f"profile of steps 3..4 ({roles[rank]})" in l]
        assert len(line) == 1 and f"rank{rank}.trace.json" in line[0], out[-3000:]
    assert sorted(roles.values()) == ["drafter", "target"]
    assert not any(f.endswith(".tmp") for f in os.listdir(prof))


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l)["loss"] for l in f if l.strip()]


def test_colocated_profile_observes_without_changing_the_run(inputs):
    r0, d0 = launch(inputs, "plain", 1, ["layout.colocated=true"])
    r1, d1 = launch(inputs, "profiled", 1, ["layout.colocated=true", "log.profile_start=1", "log.profile_steps=1"])
    r2, d2 = launch(inputs, "late", 1, ["layout.colocated=true", f"log.profile_start={STEPS + 1}"])
    for r in (r0, r1, r2):
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert losses(d1) == losses(d0) == losses(d2) and len(losses(d0)) == STEPS
    assert "profile of step 1 (colocated)" in r1.stdout + r1.stderr
    assert os.path.isfile(os.path.join(d1, "profile", "rank0.trace.json"))
    assert not os.path.exists(os.path.join(d0, "profile")) and not os.path.exists(os.path.join(d2, "profile"))
    assert "profile of" not in r2.stdout + r2.stderr


def test_bad_value_names_the_key(inputs):
    r, _ = launch(inputs, "bad", 1, ["layout.colocated=true", "log.profile_steps=0"])
    assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
    assert "log.profile_steps" in r.stdout + r.stderr and "1 to 1000" in r.stdout + r.stderr
