#!/usr/bin/env python3
"""Real, diverse user prompts with a held-out split by source, from material that ships with
Python and Debian (no dataset package is needed).

Three sources:
  code    functions of the Python standard library, picked with `ast` from its own sources
          (bodies of 4..40 lines, at most 1800 characters): explain this function, write its
          docstring, implement it from its signature and docstring, write unit tests, find
          bugs / edge cases, rewrite it more readably;
  math    templated arithmetic and word problems with known answers (each record carries
          "answer");
  topics  questions about words of a word list (Debian's wamerican, /usr/share/dict/words):
          explain, define, facts, a story, a poem, compare two words.
The eval split uses SOURCES the train split never sees: stdlib modules whose top-level package
hashes into the eval share (crc32(name) % 8 == 0), other words (crc32(word) % 8 == 0), and
math templates of their own (EVAL_MATH). Task phrasings are shared (they are what users ask).

Output (chat JSONL, one prompt per line, the format tools/regenerate.py and tools/prepare_data.py
read; extra keys are ignored by both):
  {"messages": [{"role": "user", "content": "..."}], "id": "train-000001", "source": "code/explain:json",
   "answer": "42"  (math only)}
in OUT/train.jsonl and OUT/eval.jsonl, and OUT/prompts_info.json (counts per source, the split
rule, the seed, the Python version whose stdlib was read). Deterministic for a seed, a Python
version and a word list.

  python tools/make_prompts.py --out data/prompts [--train 10000] [--eval 512] [--seed 0]
                               [--words /usr/share/dict/words | --words stdlib]
--words stdlib takes the words from the standard library's docstrings instead (machines without
wamerican).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import sys
import sysconfig
import zlib
from typing import Callable, Dict, List, Optional, Tuple

EVAL_MOD = 8  # a unit (top-level package, word) is held out when crc32(unit) % EVAL_MOD == 0
MIX = {"code": 0.4, "math": 0.3, "topics": 0.3}
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
             "ensurepip", "pydoc_data", "__pycache__", "tkinter", "venv"}


def fail(msg: str):
    """Bad input: one line on stderr, exit code 2."""
    print(f"make_prompts: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def held_out(unit: str) -> bool:
    return zlib.crc32(unit.encode()) % EVAL_MOD == 0


# ---- code ---------------------------------------------------------------------------------------

CODE_TASKS: List[Tuple[str, str, bool]] = [
    # (name, template, needs a docstring)
    ("explain", "Explain what this Python function from the `{mod}` module does, step by step:\n\n"
                "```python\n{src}\n```", False),
    ("docstring", "Write a clear docstring for this Python function (from `{mod}`):\n\n"
                  "```python\n{nodoc}\n```", False),
    ("implement", "Implement this Python function. Here are its signature and docstring:\n\n"
                  "```python\n{stub}\n```", True),
    ("tests", "Write a few unit tests with `unittest` for this function:\n\n```python\n{src}\n```", False),
    ("review", "Review this Python code. Are there edge cases or bugs to watch out for?\n\n"
               "```python\n{src}\n```", False),
    ("simplify", "Can this function be written more simply or more readably? Show your version.\n\n"
                 "```python\n{nodoc}\n```", False),
    ("summary", "In one or two sentences, what is `{name}` in Python's `{mod}` module for?\n\n"
                "```python\n{src}\n```", False),
]


def stdlib_files(root: str) -> List[Tuple[str, str]]:
    """(module name, path) of the standard library's .py files, sorted."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        for f in sorted(files):
            if not f.endswith(".py") or f.startswith("test_") or f == "__main__.py":
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
            if rel.endswith(".__init__"):
                rel = rel[: -len(".__init__")]
            out.append((rel, os.path.join(d, f)))
    return out


def _strip_docstring(src: str, node: ast.FunctionDef, text: str) -> Optional[str]:
    body = node.body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)):
        return src
    lines = text.splitlines()
    first, last = body[0].lineno, body[0].end_lineno
    if len(body) == 1:
        return None
    keep = lines[node.lineno - 1: first - 1] + lines[last: node.end_lineno]
    return _dedent("\n".join(keep))


def _dedent(s: str) -> str:
    import textwrap
    return textwrap.dedent(s).strip("\n")


