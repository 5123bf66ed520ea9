"""bench/gpu/quality.sh at toy scale on CPU, so that the H200 run does not fail on a typo: the
demo's tiny target (with the byte-level chat tokenizer of tiny_chat.py) stands in for SmolLM2;
make_prompts -> regenerate (and the transformers speed comparison) -> prepare_data -> train a
few steps (5 and 1 draft layers) -> [dflash_rank eval when it is in the tree] -> plot -> summary,
each stage as its own call, with state kept between them as on the GPU machine. A second call of
a finished stage does no work again.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", SRC / "build"))
sys.path.insert(0, str(SRC / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_chat  # noqa: E402

TOY = dict(Q_TOY="1", Q_TRAIN="24", Q_EVAL="8", Q_EVAL_PROMPTS="4", Q_REGEN_BATCH="8", Q_MAX_NEW="40",
           Q_SPEED_PROMPTS="8", Q_STEPS="4", Q_EVAL_EVERY="2", Q_CURVE_MAX_NEW="16", Q_EVAL_BATCH="4", Q_EVAL_MAX_NEW="16", Q_DEVICE="cpu",
           Q_OVERRIDES="drafter.mask_token_id=511 target.num_features=3 target.dtype=float32 data.batch_tokens=2048 data.max_seq_len=1024 "
                       "drafter.num_anchors=8 log.interval=1 checkpoint.state_every=2 checkpoint.export_every=0 "
                       "run.cpu_threads=2 comm.backend=mpi")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    if not (BUILD / "trainer" / "dflash_rank").exists():
        pytest.skip("dflash_rank not built")
    import make_tiny_target
    root = tmp_path_factory.mktemp("chain")
    model = make_tiny_target.make(str(root / "target"), seed=0)
    tiny_chat.add_tokenizer(model)
    env = dict(os.environ, **TOY, DFLASH_QUALITY_MODEL=model, DFLASH_QUALITY_DIR=str(root / "state"),
               DFLASH_BUILD=str(BUILD), DFLASH_PYTHON=sys.executable, OUT=str(root / "out"),
               OMP_NUM_THREADS="2")
    return root, env


def stage(env, name):
    r = subprocess.run(["bash", str(SRC / "bench" / "gpu" / "quality.sh"), name], env=env, cwd=SRC,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{name}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout + r.stderr


def test_toy_chain(chain):
    root, env = chain
    out, state = root / "out", root / "state"
    stage(env, "stage1")
    chat = [json.loads(l) for l in open(state / "chat.jsonl")]
    assert chat and all(c["messages"][-1]["role"] == "assistant" for c in chat)
    speed = json.loads((out / "regen_speed.json").read_text())
    assert speed["dflash"]["tokens_per_s"] > 0 and speed["transformers"]["tokens_per_s"] > 0 and speed["ratio"] > 0
    again = stage(env, "stage1")  # finished: nothing is generated again
    assert "to generate" not in again and "regeneration of the train prompts" not in again

    stage(env, "stage2")
    assert json.loads((state / "shards" / "prepare_info.json").read_text())["written"] > 0
    assert len((state / "eval_prompts.jsonl").read_text().splitlines()) == 4
    main = [json.loads(l) for l in open(out / "metrics_main.jsonl")]
    assert main[-1]["step"] == 4
    assert (state / "run_main" / "exports" / "final" / "model.safetensors").exists()

    log = stage(env, "stage3")
    abl = [json.loads(l) for l in open(out / "metrics_ablation.jsonl")]
    assert abl[-1]["step"] == 4
    cfg = json.loads((state / "run_ablation" / "exports" / "final" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert (out / "quality_curves.png").stat().st_size > 1000
    summary = (out / "quality_summary.md").read_text()
    assert "5 draft layers" in summary and "drafter.num_layers=1" in summary and "dflash / transformers" in summary
    if (SRC / "trainer" / "eval" / "evaluate.h").exists():
        for name in ["main", "ablation"]:
            e = json.loads((out / f"eval_{name}.json").read_text())
            assert 1 <= e["tau"] <= 16 and e["equal_output_share"] == 1.0  # CPU fp32: identical to greedy
        taus = [r["tau"] for r in main if isinstance(r.get("tau"), (int, float))]
        assert taus, "no real tau during training"  # eval.every: the curve's points
        assert "eval tau" in summary and "-x" not in summary
    else:
        assert "SKIP eval" in log
