"""The C++ target model (tests/model/target_tool) against Hugging Face transformers, CPU fp32.

Tiny random Qwen3 and Llama models of several shapes are saved with save_pretrained; the C++
side loads the directory and its captured layer outputs, logits and greedy tokens are compared
with transformers run on the same directory.

Error measure: rel_err(a, b) = max|a - b| / max|b| (max-norm, b the reference). Both sides
compute in float32 with different summation orders (BLAS blocking, SDPA kernels, fused
q/k/v and gate/up GEMMs), so rounding differences are ~1e-6 relative after a few layers; 1e-4
leaves margin for that and still catches any real defect (a wrong RoPE frequency, a missing
norm, a mask leak between documents give errors of order 1e-2 .. 1).
"""
import json
import os
import subprocess
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
TOOL = BUILD / "tests" / "model" / "target_tool"
TOL = float(os.environ.get("DFLASH_TEST_TOL", "1e-4"))

torch.manual_seed(0)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def run_tool(*args, check=True):
    r = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, f"target_tool {' '.join(map(str, args))} failed:\n{r.stderr}"
    return r


def ints(xs):
    return ",".join(str(int(x)) for x in xs)


MODELS = {
    # GQA, head_dim (32) != hidden/heads (16), untied, saved as bf16 (converted on load).
    "qwen3_gqa": dict(kind="qwen3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=211,
                      tie_word_embeddings=False, rope_theta=10000.0, save_dtype=torch.bfloat16),
    # MHA, tied embeddings, saved in several shards.
    "qwen3_tied_sharded": dict(kind="qwen3", hidden_size=48, num_hidden_layers=3,
                               num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                               intermediate_size=80, vocab_size=157, tie_word_embeddings=True,
                               rope_theta=1000000.0, shard="40KB"),
    # Llama-3.1 style: GQA 8/2, llama3 RoPE scaling, untied.
    "llama3_scaled": dict(kind="llama", hidden_size=64, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=2, intermediate_size=112,
                          vocab_size=173, tie_word_embeddings=False, rope_theta=500000.0,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=16)),
    # Llama, tied, explicit head_dim (24) != hidden/heads (12).
    "llama_tied_hd": dict(kind="llama", hidden_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                          intermediate_size=64, vocab_size=139, tie_word_embeddings=True,
                          rope_theta=10000.0),
}


