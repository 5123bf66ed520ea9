"""The C++ drafter (drafter_tool) against the Python reference dflash_ref.py, on the CPU in fp32.

Tolerances: both sides compute in fp32 but in different orders (SDPA vs einsum softmax, chunked
log-sum-exp and gradients computed in the forward vs autograd through full logits), which gives
relative differences around 1e-6 here; the loss must agree within 1e-5 relative and every
parameter gradient within 1e-4 (relative, in the Frobenius norm of the gradient tensor). A formula
error (mask off by one, a shifted label, a missing decay) moves these by 1e-2 or more; the
negative-control test checks that the comparison indeed detects the non-strict anchor rule.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash_ref as ref

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
TOOL = BUILD / "tests" / "drafter" / "drafter_tool"

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def tiny_cfg(bs=16, layers=2):
    return {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": bs,
        "target_layer_ids": [1, 3, 5], "num_target_layers": 8, "mask_token_id": 63,
    }


def param_shapes(c):
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qd, kvd, K = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, len(c["target_layer_ids"])
    s = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        s.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (qd, H), p + "self_attn.k_proj.weight": (kvd, H),
                  p + "self_attn.v_proj.weight": (kvd, H), p + "self_attn.o_proj.weight": (H, qd),
                  p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                  p + "mlp.down_proj.weight": (H, I)})
    return s


def make_params(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = {}
    for n, shp in param_shapes(c).items():
        if len(shp) == 1:  # norms near 1, not exactly 1, so their gradients matter
            P[n] = 1 + 0.1 * torch.randn(shp, generator=g)
        else:  # larger than the 0.02 init so that attention is far from uniform
            P[n] = torch.randn(shp, generator=g) * (0.6 / shp[1] ** 0.5)
    V, H = c["vocab_size"], c["hidden_size"]
    embed = torch.randn(V, H, generator=g)
    lm_head = torch.randn(V, H, generator=g) * 0.5
    return P, embed, lm_head


def make_batch(c, B, S, seed=1, mask_from=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c["vocab_size"] - 1, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    mask[:, mask_from:] = 1
    feats = torch.randn(B, S, len(c["target_layer_ids"]) * c["hidden_size"], generator=g)
    return ids, mask, feats


def run_tool(tmp_path, c, P, embed, lm_head, ids, mask, feats, anchor=None, keep=None, docs=None,
             extra_meta=None, name="case"):
    t = dict(P)
    t.update({"target.embed": embed, "target.lm_head": lm_head, "batch.ids": ids,
              "batch.loss_mask": mask, "batch.features": feats})
    if anchor is not None:
        t["blocks.anchor"] = anchor
        t["blocks.keep"] = keep
    if docs is not None:
        D = max(len(d) for d in docs)
        t["batch.doc_bounds"] = torch.tensor([d + [-1] * (D - len(d)) for d in docs], dtype=torch.long)
    meta = {k: (",".join(map(str, v)) if isinstance(v, list) else str(v)) for k, v in c.items()}
    meta.update(extra_meta or {})
    inp, out = tmp_path / f"{name}_in.safetensors", tmp_path / f"{name}_out.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, inp, metadata=meta)
    r = subprocess.run([str(TOOL), "case", str(inp), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return load_file(out)


def reference(c, P, embed, lm_head, ids, mask, feats, anchor, keep, docs=None, **kw):
    Pg = {k: v.clone().requires_grad_(True) for k, v in P.items()}
    loss, logits, w, lab, M = ref.forward(c, Pg, embed, lm_head, ids, mask, feats, docs, anchor, keep, **kw)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in Pg.items()}, logits.detach(), w, lab, M


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_reference(tmp_path, c, B, S, anchor, keep, docs=None, mask=None, meta=None, seed=0):
    P, embed, lm_head = make_params(c, seed)
    ids, m, feats = make_batch(c, B, S, seed + 1)
    if mask is not None:
        m = mask
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, anchor, keep, docs, meta)
    loss, grads, logits, w, lab, M = reference(c, P, embed, lm_head, ids, m, feats, anchor, keep, docs)
    assert torch.equal(out["mask"], M), "dense mask differs from DFLASH.md §2.3"
    assert abs(out["loss"].item() - loss.item()) <= LOSS_RTOL * max(abs(loss.item()), 1e-12), \
        (out["loss"].item(), loss.item())
    for n, g in grads.items():
        if g.norm() == 0:
            assert out["grad." + n].abs().max() == 0, n
        else:
            assert rel(out["grad." + n], g) <= GRAD_RTOL, (n, rel(out["grad." + n], g))
    correct, count, tau_sum, tau_inv_sum, tau_blocks = ref.metrics(logits, w, lab, c["block_size"])
    assert torch.equal(out["count_per_pos"], count)
    assert torch.equal(out["correct_per_pos"], correct)
    assert out["tau_blocks"].item() == tau_blocks
    assert out["tau_sum"].item() == pytest.approx(tau_sum)
    assert out["tau_inv_sum"].item() == pytest.approx(tau_inv_sum)
    return out, loss


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("mode", ["fused", "recompute", "plain"])
def test_overlapping_blocks_bs16_one_row(tmp_path, mode):
    c = tiny_cfg(16)
    anchor = T([[3, 4, 5, 11, 20]])  # adjacent anchors: overlapping blocks
    keep = torch.ones_like(anchor, dtype=torch.bool)
    out, loss = check_against_reference(tmp_path, c, 1, 40, anchor, keep, meta={"loss_mode": mode})
    assert loss.item() > 0


def test_blocks_touching_the_end_three_rows_bs10(tmp_path):
    c = tiny_cfg(10)
    S = 30
    anchor = T([[5, 22, 27, 28], [3, 19, 20, 0], [4, 9, 26, 0]])
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    check_against_reference(tmp_path, c, 3, S, anchor, keep)


def test_row_without_valid_anchor_three_rows(tmp_path):
    c = tiny_cfg(16)
    B, S = 3, 36
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :4] = 0
    mask[1] = 0  # no response token: no anchor, all blocks dropped
    anchor = T([[4, 10, 30], [0, 0, 0], [6, 7, 33]])
    keep = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    check_against_reference(tmp_path, c, B, S, anchor, keep, mask=mask)


def test_batch_without_any_anchor_gives_zero_loss(tmp_path):
    c = tiny_cfg(16)
    anchor = T([[0, 0]])
    keep = torch.zeros(1, 2, dtype=torch.bool)
    P, embed, lm_head = make_params(c)
    ids, m, feats = make_batch(c, 1, 24)
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, anchor, keep)
    assert out["loss"].item() == 0.0
    assert all(out[k].abs().max() == 0 for k in out if k.startswith("grad."))
    assert not any(torch.isnan(v).any() for v in out.values() if v.is_floating_point())


@pytest.mark.parametrize("bs", [16, 10])
def test_random_anchor_sets(tmp_path, bs):
    c = tiny_cfg(bs)
    g = torch.Generator().manual_seed(bs)
    B, S, N = 2, 48, 6
    anchor = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values
    keep = torch.rand(B, N, generator=g) > 0.2
    check_against_reference(tmp_path, c, B, S, anchor, keep, seed=bs)


def test_packed_row_of_three_documents(tmp_path):
    """One row packing three documents equals the three documents as separate rows (and both
    equal the reference): context, positions and labels stop at each document's boundary."""
    c = tiny_cfg(10)
    lens = [17, 23, 14]
    S = sum(lens) + 3  # 3 padding tokens after the last document
    P, embed, lm_head = make_params(c, 5)
    ids, _, feats = make_batch(c, 1, S, 6)
    m = torch.zeros(1, S, dtype=torch.long)
    starts = [0, 17, 40]
    for s0, n in zip(starts, lens):
        m[0, s0 + 2: s0 + n] = 1
    docs = [[0, 17, 40, 54]]
    anchor = T([[2, 9, 15, 17 + 3, 17 + 4, 17 + 20, 40 + 5, 40 + 12]])  # 15 and 37, 52: near doc ends
    keep = torch.ones_like(anchor, dtype=torch.bool)
    packed, loss = check_against_reference(tmp_path, c, 1, S, anchor, keep, docs=docs, seed=5)

    # The same documents as three rows (right-padded with id 0, mask 0), the same anchors.
    Smax = max(lens)
    ids3 = torch.zeros(3, Smax, dtype=torch.long)
    m3 = torch.zeros(3, Smax, dtype=torch.long)
    f3 = torch.zeros(3, Smax, feats.shape[-1])
    for r, (s0, n) in enumerate(zip(starts, lens)):
        ids3[r, :n], m3[r, :n], f3[r, :n] = ids[0, s0:s0 + n], m[0, s0:s0 + n], feats[0, s0:s0 + n]
    a3 = T([[2, 9, 15], [3, 4, 20], [5, 12, 0]])
    k3 = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    sep = run_tool(tmp_path, c, P, embed, lm_head, ids3, m3, f3, a3, k3, name="sep")
    assert abs(sep["loss"].item() - packed["loss"].item()) <= LOSS_RTOL * abs(packed["loss"].item())
    for n in P:
        assert rel(sep["grad." + n], packed["grad." + n]) <= GRAD_RTOL, n
    assert torch.equal(sep["count_per_pos"], packed["count_per_pos"])
    assert torch.equal(sep["correct_per_pos"], packed["correct_per_pos"])


