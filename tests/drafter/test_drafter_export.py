"""Export / import of the drafter (DFLASH.md §5) through drafter_tool: the files as written
(config.json fields, safetensors header names / shapes / dtypes), loading with the `safetensors`
package, the round trip export -> import -> identical logits, bad inputs to import, and the
shipped dflash.py: AutoModel.from_pretrained(export, trust_remote_code=True) in the venv's
transformers gives the C++ drafter's logits."""
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_drafter_ref import T, make_batch, make_params, param_shapes, run_tool, tiny_cfg

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
TOOL = BUILD / "tests" / "drafter" / "drafter_tool"


def tool(*args):
    return subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=300)


def write_case(tmp_path, c, P, name="in", extra_meta=None):
    embed_lm = make_params(c, 0)
    ids, m, feats = make_batch(c, 2, 30)
    t = dict(P)
    t.update({"target.embed": embed_lm[1], "target.lm_head": embed_lm[2], "batch.ids": ids,
              "batch.loss_mask": m, "batch.features": feats,
              "blocks.anchor": T([[3, 9, 20], [4, 5, 27]]), "blocks.keep": torch.ones(2, 3, dtype=torch.bool)})
    meta = {k: (",".join(map(str, v)) if isinstance(v, list) else str(v)) for k, v in c.items()}
    meta.update(extra_meta or {})
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, path, metadata=meta)
    return path


def bf16_params(c, seed=0):
    P, _, _ = make_params(c, seed)
    return {k: v.to(torch.bfloat16).float() for k, v in P.items()}  # exactly representable in bf16


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


EXPECTED_8B = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960, "attention_bias": False,
    "attention_dropout": 0.0, "layer_types": ["full_attention"] * 5, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 5, "tie_word_embeddings": False, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "use_cache": True,
    "dtype": "bfloat16",
}


def test_qwen3_8b_config_matches_dflash_md_section_5(tmp_path):
    r = tool("config8b", tmp_path / "config.json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k, v in EXPECTED_8B.items():
        assert k in cfg, k
        assert cfg[k] == v and type(cfg[k]) is type(v), (k, cfg[k], v)
    assert isinstance(cfg["dflash_config"], dict)
    assert set(cfg) - set(EXPECTED_8B) <= {"torch_dtype"}


def test_export_files_match_section_5(tmp_path):
    c = tiny_cfg(16)
    P = bf16_params(c)
    out = tmp_path / "export"
    r = tool("export", write_case(tmp_path, c, P), out)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "dflash.py", "model.safetensors"]
    assert not (tmp_path / "export.tmp").exists()
    cfg = json.loads((out / "config.json").read_text())
    expect = dict(EXPECTED_8B)
    expect.update({"block_size": 16, "num_target_layers": 8,
                   "dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 3, 5]},
                   "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000, "layer_types": ["full_attention"] * 2,
                   "max_window_layers": 2, "vocab_size": 64, "bos_token_id": None, "eos_token_id": None})
    for k, v in expect.items():
        assert cfg[k] == v, (k, cfg[k], v)
    hdr = read_header(out / "model.safetensors")
    hdr.pop("__metadata__", None)
    shapes = param_shapes(c)
    assert set(hdr) == set(shapes)  # no prefix, no embed_tokens / lm_head / rotary buffers
    for n, shp in shapes.items():
        assert hdr[n]["dtype"] == "BF16", n
        assert tuple(hdr[n]["shape"]) == shp, n
    loaded = load_file(out / "model.safetensors")  # the safetensors package reads it
    for n, t in P.items():
        assert loaded[n].dtype == torch.bfloat16
        assert torch.equal(loaded[n].float(), t), n
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_export_import_round_trip_gives_identical_logits(tmp_path):
    c = tiny_cfg(10)
    P = bf16_params(c, 4)
    inp = write_case(tmp_path, c, P, extra_meta={"logits": "1"})
    direct = tool("case", inp, tmp_path / "direct.safetensors")
    assert direct.returncode == 0, direct.stderr
    assert tool("export", inp, tmp_path / "exp").returncode == 0
    # exporting again over an existing directory replaces it
    r = tool("export", inp, tmp_path / "exp")
    assert r.returncode == 0, r.stderr
    r = tool("import", tmp_path / "exp", inp, tmp_path / "back.safetensors")
    assert r.returncode == 0, r.stderr
    a = load_file(tmp_path / "direct.safetensors")["logits"]
    b = load_file(tmp_path / "back.safetensors")["logits"]
    assert torch.equal(a, b)


