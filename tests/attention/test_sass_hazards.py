"""Static checks of the attention kernels' Hopper SASS (attention/kernel/*_sm90.cu), no GPU needed.

ptxas treats the register A operand of a wgmma (P, dS as bf16 fragments) as read when the wgmma is
issued, not when it runs: it may give those registers to other work before the WARPGROUP.DEPBAR that
retires the product, and the product then reads garbage (seen: a late-wait forward schedule wrote
P(t) into the registers P(t-1) V(t-1) was reading; kernel/NOTES.md "v6"). Whether that happens is
down to ptxas's register allocation, so the built SASS is checked here:
  1. no instruction writes a register of an in-flight wgmma's A operand on any path from the wgmma
     to the next WARPGROUP.DEPBAR;
  2. no kernel has its wgmmas serialised (a WARPGROUP.DEPBAR after nearly every HGMMA: ptxas's
     C7514/C7520 fallback, which costs the overlap the schedules are built for);
  3. A fragments loaded once before a loop (Q in registers) are not overwritten inside it: ptxas did
     exactly that in one kernel although the PTX kept them live (kernel/NOTES.md).
The checker itself is tested on small synthetic listings, so that a check that cannot fail shows.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

FUNC = re.compile(r"\s+Function : (\S+)")
INS = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
RS_HGMMA = re.compile(r"HGMMA\S* R\d+, R(\d+),")
BRANCH = re.compile(r"(@!?U?P\w+\s+)?BRA(?:\.\S+)?\s+(?:\S+,\s+)?0x([0-9a-f]+)")
# Opcodes (the part before the first '.') whose first operand is not a register they write: stores
# and reductions, the wgmma itself (its accumulator is written asynchronously, which ptxas guards),
# barriers, branches and fences (BAR.SYNC R161 reads R161). Atomics are not here: ATOMS returns the
# old value into its first operand.
NO_DST = {"ST", "STS", "STG", "STL", "STSM", "RED", "REDG", "HGMMA", "WARPGROUP", "BRA", "BAR", "SYNCS", "EXIT",
          "RET", "CALL", "WARPSYNC", "NOP", "DEPBAR", "UTMALDG", "UTMASTG", "UTMAPF", "FENCE", "MEMBAR",
          "BSSY", "BSYNC", "CCTL", "LDGSTS", "LDGDEPBAR", "ERRBAR", "YIELD"}


def parse(text):
    """{function: [(address, instruction)]} from `cuobjdump -sass` output."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = INS.match(line)
        if m and cur:
            funcs[cur].append((int(m.group(1), 16), m.group(2)))
    return funcs


def written(ins):
    """The general registers an instruction writes (vector widths from the opcode's suffix)."""
    tok = ins.split()
    if tok and tok[0].startswith("@"):
        tok = tok[1:]
    if len(tok) < 2 or tok[0].split(".")[0] in NO_DST:
        return set()
    m = re.match(r"R(\d+)", tok[1])
    if not m:
        return set()
    op, r = tok[0], int(m.group(1))
    n = 1
    if ".128" in op or ".M88.4" in op or ".X4" in op:
        n = 4
    elif ".64" in op or ".M88.2" in op or ".X2" in op or ".WIDE" in op:
        n = 2
    return {f"R{r + k}" for k in range(n)}


def rs_wgmmas(ins):
    """(index, address, A registers) of each wgmma that reads its A operand from registers."""
    for i, (a, s) in enumerate(ins):
        m = RS_HGMMA.search(s)
        if m:
            yield i, a, {f"R{int(m.group(1)) + k}" for k in range(4)}


def a_operand_hazards(ins):
    """(wgmma address, writer address, writer) for writes to an in-flight wgmma's A registers."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, a, regs in rs_wgmmas(ins):
        stack, seen = [i + 1], set()
        while stack:
            j = stack.pop()
            while j < len(ins) and j not in seen:
                seen.add(j)
                a2, s2 = ins[j]
                if s2.startswith(("WARPGROUP.DEPBAR", "EXIT")):
                    break
                if written(s2) & regs:
                    found.append((a, a2, s2))
                    break
                b = BRANCH.match(s2)
                if b:
                    t = index.get(int(b.group(2), 16))
                    if t is not None:
                        stack.append(t)
                    if not b.group(1):
                        break
                j += 1
    return found


def loops(ins):
    """(start index, back-branch index) of every loop: a branch to an earlier or the same instruction."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for j, (_, s) in enumerate(ins):
        b = BRANCH.match(s)
        if b:
            t = index.get(int(b.group(2), 16))
            if t is not None and t <= j:
                found.append((t, j))
    return found


def loop_invariant_a_clobbers(ins):
    """(wgmma address, writer address, writer) where a wgmma inside a loop reads register A fragments
    that were loaded (LDSM) before the loop and are not reloaded in it (Q held in registers), and
    another instruction in the loop writes one of those registers: the next iteration's wgmma then
    reads that instead. Seen: ptxas gave Q's fragments in the d = 64 dQ pass with Q in registers
    to dS and to an mbarrier byte count (kernel/NOTES.md); the PTX kept them live across the loop."""
    found = []
    all_loops = loops(ins)
    for i, a, regs in rs_wgmmas(ins):
        around = [(lo, hi) for lo, hi in all_loops if lo <= i <= hi]
        if not around:
            continue
        lo, hi = min(around, key=lambda r: r[1] - r[0])
        ldsm_out = any(s2.startswith("LDSM") and written(s2) & regs
                       for j, (_, s2) in enumerate(ins) if not lo <= j <= hi)
        ldsm_in = any(s2.startswith("LDSM") and written(s2) & regs for _, s2 in ins[lo:hi + 1])
        if not ldsm_out or ldsm_in:
            continue
        for a2, s2 in ins[lo:hi + 1]:
            if written(s2) & regs:
                found.append((a, a2, s2))
                break
    return found


