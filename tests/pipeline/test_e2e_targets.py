"""End-to-end training runs (mpirun, CPU, 1 target + 1 drafter rank) with tiny targets of the
qwen3_moe and qwen3_5 families (tools/make_tiny_target.py --family), on data each target
generated itself (tools/make_demo_data.py): the run finishes, its loss falls (the mean of the
last 4 steps at least LOSS_DROP nats below the mean of the first 2; a drafter that does not
learn stays within ~0.1 of ln(512) = 6.2 over these steps, as in test_e2e.py), and the export
loads with the `safetensors` package with DFLASH.md §5's names, shapes and dtype.
"""
import json
import os
import subprocess

import pytest

from pipeline_common import ENV, RANK_BIN, SRC, skip_without_rank_and_mpirun  # (and tools/ on sys.path)

STEPS = {"qwen3_moe": 24, "qwen3_5": 24}
LOSS_DROP = 0.4


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])
def test_training_run_with_family_target(family, tmp_path):
    skip_without_rank_and_mpirun()
    import make_demo_data
    import make_tiny_target
    target = make_tiny_target.make(str(tmp_path / "target"), seed=0, family=family)
    assert json.load(open(os.path.join(target, "config.json")))["model_type"] in (family, family + "_text")
    data = make_demo_data.make(target, str(tmp_path / "data"), num_docs=96, new_tokens=40, prompt_lens=(8, 16))
    run_dir = str(tmp_path / "run")
    over = {"run.dir": run_dir, "run.cpu_threads": 1, "target.model_dir": target, "data.shards": f"[{data}]",
            "data.batch_tokens": 384, "drafter.num_anchors": 24, "train.max_steps": STEPS[family], "train.lr": 1e-2,
            "log.interval": 1, "log.console_rank": -1, "checkpoint.export_every": 0, "checkpoint.state_every": 0,
            "comm.timeout_s": 60, "layout.target_ranks": 1, "layout.drafter_ranks": 1, "train.grad_accum": 2}
    cmd = ["mpirun", "-np", "2", RANK_BIN, "--config", os.path.join(SRC, "configs", "demo.yaml")] + \
        [f"{k}={v}" for k, v in over.items()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=SRC)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        losses[m["step"]] = m["loss"]
    steps = sorted(losses)
    assert len(steps) == STEPS[family]
    first = sum(losses[s] for s in steps[:2]) / 2
    last = sum(losses[s] for s in steps[-4:]) / 4
    assert last < first - LOSS_DROP, (family, first, last)

    from safetensors.torch import load_file
    import torch
    d = os.path.join(run_dir, "exports", "final")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3] and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"]["mask_token_id"] == 511
    t = load_file(os.path.join(d, "model.safetensors"))
    H, K = 64, 3
    assert t["fc.weight"].shape == (H, K * H) and t["fc.weight"].dtype == torch.bfloat16
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    assert t["layers.0.self_attn.q_proj.weight"].shape == (q, H)
    assert "layers.1.mlp.down_proj.weight" in t and not any(k.startswith("model.") for k in t)
    assert "embed_tokens.weight" not in t and "lm_head.weight" not in t
