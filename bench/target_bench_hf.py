"""transformers' Qwen3 forward truncated after the last captured layer: the reference that
bench/target_bench.cpp's capture forward is measured against (same GPU, same run).

    python3 bench/target_bench_hf.py [--shapes 8x2048,4x4096] [--compile-shapes 8x2048]
                                     [--iters 8] [--layers 34] [--no-compile] [--json OUT]
                                     [--dflash-json FILE]

Qwen3-8B shapes, random bf16 weights, Qwen3Model with num_hidden_layers = 34 (the last captured
id is 33; it ends with the final norm, which is negligible), SDPA attention, B sequences of S
tokens. Eager, then torch.compile (default mode, on --compile-shapes) with its first-call time. FLOPs per token as
in target_bench.cpp: 2 * layers * 192,937,984 + layers * 4 * 4096 * (S + 1) / 2; MFU against a
bf16 8192^3 matmul measured here. With --dflash-json (target_bench forward --json), prints one
combined table with dflash's rows and its ratio to eager and compiled transformers.
"""
import argparse
import json
import time

import torch


def median_time(fn, iters):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x2048,4x4096")
    ap.add_argument("--compile-shapes", default="8x2048")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dflash-json")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    from transformers import Qwen3Config, Qwen3Model
    dev = torch.device("cuda")
    n = 8192
    x, y = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    peak = 2 * n**3 / median_time(lambda: x @ y, args.iters)
    del x, y

    cfg = Qwen3Config(hidden_size=4096, num_hidden_layers=args.layers, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                      max_position_embeddings=40960, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = Qwen3Model(cfg).eval()
    torch.set_default_dtype(torch.float32)
    layer_weights = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288

    rows = []
    compile_shapes = [tuple(int(x) for x in s.split("x")) for s in args.compile_shapes.split(",")]
    variants = [("transformers eager", model, shapes)]
    if not args.no_compile:
        variants.append(("transformers compile", torch.compile(model), compile_shapes))
    for name, m, vshapes in variants:
        for B, S in vshapes:
            ids = torch.randint(0, cfg.vocab_size, (B, S), device=dev)
            with torch.inference_mode():
                t0 = time.perf_counter()
                m(input_ids=ids)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                s = median_time(lambda: m(input_ids=ids), args.iters)
            flop_tok = 2 * args.layers * layer_weights + args.layers * 4 * 4096 * (S + 1) / 2
            T = B * S
            rows.append(dict(impl=name, shape=f"{B}x{S}", ms=s * 1e3, tokens_per_s=T / s,
                             tflops=flop_tok * T / s / 1e12, mfu=flop_tok * T / s / peak,
                             first_call_ms=first * 1e3))
            print(f"{name:<22} {B}x{S}: {T / s:,.0f} tokens/s, MFU {100 * rows[-1]['mfu']:.1f}%, "
                  f"first call {first:.1f} s", flush=True)
        report(args, rows, peak)
    report(args, rows, peak)


def report(args, rows, peak):
    """Writes --json and prints the combined table (called after each variant, so that a run
    stopped during compilation still leaves the eager table)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(matmul_tflops=peak / 1e12, rows=rows), f)
    print(f"\nmatmul bf16 8192^3 here: {peak / 1e12:.1f} TFLOP/s")
    all_rows = [dict(r) for r in rows]
    d = None
    if args.dflash_json:
        d = json.load(open(args.dflash_json))
        print(f"matmul bf16 8192^3 in target_bench: {d['matmul_tflops']:.1f} TFLOP/s")
        all_rows += [dict(r, impl="dflash capture") for r in d["rows"]]
    # One MFU denominator for every row: the higher of the two matmul measurements.
    peak_all = max(peak, d["matmul_tflops"] * 1e12) if d else peak
    for r in all_rows:
        r["mfu"] = r["tflops"] * 1e12 / peak_all
    print(f"MFU below against {peak_all / 1e12:.1f} TFLOP/s")
    ref = {(r["impl"], r["shape"]): r["tokens_per_s"] for r in all_rows}
    print(f"{'implementation':<22} {'shape':<8} {'ms/fwd':>8} {'tokens/s':>10} {'MFU':>7} "
          f"{'first call s':>13} {'vs eager':>9} {'vs compile':>11}")
    for r in all_rows:
        e = ref.get(("transformers eager", r["shape"]))
        c = ref.get(("transformers compile", r["shape"]))
        print(f"{r['impl']:<22} {r['shape']:<8} {r['ms']:>8.1f} {r['tokens_per_s']:>10,.0f} "
              f"{100 * r['mfu']:>6.1f}% {r['first_call_ms'] / 1e3:>13.2f} "
              f"{(r['tokens_per_s'] / e) if e else float('nan'):>8.2f}x "
              f"{(r['tokens_per_s'] / c) if c else float('nan'):>10.2f}x", flush=True)

if __name__ == "__main__":
    main()
