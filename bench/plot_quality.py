#!/usr/bin/env python3
"""Loss and tau curves of the quality benchmark's runs (bench/gpu/quality.sh) to one PNG; used when
tools/plot_metrics.py is not in the tree. Each argument is a metrics.jsonl; the label is its
file name. tau: every numeric field whose name contains "tau" (the training estimate, and the
evaluation's tau when the records carry one).

  python bench/plot_quality.py OUT/metrics_main.jsonl OUT/metrics_ablation.jsonl --out curves.png
"""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for path in a.metrics:
        label = os.path.basename(path).replace("metrics_", "").replace(".jsonl", "")
        recs = [json.loads(l) for l in open(path) if l.strip()]
        recs = [r for r in recs if isinstance(r.get("step"), int)]
        ax1.plot([r["step"] for r in recs if "loss" in r], [r["loss"] for r in recs if "loss" in r], label=label)
        keys = sorted({k for r in recs for k, v in r.items() if "tau" in k and isinstance(v, (int, float))})
        for k in keys:
            pts = [(r["step"], r[k]) for r in recs if isinstance(r.get(k), (int, float))]
            ax2.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, label=f"{label} {k}")
    ax1.set(xlabel="step", ylabel="loss", title="training loss")
    ax2.set(xlabel="step", ylabel="tau", title="acceptance length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot_quality: wrote {a.out}")


if __name__ == "__main__":
    main()
