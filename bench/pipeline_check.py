"""Checks a training run's speed claims (issue 15) against its own parts and against timings taken
outside the run. Used by bench/gpu/speed.sh; runs anywhere (CPU runs give CPU numbers).

  python3 bench/pipeline_check.py --log RUN.log --metrics metrics.jsonl --launch T0
        [--target-bench dflash_forward.json --target-shape 4x3072]
        [--drafter-bench drafter_bench.txt --drafter-case "3072 4 kernel fused"] [--skip-steps 10]

RUN.log: the run's console, each line prefixed by the epoch time it was read at (this script's
caller timestamps it, so those times are independent of the run's clocks); T0: the epoch time
of the launch. Prints one line per check (PASS/FAIL/INFO) and exits 1 if a Done-when check fails:
  - pipeline efficiency: measured tok/s >= 95% of the bound from the same run's parts
    (colocated: 1 / (1/target + 1/drafter); T + D: min(T*target, D*drafter), per-rank rates
    tokens / busy seconds from metrics.jsonl);
  - the console's tok/s agrees (3%) with tokens / the time between this script's timestamps of
    the first and last step lines counted; the waits: each side's busy + wait = wall (5%; the
    target's 10%), and the waiting side is the faster one;
  - first step: first_step_s <= 3 s, and the console's launch -> first step within 1.5 s of this
    script's own timing of that line (the difference is mpirun and the loader before the process
    starts counting).
The independent benchmarks' bound (target_bench, drafter_bench of the same shapes) is printed
beside it (INFO): the gap between the two is what the run loses against its parts run alone.
"""
import argparse
import json
import re
import sys

