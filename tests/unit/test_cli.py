"""dflash_rank's command line as a user meets it, process-level: --help (options, commands and
the config sections generated from the schema), --version (the build's git describe), "did you
mean" for mistyped options and keys, errors that name the override (not the YAML) when the value
came from the command line, and a missing path named by its key. Every user error is one line
on stderr and exit code 2."""
import os
import re
import subprocess

import pytest

SRC = os.environ.get("DFLASH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build"))
RANK_BIN = os.path.join(BUILD, "trainer", "dflash_rank")
DEMO = os.path.join(SRC, "configs", "demo.yaml")


def rank(*args):
    if not os.path.exists(RANK_BIN):
        pytest.skip(f"{RANK_BIN} not built")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    return subprocess.run([RANK_BIN, *args], capture_output=True, text=True, timeout=60, env=env, cwd=SRC)


def one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_help_lists_options_commands_and_config_sections():
    r = rank("--help")
    assert r.returncode == 0 and r.stderr == ""
    for s in ["--config FILE", "--print-config", "--resume", "--comm-check [N]", "--whoami", "--version",
              "section.key=value", "check-export", "dflash_rank --print-config"]:
        assert s in r.stdout, (s, r.stdout)
    # every section of the schema with its keys, as --print-config has them
    printed = rank("--print-config").stdout
    sections = re.findall(r"^(\w+):$", printed, re.M)
    assert sections[:3] == ["run", "layout", "comm"] and "train" in sections
    for sec in sections:
        keys = re.findall(rf"^{sec}:\n((?:  .*\n)+)", printed, re.M)[0]
        names = re.findall(r"^  (\w+):", keys, re.M)
        assert re.search(rf"^  {sec}\s+{re.escape(', '.join(names))}$", r.stdout, re.M), (sec, names, r.stdout)
    assert rank("-h").stdout == r.stdout


def test_version_is_the_git_describe_of_the_build():
    r = rank("--version")
    assert r.returncode == 0
    m = re.fullmatch(r"dflash_rank (\S+)\n", r.stdout)
    assert m, r.stdout
    v = m.group(1)
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=SRC)
    if head.returncode == 0:  # a checkout: the version names the commit it was built from (or a tag of it)
        assert v.split("-dirty")[0].endswith(head.stdout.strip()[:7]) or v[0].isdigit() or "-g" in v, (v, head.stdout)
    assert v != "unknown" or head.returncode != 0


@pytest.mark.parametrize("args,expect", [
    (["--confg", DEMO], "unknown option '--confg'; did you mean '--config'?"),
    (["--resum"], "did you mean '--resume'?"),
    (["--config", DEMO, "trian.lr=1e-3"], "override 'trian.lr=1e-3': unknown key 'trian.lr'; did you mean 'train.lr'?"),
    (["--config", DEMO, "train.lrr=1e-3"], "unknown key 'train.lrr'; did you mean 'train.lr'?"),
    (["--config", DEMO, "drafter.blok_size=8"], "did you mean 'drafter.block_size'?"),
    (["check-exprt"], "did you mean 'check-export'?"),
    (["--config", DEMO, "lr=1e-3"], "unknown key 'lr'; did you mean 'train.lr'?"),
])
def test_typos_get_did_you_mean(args, expect):
    line = one_error_line(rank(*args))
    assert expect in line, line


def test_yaml_typo_gets_did_you_mean(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("train:\n  warmup_ration: 0.1\n")
    line = one_error_line(rank("--config", str(cfg)))
    assert f"config {cfg}: unknown key 'train.warmup_ration'; did you mean 'train.warmup_ratio'?" in line, line
    cfg.write_text("lr: 0.1\n")  # a key of another section at the top level
    line = one_error_line(rank("--config", str(cfg)))
    assert "did you mean 'train.lr'?" in line, line


def test_errors_name_the_override_not_the_yaml(tmp_path):
    line = one_error_line(rank("--config", DEMO, "train.grad_accum=0"))
    assert line.endswith("override 'train.grad_accum=0': key 'train.grad_accum' must be positive, got 0"), line
    assert "demo.yaml" not in line
    line = one_error_line(rank("--config", DEMO, "train.lr=fast"))
    assert "override 'train.lr=fast': key 'train.lr' expects a number, got 'fast'" in line, line
    # the same value from the YAML file is blamed on the file
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train:\n  grad_accum: 0\n")
    line = one_error_line(rank("--config", str(cfg)))
    assert f"config {cfg}: key 'train.grad_accum' must be positive" in line, line


def test_missing_paths_name_the_key_and_its_origin(tmp_path):
    line = one_error_line(rank("--config", DEMO, "layout.colocated=true", f"target.model_dir={tmp_path}/x"))
    assert f"target.model_dir: directory '{tmp_path}/x' does not exist (override 'target.model_dir={tmp_path}/x')" \
        in line, line
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"layout: {{colocated: true}}\ntarget: {{model_dir: {tmp_path}}}\ndata: {{shards: [{tmp_path}/nope]}}\n")
    line = one_error_line(rank("--config", str(cfg)))
    assert f"data.shards[0]: '{tmp_path}/nope' does not exist (config {cfg})" in line, line


def test_check_export_usage_errors(tmp_path):
    assert "check-export DIR --target" in one_error_line(rank("check-export"))
    line = one_error_line(rank("check-export", str(tmp_path / "e"), "--target", str(tmp_path)))
    assert f"export directory '{tmp_path}/e' does not exist" in line, line