def test_negative_control_inclusive_anchor_is_detected(tmp_path):
    """The old `context <= anchor` rule (DFLASH.md §2.3 history) must fail the comparison."""
    c = tiny_cfg(16)
    anchor = T([[3, 8, 14, 21]])
    keep = torch.ones_like(anchor, dtype=torch.bool)
    P, embed, lm_head = make_params(c)
    ids, m, feats = make_batch(c, 1, 40)
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, anchor, keep)
    loss_incl, *_ = reference(c, P, embed, lm_head, ids, m, feats, anchor, keep, inclusive_anchor=True)
    assert abs(out["loss"].item() - loss_incl.item()) > 100 * LOSS_RTOL * abs(loss_incl.item())


@pytest.mark.parametrize("seed", range(4))
def test_mask_matches_spec_elementwise(tmp_path, seed):
    """Random small cases: docs, anchors, dropped blocks; the C++ dense mask equals §2.3."""
    g = torch.Generator().manual_seed(100 + seed)
    c = tiny_cfg(8 if seed % 2 else 10, layers=1)
    c["gamma"] = 4.0
    B, S, N = 2, 26, 5
    docs = [[0, 9, 26], [0, 26]] if seed % 2 else None
    anchor = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values
    keep = torch.rand(B, N, generator=g) > 0.3
    P, embed, lm_head = make_params(c, seed)
    ids, m, feats = make_batch(c, B, S, seed)
    meta = {"gamma": "4.0"}
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, anchor, keep, docs, meta)
    dbeg = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for j in range(N):
            if keep[b, j]:
                dbeg[b, j] = ref.doc_of(docs[b] if docs else None, S, int(anchor[b, j]))[0]
    M = ref.dense_mask(anchor, keep, dbeg, S, c["block_size"])
    assert torch.equal(out["mask"], M)
    # the strict rule: no block sees its anchor's own context key, and sees the key before it
    for b in range(B):
        for j in range(N):
            a = int(anchor[b, j])
            rows = slice(j * c["block_size"], (j + 1) * c["block_size"])
            assert not out["mask"][b, rows, a].any()
            if keep[b, j] and a > dbeg[b, j]:
                assert out["mask"][b, rows, a - 1].all()


