#!/usr/bin/env python3
"""Training curves of one or several dflash runs from their metrics.jsonl, to one PNG (for users
without TensorBoard; `tensorboard --logdir runs/` shows the same numbers live).

  python tools/plot_metrics.py runs/demo [runs/other ...] --out curves.png

Each argument is a run directory (its metrics.jsonl is read) or a metrics file, optionally as
LABEL=PATH; without a label a run is named by its directory, or by the file's name when it is not
metrics.jsonl (metrics_main.jsonl -> main). Panels: loss, accuracy (and per block offset for a single run),
tau (tau_est, the training estimate of served tau; its plain block mean, which overstates it;
and, when the run evaluated during training, the served tau at the step each evaluation
measured, from the metrics records and the run's eval.jsonl), throughput (drafter and target tokens/s). The x axis is the optimizer step; a step logged twice (a resumed run)
keeps its last value.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional


def read_metrics(path: str) -> List[dict]:
    """The records of a metrics.jsonl, one per step (the last record of a step wins)."""
    by_step: Dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"plot_metrics: {path}:{n}: not JSON ({e.msg})")
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                by_step[rec["step"]] = {**by_step.get(rec["step"], {}), **rec}
    return [by_step[s] for s in sorted(by_step)]


def series(records: List[dict], key: str):
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def read_evals(path: str) -> Dict[int, float]:
    """step -> served tau of a run's eval.jsonl (the evaluations during training); {} if absent."""
    got: Dict[int, float] = {}
    if not os.path.isfile(path):
        return got
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: the metrics lines still carry the evaluations
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("tau"), (int, float)):
                got[rec["step"]] = rec["tau"]
    return got


def plot(runs: Dict[str, List[dict]], out: str, title: str = "",
         eval_runs: Optional[Dict[str, Dict[int, float]]] = None) -> None:
    eval_runs = eval_runs or {}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_loss, ax_acc), (ax_tau, ax_tps) = axes
    for name, recs in runs.items():
        ax_loss.plot(*series(recs, "loss"), label=name)
        ax_acc.plot(*series(recs, "accuracy"), label=f"{name}" if len(runs) > 1 else "all offsets", lw=2)
        if len(runs) == 1:
            n = max((len(r.get("accuracy_per_pos") or []) for r in recs), default=0)
            cmap = plt.get_cmap("viridis")
            for k in range(n):
                xs = [r["step"] for r in recs if len(r.get("accuracy_per_pos") or []) > k]
                ys = [r["accuracy_per_pos"][k] for r in recs if len(r.get("accuracy_per_pos") or []) > k]
                ax_acc.plot(xs, ys, lw=0.8, color=cmap(k / max(1, n - 1)), label=f"offset {k + 1}")
        # tau_est: the training estimate of served tau; tau_est_block_mean: the plain block mean
        # (overstates it, docs/training.md); tau: served tau of the evaluations during training.
        ax_tau.plot(*series(recs, "tau_est"), label=f"{name} tau_est (training estimate)")
        ax_tau.plot(*series(recs, "tau_est_block_mean"), ":", label=f"{name} block mean (overstates)")
        evals = {r["tau_step"]: r["tau"] for r in recs
                 if isinstance(r.get("tau"), (int, float)) and isinstance(r.get("tau_step"), int)}
        evals.update(eval_runs.get(name, {}))  # eval.jsonl also has the evaluations after the last line
        if evals:
            ax_tau.plot(sorted(evals), [evals[s] for s in sorted(evals)], "o-", label=f"{name} tau (served, eval)")
        ax_tps.plot(*series(recs, "drafter_tok_s"), label=f"{name} drafter")
        ax_tps.plot(*series(recs, "target_tok_s"), "--", label=f"{name} target")
    for ax, t, y in [(ax_loss, "loss", "nats"), (ax_acc, "accuracy", "top-1"),
                     (ax_tau, "tau (accepted drafts + 1)", "tokens / step"), (ax_tps, "throughput", "tokens/s")]:
        ax.set_title(t)
        ax.set_xlabel("step")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(ax.get_lines()) > 6 else 1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, out)


def run_name(path: str) -> str:
    """A run's label: its directory for a metrics.jsonl, else the file's name without the
    metrics_ prefix and the extension (bench/gpu/quality.sh copies runs as metrics_<run>.jsonl)."""
    base = os.path.basename(path)
    if base == "metrics.jsonl":
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    stem = base[: -len(".jsonl")] if base.endswith(".jsonl") else base
    return stem[len("metrics_"):] if stem.startswith("metrics_") and len(stem) > 8 else stem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    ap.add_argument("--out", default="metrics.png", help="PNG file to write (default metrics.png)")
    ap.add_argument("--title", default="", help="figure title")
    a = ap.parse_args(argv)
    runs: Dict[str, List[dict]] = {}
    evals: Dict[str, Dict[int, float]] = {}
    for r in a.runs:
        label = None
        if "=" in r and not os.path.exists(r):
            label, r = r.split("=", 1)
        path = os.path.join(r, "metrics.jsonl") if os.path.isdir(r) else r
        if not os.path.isfile(path):
            print(f"plot_metrics: error: {path} does not exist", file=sys.stderr)
            return 2
        name = label or run_name(path)
        while name in runs:
            name += "'"
        recs = read_metrics(path)
        if not recs:
            print(f"plot_metrics: error: {path} has no metrics records", file=sys.stderr)
            return 2
        runs[name] = recs
        evals[name] = read_evals(os.path.join(os.path.dirname(os.path.abspath(path)), "eval.jsonl"))
    plot(runs, a.out, a.title, evals)
    print(f"plot_metrics: {', '.join(f'{n} ({len(r)} steps)' for n, r in runs.items())} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
