"""The C++ qwen3_5 / qwen3_5_moe targets (tests/model/target_tool) against transformers, CPU fp32,
tiny random models: two layer_types patterns, GQA in the attention layers, partial RoPE of two
widths, value heads sharing key heads, the MoE variant with its shared expert, and a multimodal
wrapper (Qwen3_5ForConditionalGeneration: weights under model.language_model., vision weights
ignored). Documents of odd lengths, two of them longer than one 64-token chunk of the delta rule.
Generation is checked against transformers' UNCACHED greedy decoding. Tolerances: family_common.py.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_common import check_capture_and_logits, check_generation, expect_error, run_tool

TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=40,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
MODELS = {
    # linear, linear, full, linear, full; rotary 4 of 16 dims; conv kernel 4.
    "q35_pattern_a": dict(kind="text", num_hidden_layers=5, vocab_size=101,
                          layer_types=["linear_attention", "linear_attention", "full_attention",
                                       "linear_attention", "full_attention"],
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # full first, then three linear; rotary 8 of 16; conv kernel 3; tied embeddings; MHA-ish GQA 4/1.
    "q35_pattern_b": dict(kind="text", num_hidden_layers=4, vocab_size=83, linear_conv_kernel_dim=3,
                          num_key_value_heads=1, tie_word_embeddings=True,
                          layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"],
                          rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5)),
    # MoE: top-2 of 5 experts (always renormalised) + sigmoid-gated shared expert.
    "q35_moe": dict(kind="moe", num_hidden_layers=4, vocab_size=79, num_experts=5, num_experts_per_tok=2,
                    moe_intermediate_size=16, shared_expert_intermediate_size=24,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Multimodal wrapper with a tiny vision tower; the default 3:1 pattern.
    "q35_wrapped": dict(kind="wrapped", num_hidden_layers=4, vocab_size=91,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                             mrope_section=[1, 1, 0], mrope_interleaved=True)),
}
DOC_LENS = [71, 9, 133]


def classes(kind):
    import transformers as tr
    if kind == "moe":
        return tr.Qwen3_5MoeTextConfig, tr.Qwen3_5MoeForCausalLM
    return tr.Qwen3_5TextConfig, tr.Qwen3_5ForCausalLM


def build(name, root):
    import transformers as tr
    spec = dict(MODELS[name])
    kind = spec.pop("kind")
    text = dict(TEXT, **spec)
    if kind == "moe":
        text.pop("intermediate_size")
    if kind == "wrapped":
        cfg = tr.Qwen3_5Config(text_config=text, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
            num_position_embeddings=16))
        model = tr.Qwen3_5ForConditionalGeneration(cfg)
    else:
        Cfg, Model = classes(kind)
        model = Model(Cfg(**text))
    from family_common import randomize
    model = randomize(model.eval(), name, norm_center=0.0)  # zero-centred RMSNorms: scale 1 + w
    d = root / name
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35")
    return {n: build(n, root) for n in MODELS}


def hf_load(name, d):
    import transformers as tr
    kind = MODELS[name]["kind"]
    Model = tr.Qwen3_5ForConditionalGeneration if kind == "wrapped" else classes(kind)[1]
    return Model.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_and_logits_match_transformers(models, name, tmp_path):
    check_capture_and_logits(hf_load(name, models[name]), models[name], tmp_path, DOC_LENS, name)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_uncached_transformers(models, name):
    check_generation(hf_load(name, models[name]), models[name], [6, 13, 70], 12, name)


def test_wrapped_checkpoint_layout(models):
    d = models["q35_wrapped"]
    names = load_file(d / "model.safetensors").keys()
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    r = run_tool("dump", "--model", d, "--ids", "1,2,3", "--cu", "0,3", "--out", d / "o.safetensors")
    log = r.stdout + r.stderr
    assert log.count("ignoring") == 1 and "model.visual" in log


def edit_config(d, text=False, **kv):
    cfg = json.loads((d / "config.json").read_text())
    (cfg["text_config"] if text else cfg).update(kv)
    (d / "config.json").write_text(json.dumps(cfg))


def test_bad_input(models, tmp_path):
    d = tmp_path / "a"
    shutil.copytree(models["q35_pattern_a"], d)
    lt = MODELS["q35_pattern_a"]["layer_types"]
    edit_config(d, layer_types=lt[:2] + ["sliding_attention"] + lt[3:])
    expect_error(d, "config.json", "layer_types", "sliding_attention")
    edit_config(d, layer_types=lt[:4] + ["linear_attention"])
    expect_error(d, "missing", "model.layers.4.linear_attn.in_proj_qkv.weight")
    edit_config(d, layer_types=lt, linear_value_head_dim=8)
    expect_error(d, "model.layers.0.linear_attn.in_proj_qkv.weight", "[64, 32]")
    edit_config(d, linear_value_head_dim=12, linear_num_value_heads=3)
    expect_error(d, "linear_num_value_heads 3", "linear_num_key_heads 2")
    edit_config(d, linear_num_value_heads=4)
    t = load_file(d / "model.safetensors")
    t["model.layers.2.self_attn.q_proj.weight"] = t["model.layers.2.self_attn.q_proj.weight"][:64]
    save_file(t, d / "model.safetensors")
    expect_error(d, "model.layers.2.self_attn.q_proj.weight", "[64, 32]", "[128, 32]")
    w = tmp_path / "w"
    shutil.copytree(models["q35_wrapped"], w)
    edit_config(w, image_token_id=5)
    expect_error(w, "image_token_id 5", "vision inputs are not supported",
                 args=["dump", "--model", w, "--ids", "1,5,3", "--cu", "0,3", "--out", w / "o.safetensors"])
    edit_config(w, image_token_id=248056)
    cfg = json.loads((w / "config.json").read_text())
    del cfg["text_config"]
    (w / "config.json").write_text(json.dumps(cfg))
    expect_error(w, "text_config")
