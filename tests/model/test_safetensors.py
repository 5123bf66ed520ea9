"""Interop of our safetensors reader/writer with the Python `safetensors` package.

Files written by the package are read by our reader and written again by our writer
(target_tool st-copy); the package reads the copy back and every tensor must be bit-identical.
Corrupt files must make the tool exit with code 2 and a message naming the file and tensor.
"""
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", "build"))
TOOL = BUILD / "tests" / "model" / "target_tool"


def run_tool(*args):
    return subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=300)


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 4, 5, generator=g).to(torch.float16),
        "f32": torch.randn(11, generator=g),
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (2, 2), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (5,), generator=g).bool(),
        "scalar": torch.tensor(1.25),
        "empty": torch.zeros(0, 3),
    }


def test_python_written_file_round_trips_exactly(tmp_path):
    ts = sample_tensors()
    save_file(ts, tmp_path / "in.safetensors", metadata={"format": "pt", "k": "v"})
    r = run_tool("st-copy", tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert r.returncode == 0, r.stderr
    back = load_file(tmp_path / "out.safetensors")
    assert sorted(back) == sorted(ts)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype, k
        assert back[k].shape == t.shape, k
        assert torch.equal(back[k], t), k
    from safetensors import safe_open
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}


@pytest.mark.parametrize("dtype,torch_dtype", [("f32", torch.float32), ("bf16", torch.bfloat16),
                                               ("f16", torch.float16)])
def test_conversion_matches_torch(tmp_path, dtype, torch_dtype):
    g = torch.Generator().manual_seed(1)
    ts = {"a": torch.randn(6, 7, generator=g).to(torch.bfloat16),
          "b": torch.randn(9, generator=g),
          "c": torch.randn(4, generator=g).to(torch.float16)}
    save_file(ts, tmp_path / "in.safetensors")
    r = run_tool("st-copy", tmp_path / "in.safetensors", tmp_path / "out.safetensors", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    back = load_file(tmp_path / "out.safetensors")
    for k, t in ts.items():
        assert torch.equal(back[k], t.to(torch_dtype)), k


def test_sharded_checkpoint_from_save_pretrained_layout(tmp_path):
    ts = sample_tensors()
    names = sorted(ts)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    wm = {}
    for f, ns in shards.items():
        save_file({n: ts[n] for n in ns}, tmp_path / f)
        wm.update({n: f for n in ns})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    r = run_tool("st-copy", tmp_path, tmp_path / "all.safetensors")
    assert r.returncode == 0, r.stderr
    back = load_file(tmp_path / "all.safetensors")
    for k, t in ts.items():
        assert torch.equal(back[k], t), k
    # A missing shard is named.
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    r = run_tool("st-copy", tmp_path, tmp_path / "x.safetensors")
    assert r.returncode == 2
    assert "model-00002-of-00002.safetensors" in r.stderr and "missing" in r.stderr


def header_file(path, header: dict, data: bytes, claimed_len=None):
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if claimed_len is None else claimed_len))
        f.write(h)
        f.write(data)


def test_truncated_file(tmp_path):
    save_file({"w": torch.randn(64)}, tmp_path / "a.safetensors")
    raw = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(raw[:-10])
    r = run_tool("st-copy", tmp_path / "a.safetensors", tmp_path / "o.safetensors")
    assert r.returncode == 2, r.stderr
    assert "a.safetensors" in r.stderr and "'w'" in r.stderr and "outside" in r.stderr
    (tmp_path / "a.safetensors").write_bytes(raw[:5])
    r = run_tool("st-copy", tmp_path / "a.safetensors", tmp_path / "o.safetensors")
    assert r.returncode == 2 and "too short" in r.stderr


@pytest.mark.parametrize("case", ["outside", "bad_json", "dtype", "shape", "header_len"])
def test_corrupt_headers(tmp_path, case):
    p = tmp_path / "c.safetensors"
    good = {"layer.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    if case == "outside":
        good["layer.w"]["data_offsets"] = [0, 1 << 20]
        good["layer.w"]["shape"] = [1 << 18]
        header_file(p, good, bytes(16))
        expect = ["'layer.w'", "outside"]
    elif case == "bad_json":
        with open(p, "wb") as f:
            h = b'{"layer.w": {"dtype": "F32", "shape": [4]'
            f.write(struct.pack("<Q", len(h)) + h + bytes(16))
        expect = ["invalid JSON"]
    elif case == "dtype":
        good["layer.w"]["dtype"] = "F4"
        header_file(p, good, bytes(16))
        expect = ["'layer.w'", "unknown dtype 'F4'"]
    elif case == "shape":
        good["layer.w"]["shape"] = [5]
        header_file(p, good, bytes(16))
        expect = ["'layer.w'", "need 20"]
    else:
        header_file(p, good, bytes(16), claimed_len=1000)
        expect = ["runs past the end"]
    r = run_tool("st-copy", p, tmp_path / "o.safetensors")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "c.safetensors" in r.stderr, r.stderr
    for e in expect:
        assert e in r.stderr, r.stderr
    assert not (tmp_path / "o.safetensors").exists()
