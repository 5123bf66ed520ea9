"""dflash's AdamW, clipping and schedule (trainer/optim/) against torch.optim.AdamW,
torch.nn.utils.clip_grad_norm_ and DFLASH.md §3's schedule written here in Python.

Tolerance: the C++ side runs the same ATen kernels in the same order as torch's single-tensor
AdamW (foreach=False), so fp32 results agree to the last bit in practice; we allow 1e-6
relative (max-abs error / max-abs value) so that a different vectorisation of one kernel on
another CPU does not fail the test, while any algorithmic difference (a missing bias
correction, decay applied to the wrong tensor, clipping after the update, an off-by-one in the
schedule) is orders of magnitude larger. bf16 parameters: the fp32 masters follow the same
bound; the bf16 parameters must equal the masters rounded to bf16.
Every case runs twice: the single-tensor update (DFLASH_OPTIM_FUSED=0, CPU's default) and the fused
one (=1, on the CPU ATen's: _foreach_norm, ATen's multi-tensor _fused_adamw_), which does the same
arithmetic in another order (differences ~1e-7 relative, well inside 1e-6 over 12 steps; a wrong
bias correction or step count is 1e-2 and more). On CUDA =1 runs dflash's own kernels instead
(trainer/optim/adamw_kernels.h), tested against ATen's fused path by tests/optim/test_optim_gpu.cpp.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TRACE = os.path.join(BUILD, "tests", "optim", "dflash_optim_trace")
REL = 1e-6


def lr_at(s, lr, ratio, total):
    """DFLASH.md §3: lr*(s+1)/W for s < W = int(ratio*total), then cosine from lr to 0 over total-W."""
    w = int(ratio * total)
    if s < w:
        return lr * (s + 1) / w
    if total == w:
        return lr
    return lr * 0.5 * (1 + math.cos(math.pi * (s - w) / (total - w)))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(params=["0", "1"], ids=["single", "fused"], autouse=True)
def fused(request, monkeypatch):
    monkeypatch.setenv("DFLASH_OPTIM_FUSED", request.param)
    return request.param == "1"


def run_case(tmp_path, dtype, steps=12, resume_at=None, weight_decay=0.01, max_norm=1.0, ratio=0.25,
             expect_clipping=True):
    g = torch.Generator().manual_seed(3)
    shapes = {"fc.weight": (16, 24), "layers.0.norm.weight": (16,), "layers.0.mlp.up.weight": (8, 16)}
    params = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    tensors = {f"param.{n}": p for n, p in params.items()}
    grads = []
    for s in range(steps):
        # Gradient scale varies so that clipping is active in some steps and not in others.
        scale = 0.02 if s % 3 == 0 else 1.0
        gs = {n: (scale * torch.randn(p.shape, generator=g)).to(dtype) for n, p in params.items()}
        grads.append(gs)
        tensors.update({f"grad.{s}.{n}": t for n, t in gs.items()})
    meta = dict(steps=steps, lr=1e-2, warmup_ratio=ratio, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=weight_decay, max_norm=max_norm)
    if resume_at is not None:
        meta["resume_at"] = resume_at
    inp, outp = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    save_file(tensors, inp, metadata={k: str(v) for k, v in meta.items()})
    subprocess.run([TRACE, inp, outp], check=True)
    got = load_file(outp)
    assert got["fused"].item() == int(os.environ["DFLASH_OPTIM_FUSED"])  # the update asked for ran

    # Reference: fp32 masters under torch.optim.AdamW.
    masters = {n: p.float().clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(list(masters.values()), lr=meta["lr"], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=weight_decay, foreach=False)
    clipped = 0
    for s in range(steps):
        for n, m in masters.items():
            m.grad = grads[s][n].float()
        norm = torch.nn.utils.clip_grad_norm_(list(masters.values()), max_norm, foreach=False)
        clipped += norm.item() > max_norm
        lr = lr_at(s, meta["lr"], ratio, steps)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        assert got["lr"][s].item() == pytest.approx(lr, rel=1e-12, abs=0), s
        assert got["norm"][s].item() == pytest.approx(norm.item(), rel=1e-6), s
        for n, m in masters.items():
            p = got[f"param.{s}.{n}"]
            assert p.dtype == dtype
            if dtype == torch.float32:
                assert rel(p, m.detach()) <= REL, (s, n, rel(p, m.detach()))
            else:
                assert rel(got[f"state.master.{n}"] if s == steps - 1 else m.detach(), m.detach()) <= REL
                # bf16 parameter = its fp32 master rounded (allow one bf16 ulp where the masters
                # differ within REL across a rounding boundary)
                assert rel(p, m.detach().to(dtype)) <= 2 ** -8, (s, n)
    if expect_clipping:
        assert 0 < clipped < steps  # both regimes were exercised
    else:
        assert clipped == 0
    for n, m in masters.items():
        st = opt.state[m]
        assert rel(got[f"state.exp_avg.{n}"], st["exp_avg"]) <= REL
        assert rel(got[f"state.exp_avg_sq.{n}"], st["exp_avg_sq"]) <= REL
    return got


def test_fp32_matches_torch_adamw(tmp_path):
    run_case(tmp_path, torch.float32)


def test_bf16_params_with_fp32_masters(tmp_path):
    run_case(tmp_path, torch.bfloat16)


def test_no_weight_decay_no_clipping_no_warmup(tmp_path):
    # max_norm huge: the clip coefficient clamps to 1 everywhere; warm-up 0: pure cosine.
    run_case(tmp_path, torch.float32, weight_decay=0.0, max_norm=1e9, ratio=0.0, expect_clipping=False)


def test_resume_through_state_file_is_exact(tmp_path):
    a = run_case(tmp_path, torch.bfloat16)
    (tmp_path / "r").mkdir()
    b = run_case(tmp_path / "r", torch.bfloat16, resume_at=5)
    for k in a:
        assert torch.equal(a[k], b[k]), k
