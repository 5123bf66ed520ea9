#!/usr/bin/env python3
"""Summarise Nsight Compute PC sampling of one kernel (bench/gpu/attention_stalls.sh).

    python3 bench/ncu_stalls.py RAW_CSV SASS_CSV

RAW_CSV: `ncu -i REP --page raw --csv` (one kernel); SASS_CSV: `ncu -i REP --page source --csv
--print-source sass`. Prints the stall reasons by share of all samples, the samples summed by SASS
opcode, and the 40 instructions with the most samples (address, instruction, samples, the top
reasons where the page has per-reason columns).
"""
import csv
import re
import sys
from collections import defaultdict


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def raw_reasons(path):
    rows = list(csv.reader(open(path, newline="")))
    if len(rows) < 3:
        return
    head, vals = rows[0], rows[-1]
    print("duration:", next((f"{vals[i]} {rows[1][i]}" for i, h in enumerate(head) if h == "gpu__time_duration.sum"), "?"))
    samp = {}
    for i, h in enumerate(head):
        m = re.fullmatch(r"smsp__pcsamp_warps_issue_stalled_(\w+)", h)
        if m and not m.group(1).endswith("_not_issued"):
            v = num(vals[i])
            if v:
                samp[m.group(1)] = v
    tot = sum(samp.values())
    if tot:
        print(f"stall reasons (PC samples, {int(tot)} in all):")
        for k, v in sorted(samp.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {k:28s} {100 * v / tot:5.1f}%")
    lat = {}
    for i, h in enumerate(head):
        m = re.fullmatch(r"smsp__average_warp_latency_issue_stalled_(\w+)\.ratio", h) or re.fullmatch(
            r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio", h)
        if m:
            v = num(vals[i])
            if v:
                lat[m.group(1)] = v
    if lat and not tot:
        print("stall cycles per issued instruction:")
        for k, v in sorted(lat.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {k:28s} {v:6.2f}")


def sass(path):
    rows = list(csv.reader(open(path, newline="")))
    hi = next((i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)), None)
    if hi is None:
        print("sass page: no header found; first rows:", rows[:3])
        return
    head = [c.strip() for c in rows[hi]]
    src = head.index("Source")
    addr = head.index("Address") if "Address" in head else None
    allc = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if allc is None:
        print("sass page columns:", head)
        return
    reason_cols = [i for i, h in enumerate(head) if h.lower().startswith("stall_") or h.startswith("smsp__pcsamp")]
    items = []
    for r in rows[hi + 1:]:
        if len(r) <= max(src, allc):
            continue
        v = num(r[allc])
        if v is None:
            continue
        items.append((v, r))
    tot = sum(v for v, _ in items) or 1
    by_op = defaultdict(float)
    for v, r in items:
        toks = r[src].split()
        toks = [t for t in toks if not t.startswith("@")]
        by_op[toks[0] if toks else "?"] += v
    print(f"samples by opcode ({int(tot)} in all):")
    for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {k:32s} {100 * v / tot:5.1f}%")
    print("top instructions:")
    for v, r in sorted(items, key=lambda x: -x[0])[:40]:
        why = ""
        if reason_cols:
            rs = sorted(((num(r[i]) or 0, head[i]) for i in reason_cols), reverse=True)[:3]
            why = "  " + ", ".join(f"{h.replace('stall_', '')}:{int(x)}" for x, h in rs if x)
        a = r[addr] if addr is not None else ""
        print(f"  {a:>6s} {100 * v / tot:5.1f}%  {r[src][:70]:70s}{why}")
    if not reason_cols:
        print("(sass page columns:", ", ".join(head), ")")


if __name__ == "__main__":
    raw_reasons(sys.argv[1])
    sass(sys.argv[2])