def test_sampled_anchors_follow_the_rule_and_are_reproducible(tmp_path):
    c = tiny_cfg(16, layers=1)
    B, S = 3, 64
    P, embed, lm_head = make_params(c)
    ids, _, feats = make_batch(c, B, S)
    g = torch.Generator().manual_seed(7)
    m = (torch.rand(B, S, generator=g) > 0.3).long()
    m[2] = 0
    m[2, 10] = 1  # a single response token: no valid anchor in row 2
    docs = [[0, 30, 64], [0, 64], [0, 64]]
    meta = {"num_anchors": "6", "seed": "1234", "batch_index": "17"}
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, docs=docs, extra_meta=meta, name="a")
    again = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, docs=docs, extra_meta=meta, name="b")
    assert torch.equal(out["blocks.anchor"], again["blocks.anchor"])
    other = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, docs=docs,
                     extra_meta=dict(meta, batch_index="18"), name="c")
    assert not torch.equal(out["blocks.anchor"], other["blocks.anchor"])
    anchor, keep = out["blocks.anchor"], out["blocks.keep"]
    for b in range(B):
        bounds = docs[b]
        got = anchor[b][keep[b]].tolist()
        assert got == sorted(got)
        expect_n = 0
        for s0, e0 in zip(bounds[:-1], bounds[1:]):
            valid = [p for p in range(s0, e0 - 1) if m[b, p] and m[b, p + 1]]
            mine = [p for p in got if s0 <= p < e0]
            assert set(mine) <= set(valid)
            assert len(mine) == len(set(mine)) == min(6, len(valid))
            expect_n += min(6, len(valid))
        assert len(got) == expect_n
        assert keep[b, :expect_n].all() and not keep[b, expect_n:].any()  # kept first, padding after
    # the loss of the sampled blocks matches the reference too
    loss, *_ = reference(c, P, embed, lm_head, ids, m, feats, anchor, keep, docs)
    assert abs(out["loss"].item() - loss.item()) <= LOSS_RTOL * abs(loss.item())


