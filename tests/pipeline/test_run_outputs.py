"""What a demo-sized training run (mpirun, 1 target + 1 drafter rank on CPU, the tiny target and
its self-generated data) leaves for its user, read back with independent tools:

- the TensorBoard event file, read with the `tensorboard` package's own EventAccumulator: every
  numeric field of every metrics.jsonl record (nested ones as "a/<index>") is a scalar at the
  record's step with the record's value (the events store float32: compared to float32(value),
  exactly);
- the console: one header (code version, launch, layout, target, data, run directory) and the
  metrics lines with elapsed / ETA / epoch / percent; at the end the export and the commands
  that check, evaluate and serve it;
- the data record: prepare_info.json copied into the run directory, and the target's identity
  and the data record in the export's config.json;
- tools/plot_metrics.py draws the run's metrics.jsonl to a PNG;
- the export loads with transformers' AutoModel (trust_remote_code, the shipped dflash.py) with
  exactly the exported tensors;
- dflash_rank check-export accepts the export for its target and refuses targets with another
  hidden size, vocabulary or layer count, naming the field.
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest

from pipeline_common import ENV, RANK_BIN, SRC, skip_without_rank_and_mpirun  # (and tools/ on sys.path)

STEPS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    skip_without_rank_and_mpirun()
    import make_tiny_target
    import prepare_data
    sys.path.insert(0, os.path.join(SRC, "tests", "data"))
    from test_prepare_data import QWEN3, conversations, make_tokenizer
    root = tmp_path_factory.mktemp("outputs")
    target = make_tiny_target.make(str(root / "target"), seed=0)
    # The data as a user makes it: chat JSONL through prepare_data with the target's tokenizer
    # (a tiny BPE with a Qwen3-style template, saved into the target directory; its ~320 ids
    # lie inside the target's 512).
    make_tokenizer(target, QWEN3)
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(o) + "\n" for o, _ in conversations(3, 160)))
    data = str(root / "data")
    prepare_data.prepare(target, [str(chat)], data, block_size=8, template_kwargs={"enable_thinking": False},
                         progress=False, log=open(os.devnull, "w"))
    run_dir = str(root / "runs" / "demo")
    o = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
         "data.batch_tokens": 384, "drafter.num_anchors": 24, "train.max_steps": STEPS, "train.lr": 1e-2,
         "layout.target_ranks": 1, "layout.drafter_ranks": 1, "log.interval": 1,
         "checkpoint.export_every": 4, "checkpoint.state_every": 0, "comm.timeout_s": 60}
    cmd = ["mpirun", "-np", "2", RANK_BIN, "--config", os.path.join(SRC, "configs", "demo.yaml")]
    cmd += [f"{k}={v}" for k, v in o.items()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=SRC)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return {"root": root, "target": target, "data": data, "dir": run_dir, "out": r.stdout + r.stderr}


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def flatten(v, tag, out):
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return
    if isinstance(v, (int, float)):
        out[tag] = v
    elif isinstance(v, list):
        for i, x in enumerate(v):
            flatten(x, f"{tag}/{i}", out)
    elif isinstance(v, dict):
        for k, x in v.items():
            flatten(x, f"{tag}/{k}", out)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_tensorboard_events_hold_every_metric(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = os.path.join(run["dir"], "tensorboard")
    files = [f for f in os.listdir(tb) if f.startswith("events.out.tfevents.")]
    assert len(files) == 1, files
    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    recs = records(run["dir"])
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    expect = {}
    for r in recs:
        flat = {}
        for k, v in r.items():
            if k != "step":
                flatten(v, k, flat)
        for tag, v in flat.items():
            expect.setdefault(tag, {})[r["step"]] = v
    # the console's scalars and the per-offset accuracy are among them (block size 8: 7 offsets)
    for must in ["loss", "accuracy", "tau_est", "lr", "grad_norm", "target_tok_s", "drafter_tok_s", "elapsed_s",
                 "eta_s", "percent", "epoch", "mem_gb"] + [f"accuracy_per_pos/{k}" for k in range(7)]:
        assert must in expect, must
    assert "mfu" not in expect  # null on CPU: not a scalar
    assert tags == set(expect), (tags ^ set(expect))
    for tag, by_step in expect.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == sorted(by_step), tag
        for e in events:
            assert e.value == f32(by_step[e.step]), (tag, e.step, e.value, by_step[e.step])
            assert abs(e.wall_time - __import__("time").time()) < 3600


def test_console_header_progress_and_closing_lines(run):
    out = run["out"]
    version = subprocess.run([RANK_BIN, "--version"], capture_output=True, text=True).stdout.split()[1]
    assert out.count(f"dflash {version} | run 'demo'") == 1, out[:3000]
    for s in ["launch    mpi, world size 2", "layout    1 target + 1 drafter rank(s)",
              f"target    {run['target']} (qwen3, 6 layers, hidden 64, vocab 512); captured layers [1, 2, 3]",
              "data      1 shard(s), 160 documents",
              f"prepared  {data_info(run)}: chat_template_sha256 ",
              'chat_template_kwargs {"enable_thinking":false}, thinking "keep", supervise "all"', f"run dir   {run['dir']}: metrics {run['dir']}/metrics.jsonl",
              f"tensorboard --logdir {os.path.dirname(run['dir'])}"]:
        assert s in out, (s, out[:4000])
    lines = [l for l in out.splitlines() if "| loss " in l]
    assert len(lines) == STEPS, lines
    assert f"step {STEPS}/{STEPS} (100.0%) | epoch 1/" in lines[-1] and "| eta 0s" in lines[-1], lines[-1]
    assert all("| elapsed " in l and "| eta " in l for l in lines)
    final = os.path.join(run["dir"], "exports", "final")
    for s in [f"export: {final}", f"check-export {final} --target {run['target']}",
              f"eval --config {os.path.join(SRC, 'configs', 'demo.yaml')}", f"eval.drafter_dir={final}",
              "--speculative-algorithm DFLASH", f"--speculative-draft-model-path {final}",
              "--speculative-num-draft-tokens 8", '"num_speculative_tokens": 7']:
        assert s in out, (s, out[-3000:])


def data_info(run):
    return os.path.join(run["data"], "prepare_info.json")


def test_data_record_in_run_dir_and_export(run):
    src = json.load(open(data_info(run)))
    assert src["chat_template_kwargs"] == {"enable_thinking": False} and src["thinking"] == "keep"
    assert len(src["chat_template_sha256"]) == 64
    assert json.load(open(os.path.join(run["dir"], "prepare_info.json"))) == src
    for d in ["final", "step-00000004"]:
        cfg = json.load(open(os.path.join(run["dir"], "exports", d, "config.json")))
        assert cfg["dflash_target"] == {"path": run["target"], "model_type": "qwen3", "num_hidden_layers": 6,
                                        "hidden_size": 64, "vocab_size": 512}
        assert cfg["dflash_data"]["prepare_info"] == os.path.join(run["data"], "prepare_info.json")
        for k in ("tokens", "written", "chat_template_sha256", "chat_template_kwargs", "thinking", "supervise",
                  "model", "supervised_tokens"):
            assert cfg["dflash_data"][k] == src[k], k
        assert cfg["dflash_version"]


def test_plot_metrics_draws_the_run(run, tmp_path):
    png = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "plot_metrics.py"), run["dir"], "--out", str(png)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (880, 600)
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "plot_metrics.py"), str(tmp_path / "none")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_plot_metrics_names_runs(run, tmp_path):
    # Two copies in one folder (as quality.sh leaves them) are named by their files, a LABEL= wins,
    # and a run directory by its directory; the names are what the console line prints.
    src = os.path.join(run["dir"], "metrics.jsonl")
    for n in ("metrics_main.jsonl", "metrics_ablation.jsonl"):
        shutil.copy(src, tmp_path / n)
    tool = os.path.join(SRC, "tools", "plot_metrics.py")
    r = subprocess.run([sys.executable, tool, str(tmp_path / "metrics_main.jsonl"), str(tmp_path / "metrics_ablation.jsonl"),
                        "5 layers=" + src, run["dir"], "--out", str(tmp_path / "c.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    base = os.path.basename(run["dir"])
    assert f"main (" in r.stdout and "ablation (" in r.stdout and "5 layers (" in r.stdout and f" {base} (" in r.stdout, r.stdout


def test_export_loads_with_automodel(run):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel
    final = os.path.join(run["dir"], "exports", "final")
    assert sorted(os.listdir(final)) == ["config.json", "dflash.py", "model.safetensors"]
    m = AutoModel.from_pretrained(final, trust_remote_code=True, dtype=torch.float32)
    assert type(m).__name__ == "DFlashDraftModel"
    want = load_file(os.path.join(final, "model.safetensors"))
    got = dict(m.named_parameters())
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k].detach(), t.float()), k


def test_check_export_against_targets(run, tmp_path):
    final = os.path.join(run["dir"], "exports", "final")
    r = subprocess.run([RANK_BIN, "check-export", final, "--target", run["target"]], capture_output=True, text=True)
    assert r.returncode == 0 and "fits the target" in r.stdout, r.stdout + r.stderr
    for field, edit in [("hidden_size", {"hidden_size": 128}), ("vocab_size", {"vocab_size": 1024}),
                        ("num_target_layers", {"num_hidden_layers": 12})]:
        t = tmp_path / f"target-{field}"
        t.mkdir()
        cfg = json.load(open(os.path.join(run["target"], "config.json")))
        cfg.update(edit)
        (t / "config.json").write_text(json.dumps(cfg))
        r = subprocess.run([RANK_BIN, "check-export", final, "--target", str(t)], capture_output=True, text=True)
        assert r.returncode == 2, (field, r.stdout, r.stderr)
        assert f"field '{field}'" in r.stderr and str(t) in r.stderr, (field, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("edit,expect", [
    ({"dflash_config": {"mask_token_id": 511, "target_layer_ids": [3, 2, 1]}}, "target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 600, "target_layer_ids": [1, 2, 3]}}, "mask_token_id"),
    ({"dtype": "float16", "torch_dtype": "float16"}, "dtype"),
])
def test_check_export_refuses_a_bad_export(run, tmp_path, edit, expect):
    final = os.path.join(run["dir"], "exports", "final")
    bad = tmp_path / "bad"
    shutil.copytree(final, bad)
    cfg = json.load(open(bad / "config.json"))
    cfg.update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([RANK_BIN, "check-export", str(bad), "--target", run["target"]], capture_output=True, text=True)
    assert r.returncode == 2 and expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
