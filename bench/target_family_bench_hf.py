"""transformers' forward of the qwen3_moe / qwen3_5 targets at real shapes with random bf16
weights, truncated to the layers the capture runs: the reference bench/target_family_bench.cpp
is measured against (same GPU, same run; bench/gpu/target_family.sh).

    python3 bench/target_family_bench_hf.py --config qwen3-30b-a3b|qwen3.5-9b [--shapes 8x2048]
            [--iters 5] [--json OUT] [--dflash-json FILE]

Qwen3MoeModel / Qwen3_5TextModel with num_hidden_layers = last capture id + 1 (46 / 30; it ends
with the final norm, negligible), SDPA attention, transformers' default expert and linear-attention
implementations (whatever kernels this environment has: the reference fallbacks print a line),
B sequences of S tokens. FLOPs per token: the C++ bench's count, read from --dflash-json (so the
two MFU columns share one definition); ratios are tokens/s against dflash capture.
"""
import argparse
import json
import time

import torch

CONFIGS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeModel", 46, dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3.5-9b": ("Qwen3_5TextConfig", "Qwen3_5TextModel", 30, dict(
        hidden_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=256, intermediate_size=12288,
        vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(30)],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})),
}


def median_time(fn, iters):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--shapes", default="8x2048")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--dflash-json", action="append", default=[],
                    help="the C++ bench's --json; repeatable as LABEL=FILE for variants (the first: FLOPs)")
    a = ap.parse_args()
    import transformers as tr
    cname, mname, layers, kw = CONFIGS[a.config]
    cfg = getattr(tr, cname)(num_hidden_layers=layers, **kw)
    cfg._attn_implementation = "sdpa"
    dev = torch.device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = getattr(tr, mname)(cfg).eval()
    torch.set_default_dtype(torch.float32)
    variants = []  # (label, {shape: row}) in the order given
    d = None
    for spec in a.dflash_json:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        try:
            dj = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"(dflash {label or 'capture'}: {path} unreadable: {e})", flush=True)
            continue
        d = d or dj
        variants.append((label, {r["shape"]: r for r in dj["rows"]}))
    dflash = variants[0][1] if variants else {}
    rows = []
    for shape in a.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (B, S), device=dev)
        with torch.inference_mode():
            s = median_time(lambda: model(input_ids=ids, use_cache=False), a.iters)
        r = dict(impl="transformers eager", shape=shape, ms=s * 1e3, tokens_per_s=B * S / s)
        if shape in dflash:  # the same FLOP count as the C++ bench
            flop_tok = dflash[shape]["tflops"] * 1e12 / dflash[shape]["tokens_per_s"]
            r["mfu"] = flop_tok * B * S / s / (d["matmul_tflops"] * 1e12)
        rows.append(r)
        print(f"transformers eager {a.config} {shape}: {B * S / s:,.0f} tokens/s", flush=True)
    if a.json:
        json.dump(dict(config=a.config, layers=layers, rows=rows), open(a.json, "w"))
    print(f"\n{a.config}, {layers} layers run{'' if not d else ', MFU against %.1f TFLOP/s' % d['matmul_tflops']}")
    print(f"{'implementation':<20} {'shape':<8} {'ms/fwd':>9} {'tokens/s':>10} {'MFU':>7} {'vs eager':>9}")
    for r in rows:
        e = r["tokens_per_s"]
        print(f"{r['impl']:<20} {r['shape']:<8} {r['ms']:>9.1f} {e:>10,.0f} {100 * r.get('mfu', float('nan')):>6.1f}% {1.0:>8.2f}x")
        for label, rows_v in variants:
            if r["shape"] in rows_v:
                x = rows_v[r["shape"]]
                name = "dflash capture" + (f" {label}" if label else "")
                print(f"{name:<20} {r['shape']:<8} {x['ms']:>9.1f} {x['tokens_per_s']:>10,.0f} "
                      f"{100 * x['mfu']:>6.1f}% {x['tokens_per_s'] / e:>8.2f}x")


if __name__ == "__main__":
    main()
