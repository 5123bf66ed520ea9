"""FlexAttention baseline for bench/attention_bench.cpp (same masks, same FLOP count).

Reads DIR/spec_<shape>.txt written by `attention_bench --out DIR` (first line B Hq Hkv N bs C d,
then ctx_begin and ctx_end of the B*N blocks, sorted by anchor), times torch.compile'd
flex_attention forward and forward+backward with CUDA events (median), appends the rows to the
kernel's DIR/kernel_results.tsv rows and prints one combined table with the ratios the issue's
bar uses (kernel vs FlexAttention, kernel vs SDPA+mask).

Usage: python3 attention_bench_flex.py DIR [--iters N]
"""
import os
import statistics
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def read_spec(path):
    with open(path) as f:
        head = [int(x) for x in f.readline().split()]
        cb = [int(x) for x in f.readline().split()]
        ce = [int(x) for x in f.readline().split()]
    B, Hq, Hkv, N, bs, C, d = head
    return dict(B=B, Hq=Hq, Hkv=Hkv, N=N, bs=bs, C=C, d=d,
                cb=torch.tensor(cb).view(B, N), ce=torch.tensor(ce).view(B, N))


def time_ms(fn, iters):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def run_shape(name, s, iters):
    dev = "cuda"
    B, Hq, Hkv, N, bs, C, d = (s[k] for k in ("B", "Hq", "Hkv", "N", "bs", "C", "d"))
    QL, KL = N * bs, C + N * bs
    cb, ce = s["cb"].to(dev), s["ce"].to(dev)
    pairs = float(((ce - cb) + bs).sum().item()) * bs * Hq
    fwd_flop = 4.0 * d * pairs
    fb_flop = 3.5 * fwd_flop

    # per-query-row tables padded to a multiple of 128 (flex evaluates padded tiles too)
    QP = (QL + 127) // 128 * 128
    rcb = torch.zeros(B, QP, dtype=torch.long, device=dev)
    rce = torch.zeros(B, QP, dtype=torch.long, device=dev)
    rblk = torch.full((B, QP), -1, dtype=torch.long, device=dev)
    rcb[:, :QL] = cb.repeat_interleave(bs, dim=1)
    rce[:, :QL] = ce.repeat_interleave(bs, dim=1)
    rblk[:, :QL] = torch.arange(N, device=dev).repeat_interleave(bs).unsqueeze(0)

    def mask_mod(b, h, q, kv):
        ctx = (kv >= rcb[b, q]) & (kv < rce[b, q])
        own = (kv >= C) & ((kv - C) // bs == rblk[b, q])
        return ctx | own

    bm = create_block_mask(mask_mod, B, None, QL, KL, device=dev)
    flex = torch.compile(flex_attention, dynamic=False)
    torch.manual_seed(0)
    q = torch.randn(B, Hq, QL, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, KL, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, KL, d, device=dev, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    gqa = Hq != Hkv
    f_ms = time_ms(lambda: flex(q, k, v, block_mask=bm, enable_gqa=gqa), iters)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def fb():
        qg.grad = kg.grad = vg.grad = None
        flex(qg, kg, vg, block_mask=bm, enable_gqa=gqa).backward(dout)

    fb_ms = time_ms(fb, iters)
    return (name, "flex(compiled)", f_ms, fb_ms, fwd_flop / f_ms * 1e-9, fb_flop / fb_ms * 1e-9)


def main():
    out = sys.argv[1]
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 10
    rows = []
    kpath = os.path.join(out, "kernel_results.tsv")
    if os.path.exists(kpath):
        with open(kpath) as f:
            for line in f:
                p = line.rstrip("\n").split("\t")
                rows.append((p[0], p[1], *map(float, p[2:])))
    for name in ("train", "long"):
        sp = os.path.join(out, f"spec_{name}.txt")
        if not os.path.exists(sp):
            continue
        try:
            r = run_shape(name, read_spec(sp), iters)
            rows.append(r)
            print(f"[{name}] flex: fwd {r[2]:.2f} ms, fwd+bwd {r[3]:.2f} ms", flush=True)
        except Exception as e:  # report, keep the other rows
            print(f"[{name}] flex failed: {type(e).__name__}: {e}", flush=True)
    print("\n| shape | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.0f} | {r[5]:.0f} |")
    print()
    by = {(r[0], r[1]): r for r in rows}
    for name in ("train", "long"):
        kr = by.get((name, "kernel"))
        if not kr:
            continue
        for other in ("flex(compiled)", "sdpa+mask"):
            o = by.get((name, other))
            if o:
                print(f"{name}: kernel speed-up over {other}: fwd {o[2] / kr[2]:.2f}x, "
                      f"fwd+bwd {o[3] / kr[3]:.2f}x")
    tmp = os.path.join(out, "all_results.tsv.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write("\t".join(str(x) for x in r) + "\n")
    os.replace(tmp, os.path.join(out, "all_results.tsv"))


if __name__ == "__main__":
    main()