def build_model(name, root: Path):
    spec = dict(MODELS[name])
    kind = spec.pop("kind")
    save_dtype = spec.pop("save_dtype", torch.float32)
    shard = spec.pop("shard", None)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    rope = spec.pop("rope_scaling", None)
    theta = spec.pop("rope_theta")
    rope_parameters = dict(rope_type="default", rope_theta=theta) if rope is None else dict(rope, rope_theta=theta)
    Cfg, Model = (Qwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    cfg = Cfg(**spec, rope_parameters=rope_parameters, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    model = Model(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: around 1, not exactly 1, so that they matter
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    d = root / name
    model.to(save_dtype).save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (d / "model.safetensors.index.json").exists()
        assert len(list(d.glob("model-*.safetensors"))) >= 3
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root) for name in MODELS}


def hf_load(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def hf_layer_outputs(model, ids):
    """Outputs of every decoder layer (forward hooks: the definition of a capture id) and logits."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o).detach()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            r = model(ids[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    layers = [o[0] for o in outs]
    # DFLASH.md's statement: id i = hidden_states[i + 1] (checked for all but the last layer,
    # whose hidden_states entry transformers may report after the final norm).
    for i in range(len(layers) - 1):
        assert torch.equal(layers[i], r.hidden_states[i + 1][0])
    return layers, r.logits[0]


DOC_LENS = [7, 19, 4]


def docs_for(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in DOC_LENS]


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_and_logits_match_transformers(models, name, tmp_path):
    d = models[name]
    hf = hf_load(d)
    L = hf.config.num_hidden_layers
    docs = docs_for(hf.config.vocab_size, 1)
    all_layers = list(range(L))
    ref_layers, ref_logits = [], []
    for doc in docs:
        layers, logits = hf_layer_outputs(hf, doc)
        ref_layers.append(torch.cat(layers, dim=-1))
        ref_logits.append(logits)
    ref_layers = torch.cat(ref_layers)
    ref_logits = torch.cat(ref_logits)
    ids = torch.cat(docs)
    cu = [0]
    for doc in docs:
        cu.append(cu[-1] + len(doc))

    # Packed stream of 3 documents, every layer captured, plus logits.
    run_tool("dump", "--model", d, "--ids", ints(ids), "--cu", ints(cu), "--layers", ints(all_layers),
             "--out", tmp_path / "packed.safetensors")
    got = load_file(tmp_path / "packed.safetensors")
    H = hf.config.hidden_size
    for i in all_layers:
        e = rel_err(got["captured"][:, i * H:(i + 1) * H], ref_layers[:, i * H:(i + 1) * H])
        assert e < TOL, f"{name}: layer {i} rel err {e:.3g}"
    e = rel_err(got["logits"], ref_logits)
    assert e < TOL, f"{name}: logits rel err {e:.3g}"

    # Each document alone gives the same states as inside the packed stream.
    off = 0
    for k, doc in enumerate(docs):
        run_tool("dump", "--model", d, "--ids", ints(doc), "--cu", f"0,{len(doc)}", "--layers",
                 ints(all_layers), "--out", tmp_path / f"doc{k}.safetensors")
        alone = load_file(tmp_path / f"doc{k}.safetensors")
        e = rel_err(got["captured"][off:off + len(doc)], alone["captured"])
        assert e < TOL, f"{name}: doc {k} packed vs alone rel err {e:.3g}"
        off += len(doc)

    # Capture-only over a subset of layers (stops after the last one) = the same columns.
    subset = [0, L - 2] if L > 2 else [0]
    run_tool("dump", "--model", d, "--ids", ints(ids), "--cu", ints(cu), "--layers", ints(subset),
             "--capture-only", "--out", tmp_path / "sub.safetensors")
    sub = load_file(tmp_path / "sub.safetensors")
    assert "logits" not in sub
    want = torch.cat([ref_layers[:, i * H:(i + 1) * H] for i in subset], dim=-1)
    assert sub["captured"].shape == want.shape
    e = rel_err(sub["captured"], want)
    assert e < TOL, f"{name}: capture subset rel err {e:.3g}"
    # A model loaded with only the layers needed gives the same.
    run_tool("dump", "--model", d, "--ids", ints(ids), "--cu", ints(cu), "--layers", ints(subset),
             "--capture-only", "--num-layers", subset[-1] + 1, "--out", tmp_path / "sub2.safetensors")
    assert torch.equal(load_file(tmp_path / "sub2.safetensors")["captured"], sub["captured"])


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_transformers(models, name):
    d = models[name]
    hf = hf_load(d)
    prompts = docs_for(hf.config.vocab_size, 2)
    ref = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
    assert all(len(r) == 32 for r in ref)
    r = run_tool("generate", "--model", d, "--prompts", ";".join(ints(p) for p in prompts),
                 "--max-new", 32)
    got = [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]
    assert got == ref, f"{name}:\nours {got}\nhf   {ref}"


@pytest.mark.parametrize("name", ["qwen3_gqa", "llama3_scaled"])
def test_batched_generation_of_unequal_prompts(models, name):
    """One batch of prompts of very different lengths = each prompt generated alone by
    transformers, also when freed and new heap memory holds junk (MALLOC_PERTURB_): no unwritten
    KV-cache slot may reach the arithmetic (the bug of issue 12: shorter rows emitted token 0)."""
    d = models[name]
    hf = hf_load(d)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in (3, 41, 1, 17, 29)]
    ref = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
    for perturb in (None, "128", "255"):
        env = dict(os.environ)
        if perturb:
            env["MALLOC_PERTURB_"] = perturb
        r = subprocess.run([str(TOOL), "generate", "--model", str(d), "--prompts",
                            ";".join(ints(p) for p in prompts), "--max-new", "24"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        got = [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]
        assert got == ref, f"{name} MALLOC_PERTURB_={perturb}:\nours {got}\nhf   {ref}"


def test_generation_stops_at_eos(models, tmp_path):
    """eos_token_id as a list in config.json; each sequence stops after its first eos."""
    import shutil
    src = models["llama3_scaled"]
    d = tmp_path / "eos_model"
    shutil.copytree(src, d)
    hf = hf_load(d)
    prompts = docs_for(hf.config.vocab_size, 3)
    with torch.no_grad():
        free = [hf.generate(p[None], max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eos = [free[0][5], free[1][9]]  # tokens the model will produce: both sequences stop early
    ref = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(p[None], max_new_tokens=32, do_sample=False, eos_token_id=eos,
                              pad_token_id=0)[0, len(p):].tolist()
            ref.append(out)
    assert len(ref[0]) <= 6 and len(ref[1]) <= 10
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    r = run_tool("generate", "--model", d, "--prompts", ";".join(ints(p) for p in prompts),
                 "--max-new", 32, "--stop-at-eos")
    got = [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]
    assert got == ref


@pytest.mark.parametrize("name", ["qwen3_gqa", "qwen3_tied_sharded"])
def test_drafter_embeddings(models, name, tmp_path):
    d = models[name]
    hf = hf_load(d)
    run_tool("embeddings", "--model", d, "--out", tmp_path / "e.safetensors")
    e = load_file(tmp_path / "e.safetensors")
    assert torch.equal(e["embed_tokens"], hf.model.embed_tokens.weight.detach())
    assert torch.equal(e["lm_head"], hf.lm_head.weight.detach())
    assert bool(e["tied"][0]) == hf.config.tie_word_embeddings


# ---- bad input -------------------------------------------------------------------------------

def copy_model(models, name, tmp_path):
    import shutil
    d = tmp_path / name
    shutil.copytree(models[name], d)
    return d


def expect_error(d, *needles, args=None):
    args = args or ["dump", "--model", d, "--ids", "1,2,3", "--cu", "0,3", "--out", d / "o.safetensors"]
    r = run_tool(*args, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr  # one line, no stack trace
    for n in needles:
        assert str(n) in r.stderr, f"{n!r} not in {r.stderr!r}"
    return r.stderr


def edit_config(d, **kv):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kv)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(models, tmp_path):
    d = copy_model(models, "qwen3_gqa", tmp_path)
    edit_config(d, model_type="mistral")
    expect_error(d, "config.json", "mistral", "qwen3", "llama")
    edit_config(d, model_type="qwen3", architectures=["Qwen3MoeForCausalLM"])
    expect_error(d, "config.json", "Qwen3MoeForCausalLM")
    edit_config(d, architectures=["Qwen3ForCausalLM"], rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    expect_error(d, "config.json", "yarn")


def test_config_and_weights_disagree(models, tmp_path):
    d = copy_model(models, "qwen3_gqa", tmp_path)
    edit_config(d, intermediate_size=100)
    expect_error(d, "model.layers.0.mlp.gate_proj.weight", "model.safetensors", "[96, 64]", "[100, 64]")
    edit_config(d, intermediate_size=96, num_hidden_layers=5)
    expect_error(d, "missing", "model.layers.4.self_attn.q_proj.weight")
    edit_config(d, num_hidden_layers=4)
    t = load_file(d / "model.safetensors")
    t["model.layers.1.extra.weight"] = torch.zeros(2)
    del t["model.layers.2.self_attn.k_norm.weight"]
    save_file(t, d / "model.safetensors")
    expect_error(d, "missing 1: model.layers.2.self_attn.k_norm.weight", "unexpected 1: model.layers.1.extra.weight")


def test_wrong_dtype_and_shape(models, tmp_path):
    d = copy_model(models, "llama_tied_hd", tmp_path)
    t = load_file(d / "model.safetensors")
    orig = dict(t)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    save_file(t, d / "model.safetensors")
    expect_error(d, "model.layers.1.mlp.up_proj.weight", "model.safetensors", "dtype")
    t = dict(orig)
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(25, 48)
    save_file(t, d / "model.safetensors")
    expect_error(d, "model.layers.0.self_attn.k_proj.weight", "[25, 48]", "[24, 48]")


def test_corrupt_and_missing_shards(models, tmp_path):
    d = copy_model(models, "qwen3_tied_sharded", tmp_path)
    shards = sorted(d.glob("model-*.safetensors"))
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[: len(raw) - 100])  # truncated
    expect_error(d, shards[1].name, "outside")
    shards[1].write_bytes(raw[:4])
    expect_error(d, shards[1].name, "too short")
    # Header pointing outside the file.
    import struct
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    name = next(k for k in hdr if k != "__metadata__")
    hdr[name]["data_offsets"][1] += 1 << 30
    h = json.dumps(hdr).encode()
    shards[1].write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    expect_error(d, shards[1].name, name)
    shards[1].write_bytes(raw)
    os.remove(shards[2])
    expect_error(d, shards[2].name, "missing")


def test_bad_tokens_and_cu_seqlens(models):
    d = models["qwen3_gqa"]
    expect_error(d, "211", args=["dump", "--model", d, "--ids", "1,2,211", "--cu", "0,3", "--out", "/dev/null"])
    expect_error(d, "cu_seqlens", args=["dump", "--model", d, "--ids", "1,2,3", "--cu", "0,2", "--out", "/dev/null"])
    expect_error(d, "layer id 4", args=["dump", "--model", d, "--ids", "1,2,3", "--cu", "0,3", "--layers", "1,4", "--out", "/dev/null"])
