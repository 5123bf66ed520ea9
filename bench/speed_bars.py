#!/usr/bin/env python3
"""Issue 15's throughput bars, judged from one speed.sh run's own outputs: one line per bar,
"BAR met" or "BAR NOT MET", with the measured figure and the bar.

    python3 bench/speed_bars.py --drafter drafter_step_4x3072.txt drafter_step_1x40000.txt \
        --target target.json [--drafter-fused drafter_step_1x40000_fused_bwd.txt]

--drafter: drafter_bench output (its table rows "| S | B | attention / loss | fwd | bwd | opt | step |
draft pos/s | target tok/s | ..."); the kernel rows ("kernel fused") of the bar shapes are judged.
--target: target_bench forward --json output (rows with "shape" and "tokens_per_s").
--drafter-fused: drafter_bench output run with the fused backward (what drafter.attention_backward: auto, the
default, runs at 16384-token documents and more); one more line per drafter bar whose shape it holds, named so (no
line for a shape it lacks).
A bar whose measurement is missing (a shape not run, a failed row) reads "BAR ... not measured".
Always exits 0: the lines are a report, the benchmarks' own checks decide the area's status.
"""
import argparse
import json

# (what, row key, bar in target tokens/s)
DRAFTER_BARS = [("drafter step 4 x 3072, 512 anchors, kernel", (3072, 4, "kernel fused"), 25000.0),
                ("drafter step 1 x 40000, 2048 anchors, kernel", (40000, 1, "kernel fused"), 45000.0)]
TARGET_BARS = [("target capture forward 8 x 2048", "8x2048", 46000.0)]


def drafter_rows(paths):
    """{(S, B, "attention loss"): target tok/s} of the rows of drafter_bench tables (failed rows and
    unreadable files are left out). Also read by pipeline_check.py."""
    out = {}
    for p in paths:
        try:
            lines = open(p).read().splitlines()
        except OSError:
            continue
        for line in lines:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 9 or not cells[0].isdigit() or not cells[1].isdigit():
                continue
            try:
                out[(int(cells[0]), int(cells[1]), cells[2])] = float(cells[8])
            except ValueError:
                pass  # a "failed: ..." row
    return out


def target_rows(path):
    """{shape: tokens/s} of a target_bench forward --json file ({} if unreadable). Also read by
    pipeline_check.py."""
    try:
        return {r["shape"]: float(r["tokens_per_s"]) for r in json.load(open(path))["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def verdict(what, got, bar):
    if got is None:
        return f"BAR {what}: not measured (bar >= {bar:,.0f} tok/s)"
    state = "met" if got >= bar else "NOT MET"
    return f"BAR {what}: {got:,.0f} tok/s, {100.0 * got / bar:.1f}% of the bar >= {bar:,.0f}: {state}"


def report(drafter_paths, target_path, fused_paths=()):
    d = drafter_rows(drafter_paths)
    t = target_rows(target_path) if target_path else {}
    lines = [verdict(w, d.get(k), b) for w, k, b in DRAFTER_BARS]
    f = drafter_rows(fused_paths)
    lines += [verdict(w + ", fused backward (auto's choice there)", f[k], b) for w, k, b in DRAFTER_BARS if k in f]
    lines += [verdict(w, t.get(k), b) for w, k, b in TARGET_BARS]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", nargs="*", default=[])
    ap.add_argument("--target")
    ap.add_argument("--drafter-fused", nargs="*", default=[])
    a = ap.parse_args()
    for line in report(a.drafter, a.target, a.drafter_fused):
        print(line)


if __name__ == "__main__":
    main()
