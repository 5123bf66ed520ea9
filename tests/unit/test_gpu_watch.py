"""bench/gpu_watch.py on given nvidia-smi samples (CPU): the busy filter, the medians and shares,
one line per GPU, and lines that do not parse."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(ROOT / "bench"))
import gpu_watch  # noqa: E402


def rows(idx, samples):
    # (sm MHz, power W, reasons): max clock 1980, limit 700
    return [f"{idx}, {c}, 1980, {p}, 700.00, 0x{r:016x}" for c, p, r in samples]


def test_busy_samples_only_and_their_figures():
    lines = rows(0, [(1980, 80.0, 0x1)] * 5 +                              # idle: not counted
                 [(1650, 690.0, 0x4)] * 6 + [(1800, 600.0, 0x0)] * 2 +     # busy, mostly capped
                 [(1500, 699.0, 0x4 | 0x20)] * 2)
    per_gpu, skipped = gpu_watch.parse(lines)
    assert skipped == 0 and list(per_gpu) == [0]
    s = gpu_watch.summarize(per_gpu[0], 0.4)
    assert s["samples"] == 15 and s["busy"] == 10
    assert s["clock_median"] == 1650 and s["clock_max"] == 1980
    assert s["clock_p10"] == 1500 and s["clock_p90"] == 1800
    assert s["power_median"] == 690.0 and s["power_limit"] == 700.0
    assert abs(s["power_capped"] - 0.8) < 1e-9 and abs(s["thermal"] - 0.2) < 1e-9
    text = gpu_watch.line("the step", 0, s)
    assert text.startswith("GPU 0 during the step: SM clock median 1650 MHz (p10-p90 1500-1800) of 1980 max (83%)")
    assert "power-capped in 80% and thermally slowed in 20% of 10 busy samples (of 15)" in text


def test_unparsable_lines_skipped_and_no_busy_sample():
    lines = ["0, [N/A], 1980, 80.0, 700.00, 0x1", "0, 1980, 1980", "garbage"] + rows(0, [(1980, 50.0, 0x1)])
    per_gpu, skipped = gpu_watch.parse(lines)
    assert skipped == 3 and len(per_gpu[0]) == 1
    assert gpu_watch.summarize(per_gpu[0], 0.4) is None
    assert gpu_watch.line("x", 0, None) == "GPU 0 during x: no busy sample"


def test_script_one_line_per_gpu(tmp_path):
    csv = tmp_path / "gpu.csv"
    csv.write_text("\n".join(rows(1, [(1700, 650.0, 0x4)] * 3) + rows(0, [(1900, 500.0, 0x0)] * 3)) + "\n0, 19")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_watch.py"), str(csv), "--label", "decode"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 2 and out[0].startswith("GPU 0 during decode: SM clock median 1900")
    assert out[1].startswith("GPU 1 during decode: SM clock median 1700") and "power-capped in 100%" in out[1]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_watch.py"), str(tmp_path / "missing.csv")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "missing.csv" in r.stderr
