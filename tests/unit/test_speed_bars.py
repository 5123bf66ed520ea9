"""bench/speed_bars.py on given benchmark outputs (CPU): the kernel rows of the bar shapes are read
(not the SDPA rows, not a failed row), each bar is judged against its threshold, and a missing
measurement says so."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(ROOT / "bench"))
import speed_bars  # noqa: E402

HEAD = ("| S | B | attention / loss | fwd ms | bwd ms | opt ms | step ms | draft pos/s | target tok/s | TFLOP/s | MFU "
        "| peak GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def test_bars_from_the_tables(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("drafter_bench: cuda bf16\n" + HEAD +
                     "| 3072 | 4 | kernel fused | 237.8 | 248.8 | 7.9 | 494.5 | 66267 | 25100 | 590.7 | 74.1% | 42.5 |\n"
                     "| 3072 | 4 | sdpa-g1024 fused | 275.9 | 312.2 | 7.8 | 595.9 | 54986 | 20620 | 490.2 | 61.4% | 51.9 |\n")
    long = tmp_path / "long.txt"
    long.write_text(HEAD +
                    "| 40000 | 1 | kernel fused | 359.2 | 596.8 | 7.8 | 963.8 | 33998 | 41501 | 488.6 | 62.9% | 45.9 |\n"
                    "| 40000 | 1 | sdpa-g1024 fused | failed: CUDA out of memory. Tried to allocate 10.03 GiB |\n")
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"rows": [{"shape": "4x3072", "tokens_per_s": 42633.0},
                                           {"shape": "8x2048", "tokens_per_s": 46500.0}]}))
    lines = speed_bars.report([str(short), str(long)], str(target))
    assert lines == [
        "BAR drafter step 4 x 3072, 512 anchors, kernel: 25,100 tok/s, 100.4% of the bar >= 25,000: met",
        "BAR drafter step 1 x 40000, 2048 anchors, kernel: 41,501 tok/s, 92.2% of the bar >= 45,000: NOT MET",
        "BAR target capture forward 8 x 2048: 46,500 tok/s, 101.1% of the bar >= 46,000: met",
    ]


def test_fused_backward_lines(tmp_path):
    """--drafter-fused adds a line for each bar shape its file holds, after the default's lines."""
    fused = tmp_path / "fused.txt"
    fused.write_text(HEAD + "| 40000 | 1 | kernel fused | 347.6 | 516.0 | 10.7 | 874.3 | 37478 | 45749 | 538.6 | 67.8% | 45.9 |\n")
    lines = speed_bars.report([], None, [str(fused)])
    assert lines == [
        "BAR drafter step 4 x 3072, 512 anchors, kernel: not measured (bar >= 25,000 tok/s)",
        "BAR drafter step 1 x 40000, 2048 anchors, kernel: not measured (bar >= 45,000 tok/s)",
        "BAR drafter step 1 x 40000, 2048 anchors, kernel, fused backward (auto's choice there): 45,749 tok/s, 101.7% of the bar "
        ">= 45,000: met",
        "BAR target capture forward 8 x 2048: not measured (bar >= 46,000 tok/s)",
    ]
    assert len(speed_bars.report([], None, [str(tmp_path / "absent.txt")])) == 3


def test_missing_and_failed_measurements(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text(HEAD + "| 40000 | 1 | kernel fused | failed: CUDA out of memory |\n")
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"rows": [{"shape": "4x3072", "tokens_per_s": 42633.0}]}))
    lines = speed_bars.report([str(tmp_path / "absent.txt"), str(long)], str(target))
    assert [l.endswith("not measured (bar >= 25,000 tok/s)") for l in lines[:1]] == [True]
    assert lines[1] == "BAR drafter step 1 x 40000, 2048 anchors, kernel: not measured (bar >= 45,000 tok/s)"
    assert lines[2] == "BAR target capture forward 8 x 2048: not measured (bar >= 46,000 tok/s)"
    assert speed_bars.report([], str(tmp_path / "nothing.json"))[2].endswith("not measured (bar >= 46,000 tok/s)")