def test_import_accepts_model_prefix_and_dflash_config_block_size(tmp_path):
    c = tiny_cfg(16)
    P = bf16_params(c)
    inp = write_case(tmp_path, c, P)
    out = tmp_path / "exp"
    assert tool("export", inp, out).returncode == 0
    ts = load_file(out / "model.safetensors")
    save_file({"model." + k: v for k, v in ts.items()}, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (out / "config.json").write_text(json.dumps(cfg))
    r = tool("import", out, inp, tmp_path / "o.safetensors")
    assert r.returncode == 0, r.stderr


def corrupt_config(key, value):
    def f(cfg):
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[p]
        if value is DELETE:
            del node[parts[-1]]
        else:
            node[parts[-1]] = value
    return f


DELETE = object()


@pytest.mark.parametrize("edit,expect", [
    (corrupt_config("hidden_size", 48), "hidden_size"),
    (corrupt_config("vocab_size", 100), "vocab_size"),
    (corrupt_config("dflash_config.target_layer_ids", [1, 3, 8]), "target_layer_ids"),
    (corrupt_config("dflash_config.mask_token_id", 64), "mask_token_id"),
    (corrupt_config("dflash_config.mask_token_id", DELETE), "mask_token_id"),
    (corrupt_config("num_target_layers", 12), "num_target_layers"),
    (corrupt_config("architectures", ["Qwen3ForCausalLM"]), "architectures"),
    (corrupt_config("layer_types", ["sliding_attention", "full_attention"]), "layer_types"),
    (corrupt_config("num_attention_heads", "four"), "num_attention_heads"),
    (corrupt_config("head_dim", 16), "q_proj"),
])
def test_import_rejects_bad_config(tmp_path, edit, expect):
    c = tiny_cfg(16)
    inp = write_case(tmp_path, c, bf16_params(c))
    out = tmp_path / "exp"
    assert tool("export", inp, out).returncode == 0
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    r = tool("import", out, inp, tmp_path / "o.safetensors")
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr, r.stderr


@pytest.mark.parametrize("what", ["missing", "misshapen", "extra"])
def test_import_rejects_bad_tensors(tmp_path, what):
    c = tiny_cfg(16)
    inp = write_case(tmp_path, c, bf16_params(c))
    out = tmp_path / "exp"
    assert tool("export", inp, out).returncode == 0
    ts = load_file(out / "model.safetensors")
    name = "layers.1.self_attn.k_proj.weight"
    if what == "missing":
        del ts[name]
    elif what == "misshapen":
        ts[name] = ts[name][:-1].contiguous()
    else:
        ts["lm_head.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)
        name = "lm_head.weight"
    save_file(ts, out / "model.safetensors")
    r = tool("import", out, inp, tmp_path / "o.safetensors")
    assert r.returncode == 2, r.stderr
    assert name in r.stderr, r.stderr


def test_import_rejects_target_mismatch(tmp_path):
    c = tiny_cfg(16)
    P = bf16_params(c)
    assert tool("export", write_case(tmp_path, c, P), tmp_path / "exp").returncode == 0
    for meta, field in [({"target_hidden_size": "64"}, "hidden_size"), ({"target_vocab_size": "128"}, "vocab_size"),
                        ({"target_num_layers": "4"}, "target_layer_ids")]:
        inp = write_case(tmp_path, c, P, name="t", extra_meta=meta)
        r = tool("import", tmp_path / "exp", inp, tmp_path / "o.safetensors")
        assert r.returncode == 2 and field in r.stderr, (meta, r.stderr)


# fp32 on both sides with the same (bf16-exact) weights; they differ only in the order of the
# floating-point sums (SDPA over the visible keys vs the C++ masked attention over all of them,
# GEMM blocking), about 1e-6 on logits of magnitude ~3 here. 1e-4 is far below what a formula
# error (the anchor's own feature visible, RoPE on the wrong positions, a missing norm) changes:
# those move logits by 1e-2 or more (the negative control below).
HF_ATOL = 1e-4


def hf_block_logits(model, c, embed, lm_head, ids, feats, b, a, bs):
    """Logits of the block anchored at `a` of row b from the HF model: the context is the target
    features of positions < a (the anchor's own is not visible, DFLASH.md §2.3), the block is
    [x[a], MASK x (bs-1)] at positions a..a+bs-1."""
    block = torch.tensor([int(ids[b, a])] + [c["mask_token_id"]] * (bs - 1))
    noise = embed[block][None]
    ctx = feats[b, :a][None]
    pos = torch.arange(a + bs)[None]
    with torch.no_grad():
        h = model(noise_embedding=noise, target_hidden=ctx, position_ids=pos).last_hidden_state
    return h[0] @ lm_head.T


@pytest.mark.parametrize("bs", [16, 8])
def test_automodel_loads_the_export_and_matches_cpp_logits(tmp_path, bs):
    from transformers import AutoModel
    c = tiny_cfg(bs)
    P = bf16_params(c, 7)
    inp = write_case(tmp_path, c, P)
    out = tmp_path / "exp"
    assert tool("export", inp, out).returncode == 0
    r = tool("import", out, inp, tmp_path / "cpp.safetensors")
    assert r.returncode == 0, r.stderr
    cpp = load_file(tmp_path / "cpp.safetensors")["logits"]  # [B, N*bs, V]
    f = load_file(inp)
    embed, lm_head, ids, feats = f["target.embed"], f["target.lm_head"], f["batch.ids"], f["batch.features"]
    anchors = f["blocks.anchor"]
    model = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlashDraftModel" and model.block_size == bs
    assert model.target_layer_ids == c["target_layer_ids"] and model.mask_token_id == c["mask_token_id"]
    worst = 0.0
    for b in range(anchors.shape[0]):
        for j, a in enumerate(anchors[b].tolist()):
            got = hf_block_logits(model, c, embed, lm_head, ids, feats, b, a, bs)
            want = cpp[b, j * bs:(j + 1) * bs]
            worst = max(worst, (got - want).abs().max().item())
    assert worst <= HF_ATOL, worst
    # Negative control: the anchor's own feature made visible moves the logits far beyond that.
    a = int(anchors[0, 1])
    block = torch.tensor([int(ids[0, a])] + [c["mask_token_id"]] * (bs - 1))
    with torch.no_grad():
        h = model(noise_embedding=embed[block][None], target_hidden=feats[0, :a + 1][None],
                  position_ids=torch.cat([torch.arange(a + 1), torch.arange(a, a + bs)])[None]).last_hidden_state
    assert (h[0] @ lm_head.T - cpp[0, bs:2 * bs]).abs().max().item() > 100 * HF_ATOL
