#!/usr/bin/env python3
"""The regeneration bar of issue 13 from the speed step of bench/gpu/quality.sh: dflash_rank
regenerate (static engine with CUDA graphs, the same eager, the cache engine) and transformers'
generate on the same prompts at the same batch size, in the same run.

  python bench/regen_speed.py OUT STATE
reads OUT/regen_dflash_{graphs,eager,cache}.json and OUT/regen_hf_subset.json (any may be
missing), the results of each dflash run in STATE/speed_<v>.jsonl.work/results.jsonl; writes
OUT/regen_speed.json and prints the ratios (the line "REGEN BAR: ...") and whether the outputs
agree: the graphed and the eager step must give identical tokens; the cache engine computes the
same greedy decoding with other kernels, so in bf16 a few items may differ where two logits tie
within rounding.
"""
import json
import os
import sys


def main(out: str, state: str) -> int:
    def load(name):
        p = os.path.join(out, name)
        return json.load(open(p)) if os.path.exists(p) else None

    def results(v):
        p = os.path.join(state, f"speed_{v}.jsonl.work", "results.jsonl")
        if not os.path.exists(p):
            return None
        return {r["key"]: r["tokens"] for r in map(json.loads, open(p))}

    def ratio(a, b):
        return a["tokens_per_s"] / b["tokens_per_s"] if a and b and b["tokens_per_s"] else None

    def differing(a, b):
        return None if a is None or b is None else sum(a.get(k) != t for k, t in b.items())

    d, e, c = (load(f"regen_dflash_{v}.json") for v in ("graphs", "eager", "cache"))
    h = load("regen_hf_subset.json")
    rg, re_, rc = results("graphs"), results("eager"), results("cache")
    r = {"dflash": d, "dflash_eager": e, "dflash_cache_engine": c, "transformers": h, "ratio": ratio(d, h),
         "ratio_eager": ratio(e, h), "ratio_cache_engine": ratio(c, h), "graphs_over_eager": ratio(d, e),
         "graphs_vs_eager_differing_items": differing(rg, re_), "static_vs_cache_differing_items": differing(rg, rc)}
    with open(os.path.join(out, "regen_speed.json"), "w") as f:
        json.dump(r, f, indent=1)
    tps = lambda x: f"{x['tokens_per_s']:.0f}" if x else "n/a"
    fx = lambda x: "n/a" if x is None else f"{x:.2f}x"
    print(f"regeneration tokens/s (batch {d['batch_size'] if d else '?'}, {d['items'] if d else '?'} prompts): "
          f"dflash {tps(d)} ({d['graphs'] if d else '?'} CUDA graphs, {d['host_reads'] if d else '?'} host reads in "
          f"{d['steps'] if d else '?'} steps, prefills {d.get('prefill_s', '?') if d else '?'} of {d['seconds'] if d else '?'} s), "
          f"eager {tps(e)}, cache engine {tps(c)}, transformers {tps(h)}")
    print(f"REGEN BAR: dflash / transformers = {fx(r['ratio'])} (bar: >= 5x); graphs on/off = "
          f"{fx(r['graphs_over_eager'])}; eager / transformers = {fx(r['ratio_eager'])}; cache engine / "
          f"transformers = {fx(r['ratio_cache_engine'])}")
    print(f"outputs: graphs vs eager differ on {r['graphs_vs_eager_differing_items']} items (must be 0); static vs "
          f"cache engine on {r['static_vs_cache_differing_items']}")
    if r["graphs_vs_eager_differing_items"]:
        print("WARNING: the graphed and the eager decode step disagree: the graphs are not the eager step")
    return 0  # the stage goes on (regeneration); the lines above are the verdict


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
