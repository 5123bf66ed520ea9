"""Regeneration (tools/regenerate.py + `dflash_rank regenerate`) on CPU with the demo's tiny target
(tools/make_tiny_target.py) and a byte-level chat tokenizer (tiny_chat.py).

- Valid chat JSONL: one conversation per (prompt, sample), the prompt's turns then one
  assistant turn, in prompt order; tools/prepare_data.py turns it into shards.
- Greedy tokens equal transformers' generate() on the same rendered ids (the oracle of
  tests/model/test_target.py for these tiny models), with more prompts than rows so that
  rows are refilled (continuous batching) and prompts of unequal lengths share a batch.
- Resumable: SIGKILL of the wrapper (the generator dies with it) after 4 responses (the generator
  stops itself there through the fault hook, so the kill is never late), a torn
  last line planted, a restart: no duplicate keys, and the final file equals an uninterrupted
  run's byte for byte.
- Sampling: the first-token frequencies over many samples match softmax(logits / T) from
  transformers within 4.5 standard deviations per token (binomial; 4.5 sigma over the ~20
  tokens checked keeps the false-alarm rate below 1e-4), tokens outside the top-p nucleus never
  appear, and the samples are a pure function of (seed, prompt, sample): another batch size
  gives the same file.
- Stop ids end a response after the stop token (included in the raw result, dropped in chat),
  with the static engine (host reads every step, and every 5 steps with rows of different
  lengths refilled one at a time) and the cache engine alike.
- Bad input: malformed prompt lines (file:line), a target without a chat template, other
  settings on a restart, bad generator arguments: one line, exit code 2.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SRC = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("DFLASH_BUILD_DIR", SRC / "build"))
RANK = BUILD / "trainer" / "dflash_rank"
sys.path.insert(0, str(SRC / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_chat  # noqa: E402

NEW = 24
ENV = dict(os.environ, DFLASH_BUILD_DIR=str(BUILD), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not RANK.exists():
        pytest.skip(f"{RANK} not built")
    import make_tiny_target
    root = tmp_path_factory.mktemp("regen")
    target = make_tiny_target.make(str(root / "target"), seed=0)
    tiny_chat.add_tokenizer(target)
    prompts = root / "prompts.jsonl"
    texts = ["What is 2 + 2?", "Tell me about rivers.", "Write a haiku about snow and the quiet night.",
             "Explain recursion.", "def f(x):\n    return x * 2\n\nWhat does f do?", "Hi",
             "List three colours.", "Why is the sea salty? Explain in detail, please.", "Name a prime.",
             "Translate 'cat' into French."]
    with open(prompts, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"messages": [{"role": "user", "content": t}], "id": f"p{i}", "source": "test"}) + "\n")
    return root, Path(target), prompts


def regen(model, prompts, out, *extra, check=True, popen=False, **kw):
    cmd = [sys.executable, str(SRC / "tools" / "regenerate.py"), "--model", str(model), "--prompts", str(prompts),
           "--out", str(out), "--max-new-tokens", str(NEW), "--batch-size", "4", "--progress-s", "0",
           "--threads", "1", *map(str, extra)]
    env = kw.pop("env", ENV)
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def lines(path):
    return [json.loads(l) for l in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def greedy(tiny):
    root, model, prompts = tiny
    out = root / "greedy.jsonl"
    regen(model, prompts, out)
    return out


def test_valid_chat_jsonl(tiny, greedy, tmp_path):
    root, model, prompts = tiny
    src = lines(prompts)
    got = lines(greedy)
    assert len(got) == len(src)
    from prepare_data import parse_sample, prepare
    for p, g in zip(src, got):
        msgs = parse_sample(json.dumps(g))
        assert msgs[:-1] == p["messages"] and msgs[-1]["role"] == "assistant" and msgs[-1]["content"]
        assert g["id"] == p["id"] and g["source"] == "test" and g["sample"] == 0 and g["finish"] == "length"
    s = prepare(str(model), [str(greedy)], str(tmp_path / "shards"), block_size=4)
    assert s.written == len(src) and s.malformed == 0 and s.supervised >= NEW * len(src) // 2


def hf_rendered(model, prompts):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    import regenerate
    return [regenerate.render(tok, p["messages"], {}) for p in lines(prompts)]


def test_greedy_matches_transformers(tiny, greedy):
    root, model, prompts = tiny
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    results = {r["key"]: r for r in lines(Path(str(greedy) + ".work") / "results.jsonl")}
    ids = hf_rendered(model, prompts)
    assert len({len(x) for x in ids}) > 3  # unequal prompt lengths share batches
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
            assert results[f"{i}:0"]["tokens"] == ref.tolist(), f"prompt {i}"


def test_resume_after_sigkill(tiny, greedy, tmp_path):
    root, model, prompts = tiny
    out = tmp_path / "killed.jsonl"
    res = Path(str(out) + ".work") / "results.jsonl"
    # The generator stops itself (SIGSTOP) right after flushing its 4th line (core/fault.h), so the
    # kill always lands mid-run however fast the machine is; then the wrapper's whole process group
    # is killed, as a scheduler would.
    env = dict(ENV, DFLASH_TEST_FAIL_AT="0:item4:stop")
    p = regen(model, prompts, out, start_new_session=True, popen=True, env=env)
    t0 = time.time()
    while (not res.exists() or len(res.read_text().splitlines()) < 4) and time.time() - t0 < 300:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    n_before = len(res.read_text().splitlines())
    assert n_before == 4 and not out.exists(), n_before
    with open(res, "a") as f:
        f.write('{"key": "9:0", "tokens": [1, 2')  # a torn line: the writer died mid-write
    r = regen(model, prompts, out)
    assert f"{n_before} responses already in" in r.stderr, r.stderr
    keys = [json.loads(l)["key"] for l in res.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 10
    assert out.read_bytes() == greedy.read_bytes()
    # Complete: a third run generates nothing and writes the same file.
    r = regen(model, prompts, out)
    assert "0 to generate" in r.stderr and out.read_bytes() == greedy.read_bytes()


def test_sampling_distribution(tiny, tmp_path):
    """First tokens of 600 samples of one prompt vs transformers' softmax(logits / T)."""
    root, model, prompts = tiny
    one = tmp_path / "one.jsonl"
    one.write_text(prompts.read_text().splitlines()[1] + "\n")
    n, T, top_p = 600, 1.3, 0.9
    out = tmp_path / "s.jsonl"
    regen(model, one, out, "--samples", n, "--temperature", T, "--top-p", top_p, "--max-new-tokens", 1,
          "--batch-size", 64)
    firsts = [r["tokens"][0] for r in lines(Path(str(out) + ".work") / "results.jsonl")]
    assert len(firsts) == n
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = hf_rendered(model, one)[0]
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([ids])).logits[0, -1].double() / T, -1)
    sp, order = probs.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < top_p
    nucleus = set(order[keep].tolist())
    q = torch.zeros_like(probs)
    q[order[keep]] = sp[keep] / sp[keep].sum()
    assert set(firsts) <= nucleus, set(firsts) - nucleus
    counts = torch.bincount(torch.tensor(firsts), minlength=len(probs)).double()
    for t in order[:20].tolist():
        p = q[t].item()
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(counts[t].item() / n - p) <= 4.5 * sd + 1e-9, (t, counts[t].item() / n, p)
    assert len(set(firsts)) > 5  # really sampled


