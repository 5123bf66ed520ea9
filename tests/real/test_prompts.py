"""tools/make_prompts.py: chat JSONL prompts from the standard library, templated math and a word
list, with a held-out split whose sources the train split never uses.

Checked: the files are valid chat JSONL (one user turn, ids unique); the same seed gives the
same bytes and another seed other prompts; the train and eval splits share no stdlib top-level
package, no word and no math template; math answers are right (recomputed here from the
question text by an independent parser for the templates whose question states every number);
the mix has every source; a missing word list is one clear line.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(os.environ.get("DFLASH_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SRC / "tools"))
import make_prompts  # noqa: E402

WORDS = "/usr/share/dict/words"


def words_arg():
    return WORDS if os.path.isfile(WORDS) else "stdlib"


def load(path):
    return [json.loads(l) for l in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "p"
    make_prompts.make(str(out), n_train=1200, n_eval=200, seed=3, words=words_arg())
    return out


def test_valid_chat_and_mix(made):
    for split, n in [("train", 1200), ("eval", 200)]:
        recs = load(made / f"{split}.jsonl")
        assert len(recs) == n
        assert len({r["id"] for r in recs}) == n
        assert len({r["messages"][0]["content"] for r in recs}) == n  # no duplicate prompts
        for r in recs:
            assert r["messages"] == [{"role": "user", "content": r["messages"][0]["content"]}]
            assert r["messages"][0]["content"].strip()
        kinds = {r["source"].split("/")[0] for r in recs}
        assert kinds == {"code", "math", "topics"}
    info = json.loads((made / "prompts_info.json").read_text())
    assert info["counts"]["train"]["total"] == 1200 and info["seed"] == 3


def sources(recs):
    mods, words, templates = set(), set(), set()
    for r in recs:
        kind, rest = r["source"].split("/", 1)
        if kind == "code":
            mods.add(rest.split(":")[1].split(".")[0])
        elif kind == "topics":
            words.update(rest.split(":")[1].split(","))
        else:
            templates.add(rest)
    return mods, words, templates


def test_held_out_by_source(made):
    tm, tw, tt = sources(load(made / "train.jsonl"))
    em, ew, et = sources(load(made / "eval.jsonl"))
    assert tm and em and not (tm & em), tm & em
    assert tw and ew and not (tw & ew), tw & ew
    assert tt and et and not (tt & et), tt & et
    assert et <= set(make_prompts.EVAL_MATH) and tt <= set(make_prompts.TRAIN_MATH)


def check_answer(q, a):
    """An independent reading of the question -> the expected answer (None: not checked)."""
    n = [int(x) for x in re.findall(r"-?\d+", q)]
    if q.startswith(("What is", "Calculate", "Please solve this: What is", "Please solve this: Calculate")):
        m = re.search(r"(\d+) (\+|-|times|divided by) (\d+)", q)
        if m:
            x, op, y = int(m.group(1)), m.group(2), int(m.group(3))
            return str({"+": x + y, "-": x - y, "times": x * y, "divided by": x // y}[op])
        m = re.search(r"(\d+) squared", q)
        if m:
            return str(int(m.group(1)) ** 2)
        m = re.search(r"remainder when (\d+) is divided by (\d+)", q)
        if m:
            return str(int(m.group(1)) % int(m.group(2)))
    m = re.search(r"Solve for x: (\d+)x ([+-]) (\d+) = (-?\d+)", q)
    if m:
        a_, s, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        return str((c - (b if s == "+" else -b)) // a_)
    m = re.search(r"(\d+) minutes\?", q)
    if m:
        t = int(m.group(1))
        return f"{t // 60} hours {t % 60} minutes"
    if "rectangle is" in q and "area" in q:
        return str(n[0] * n[1])
    if "perimeter" in q:
        return str(2 * (n[0] + n[1]))
    return None


def test_math_answers(made):
    checked = 0
    for split in ["train", "eval"]:
        for r in load(made / f"{split}.jsonl"):
            if r["source"].startswith("math/"):
                want = check_answer(r["messages"][0]["content"], r["answer"])
                if want is not None:
                    assert r["answer"] == want, r
                    checked += 1
    assert checked > 100


def test_deterministic(made, tmp_path):
    make_prompts.make(str(tmp_path / "again"), n_train=1200, n_eval=200, seed=3, words=words_arg())
    for f in ["train.jsonl", "eval.jsonl"]:
        assert (tmp_path / "again" / f).read_bytes() == (made / f).read_bytes()
    make_prompts.make(str(tmp_path / "other"), n_train=1200, n_eval=200, seed=4, words=words_arg())
    a = {r["messages"][0]["content"] for r in load(made / "train.jsonl")}
    b = {r["messages"][0]["content"] for r in load(tmp_path / "other" / "train.jsonl")}
    assert len(a & b) < len(a) // 2


def test_missing_word_list(tmp_path):
    r = subprocess.run([sys.executable, str(SRC / "tools" / "make_prompts.py"), "--out", str(tmp_path / "o"),
                        "--words", str(tmp_path / "nowords")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "nowords" in r.stderr and "wamerican" in r.stderr, r.stderr
