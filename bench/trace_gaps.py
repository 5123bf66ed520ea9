#!/usr/bin/env python3
"""Where a profiled step leaves the GPU idle: the gaps between consecutive device kernels of a
Chrome trace written by LibTorch's profiler (drafter_bench --profile-trace FILE, or a run's
<run.dir>/profile/rank<N>.trace.json), largest first, each with the kernels on either side and the
host operators that were running (outermost first) when the gap began.

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 25] [--min-us 20] [--calls N]

--calls N also lists the N CUDA runtime/driver calls of the window with the most total time
(cudaMalloc, cudaEventSynchronize, module loading, ...), summed by name.
"""
import argparse
import collections
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-us", type=float, default=20.0, help="gaps shorter than this are summed, not listed")
    ap.add_argument("--calls", type=int, default=0, help="also list the N CUDA runtime/driver calls with the most time")
    a = ap.parse_args()
    ev = load(a.trace)
    ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
    kernels = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        sys.exit(f"{a.trace}: no device kernels in the trace")
    ops = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    # the host call that launched each kernel (cudaLaunchKernel, cudaMemcpyAsync, ...), by correlation id
    launch = {e["args"]["correlation"]: e for e in ev
              if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, gaps, end, prev = 0.0, [], kernels[0]["ts"], None
    for k in kernels:
        if k["ts"] > end and prev is not None:
            gaps.append((k["ts"] - end, end, prev["name"], k["name"], k.get("args", {}).get("correlation")))
        busy += max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
        if k["ts"] + k["dur"] > end:
            end, prev = k["ts"] + k["dur"], k
    gaps.sort(reverse=True)
    small = sum(g[0] for g in gaps if g[0] < a.min_us)
    print(f"kernels {len(kernels)}, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({100 * busy / span:.1f}%), "
          f"idle {(span - busy) / 1e3:.2f} ms in {len(gaps)} gaps ({small / 1e3:.2f} ms in gaps < {a.min_us:g} us)")
    if a.calls:
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
                by[e["name"]][0] += 1
                by[e["name"]][1] += e["dur"]
        print("CUDA runtime/driver calls, by total time:")
        for n, (c, d) in sorted(by.items(), key=lambda i: -i[1][1])[: a.calls]:
            print(f"  {n:<40} {c:>6} calls {d / 1e3:9.1f} ms")
    print("\nA gap ends when the host launches the next kernel: the operators named are those that launched it, "
          "and 'late' is how long after the gap began the launch call started.")
    print(f"\n| gap us | at ms | kernel before | kernel after | late us | host operators launching the kernel after |")
    print("|---|---|---|---|---|---|")
    t0 = kernels[0]["ts"]
    for dur, at, before, after, corr in gaps[: a.top]:
        if dur < a.min_us:
            break
        lc = launch.get(corr)
        late, names = "", ""
        if lc is not None:
            late = f"{lc['ts'] - at:.0f}"
            host = sorted((o for o in ops if o.get("tid") == lc.get("tid") and o["ts"] <= lc["ts"] <= o["ts"] + o["dur"]),
                          key=lambda o: o["ts"])
            names = " > ".join(o["name"] for o in host)[:200]
        print(f"| {dur:.0f} | {(at - t0) / 1e3:.2f} | {before[:50]} | {after[:50]} | {late} | {names} |")


if __name__ == "__main__":
    main()