def code_functions(root: str) -> List[Dict]:
    """Every usable function of the stdlib: name, module, top package, source, variants."""
    funcs = []
    for mod, path in stdlib_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            n = node.end_lineno - node.lineno + 1
            if not 4 <= n <= 40:
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            src = _dedent("\n".join(lines[start - 1: node.end_lineno]))
            if len(src) > 1800 or "\t" in src:
                continue
            doc = ast.get_docstring(node)
            nodoc = _strip_docstring(src, node, text)
            stub = None
            if doc and len(doc) >= 40:
                head = _dedent("\n".join(lines[start - 1: node.body[0].lineno - 1]))
                ind = " " * 4
                body = "\n".join((ind + l).rstrip() for l in doc.strip().splitlines())
                stub = head + "\n" + ind + '"""' + body.lstrip() + "\n" + ind + '"""'
            funcs.append({"name": node.name, "mod": mod, "top": mod.split(".")[0], "src": src,
                          "nodoc": nodoc, "stub": stub})
    return funcs


def code_prompts(root: str) -> Tuple[List[Dict], List[Dict]]:
    """All (function, task) prompts, split by top-level package."""
    train, ev = [], []
    for fn in code_functions(root):
        for task, tpl, needs_doc in CODE_TASKS:
            if (needs_doc and not fn["stub"]) or ("{nodoc}" in tpl and not fn["nodoc"]):
                continue
            text = tpl.format(mod=fn["mod"], name=fn["name"], src=fn["src"], nodoc=fn["nodoc"], stub=fn["stub"])
            rec = {"content": text, "source": f"code/{task}:{fn['mod']}"}
            (ev if held_out(fn["top"]) else train).append(rec)
    return train, ev


# ---- math ---------------------------------------------------------------------------------------

def _fmt(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0").rstrip(".")


def _m_add(r):
    a, b = r.randint(10, 9999), r.randint(10, 9999)
    return f"What is {a} + {b}?", a + b


def _m_sub(r):
    a, b = sorted((r.randint(10, 9999), r.randint(10, 9999)), reverse=True)
    return f"Calculate {a} - {b}.", a - b


def _m_mul(r):
    a, b = r.randint(2, 99), r.randint(2, 999)
    return f"What is {a} times {b}?", a * b


def _m_div(r):
    b, q = r.randint(2, 30), r.randint(2, 300)
    return f"What is {b * q} divided by {b}?", q


def _m_shop(r):
    item = r.choice(["pencils", "apples", "notebooks", "stickers", "bananas", "erasers"])
    p, n = r.randint(2, 95), r.randint(2, 40)
    return f"A shop sells {item} for {p} cents each. How many cents do {n} {item} cost?", p * n


def _m_give(r):
    who = r.choice(["Tom", "Maria", "Ken", "Aisha", "Lena", "Omar"])
    a = r.randint(10, 200)
    b = r.randint(1, a - 1)
    thing = r.choice(["marbles", "cards", "cookies", "coins", "stamps"])
    return f"{who} has {a} {thing} and gives {b} of them to a friend. How many {thing} are left?", a - b


def _m_speed(r):
    v, t = r.randint(20, 120), r.randint(2, 9)
    return f"A train travels at {v} km/h for {t} hours. How far does it travel?", v * t


def _m_percent(r):
    p, n = r.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), r.randint(2, 80) * 20
    return f"What is {p}% of {n}?", p * n / 100


def _m_linear(r):
    x, a, b = r.randint(-20, 20), r.randint(2, 12), r.randint(-50, 50)
    return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}", x


def _m_rect(r):
    w, h = r.randint(2, 60), r.randint(2, 60)
    return f"A rectangle is {w} cm wide and {h} cm long. What is its area?", w * h


def _m_minutes(r):
    m = r.randint(61, 1000)
    return f"How many hours and minutes are {m} minutes?", f"{m // 60} hours {m % 60} minutes"


def _m_mean(r):
    xs = [r.randint(1, 100) for _ in range(r.randint(3, 7))]
    return f"What is the average of {', '.join(map(str, xs))}?", sum(xs) / len(xs)


