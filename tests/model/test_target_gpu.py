"""GPU: the C++ target forward in bf16 against transformers on the same GPU (Qwen3-8B shapes).

Skipped without CUDA, but for DFLASH_TEST_GPU_ON_CPU=1 (CI): then the tiny float32 test runs on
the CPU, which checks the test itself (its helpers come from test_target.py and must keep up with
it) while the CUDA code paths it exists for are not run. The checkpoint (Qwen3-8B shapes, 36 layers, random bf16 weights) comes
from DFLASH_TARGET_GPU_CKPT, or is written by `target_bench write-checkpoint` into a temporary
directory. Three documents of different lengths are packed into one stream for dflash
(layer ids 1, 9, 17, 25, 33); transformers runs each document alone.

Error measures per captured layer: fro(a, b) = ||a - b||_2 / ||b||_2 over all elements, and
maxn(a, b) = max|a - b| / max|b|. transformers in float32 (the same bf16 weights, upcast) is the
gold. Pass criteria:
1. fro(dflash, transformers-bf16) < max(1e-2, 2 * fro(transformers-bf16, gold)): within the
   issue's 1e-2, or within twice transformers' own bf16 error where that error alone exceeds
   1e-2. Two bf16 implementations that round at different points (fused vs separate norms,
   RoPE in fp32 vs bf16, GEMM epilogues) each sit at about the bf16 noise floor from the gold,
   so their mutual distance is about sqrt(2) times it; any real defect (wrong RoPE, mask, norm,
   head layout) gives errors of order 1.
2. maxn(dflash, gold) <= 1.5 * maxn(transformers-bf16, gold) + 1e-3: dflash rounds no worse
   than transformers does, in the strict max-norm.
Measured on an H200 (run1, 2026-11-30, commit 013c09f of main), layers 1 / 9 / 17 / 25 / 33:
fro(transformers-bf16, gold) = 1.1e-2 / 2.5e-2 / 3.5e-2 / 4.2e-2 / 4.9e-2 on these random
weights, so a fixed 1e-2 against transformers-bf16 cannot hold for any implementation that is
not bit-identical to it; fro(dflash, transformers-bf16) = 1.4e-2 / 3.2e-2 / 4.3e-2 / 5.3e-2 /
6.1e-2; maxn(dflash, gold) = 1.0e-2 .. 4.5e-2 against transformers' 1.3e-2 .. 5.3e-2 (dflash
is the closer one at every layer).
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch

ON_CPU = not torch.cuda.is_available() and bool(os.environ.get("DFLASH_TEST_GPU_ON_CPU"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_cuda_or_on_cpu = pytest.mark.skipif(not torch.cuda.is_available() and not ON_CPU,
                                          reason="needs CUDA (or DFLASH_TEST_GPU_ON_CPU=1)")

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
LAYER_IDS = [1, 9, 17, 25, 33]
DOC_LENS = [1500, 2048, 517]


def maxn(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def fro(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = os.environ.get("DFLASH_TARGET_GPU_CKPT")
    if d and (Path(d) / "config.json").exists():
        return Path(d)
    d = tmp_path_factory.mktemp("q8b")
    subprocess.run([str(BUILD / "bench" / "target_bench"), "write-checkpoint", str(d)], check=True)
    return d


def hf_captures(model, docs):
    outs = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, inp, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].float().cpu()))
        for i in LAYER_IDS]
    res = []
    with torch.inference_mode():
        for doc in docs:
            outs.clear()
            model.model(input_ids=doc[None].cuda())
            res.append(torch.cat([outs[i] for i in LAYER_IDS], dim=-1))
    for h in hooks:
        h.remove()
    return torch.cat(res)


@needs_cuda
def test_capture_matches_transformers_bf16(ckpt, tmp_path):
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 151936, (n,), generator=g) for n in DOC_LENS]
    ids = torch.cat(docs)
    cu = [0]
    for n in DOC_LENS:
        cu.append(cu[-1] + n)
    r = subprocess.run([str(BUILD / "tests" / "model" / "target_tool"), "dump", "--model", str(ckpt),
                        "--ids", ",".join(map(str, ids.tolist())), "--cu", ",".join(map(str, cu)),
                        "--layers", ",".join(map(str, LAYER_IDS)), "--capture-only",
                        "--num-layers", str(LAYER_IDS[-1] + 1), "--device", "cuda", "--dtype", "bf16",
                        "--out", str(tmp_path / "ours.safetensors")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    print(r.stderr.strip())
    ours = load_file(tmp_path / "ours.safetensors")["captured"].float()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    model.model.layers = model.model.layers[: LAYER_IDS[-1] + 1]  # truncated, as dflash runs
    hf16 = hf_captures(model, docs)
    gold = hf_captures(model.float(), docs)  # the same weights in float32: the gold
    del model
    torch.cuda.empty_cache()
    H = 4096
    print(f"{'layer':>5} {'fro dfl/hf16':>13} {'maxn dfl/hf16':>14} {'maxn dfl/fp32':>14} "
          f"{'maxn hf16/fp32':>15} {'fro hf16/fp32':>14} {'max|ref|':>9}")
    failures = []
    for k, i in enumerate(LAYER_IDS):
        sl = slice(k * H, (k + 1) * H)
        o, h, gd = ours[:, sl], hf16[:, sl], gold[:, sl]
        f16, m16, mg, hg = fro(o, h), maxn(o, h), maxn(o, gd), maxn(h, gd)
        print(f"{i:>5} {f16:>13.2e} {m16:>14.2e} {mg:>14.2e} {hg:>15.2e} {fro(h, gd):>14.2e} "
              f"{gd.abs().max().item():>9.3g}")
        floor = fro(h, gd)
        if not (f16 < max(1e-2, 2 * floor)):
            failures.append(f"layer {i}: fro(dflash, transformers-bf16) {f16:.3g} >= max(1e-2, 2 x {floor:.3g})")
        if not (mg <= 1.5 * hg + 1e-3):
            failures.append(f"layer {i}: maxn(dflash, fp32 gold) {mg:.3g} > 1.5 x transformers-bf16's {hg:.3g} + 1e-3")
    assert not failures, failures


@needs_cuda_or_on_cpu
@pytest.mark.parametrize("name", ["qwen3_gqa", "llama3_scaled"])
def test_tiny_fp32_forward_and_generation_on_cuda(tmp_path, name):
    """The CUDA code paths (fused q/k-norm+RoPE and SiLU kernels, KV-cache decode) in float32
    against transformers on the same GPU: states within 1e-4 (max-norm; TF32 is off on both
    sides, so only summation order differs) and exactly the same 32 greedy tokens."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    import test_target as cpu
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    d = cpu.build_model(name, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(DEV).eval()
    docs = cpu.docs_for(hf.config.vocab_size, 1, cpu.DOC_LENS)
    ids = torch.cat(docs)
    cu = [0]
    for doc in docs:
        cu.append(cu[-1] + len(doc))
    L = hf.config.num_hidden_layers
    tool = str(BUILD / "tests" / "model" / "target_tool")
    r = subprocess.run([tool, "dump", "--model", str(d), "--ids", cpu.ints(ids), "--cu", cpu.ints(cu),
                        "--layers", cpu.ints(range(L)), "--device", DEV, "--out", str(tmp_path / "o.safetensors")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "o.safetensors")
    ref = []
    for doc in docs:
        layers, _ = cpu.hf_layer_outputs(hf, doc.to(DEV))
        ref.append(torch.cat(layers, dim=-1).cpu())
    e = maxn(got["captured"], torch.cat(ref))
    assert e < 1e-4, e
    prompts = cpu.docs_for(hf.config.vocab_size, 2, cpu.DOC_LENS)
    with torch.no_grad():
        want = [hf.generate(p[None].to(DEV), max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    r = subprocess.run([tool, "generate", "--model", str(d), "--prompts", ";".join(cpu.ints(p) for p in prompts),
                        "--max-new", "32", "--device", DEV], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got_tokens = [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]
    assert got_tokens == want
