"""Bad input as a user gives it, to the real dflash_rank process: for each value class (NaN and
huge numbers, an empty run.dir, duplicate YAML keys, a target config.json with huge or infinite
sizes, a drafter export whose config.json does not match its tensors, NaN weights) the process
exits 2 with one error line naming the key/file/tensor and where the value came from, creates
no run directory (and writes nothing into its working directory), and stays small: it runs under
a 6 GiB address-space limit (LibTorch maps ~2 GiB at start-up; every refused value would
allocate far more than the limit, or create a million threads) and ends within 30 s.
"""
import json
import os
import shutil

import pytest

import ops_common as oc

LIMIT_AS = 6 << 30
MAX_S = 30


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    if not os.path.exists(oc.RANK_BIN):
        pytest.skip(f"{oc.RANK_BIN} not built")
    root = str(tmp_path_factory.mktemp("validate"))
    target, data = oc.make_assets(root)
    return root, target, data


def expect_refused(p, run_dir, cwd, *needles, loaded=False):
    """loaded: the error comes from reading tensor values (NaN weights), after world rank 0 claimed
    run.dir; then it may hold run.json, run.lock and the data's record (prepare_info.json, copied
    after the plan), nothing else (and a new run may use it)."""
    lines = oc.error_lines(p.all)
    assert p.returncode == 2, (p.returncode, p.all[-3000:])
    assert len(lines) == 1, p.all[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "terminate called" not in p.all and "bad_alloc" not in p.all
    if loaded and os.path.exists(run_dir):
        assert set(os.listdir(run_dir)) <= {"run.json", "run.lock", "prepare_info.json"}, os.listdir(run_dir)
        assert "run.json" in os.listdir(run_dir), os.listdir(run_dir)
    else:
        assert not os.path.exists(run_dir), f"{run_dir} was created"
    assert os.listdir(cwd) == [], f"written into the working directory: {os.listdir(cwd)}"
    assert p.elapsed < MAX_S, p.elapsed


def colocated(target, data, run_dir, **extra):
    return ["--config", oc.DEMO] + oc.overrides(target, data, run_dir, **{"layout.colocated": "true",
                                                                          "train.max_steps": 2, **extra})


@pytest.mark.parametrize("key,value,expect", [
    ("comm.timeout_s", "nan", "must be a finite number of seconds"),
    ("eval.temperature", "nan", "must be 0 (greedy) or a finite temperature > 0"),
    ("eval.max_new_tokens", "1000000000000", "[1, 16777216]"),
    ("comm.timeout_s", "inf", "must be a finite number of seconds"),
    ("comm.startup_timeout_s", "-1", "must be a finite number of seconds"),
    ("run.cpu_threads", "1000000", "hardware threads"),
    ("train.max_steps", "1000000000000", "step count in [1, 10000000]"),
    ("train.grad_accum", "1000000000", "[1, 4096]"),
    ("drafter.num_layers", "1000000", "[1, 256]"),
    ("drafter.num_anchors", "1000000000", "[1, 65536]"),
    ("data.batch_tokens", "100000000000", "[1, 16777216]"),
    ("train.lr", "nan", "finite learning rate"),
    ("train.lr", "-0.001", "finite learning rate"),
    ("train.beta1", "1.5", "in [0, 1)"),
    ("train.grad_clip", "-1", "finite norm"),
    ("train.weight_decay", "-0.1", "finite number >= 0"),
    ("train.warmup_ratio", "2", "[0, 1]"),
])
def test_bad_value_refused_before_anything_happens(assets, tmp_path, key, value, expect):
    root, target, data = assets
    run_dir = str(tmp_path / "run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = oc.run_rank(colocated(target, data, run_dir, **{key: value}), cwd=str(cwd), limit_as=LIMIT_AS)
    expect_refused(p, run_dir, str(cwd), f"override '{key}={value}': key '{key}'", expect)


def test_empty_or_root_run_dir_refused(assets, tmp_path):
    root, target, data = assets
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for value in ('""', "/", "//"):
        p = oc.run_rank(colocated(target, data, value), cwd=str(cwd), limit_as=LIMIT_AS)
        expect_refused(p, "/checkpoints", str(cwd), f"key 'run.dir'")
        assert not os.path.exists("/metrics.jsonl")


def test_value_from_the_file_names_the_file(assets, tmp_path):
    root, target, data = assets
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(open(oc.DEMO).read().replace("  timeout_s: 60", "  timeout_s: nan"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run_dir = str(tmp_path / "run")
    args = [a for a in colocated(target, data, run_dir) if not a.startswith("comm.timeout_s")]
    args[1] = str(cfg)
    p = oc.run_rank(args, cwd=str(cwd), limit_as=LIMIT_AS)
    expect_refused(p, run_dir, str(cwd), f"config {cfg}: key 'comm.timeout_s'", "got nan")


def test_duplicate_yaml_key_refused_with_both_lines(assets, tmp_path):
    root, target, data = assets
    text = open(oc.DEMO).read()
    assert "  lr: 5.0e-3\n" in text
    cfg = tmp_path / "dup.yaml"
    cfg.write_text(text.replace("  lr: 5.0e-3\n", "  lr: 5.0e-3\n  epochs: 2\n  lr: 1.0\n"))
    first = text.splitlines().index("  lr: 5.0e-3") + 1
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run_dir = str(tmp_path / "run")
    args = colocated(target, data, run_dir)
    args[1] = str(cfg)
    p = oc.run_rank(args, cwd=str(cwd), limit_as=LIMIT_AS)
    expect_refused(p, run_dir, str(cwd), f"key 'train.lr' is given twice (lines {first} and {first + 2})")


def edited_target(tmp_path, target, **fields):
    t = tmp_path / "target"
    shutil.copytree(target, t)
    cfg = json.load(open(t / "config.json"))
    cfg.update(fields)
    (t / "config.json").write_text(json.dumps(cfg).replace("Infinity", "1e999"))
    return str(t)


@pytest.mark.parametrize("fields,expect", [
    ({"num_hidden_layers": 1000000}, "key 'num_hidden_layers' must be at most 1024"),
    ({"intermediate_size": 100000000}, "key 'intermediate_size' must be at most"),
    ({"vocab_size": 4000000000}, "key 'vocab_size' must be at most"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e400}}, "rope_theta must be a finite number"),
    ({"num_hidden_layers": 12}, "has shape"),  # in range, but more layers than tensors
])
def test_target_config_json_checked_before_allocating(assets, tmp_path, fields, expect):
    root, target, data = assets
    t = edited_target(tmp_path, target, **fields)
    run_dir = str(tmp_path / "run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = oc.run_rank(colocated(target, data, run_dir, **{"target.model_dir": t}), cwd=str(cwd), limit_as=LIMIT_AS)
    if "has shape" in expect:  # the tensor-name check speaks first: layers 6..11 are missing
        expect = "missing"
    expect_refused(p, run_dir, str(cwd), os.path.join(t, "config.json") if "must" in expect else t, expect)


@pytest.fixture(scope="module")
def export_dir(assets):
    """A real export: 2 colocated steps."""
    root, target, data = assets
    run_dir = os.path.join(root, "exporter")
    p = oc.run_rank(colocated(target, data, run_dir), cwd=root)
    assert p.returncode == 0, p.all[-3000:]
    return os.path.join(run_dir, "exports", "final")


def edited_export(tmp_path, export_dir, config=None, nan_tensor=None):
    d = tmp_path / "export"
    shutil.copytree(export_dir, d)
    if config:
        cfg = json.load(open(d / "config.json"))
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg).replace("Infinity", "1e999"))
    if nan_tensor:
        import torch
        from safetensors.torch import load_file, save_file
        t = load_file(str(d / "model.safetensors"))
        t[nan_tensor][0, 0] = float("nan")
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)


