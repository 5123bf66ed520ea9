"""End-to-end training runs of dflash_rank under mpirun on CPU, with the demo's tiny target and
self-generated data (tools/make_tiny_target.py, tools/make_demo_data.py), made here in a
temporary directory.

- Layouts 1+1 (grad_accum 2), 2+2 (grad_accum 1), 3+1 (grad_accum 2) and colocated
  (grad_accum 2): every run trains on the same G = 2 batches per step, so
  * each run's loss falls: the mean loss of the last 4 steps is at least LOSS_DROP nats below
    the mean of the first 2 steps (the initial loss is about ln(512) = 6.2 for a random drafter;
    a drafter that does not learn stays within ~0.1 of it over these steps), and the export
    loads with the `safetensors` package with the DFLASH.md §5 names, shapes and dtype;
  * layout independence: the per-step losses agree within LAYOUT_RTOL relative over all
    steps (the layouts differ only in the order of floating-point sums: an all-reduce average
    of two gradients vs. accumulation of two halves).
- Gradient reduction overlapped with the backward (comm.grad_bucket_mb > 0, grad_reduce.h: the
  2+2 run above uses buckets of 0.05 MiB, several for the tiny drafter) against the old path
  (comm.grad_bucket_mb = 0: one all-reduce after the backward), with grad_accum 1 (the 2+2 run)
  and 2 (a shorter pair): the per-step losses and the final training state (fp32 weights and
  AdamW moments) are bit-identical. With two drafter ranks each element of the average is
  (a + b) / 2 whatever the bucketing, so exact equality is the right bar, not a tolerance.
- Resume: N steps, kill -9 of every rank once a state exists, --resume to 2N (with a fake
  half-written newer state planted, which must be ignored): the per-step losses after the
  resumed state equal the straight run's within RESUME_RTOL (same layout, one thread per
  rank: the computation is deterministic; 1e-6 leaves room for nothing but printing).
- Bad input: a corrupt shard, data smaller than one batch, a target that does not match the
  drafter config, a resume from another layout: every rank prints the error, the exit code is
  non-zero, and nothing is written to run.dir.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from pipeline_common import ENV, RANK_BIN, SRC, skip_without_rank_and_mpirun  # (and tools/ on sys.path)

STEPS = 24
LOSS_DROP = 0.4
LAYOUT_RTOL = 1e-5
RESUME_RTOL = 1e-6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    skip_without_rank_and_mpirun()
    import make_demo_data
    import make_tiny_target
    root = tmp_path_factory.mktemp("e2e")
    target = make_tiny_target.make(str(root / "target"), seed=0)
    data = make_demo_data.make(target, str(root / "data"), num_docs=192, new_tokens=40, prompt_lens=(8, 16))
    return root, target, data


def base_overrides(assets, run_dir, **extra):
    root, target, data = assets
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
         "data.batch_tokens": 384, "drafter.num_anchors": 24, "train.max_steps": STEPS, "train.lr": 1e-2,
         "log.interval": 1, "log.console_rank": -1, "checkpoint.export_every": 0, "checkpoint.state_every": 12,
         "comm.timeout_s": 60}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def mpirun(np_, overrides, resume=False, timeout=300, wait=True):
    cmd = ["mpirun", "-np", str(np_), RANK_BIN, "--config", os.path.join(SRC, "configs", "demo.yaml")] + overrides
    if resume:
        cmd.append("--resume")
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                cwd=SRC, start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=SRC)


def step_losses(run_dir):
    """step -> loss from metrics.jsonl (log.interval = 1); a step written twice (before a crash and
    after the resume) keeps its last value."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = m["loss"]
    return out


def check_export(run_dir):
    from safetensors.torch import load_file
    d = os.path.join(run_dir, "exports", "final")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3] and cfg["num_target_layers"] == 6
    t = load_file(os.path.join(d, "model.safetensors"))
    import torch
    assert t["fc.weight"].shape == (64, 3 * 64) and t["fc.weight"].dtype == torch.bfloat16
    assert "layers.1.mlp.down_proj.weight" in t and not any(k.startswith("model.") for k in t)
    assert "embed_tokens.weight" not in t and "lm_head.weight" not in t


LAYOUTS = {  # name: (processes, overrides)
    "1+1": (2, {"layout.target_ranks": 1, "layout.drafter_ranks": 1, "train.grad_accum": 2}),
    # buckets of 0.05 MiB: the tiny drafter's 395 KB of fp32 gradients are all-reduced in 9 of them
    "2+2": (4, {"layout.target_ranks": 2, "layout.drafter_ranks": 2, "train.grad_accum": 1,
                "comm.grad_bucket_mb": 0.05}),
    "3+1": (4, {"layout.target_ranks": 3, "layout.drafter_ranks": 1, "train.grad_accum": 2}),
    "colocated": (1, {"layout.colocated": "true", "train.grad_accum": 2}),
}