def test_accuracy_and_tau_with_partly_right_predictions(tmp_path):
    """Labels from two tokens and an LM head that mostly picks one of them: about half the
    argmaxes are right, so per-position accuracy and τ are exercised with non-trivial runs."""
    c = tiny_cfg(10)
    P, embed, lm_head = make_params(c, 3)
    lm_head = lm_head * 0.01
    lm_head[5] *= 300
    lm_head[6] *= 300
    g = torch.Generator().manual_seed(9)
    B, S = 2, 40
    ids = 5 + torch.randint(0, 2, (B, S), generator=g)
    _, m, feats = make_batch(c, B, S, 4)
    anchor = T([[3, 6, 12, 20, 25, 31], [4, 5, 17, 22, 29, 38]])
    keep = torch.ones_like(anchor, dtype=torch.bool)
    out = run_tool(tmp_path, c, P, embed, lm_head, ids, m, feats, anchor, keep)
    loss, grads, logits, w, lab, M = reference(c, P, embed, lm_head, ids, m, feats, anchor, keep)
    correct, count, tau_sum, tau_inv_sum, tau_blocks = ref.metrics(logits, w, lab, c["block_size"])
    assert 0.2 < correct.sum() / count.sum() < 0.8  # the case is informative
    assert torch.equal(out["correct_per_pos"], correct)
    assert torch.equal(out["count_per_pos"], count)
    assert out["tau_blocks"].item() == tau_blocks
    assert out["tau_sum"].item() == pytest.approx(tau_sum)
    assert out["tau_inv_sum"].item() == pytest.approx(tau_inv_sum)
    assert tau_sum / tau_blocks > 1.2
    assert abs(out["loss"].item() - loss.item()) <= LOSS_RTOL * abs(loss.item())
