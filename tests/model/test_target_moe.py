"""The C++ qwen3_moe target (tests/model/target_tool) against transformers' Qwen3MoeForCausalLM,
CPU fp32, tiny random models saved with save_pretrained (per-expert weight names, as released
checkpoints); one also re-saved with fused experts (mlp.experts.gate_up_proj / down_proj).
Tolerances: see family_common.py."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_common import (TOL, check_capture_and_logits, check_generation, expect_error, ints, randomize,
                           rel_err, run_tool)

MODELS = {
    # top-2 of 6, renormalised; layer 1 dense (mlp_only_layers), GQA 4/2, head_dim 16 != 32/4.
    "moe_top2_norm": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=40, moe_intermediate_size=24, num_experts=6,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], vocab_size=97,
                          tie_word_embeddings=False),
    # top-8 of 10, not renormalised; decoder_sparse_step 2 (layers 1, 3 sparse, 0, 2 dense), tied.
    "moe_top8_step2": dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=10,
                           num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=2, vocab_size=89,
                           tie_word_embeddings=True),
}
DOC_LENS = [7, 19, 4]


def build(name, root):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**MODELS[name], rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                         rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = randomize(Qwen3MoeForCausalLM(cfg).eval(), name)
    d = root / name
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {n: build(n, root) for n in MODELS}


def hf_load(d):
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_and_logits_match_transformers(models, name, tmp_path):
    d = models[name]
    names = load_file(d / "model.safetensors").keys()
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)  # per-expert names
    cfg = MODELS[name]
    dense = [l for l in range(cfg["num_hidden_layers"]) if f"model.layers.{l}.mlp.gate_proj.weight" in names]
    assert dense, "the model must have a dense layer among sparse ones"
    check_capture_and_logits(hf_load(d), d, tmp_path, DOC_LENS, name)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_uncached_transformers(models, name):
    check_generation(hf_load(models[name]), models[name], [5, 11, 3], 16, name)


def test_fused_expert_checkpoint(models, tmp_path):
    """The same weights with experts stored fused ([E, 2I, H] and [E, H, I]) give identical states."""
    src = models["moe_top2_norm"]
    d = tmp_path / "fused"
    shutil.copytree(src, d)
    t = load_file(src / "model.safetensors")
    E = MODELS["moe_top2_norm"]["num_experts"]
    for l in range(MODELS["moe_top2_norm"]["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp.experts."
        if p + "0.gate_proj.weight" not in t:
            continue
        t[p + "gate_up_proj"] = torch.stack(
            [torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)])
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    save_file(t, d / "model.safetensors")
    ids, cu = ints(range(1, 30)), "0,10,29"
    run_tool("dump", "--model", src, "--ids", ids, "--cu", cu, "--layers", "0,1,2", "--out", tmp_path / "a.st")
    run_tool("dump", "--model", d, "--ids", ids, "--cu", cu, "--layers", "0,1,2", "--out", tmp_path / "b.st")
    a, b = load_file(tmp_path / "a.st"), load_file(tmp_path / "b.st")
    assert rel_err(b["captured"], a["captured"]) < TOL and rel_err(b["logits"], a["logits"]) < TOL


def test_drafter_embeddings(models, tmp_path):
    d = models["moe_top8_step2"]
    hf = hf_load(d)
    run_tool("embeddings", "--model", d, "--out", tmp_path / "e.safetensors")
    e = load_file(tmp_path / "e.safetensors")
    assert torch.equal(e["embed_tokens"], hf.model.embed_tokens.weight.detach())
    assert torch.equal(e["lm_head"], hf.lm_head.weight.detach())
    assert bool(e["tied"][0])


def edit_config(d, **kv):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kv)
    (d / "config.json").write_text(json.dumps(cfg))


def test_bad_input(models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(models["moe_top2_norm"], d)
    edit_config(d, moe_intermediate_size=20)
    expect_error(d, "model.layers.0.mlp.experts.0.gate_proj.weight", "[24, 32]", "[20, 32]")
    edit_config(d, moe_intermediate_size=24, num_experts=7)
    expect_error(d, "missing", "model.layers.0.mlp.experts.6.gate_proj.weight")
    edit_config(d, num_experts=6, mlp_only_layers=[])
    expect_error(d, "missing", "model.layers.1.mlp.experts.0.down_proj.weight")
    edit_config(d, mlp_only_layers=[1], num_experts_per_tok=9)
    expect_error(d, "num_experts_per_tok 9", "num_experts 6")
    edit_config(d, num_experts_per_tok=2, model_type="gpt_oss", architectures=["GptOssForCausalLM"])
    expect_error(d, "config.json", "model_type 'gpt_oss'", "qwen3_moe")
    edit_config(d, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], use_sliding_window=True)
    expect_error(d, "use_sliding_window")
    edit_config(d, use_sliding_window=False, layer_types=["sliding_attention"] * 3)
    expect_error(d, "layer type 'sliding_attention'", "qwen3_moe")