@pytest.mark.parametrize("config,nan,expect", [
    ({"intermediate_size": 1000000}, None, "but {}/config.json implies"),  # in range, tensors differ
    ({"intermediate_size": 10**12}, None, "intermediate_size must be at most"),
    ({"num_hidden_layers": 10**6}, None, "num_hidden_layers must be at most 256"),
    ({"rope_theta": float("inf")}, None, "rope_theta must be a finite number"),
    (None, "layers.0.mlp.up_proj.weight", "tensor 'layers.0.mlp.up_proj.weight' holds 1 NaN"),
])
def test_export_checked_before_allocating(assets, export_dir, tmp_path, config, nan, expect):
    root, target, data = assets
    d = edited_export(tmp_path, export_dir, config, nan)
    if config and "num_hidden_layers" in config:  # keep layer_types consistent so the size check speaks
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg.pop("layer_types")
        open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    run_dir = str(tmp_path / "run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = oc.run_rank(colocated(target, data, run_dir, **{"drafter.init_from": d}), cwd=str(cwd), limit_as=LIMIT_AS)
    expect_refused(p, run_dir, str(cwd), expect.format(d), loaded=nan is not None)


def test_nan_target_weight_names_file_and_tensor(assets, tmp_path):
    root, target, data = assets
    import torch
    from safetensors.torch import load_file, save_file
    t = tmp_path / "target"
    shutil.copytree(target, t)
    w = load_file(str(t / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"][3, 4] = float("inf")
    save_file(w, str(t / "model.safetensors"), metadata={"format": "pt"})
    run_dir = str(tmp_path / "run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = oc.run_rank(colocated(target, data, run_dir, **{"target.model_dir": str(t)}), cwd=str(cwd), limit_as=LIMIT_AS)
    expect_refused(p, run_dir, str(cwd), str(t / "model.safetensors"),
                   "tensor 'model.layers.1.mlp.down_proj.weight' holds 0 NaN and 1 infinite", loaded=True)
    # the directory is free again: the same run with the good target trains
    p = oc.run_rank(colocated(target, data, run_dir), cwd=str(cwd))
    assert p.returncode == 0, p.all[-3000:]

