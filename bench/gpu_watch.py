#!/usr/bin/env python3
"""One line per GPU on how it ran during a benchmark: SM clock and power from nvidia-smi samples.

An H200 running the drafter step sits at its 700 W power limit with the SM clock ~17% below its
maximum (bench/RESULTS.md, 2026-12-04): the same code measures a few percent apart on two machines,
and a kernel timed alone runs at a clock the training step never sees. This summary puts the clock
and the power state next to every number of bench/gpu/speed.sh.

Input: the CSV of
    nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active
               --format=csv,noheader,nounits -lms 50
(bench/gpu/lib/common.sh gpu_watch_start). Busy samples are those drawing at least --busy of the power
limit (default 0.4); idle gaps between the benchmark's parts do not count. Lines that do not parse
([N/A] values, a truncated last line) are skipped and counted.

    python3 bench/gpu_watch.py CSV [--label NAME] [--busy 0.4]
"""
import argparse
import statistics
import sys

SW_POWER_CAP = 0x4          # clocks_throttle_reasons bits (nvidia-smi -q: "Clocks Event Reasons")
HW_SLOWDOWN = 0x8           # hardware slowdown (temperature or the power brake), counted as thermal
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80


def parse(lines):
    """{gpu index: [(sm MHz, max sm MHz, power W, limit W, reasons)]}, and the count of lines skipped."""
    per_gpu, skipped = {}, 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            skipped += 1
            continue
        try:
            idx = int(parts[0])
            row = (float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), int(parts[5], 16))
        except ValueError:
            skipped += 1
            continue
        per_gpu.setdefault(idx, []).append(row)
    return per_gpu, skipped


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rows, busy_fraction):
    """Dict of the busy samples' figures, or None when no sample was busy."""
    busy = [r for r in rows if r[3] > 0 and r[2] >= busy_fraction * r[3]]
    if not busy:
        return None
    clocks = [r[0] for r in busy]
    share = lambda bit: sum(1 for r in busy if r[4] & bit) / len(busy)
    return {
        "samples": len(rows), "busy": len(busy),
        "clock_median": statistics.median(clocks), "clock_p10": quantile(clocks, 0.1),
        "clock_p90": quantile(clocks, 0.9), "clock_max": max(r[1] for r in busy),
        "power_median": statistics.median(r[2] for r in busy), "power_limit": max(r[3] for r in busy),
        "power_capped": share(SW_POWER_CAP | HW_POWER_BRAKE),
        "thermal": share(SW_THERMAL | HW_THERMAL | HW_SLOWDOWN),
    }


def line(label, idx, s):
    if s is None:
        return f"GPU {idx} during {label}: no busy sample"
    return (f"GPU {idx} during {label}: SM clock median {s['clock_median']:.0f} MHz (p10-p90 {s['clock_p10']:.0f}-"
            f"{s['clock_p90']:.0f}) of {s['clock_max']:.0f} max ({s['clock_median'] / s['clock_max']:.0%}); power "
            f"median {s['power_median']:.0f} W of {s['power_limit']:.0f} W; power-capped in {s['power_capped']:.0%} "
            f"and thermally slowed in {s['thermal']:.0%} of {s['busy']} busy samples (of {s['samples']})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--label", default="the benchmark")
    ap.add_argument("--busy", type=float, default=0.4, help="busy: power draw >= this fraction of the limit")
    a = ap.parse_args(argv)
    try:
        with open(a.csv) as f:
            per_gpu, skipped = parse(f)
    except OSError as e:
        print(f"gpu_watch: {a.csv}: {e.strerror}", file=sys.stderr)
        return 1
    if not per_gpu:
        print(f"GPU during {a.label}: no samples in {a.csv} ({skipped} lines did not parse)")
        return 0
    for idx in sorted(per_gpu):
        print(line(a.label, idx, summarize(per_gpu[idx], a.busy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
