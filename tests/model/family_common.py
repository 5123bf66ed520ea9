"""Shared checks of the C++ target (tests/model/target_tool) against transformers for the
qwen3_moe / qwen3_5 families (test_target_moe.py, test_target_qwen35.py). CPU, fp32.

Error measure: rel_err(a, b) = max|a - b| / max|b| (b the reference). Both sides compute in
float32 with different summation orders (fused GEMMs, the experts' per-token sum in routing
order instead of expert order, the chunked delta rule's matmul blocking), so rounding
differences are ~1e-6 relative after a few layers; 1e-4 leaves margin and still catches a real
defect (a wrong gate, norm offset, RoPE width, a conv or state leaking across documents:
errors of order 1e-2 .. 1). Router top-k over random weights has no near-ties at this scale.
"""
import os
import subprocess
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
TOOL = BUILD / "tests" / "model" / "target_tool"
TOL = float(os.environ.get("DFLASH_TEST_TOL", "1e-4"))


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def run_tool(*args, check=True):
    r = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, f"target_tool {' '.join(map(str, args))} failed:\n{r.stderr}"
    return r


def ints(xs):
    return ",".join(str(int(x)) for x in xs)


def randomize(model, name, norm_center=1.0):
    """Deterministic random weights: 1-D params (norms, A_log, dt_bias) around norm_center, the
    rest N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                c = 1.0 if ("A_log" in pname or "dt_bias" in pname or "linear_attn.norm" in pname) else norm_center
                p.copy_(c + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    return model


def decoder_layers(model):
    m = model.model
    return m.language_model.layers if hasattr(m, "language_model") else m.layers


def hf_layer_outputs(model, ids):
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o).detach()))
             for layer in decoder_layers(model)]
    try:
        with torch.no_grad():
            r = model(input_ids=ids[None])
    finally:
        for h in hooks:
            h.remove()
    return [o[0] for o in outs], r.logits[0]


def docs_for(vocab, seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def check_capture_and_logits(hf, d, tmp_path, doc_lens, name):
    """Packed stream of documents: every layer's output and the logits vs transformers run on
    each document alone; each document alone through the C++ model gives the same states."""
    L = hf.config.get_text_config().num_hidden_layers
    H = hf.config.get_text_config().hidden_size
    vocab = hf.config.get_text_config().vocab_size
    docs = docs_for(vocab, 1, doc_lens)
    ref_layers, ref_logits = [], []
    for doc in docs:
        layers, logits = hf_layer_outputs(hf, doc)
        ref_layers.append(torch.cat(layers, -1))
        ref_logits.append(logits)
    ref_layers, ref_logits = torch.cat(ref_layers), torch.cat(ref_logits)
    ids = torch.cat(docs)
    cu = [0]
    for doc in docs:
        cu.append(cu[-1] + len(doc))
    all_layers = list(range(L))
    run_tool("dump", "--model", d, "--ids", ints(ids), "--cu", ints(cu), "--layers", ints(all_layers),
             "--out", tmp_path / "packed.safetensors")
    got = load_file(tmp_path / "packed.safetensors")
    for i in all_layers:
        e = rel_err(got["captured"][:, i * H:(i + 1) * H], ref_layers[:, i * H:(i + 1) * H])
        assert e < TOL, f"{name}: layer {i} rel err {e:.3g}"
    e = rel_err(got["logits"], ref_logits)
    assert e < TOL, f"{name}: logits rel err {e:.3g}"
    off = 0
    for k, doc in enumerate(docs):
        run_tool("dump", "--model", d, "--ids", ints(doc), "--cu", f"0,{len(doc)}", "--layers",
                 ints(all_layers), "--capture-only", "--out", tmp_path / f"doc{k}.safetensors")
        alone = load_file(tmp_path / f"doc{k}.safetensors")
        e = rel_err(got["captured"][off:off + len(doc)], alone["captured"])
        assert e < TOL, f"{name}: doc {k} packed vs alone rel err {e:.3g}"
        off += len(doc)
    # Capture-only of a subset, with only the layers needed loaded: the same columns.
    subset = [0, L - 2]
    run_tool("dump", "--model", d, "--ids", ints(ids), "--cu", ints(cu), "--layers", ints(subset),
             "--capture-only", "--num-layers", subset[-1] + 1, "--out", tmp_path / "sub.safetensors")
    sub = load_file(tmp_path / "sub.safetensors")
    assert "logits" not in sub
    want = torch.cat([ref_layers[:, i * H:(i + 1) * H] for i in subset], -1)
    e = rel_err(sub["captured"], want)
    assert e < TOL, f"{name}: capture subset rel err {e:.3g}"
    return got


def uncached_greedy(hf, prompt, n):
    """transformers' greedy decoding WITHOUT a cache: the full sequence every step (the oracle;
    cached generate of hybrid models is not one in general)."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=ids[None], use_cache=False).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1)])
    return ids[len(prompt):].tolist()


def check_generation(hf, d, prompt_lens, n, name):
    vocab = hf.config.get_text_config().vocab_size
    prompts = docs_for(vocab, 2, prompt_lens)
    ref = [uncached_greedy(hf, p, n) for p in prompts]
    r = run_tool("generate", "--model", d, "--prompts", ";".join(ints(p) for p in prompts), "--max-new", n)
    lines = [l for l in r.stdout.strip().splitlines() if not l.startswith("[dflash]")]  # log lines
    got = [[int(x) for x in line.split(",")] for line in lines]
    assert got == ref, f"{name}:\nours {got}\nhf   {ref}"


def expect_error(d, *needles, args=None):
    args = args or ["dump", "--model", d, "--ids", "1,2,3", "--cu", "0,3", "--out", d / "o.safetensors"]
    r = run_tool(*args, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if not l.startswith("[dflash]")]  # info lines aside
    assert len(lines) == 1, r.stderr  # one error line, no stack trace
    for n in needles:
        assert str(n) in r.stderr, f"{n!r} not in {r.stderr!r}"
    return r.stderr