# held-out templates (never in train)
def _m_remainder(r):
    a, b = r.randint(20, 5000), r.randint(3, 40)
    return f"What is the remainder when {a} is divided by {b}?", a % b


def _m_recipe(r):
    e, p = r.randint(2, 6), r.randint(2, 6)
    k = r.randint(2, 5)
    return f"A recipe needs {e} eggs for {p} people. How many eggs are needed for {p * k} people?", e * k


def _m_perimeter(r):
    w, h = r.randint(2, 90), r.randint(2, 90)
    return f"What is the perimeter of a rectangle with sides {w} m and {h} m?", 2 * (w + h)


def _m_square(r):
    a = r.randint(11, 199)
    return f"What is {a} squared?", a * a


def _m_ages(r):
    a, d = r.randint(5, 40), r.randint(2, 30)
    return f"Sam is {a} years old and his mother is {d} years older than twice his age. How old is his mother?", 2 * a + d


TRAIN_MATH: Dict[str, Callable] = {"add": _m_add, "sub": _m_sub, "mul": _m_mul, "div": _m_div, "shop": _m_shop,
                                   "give": _m_give, "speed": _m_speed, "percent": _m_percent,
                                   "linear": _m_linear, "rect": _m_rect, "minutes": _m_minutes, "mean": _m_mean}
EVAL_MATH: Dict[str, Callable] = {"remainder": _m_remainder, "recipe": _m_recipe, "perimeter": _m_perimeter,
                                  "square": _m_square, "ages": _m_ages}
MATH_STYLES = ["{q}", "{q} Show your work.", "{q} Explain your reasoning step by step.",
               "Please solve this: {q}", "{q} Give the final answer at the end."]


def math_prompts(rng: random.Random, templates: Dict[str, Callable], n: int) -> List[Dict]:
    out, seen = [], set()
    names = sorted(templates)
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        name = names[len(out) % len(names)]
        q, ans = templates[name](rng)
        text = rng.choice(MATH_STYLES).format(q=q)
        if text in seen:
            continue
        seen.add(text)
        out.append({"content": text, "source": f"math/{name}", "answer": ans if isinstance(ans, str) else _fmt(ans)})
    return out


# ---- topics -------------------------------------------------------------------------------------

TOPIC_TASKS = [
    ("explain", "Tell me about {w}."),
    ("define", "What does the word \"{w}\" mean? Use it in two example sentences."),
    ("facts", "Give me three interesting facts related to {w}."),
    ("story", "Write a short story (about 100 words) that involves {w}."),
    ("poem", "Write a short poem about {w}."),
    ("child", "Explain \"{w}\" to a ten-year-old."),
    ("compare", "What is the difference between {w} and {w2}?"),
    ("email", "Write a short, friendly email to a colleague that mentions {w}."),
    ("list", "List five words related to \"{w}\" and say how each is related."),
]