from speed_bars import drafter_rows, target_rows  # the benchmark tables, read once (bench/speed_bars.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--launch", type=float, required=True)
    ap.add_argument("--target-bench")
    ap.add_argument("--target-shape", default="4x3072")
    ap.add_argument("--drafter-bench")
    ap.add_argument("--drafter-case", default="3072 4 kernel fused")
    ap.add_argument("--skip-steps", type=int, default=10, help="steps left out as warm-up")
    a = ap.parse_args()
    recs = [json.loads(l) for l in open(a.metrics) if l.strip()]
    recs = [r for r in recs if "interval_s" in r]
    lines = []
    for l in open(a.log, errors="replace"):
        t, _, rest = l.partition(" ")
        try:
            lines.append((float(t), rest.rstrip("\n")))
        except ValueError:
            pass
    fails = []

    def check(ok, what):
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            fails.append(what)

    colocated = any("(colocated)" in l for _, l in lines)
    m = [re.search(r"layout\s+(\d+) target \+ (\d+) drafter", l) for _, l in lines]
    m = next((x for x in m if x), None)
    T, D = (1, 1) if colocated or not m else (int(m.group(1)), int(m.group(2)))
    prev = {r["step"]: p for p, r in zip([None] + recs[:-1], recs)}
    steady = [r for r in recs if prev[r["step"]] is not None and prev[r["step"]]["step"] >= a.skip_steps]
    if not steady:
        print("FAIL no metrics records after the warm-up steps")
        return 1
    tok = t_busy = d_busy = wall = t_wait = d_wait = 0.0
    for r in steady:
        p = prev[r["step"]]
        nb, ns = r["batch"] - p["batch"], r["step"] - p["step"]
        n = r["drafter_tok_s"] * r["interval_s"]
        tok += n
        wall += r["interval_s"]
        t_busy += r["target_busy_s"] * nb
        t_wait += r["target_wait_s"] * nb
        d_busy += r["drafter_busy_s"] * ns * D
        d_wait += r["drafter_wait_s"] * ns * D
    s, d = tok / t_busy, tok / d_busy  # per-rank rates (a batch is one target rank's work)
    measured = tok / wall
    bound = 1 / (1 / s + 1 / d) if colocated else min(T * s, D * d)
    mode = "colocated" if colocated else f"{T} + {D}"
    print(f"INFO {mode}: steps {steady[0]['step'] - (steady[0]['step'] - prev[steady[0]['step']]['step'])}.."
          f"{steady[-1]['step']}: {tok:.0f} tokens in {wall:.2f} s; per rank: target {s:.0f} tok/s, drafter {d:.0f} tok/s")
    check(measured >= 0.95 * bound, f"pipeline {measured:.0f} tok/s = {100 * measured / bound:.1f}% of its parts' bound "
                                    f"{bound:.0f} ({'1/(1/target+1/drafter)' if colocated else 'min(T*target, D*drafter)'}; >= 95%)")
    if a.target_bench and a.drafter_bench:
        sb = target_rows(a.target_bench)[a.target_shape]
        S, B, att, loss = a.drafter_case.split()
        db = drafter_rows([a.drafter_bench])[(int(S), int(B), f"{att} {loss}")]  # the full step's target tok/s
        bb = 1 / (1 / sb + 1 / db) if colocated else min(T * sb, D * db)
        print(f"INFO independent benches: target {sb:.0f} tok/s ({a.target_shape}), drafter step {db:.0f} tok/s "
              f"({a.drafter_case}); bound {bb:.0f}: the run reaches {100 * measured / bb:.1f}%; its own parts vs the "
              f"benches: target {100 * s / sb:.1f}%, drafter {100 * d / db:.1f}%")
    # the console's tok/s against this script's timestamps of the step lines
    ts = {}
    for t, l in lines:
        x = re.search(r"\] step (\d+)/\d+ \(", l)
        if x and "| loss " in l:
            ts[int(x.group(1))] = t
    first_step = prev[steady[0]["step"]]["step"]
    if first_step in ts and steady[-1]["step"] in ts:
        indep = tok / (ts[steady[-1]["step"]] - ts[first_step])
        check(abs(indep - measured) / indep < 0.03, f"console tok/s {measured:.0f} vs {indep:.0f} from this script's "
                                                   f"clock of the step lines (3%)")
    if colocated:
        check(abs(t_busy + d_busy + d_wait - wall) / wall < 0.05,
              f"colocated target {t_busy:.2f} s + drafter {d_busy:.2f} s + wait {d_wait:.2f} s vs wall {wall:.2f} s (5%)")
    else:
        check(abs(d_busy + d_wait - wall * D) / (wall * D) < 0.05,
              f"drafter busy {d_busy / D:.2f} s + wait {d_wait / D:.2f} s per rank vs wall {wall:.2f} s (5%)")
        # the target's stats travel with its batches, sent ~prefetch batches before they are
        # trained, and its sends complete in bursts: 10% over the window
        check(abs(t_busy + t_wait - wall * T) / (wall * T) < 0.10,
              f"target busy {t_busy / T:.2f} s + wait {t_wait / T:.2f} s per rank vs wall {wall:.2f} s (10%)")
        slow = "drafter" if D * d < T * s else "target"
        waiting = "target" if t_wait / T > d_wait / D else "drafter"
        check(slow != waiting, f"the {slow} side is the bottleneck and the {waiting} side waits "
                               f"(target {t_wait / T:.2f} s, drafter {d_wait / D:.2f} s per rank)")
    fl = next(((t, l) for t, l in lines if "first step done" in l), None)
    if fl is None:
        check(False, "no 'first step done' line")
    else:
        x = re.search(r"first step done ([0-9.]+) s after the process started: start-up ([0-9.]+) s, loading weights "
                      r"([0-9.]+) s, first step ([0-9.]+) s", fl[1])
        total, first = float(x.group(1)), float(x.group(4))
        seen = fl[0] - a.launch
        print(f"INFO {fl[1].split('] ', 1)[-1]}")
        # the process dates its own start from /proc (start time and uptime in 10 ms clock ticks), so
        # its figure may run up to ~20 ms past this script's, which began before the launch
        check(-0.05 <= seen - total < 1.5, f"first step: {total:.2f} s after process start on the console, {seen:.2f} s "
                                           f"after launch by this script's clock (difference {seen - total:+.3f} s: "
                                           f"-0.05 to 1.5 s)")
        check(first <= 3.0, f"first step {first:.2f} s after the weights are loaded (<= 3 s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