CONSOLE = {}  # run dir -> what its launch printed


def launch(assets, name, np_, extra):
    run_dir = str(assets[0] / f"run-{name}")
    r = mpirun(np_, base_overrides(assets, run_dir, **extra))
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    CONSOLE[run_dir] = r.stdout + r.stderr
    return run_dir


@pytest.fixture(scope="module")
def layout_runs(assets):
    return {name: launch(assets, name, np_, extra) for name, (np_, extra) in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_and_exports(layout_runs, name):
    losses = step_losses(layout_runs[name])
    assert sorted(losses) == list(range(1, STEPS + 1))
    first = sum(losses[s] for s in (1, 2)) / 2
    last = sum(losses[s] for s in range(STEPS - 3, STEPS + 1)) / 4
    assert last < first - LOSS_DROP, (name, first, last)
    check_export(layout_runs[name])
    # A state was written at step 12 and at the end, `latest` names the last one.
    ck = os.path.join(layout_runs[name], "checkpoints")
    assert open(os.path.join(ck, "latest")).read().strip() == f"step-{STEPS:08d}"
    assert os.path.exists(os.path.join(ck, f"step-{STEPS:08d}", "meta.json"))


def test_layouts_give_the_same_losses(layout_runs):
    ref = step_losses(layout_runs["2+2"])
    for name in ("1+1", "3+1", "colocated"):
        got = step_losses(layout_runs[name])
        for s in range(1, STEPS + 1):
            assert abs(got[s] - ref[s]) <= LAYOUT_RTOL * abs(ref[s]), (name, s, got[s], ref[s])


NO_OVERLAP = {"comm.grad_bucket_mb": 0}
GA2_STEPS = 8


@pytest.fixture(scope="module")
def overlap_twins(assets, layout_runs):
    """case -> (overlapped run, its twin with comm.grad_bucket_mb = 0): the 2+2 layout run, and a
    2+2 pair with grad_accum 2 (the hooks armed for the second micro-batch of each step only)."""
    two = LAYOUTS["2+2"][1]
    ga2 = {**two, "train.grad_accum": 2, "train.max_steps": GA2_STEPS, "checkpoint.state_every": GA2_STEPS}
    return {
        "grad_accum 1": (layout_runs["2+2"], launch(assets, "2+2-no-overlap", 4, {**two, **NO_OVERLAP})),
        "grad_accum 2": (launch(assets, "2+2-ga2", 4, ga2), launch(assets, "2+2-ga2-no-overlap", 4, {**ga2, **NO_OVERLAP})),
    }


@pytest.mark.parametrize("case", ["grad_accum 1", "grad_accum 2"])
def test_overlapped_gradient_reduction_is_bit_identical(overlap_twins, case):
    over, plain = overlap_twins[case]
    m = re.search(r"drafter 0: gradients all-reduced in (\d+) buckets of <= 0\.05 MiB during the backward "
                  r"\(comm\.grad_bucket_mb\)", CONSOLE[over])
    assert m and int(m.group(1)) >= 4, CONSOLE[over][-3000:]
    assert "drafter 0: gradients all-reduced in one call after the backward (comm.grad_bucket_mb=0)" in CONSOLE[plain]
    a, b = step_losses(over), step_losses(plain)
    assert len(a) in (STEPS, GA2_STEPS) and a == b, [(s, a[s], b.get(s)) for s in a if a[s] != b.get(s)]
    last = f"step-{max(a):08d}"
    states = [open(os.path.join(d, "checkpoints", last, "optimizer.safetensors"), "rb").read() for d in (over, plain)]
    assert states[0] == states[1], "the final weights or AdamW moments differ"
    # the per-rank files (the default CPU generator, seeded from run.seed and the rank) too
    ranks = sorted(f for f in os.listdir(os.path.join(over, "checkpoints", last)) if f.startswith("rank-"))
    assert ranks, os.listdir(os.path.join(over, "checkpoints", last))
    for f in ranks:
        a_, b_ = (open(os.path.join(d, "checkpoints", last, f), "rb").read() for d in (over, plain))
        assert a_ == b_, f"{f} differs between two runs with the same seed"


def kill_all(proc):
    """kill -9 every rank (the children of mpirun), then mpirun itself."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == proc.pid:  # ppid
                    pids.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return pids


def test_resume_after_kill_reproduces_the_straight_run(assets, layout_runs):
    straight = step_losses(layout_runs["2+2"])
    run_dir = str(assets[0] / "run-resume")
    over = base_overrides(assets, run_dir, **LAYOUTS["2+2"][1], **{"checkpoint.state_every": 6})
    proc = mpirun(4, over, wait=False)
    latest = os.path.join(run_dir, "checkpoints", "latest")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(latest) and open(latest).read().strip() >= "step-00000006":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    killed = kill_all(proc)
    assert len(killed) == 4, killed
    ck = os.path.join(run_dir, "checkpoints")
    states = sorted(n for n in os.listdir(ck) if n.startswith("step-") and not n.endswith(".tmp"))
    resumed_from = int(states[-1][5:])
    assert 6 <= resumed_from < STEPS
    # Plant a half-written newer state: a renamed directory without meta.json, and a .tmp one.
    fake = os.path.join(ck, f"step-{resumed_from + 1:08d}")
    shutil.copytree(os.path.join(ck, states[-1]), fake)
    os.unlink(os.path.join(fake, "meta.json"))
    shutil.copytree(os.path.join(ck, states[-1]), os.path.join(ck, f"step-{resumed_from + 2:08d}.tmp"))
    with open(latest, "w") as f:
        f.write(f"step-{resumed_from + 1:08d}\n")
    r = mpirun(4, over, resume=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming from {os.path.join(ck, states[-1])}" in r.stdout + r.stderr
    resumed = step_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(resumed_from + 1, STEPS + 1):
        assert abs(resumed[s] - straight[s]) <= RESUME_RTOL * abs(straight[s]), (s, resumed[s], straight[s])
    check_export(run_dir)


def expect_clean_failure(r, run_dir, nranks, *needles):
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    for n in needles:
        assert n in text, (n, text[-3000:])
    # every rank printed the error itself
    errors = [l for l in text.splitlines() if "error:" in l and needles[0] in l]
    ranks = {l.split("]")[0] for l in errors}
    assert len(ranks) == nranks, (ranks, text[-3000:])
    assert "Traceback" not in text and "terminate called" not in text
    assert not os.path.exists(run_dir), f"{run_dir} was created"


def test_bad_inputs_fail_cleanly_on_every_rank(assets, layout_runs, tmp_path):
    import dflash_shard
    root, target, data = assets
    # (a) a corrupt shard: bad magic
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".dfshard"))[0]
    raw = bytearray((bad / shard).read_bytes())
    raw[0:8] = b"NOTASHRD"
    (bad / shard).write_bytes(bytes(raw))
    run_dir = str(tmp_path / "run-a")
    r = mpirun(4, base_overrides(assets, run_dir, **{"data.shards": f"[{bad}]"}))
    expect_clean_failure(r, run_dir, 4, "bad magic", str(bad / shard))
    # (a') a truncated shard
    (bad / shard).write_bytes(open(os.path.join(data, shard), "rb").read()[:-10])
    r = mpirun(2, base_overrides(assets, run_dir, **{"data.shards": f"[{bad}]", **LAYOUTS["1+1"][1]}))
    expect_clean_failure(r, run_dir, 2, "truncated", str(bad / shard))
    # (b) data smaller than one batch
    small = str(tmp_path / "small.dfshard")
    dflash_shard.write_shard(small, [([1, 2, 3] * 20, [0, 1, 1] * 20)] * 3, 512)
    r = mpirun(4, base_overrides(assets, run_dir, **{"data.shards": f"[{small}]"}))
    expect_clean_failure(r, run_dir, 4, "cannot fill one batch", "data.batch_tokens = 384")
    # (c) a target that does not match the drafter config: a captured layer beyond its depth,
    # and a drafter to continue from (an export for a 64-wide target) on a 32-wide target.
    r = mpirun(4, base_overrides(assets, run_dir, **{"target.layer_ids": "[1, 3, 7]"}))
    expect_clean_failure(r, run_dir, 4, "target.layer_ids holds 7, but the target has 6 layers")
    import make_tiny_target
    narrow = make_tiny_target.make(str(tmp_path / "narrow"), seed=1, hidden_size=32, intermediate_size=64)
    r = mpirun(4, base_overrides(assets, run_dir, **{"target.model_dir": narrow,
                                                   "drafter.init_from": os.path.join(layout_runs["2+2"], "exports", "final")}))
    expect_clean_failure(r, run_dir, 4, "hidden_size 64 does not match the target's hidden_size 32")
    # (d) a resume from a state of another layout: refused, saying why; the state is untouched.
    src = layout_runs["2+2"]
    before = sorted(os.listdir(os.path.join(src, "checkpoints")))
    r = mpirun(2, base_overrides(assets, src, **LAYOUTS["1+1"][1]), resume=True)
    text = r.stdout + r.stderr
    assert r.returncode != 0 and "world size: state 4, this run 2" in text and "train.grad_accum: state 1, this run 2" in text, text[-3000:]
    assert sorted(os.listdir(os.path.join(src, "checkpoints"))) == before