def serialised(ins):
    """True when the wgmmas are serialised: a WARPGROUP.DEPBAR for at least every other HGMMA."""
    h = sum(1 for _, s in ins if s.startswith("HGMMA"))
    d = sum(1 for _, s in ins if s.startswith("WARPGROUP.DEPBAR"))
    return h >= 8 and 2 * d >= h


SYNTH = """
        Function : ok_kernel
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0010*/                   FMNMX R19, R90, R91, !PT ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   F2FP.BF16.F32.PACK_AB R152, R89, R88 ;
        /*0040*/                   EXIT ;
        Function : bad_kernel
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0010*/              @P0  BRA 0x40 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   EXIT ;
        /*0040*/                   LDSM.16.M88.4 R152, [R17+0x2000] ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   EXIT ;
"""


def test_checker_finds_an_overwrite_on_a_branch():
    f = parse(SYNTH)
    assert a_operand_hazards(f["ok_kernel"]) == []
    bad = a_operand_hazards(f["bad_kernel"])
    assert [(a, b) for a, b, _ in bad] == [(0x0, 0x40)]


LOOP = """
        Function : qreg_ok
        /*0000*/                   LDSM.16.M88.4 R120, [R18] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R56, R120, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   F2FP.BF16.F32.PACK_AB R140, R57, R56 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   MOV R120, 0x1 ;
        /*0060*/                   EXIT ;
        Function : qreg_bad
        /*0000*/                   LDSM.16.M88.4 R120, [R18] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R56, R120, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   F2FP.BF16.F32.PACK_AB R121, R57, R56 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
"""


def test_checker_finds_a_loop_invariant_operand_clobbered():
    f = parse(LOOP)
    assert loop_invariant_a_clobbers(f["qreg_ok"]) == []  # written after the loop only
    assert [(a, b) for a, b, _ in loop_invariant_a_clobbers(f["qreg_bad"])] == [(0x10, 0x30)]


def test_checker_finds_serialisation():
    lines = []
    for k in range(8):
        lines.append((0x20 * k, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88, gsb0"))
        lines.append((0x20 * k + 0x10, "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert serialised(lines)
    assert not serialised([x for x in lines if "DEPBAR" not in x[1]] + lines[1:4:2])


def cuobjdump():
    cands = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:
        import triton  # the torch wheel's triton bundles one

        cands.append(str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"))
    except Exception:
        pass
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def problems_of(f, ins):
    """What the three checks find in kernel `f` (its parsed instructions), one line each."""
    found = []
    for a, b, s in a_operand_hazards(ins)[:3]:
        found.append(f"{f}: wgmma at {a:#x} reads its A operand from registers that {s!r} at {b:#x} "
                     "overwrites before the wait that retires it")
    for a, b, s in loop_invariant_a_clobbers(ins)[:3]:
        found.append(f"{f}: wgmma at {a:#x} reads A fragments loaded before its loop, which {s!r} at "
                     f"{b:#x} overwrites inside the loop")
    if serialised(ins):
        found.append(f"{f}: wgmmas serialised (a WARPGROUP.DEPBAR after nearly every HGMMA)")
    return found


def test_attention_kernels_have_no_a_operand_hazard_and_no_serialisation():
    build = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
    lib = build / "attention" / "libdflash_attention.a"
    if not lib.exists():
        pytest.skip(f"{lib} not built")
    tool = cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump (CUDA toolkit or the torch wheel's triton)")
    out = subprocess.run([tool, "-sass", "-arch", "sm_90a", str(lib)], capture_output=True, text=True)
    funcs = {f: i for f, i in parse(out.stdout).items() if any(s.startswith("HGMMA") for _, s in i)}
    if not funcs:
        pytest.skip(f"{lib} has no sm_90a wgmma code (built without CUDA or without 90a)")
    # the kernels whose schedules depend on it must be among those checked
    for name in ("attn_fwd_ws_kernel", "attn_bwd_dq_ws_lw_kernel", "attn_bwd_dq_wgmma_kernel",
                 "attn_bwd_dkv_wgmma_kernel", "attn_fwd_wgmma_kernel"):
        assert any(name in f for f in funcs), f"{name} not found in {lib}"
    problems = [line for f, ins in funcs.items() for line in problems_of(f, ins)]
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    # Instruction counts per wgmma kernel of a library or object (the uniform-datapath and wgmma
    # figures in kernel/NOTES.md "v6"; the innermost wgmma loop's length), then what the checks find in it (the builds NOTES "v7" cites):
    #   python3 tests/attention/test_sass_hazards.py LIB_OR_OBJECT
    import sys

    out = subprocess.run([cuobjdump(), "-sass", "-arch", "sm_90a", sys.argv[1]], capture_output=True, text=True)
    for f, ins in sorted(parse(out.stdout).items()):
        ops = [s.split()[1] if s.startswith("@") else s.split()[0] for _, s in ins]
        h = sum(o.startswith("HGMMA") for o in ops)
        if h:
            u = sum(o.startswith("U") for o in ops)
            d = sum(o.startswith("WARPGROUP.DEPBAR") for o in ops)
            # the innermost loop holding a wgmma (a kernel's per-tile loop: kernel/NOTES.md compares them)
            inner = [hi - lo + 1 for lo, hi in loops(ins) if any(o.startswith("HGMMA") for o in ops[lo:hi + 1])]
            tile = f"{min(inner):5d}" if inner else "    -"
            print(f"{len(ops):6d} instructions {u:5d} uniform {h:3d} HGMMA {d:3d} DEPBAR {tile} in the tile loop  {f}")
            for line in problems_of(f, ins):
                print("  PROBLEM " + line)