def test_sampling_independent_of_batching(tiny, tmp_path):
    root, model, prompts = tiny
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    regen(model, prompts, a, "--samples", 2, "--temperature", 0.8, "--top-p", 0.95, "--seed", 7, "--limit", 4)
    regen(model, prompts, b, "--samples", 2, "--temperature", 0.8, "--top-p", 0.95, "--seed", 7, "--limit", 4,
          "--batch-size", 3)
    assert a.read_bytes() == b.read_bytes()
    got = lines(a)
    assert [(g["id"], g["sample"]) for g in got] == [(f"p{i}", s) for i in range(4) for s in range(2)]
    assert got[0]["messages"][-1] != got[1]["messages"][-1]  # two samples of one prompt differ


# The static engine (default) with host reads every 5 steps (rows that stopped run dead steps),
# attention windows in buckets of 4 and refills of single rows; the cache engine.
@pytest.mark.parametrize("engine", [[], ["--check-every", "5", "--window-bucket", "4", "--refill-rows", "1"],
                                    ["--engine", "cache"]], ids=["static", "static-k5", "cache"])
def test_stop_ids(tiny, greedy, tmp_path, engine):
    root, model, prompts = tiny
    full = {r["key"]: r["tokens"] for r in lines(Path(str(greedy) + ".work") / "results.jsonl")}
    stop = full["0:0"][5]
    items = tmp_path / "items.jsonl"
    ids = hf_rendered(model, prompts)
    items.write_text("".join(json.dumps({"key": f"{i}:0", "input_ids": x}) + "\n" for i, x in enumerate(ids)))
    res = tmp_path / "res.jsonl"
    r = subprocess.run([str(RANK), "regenerate", "--model", str(model), "--in", str(items), "--out", str(res),
                        "--max-new-tokens", str(NEW), "--stop-ids", str(stop), "--batch-size", "3",
                        "--threads", "1", "--stats", str(tmp_path / "st.json"), *engine],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    st = json.loads((tmp_path / "st.json").read_text())
    assert st["engine"] == ("cache" if "cache" in engine else "static") and st["graphs"] == 0  # CPU: eager
    if "5" in engine:
        assert st["host_reads"] < st["steps"]
    got = {x["key"]: x for x in lines(res)}
    for k, toks in full.items():
        want = toks[:toks.index(stop) + 1] if stop in toks else toks
        assert got[k]["tokens"] == want and got[k]["stopped"] == (stop in toks), k


# ---- bad input -------------------------------------------------------------------------------

def one_line(r, *needles, prefix="regenerate: error: "):
    assert r.returncode == 2, (r.returncode, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix) and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert str(n) in last, f"{n!r} not in {last!r}"


@pytest.mark.parametrize("line,reason", [
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
    ('["a list"]', "JSON object"),
    ('{"prompt": "hi"}', "'messages' or 'conversations'"),
    ('{"messages": [{"role": "user"}]}', "messages[0]"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role"),
    ('{"messages": [{"role": "system", "content": "x"}]}', "end with a user turn"),
])
def test_malformed_prompt_lines(tiny, tmp_path, line, reason):
    root, model, prompts = tiny
    bad = tmp_path / "bad.jsonl"
    good = prompts.read_text().splitlines()
    bad.write_text("\n".join(good[:2] + [""] + [line] + good[2:]) + "\n")
    one_line(regen(model, bad, tmp_path / "o.jsonl", check=False), f"{bad}:4:", reason)
    assert not (tmp_path / "o.jsonl").exists()


def test_target_without_chat_template(tiny, tmp_path):
    root, model, prompts = tiny
    import shutil
    d = tmp_path / "notemplate"
    shutil.copytree(model, d)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line(regen(d, prompts, tmp_path / "o.jsonl", check=False), str(d), "no chat template")


def test_restart_with_other_settings(tiny, greedy):
    root, model, prompts = tiny
    one_line(regen(model, prompts, greedy, "--max-new-tokens", NEW + 1, check=False), "max_new_tokens",
             "other settings")


def test_generator_bad_arguments(tiny, tmp_path):
    root, model, prompts = tiny
    items = tmp_path / "i.jsonl"
    items.write_text('{"key": "a", "input_ids": [1, 2, 3]}\n{"key": "b", "input_ids": [1, 600]}\n')
    base = [str(RANK), "regenerate", "--model", str(model), "--out", str(tmp_path / "r.jsonl")]
    cases = [(["--in", str(items)], ["'b'", "600", "vocabulary"]),
             (["--in", str(items), "--batch-size", "x"], ["--batch-size", "'x'"]),
             (["--in", str(items), "--bogus", "1"], ["--bogus"]),
             (["--in", str(tmp_path / "none.jsonl")], ["none.jsonl"]),
             (["--in", str(items), "--temperature", "-1"], ["temperature"]),
             (["--in", str(items), "--engine", "fast"], ["--engine", "'fast'"]),
             (["--in", str(items), "--cuda-graphs", "yes"], ["--cuda-graphs", "'yes'"]),
             (["--in", str(items), "--check-every", "0"], ["check every"])]
    for args, needles in cases:
        r = subprocess.run(base + args, capture_output=True, text=True, env=ENV, timeout=120)
        one_line(r, *needles, prefix="dflash_rank: error: regenerate")
    items.write_text('{"key": "a", "input_ids": [1, 2, 3]}\n{"key": "a", "input_ids": [1]}\n{"key": 3}\n')
    r = subprocess.run(base + ["--in", str(items)], capture_output=True, text=True, env=ENV, timeout=120)
    one_line(r, f"{items}:2", "twice", prefix="dflash_rank: error: regenerate")
