#!/usr/bin/env python3
"""The summary table of bench/gpu/quality.sh (markdown on stdout) from the JSON files it leaves
in OUT: regen_speed.json, regen_train_stats.json, prepare_info.json, metrics_{main,ablation}.jsonl,
eval_{main,ablation}.json (dflash_rank eval's report, docs/eval.md). Missing pieces show as "-".

  python bench/quality_summary.py OUT "drafter.num_layers=1"
"""
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def last_metrics(path):
    recs = []
    if os.path.exists(path):
        for line in open(path):
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    recs = [r for r in recs if isinstance(r.get("step"), int)]
    return recs[-1] if recs else None, recs


def train_seconds(recs):
    """Training wall seconds over every call of a run: elapsed_s restarts when a run resumes, so
    the run's time is the sum of each segment's last elapsed_s."""
    total, last = 0.0, None
    for r in recs:
        e = r.get("elapsed_s")
        if not isinstance(e, (int, float)):
            continue
        if last is not None and e < last:
            total += last
        last = e
    return None if last is None else total + last


def f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main():
    out, ablation = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ablation"
    lines = ["# Quality benchmark: SmolLM2-135M-Instruct (bench/gpu/quality.sh)", ""]
    sp = load(os.path.join(out, "regen_speed.json")) or {}
    d, h = sp.get("dflash") or {}, sp.get("transformers") or {}
    tr = load(os.path.join(out, "regen_train_stats.json")) or {}
    lines += ["## Regeneration", "",
              "| | prompts | new tokens | seconds | tokens/s | batch |", "|---|---|---|---|---|---|",
              f"| dflash_rank regenerate (subset) | {d.get('items', '-')} | {d.get('new_tokens', '-')} | {f(d.get('seconds'), '.1f')} | {f(d.get('tokens_per_s'), '.0f')} | {d.get('batch_size', '-')} |",
              f"| transformers generate (same subset) | {h.get('items', '-')} | {h.get('new_tokens', '-')} | {f(h.get('seconds'), '.1f')} | {f(h.get('tokens_per_s'), '.0f')} | {h.get('batch_size', '-')} |",
              f"| dflash_rank regenerate (all train prompts) | {tr.get('items', '-')} | {tr.get('new_tokens', '-')} | {f(tr.get('seconds'), '.1f')} | {f(tr.get('tokens_per_s'), '.0f')} | {tr.get('batch_size', '-')} |",
              "", f"dflash / transformers: **{f(sp.get('ratio'))}x** (bar: >= 5x)", ""]
    pi = load(os.path.join(out, "prepare_info.json")) or {}
    lines += [f"Training data: {pi.get('written', '-')} conversations, {pi.get('tokens', '-')} tokens, "
              f"{pi.get('supervised_tokens', '-')} supervised.", ""]
    lines += ["## Drafters (same data)", "",
              "| run | steps | train s | loss | tau (train est.) | drafter tok/s | eval tau | speedup | equal to greedy | histogram (accepted 0..15) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in [("main", "5 draft layers (configs/smollm2-135m.yaml)"), ("ablation", ablation)]:
        m, recs = last_metrics(os.path.join(out, f"metrics_{name}.jsonl"))
        e = load(os.path.join(out, f"eval_{name}.json")) or {}
        m = m or {}
        eq = e.get("equal_output_share")
        lines.append(f"| {label} | {m.get('step', '-')} | {f(train_seconds(recs), '.0f')} | {f(m.get('loss'), '.3f')} | "
                     f"{f(m.get('tau_est', m.get('tau')))} | {f(m.get('drafter_tok_s'), '.0f')} | **{f(e.get('tau'))}** | "
                     f"{f(e.get('speedup'))}x | {f(eq * 100 if eq is not None else None, '.0f')}% | {e.get('acceptance_histogram', '-')} |")
    em, ea = load(os.path.join(out, "eval_main.json")), load(os.path.join(out, "eval_ablation.json"))
    if em and ea:
        lines += ["", f"tau difference (main - ablation): **{em['tau'] - ea['tau']:+.2f}** (bar for main: tau >= 2.5 at block 16, greedy)"]
    ef = load(os.path.join(out, "eval_main_fixed.json"))
    if em and ef:
        same = sum(a.get("tokens") == b.get("tokens") and a.get("accepted") == b.get("accepted")
                   for a, b in zip(em.get("prompts", []), ef.get("prompts", [])))
        lines += ["", "## Engines (the main drafter's eval, the same prompts)", "",
                  "| engine | speculative s | tok/s | plain greedy s | tok/s | speedup | tau | prompts identical to the cache engine's |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, e, ident in [("cache (TargetCache, the default)", em, "-"),
                                ("fixed (DFLASH_EVAL_ENGINE=fixed, CUDA graphs)", ef, f"{same}/{len(ef.get('prompts', []))}")]:
            sp, bl = e.get("speculative") or {}, e.get("baseline") or {}
            lines.append(f"| {label} | {f(sp.get('wall_s'))} | {f(sp.get('tokens_per_s'), '.0f')} | {f(bl.get('wall_s'))} | "
                         f"{f(bl.get('tokens_per_s'), '.0f')} | {f(e.get('speedup'))}x | {f(e.get('tau'))} | {ident} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
