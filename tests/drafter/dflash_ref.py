"""A reference of the DFlash drafter forward and loss, written from DFLASH.md §1-§2.4 with plain
torch operations: a dense boolean mask built by loops, explicit softmax attention, full logits,
no chunking. fp32 on the CPU. Independent of the C++ code (shares only the formulas).
"""
import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [B, L, H, d], pos [B, L]: Qwen3 rotate-half RoPE over all d dims."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = pos.to(torch.float64)[..., None] * inv
    emb = torch.cat([f, f], -1)[:, :, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def doc_of(docs, S, p):
    """(begin, end) of the document of row position p; docs = [0, b1, ..., bD] or None."""
    bounds = docs if docs else [0, S]
    for i in range(len(bounds) - 1):
        if bounds[i] <= p < bounds[i + 1]:
            return bounds[i], bounds[i + 1]
    raise ValueError(f"position {p} outside documents {bounds}")


def dense_mask(anchor, keep, doc_begin, S, bs):
    """DFLASH.md §2.3, element by element: [B, N*bs, S + N*bs] bool (True = visible)."""
    B, N = anchor.shape
    Q = N * bs
    M = torch.zeros(B, Q, S + Q, dtype=torch.bool)
    for b in range(B):
        for j in range(N):
            if not keep[b, j]:
                continue  # a dropped block sees nothing
            for k in range(bs):
                q = j * bs + k
                for c in range(S):
                    # context key: own document, strictly before the anchor
                    M[b, q, c] = doc_begin[b, j] <= c < anchor[b, j]
                for jj in range(N):
                    for kk in range(bs):
                        M[b, q, S + jj * bs + kk] = jj == j  # own block, bidirectional
    return M


def block_tensors(ids, loss_mask, docs, anchor, keep, bs, mask_id):
    """Block inputs, positions, labels and binary weights (§1.3, §2.4), per document."""
    B, S = ids.shape
    N = anchor.shape[1]
    inp = torch.full((B, N * bs), mask_id, dtype=torch.long)
    pos = torch.zeros(B, N * bs, dtype=torch.long)
    lab = torch.zeros(B, N * bs, dtype=torch.long)
    w = torch.zeros(B, N * bs)
    off = torch.zeros(B, N * bs, dtype=torch.long)
    dbeg = torch.zeros(B, N, dtype=torch.long)
    ctx_pos = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        bounds = docs[b] if docs and docs[b] else [0, S]
        for t in range(S):
            start = max(x for x in bounds if x <= t) if t < bounds[-1] else bounds[-1]
            ctx_pos[b, t] = t - start
        for j in range(N):
            a = int(anchor[b, j])
            beg, end = doc_of(bounds, S, a) if keep[b, j] else (0, 0)
            dbeg[b, j] = beg
            for k in range(bs):
                q = j * bs + k
                off[b, q] = k
                pos[b, q] = a + k - beg
                if keep[b, j] and k == 0:
                    inp[b, q] = ids[b, a]
                if keep[b, j] and k > 0 and a + k < end and loss_mask[b, a + k]:
                    w[b, q] = 1.0
                    lab[b, q] = ids[b, a + k]
    return inp, pos, ctx_pos, lab, w, off, dbeg


def gamma_for(bs, gamma=0.0):
    if gamma > 0:
        return gamma
    return {16: 7.0, 10: 5.0, 8: 4.0}[bs]


def forward(cfg, P, embed, lm_head, ids, loss_mask, feats, docs, anchor, keep, inclusive_anchor=False):
    """Returns (loss, logits [B, Q, V], weights [B, Q], labels [B, Q], mask)."""
    bs, eps, theta = cfg["block_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    Hq, Hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B, S = ids.shape
    N = anchor.shape[1]
    Q = N * bs
    inp, pos, ctx_pos, lab, w, off, dbeg = block_tensors(ids, loss_mask, docs, anchor, keep, bs,
                                                         cfg["mask_token_id"])
    end = anchor + 1 if inclusive_anchor else anchor  # the negative control of the tests
    M = dense_mask(end, keep, dbeg, S, bs)

    C = rms(feats @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    x = embed[inp]
    kv_pos = torch.cat([ctx_pos, pos], 1)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        h = rms(x, p("input_layernorm.weight"), eps)
        q = (h @ p("self_attn.q_proj.weight").T).view(B, Q, Hq, d)
        q = rope(rms(q, p("self_attn.q_norm.weight"), eps), pos, theta)
        kin = torch.cat([C, h], 1)  # context first, then the block tokens
        k = (kin @ p("self_attn.k_proj.weight").T).view(B, S + Q, Hkv, d)
        k = rope(rms(k, p("self_attn.k_norm.weight"), eps), kv_pos, theta)
        v = (kin @ p("self_attn.v_proj.weight").T).view(B, S + Q, Hkv, d)
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
        sc = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        vis = M[:, None]
        sc = sc.masked_fill(~vis, float("-inf"))
        sc = torch.where(vis.any(-1, keepdim=True), sc, torch.zeros_like(sc))
        a = torch.softmax(sc, -1) * vis  # a row that sees nothing: all zeros
        o = torch.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, Q, Hq * d)
        x = x + o @ p("self_attn.o_proj.weight").T
        h2 = rms(x, p("post_attention_layernorm.weight"), eps)
        g = h2 @ p("mlp.gate_proj.weight").T
        u = h2 @ p("mlp.up_proj.weight").T
        x = x + (F.silu(g) * u) @ p("mlp.down_proj.weight").T
    hf = rms(x, P["norm.weight"], eps)
    logits = hf @ lm_head.T
    gam = gamma_for(bs, cfg.get("gamma", 0.0))
    dk = torch.exp(-(off.to(torch.float64) - 1) / gam).to(torch.float32)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").view(B, Q)
    wd = w * dk
    loss = (ce * wd).sum() / (wd.sum() + 1e-6)
    return loss, logits, w, lab, M


def metrics(logits, w, lab, bs):
    """Per-position accuracy sums and τ as defined in trainer/model/loss.h."""
    B, Q, _ = logits.shape
    N = Q // bs
    valid = (w > 0).view(B, N, bs)
    hit = ((logits.argmax(-1) == lab).view(B, N, bs)) & valid
    correct = hit.sum((0, 1)).double()
    count = valid.sum((0, 1)).double()
    tau_sum, tau_inv_sum, tau_blocks = 0.0, 0.0, 0
    for b in range(B):
        for j in range(N):
            if not valid[b, j, 1]:
                continue
            acc = 0
            for k in range(1, bs):
                if not hit[b, j, k]:
                    break
                acc += 1
            tau_sum += 1 + acc
            tau_inv_sum += 1.0 / (1 + acc)
            tau_blocks += 1
    return correct, count, tau_sum, tau_inv_sum, tau_blocks