def read_words(spec: str, stdlib_root: str) -> Tuple[List[str], str]:
    """Lower-case alphabetic words of 4..14 letters, sorted and unique; -> (words, description)."""
    if spec == "stdlib":
        words = set()
        for _, path in stdlib_files(stdlib_root):
            try:
                tree = ast.parse(open(path, encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                    doc = ast.get_docstring(node)
                    if doc:
                        words.update(w for w in re.findall(r"\b[a-z]{5,14}\b", doc))
        return sorted(words), "words of the Python standard library's docstrings"
    if not os.path.isfile(spec):
        fail(f"word list {spec} does not exist (install Debian's wamerican, pass --words FILE, "
             f"or --words stdlib)")
    with open(spec, encoding="utf-8", errors="replace") as f:
        words = {w.strip() for w in f}
    words = {w for w in words if re.fullmatch(r"[a-z]{4,14}", w)}
    return sorted(w for w in words if not _inflected(w, words)), os.path.abspath(spec)


def _inflected(w: str, words) -> bool:
    """An inflected form whose base is in the list ("apples", "walked", "walking", "quickly")."""
    for suffix, repl in (("s", ""), ("es", ""), ("ed", ""), ("ed", "e"), ("ing", ""), ("ing", "e"),
                         ("ly", ""), ("ies", "y"), ("er", ""), ("est", "")):
        if w.endswith(suffix) and w[: len(w) - len(suffix)] + repl in words:
            return True
    return False


def topic_prompts(rng: random.Random, words: List[str], n: int) -> List[Dict]:
    out, seen = [], set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        name, tpl = TOPIC_TASKS[len(out) % len(TOPIC_TASKS)]
        w, w2 = rng.choice(words), rng.choice(words)
        if w == w2:
            continue
        text = tpl.format(w=w, w2=w2)
        if text in seen:
            continue
        seen.add(text)
        out.append({"content": text, "source": f"topics/{name}:{w}" + (f",{w2}" if "{w2}" in tpl else "")})
    return out


# ---- assembly -----------------------------------------------------------------------------------

def split_counts(n: int) -> Dict[str, int]:
    c = {k: int(round(n * v)) for k, v in MIX.items()}
    c["code"] += n - sum(c.values())
    return c


def make(out: str, n_train: int = 10000, n_eval: int = 512, seed: int = 0, words: str = "/usr/share/dict/words",
         stdlib_root: Optional[str] = None, log=sys.stderr) -> Dict:
    root = stdlib_root or sysconfig.get_paths()["stdlib"]
    rng = random.Random(seed)
    word_list, words_desc = read_words(words, root)
    w_train = [w for w in word_list if not held_out(w)]
    w_eval = [w for w in word_list if held_out(w)]
    code_train, code_eval = code_prompts(root)
    ct, ce = split_counts(n_train), split_counts(n_eval)
    for name, have, want in [("train", code_train, ct["code"]), ("eval", code_eval, ce["code"])]:
        if len(have) < want:
            fail(f"only {len(have)} code prompts for {name} in {root}, asked for {want}")
    splits = {
        "train": rng.sample(code_train, ct["code"]) + math_prompts(rng, TRAIN_MATH, ct["math"])
        + topic_prompts(rng, w_train, ct["topics"]),
        "eval": rng.sample(code_eval, ce["code"]) + math_prompts(rng, EVAL_MATH, ce["math"])
        + topic_prompts(rng, w_eval, ce["topics"]),
    }
    os.makedirs(out, exist_ok=True)
    info = {"seed": seed, "python": sys.version.split()[0], "stdlib": root, "words": words_desc,
            "split_rule": f"eval = stdlib top-level packages and words with crc32 % {EVAL_MOD} == 0, "
                          f"math templates {sorted(EVAL_MATH)}; train = the rest, math templates {sorted(TRAIN_MATH)}",
            "counts": {}}
    for split, recs in splits.items():
        rng.shuffle(recs)
        path = os.path.join(out, f"{split}.jsonl")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for i, r in enumerate(recs):
                line = {"messages": [{"role": "user", "content": r["content"]}], "id": f"{split}-{i:06d}",
                        "source": r["source"]}
                if "answer" in r:
                    line["answer"] = r["answer"]
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(path + ".tmp", path)
        counts: Dict[str, int] = {}
        for r in recs:
            k = r["source"].split(":")[0].split("/")[0]
            counts[k] = counts.get(k, 0) + 1
        info["counts"][split] = dict(sorted(counts.items()), total=len(recs))
    info["available"] = {"code_train": len(code_train), "code_eval": len(code_eval),
                         "words_train": len(w_train), "words_eval": len(w_eval)}
    with open(os.path.join(out, "prompts_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"make_prompts: {info['counts']['train']['total']} train and {info['counts']['eval']['total']} eval "
          f"prompts in {out} (train {info['counts']['train']}, eval {info['counts']['eval']})", file=log)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (train.jsonl, eval.jsonl, prompts_info.json)")
    ap.add_argument("--train", type=int, default=10000, help="train prompts")
    ap.add_argument("--eval", type=int, default=512, help="held-out eval prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", default="/usr/share/dict/words",
                    help="word list for topic prompts (one word a line), or 'stdlib'")
    ap.add_argument("--stdlib", default=None, help="standard library directory (default: this Python's)")
    a = ap.parse_args(argv)
    if a.train < 0 or a.eval < 0:
        ap.error("--train and --eval must be >= 0")
    make(a.out, a.train, a.eval, a.seed, a.words, a.stdlib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
