"""tools/prepare_data.py and the shard format, end to end with a tokenizer built here.

The tokenizer is a tiny byte-level BPE trained with the `tokenizers` library, wrapped in
transformers' PreTrainedTokenizerFast with Qwen-style special tokens and one of three chat
templates: plain Qwen2.5-style (prefix rendering works), Qwen3-style (rewrites earlier turns:
the fallback path), and one with {% generation %} markers (transformers' assistant mask).
The expected loss mask is computed independently: the decoded supervised runs must be exactly
the assistant contents followed by "<|im_end|>\\n" (plus the think block where the template
injects it). Finally the C++ reader (tests/data/dflash_shard_dump) is compared against an
independent Python implementation of docs/data_format.md's order and packing rules.
"""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

SRC = os.environ.get("DFLASH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tools"))
import dflash_shard  # noqa: E402
import prepare_data  # noqa: E402

QWEN25 = ("{%- for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n'}}"
          "{%- endfor %}{%- if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{%- endif %}")
# Like Qwen3: the assistant turns after the last user turn get an (empty) think block; earlier
# ones do not, so rendering a prefix of the conversation is not a prefix of the full rendering.
QWEN3 = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
         "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
         "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
         "{{'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n'}}"
         "{%- else %}{{'<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n'}}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{%- endif %}")
GENERATION = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{{'<|im_start|>assistant\\n'}}"
              "{% generation %}{{m.content + '<|im_end|>\\n'}}{% endgeneration %}"
              "{%- else %}{{'<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n'}}{%- endif %}"
              "{%- endfor %}{%- if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{%- endif %}")

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras "
         "numbers 0 1 2 3 4 5 6 7 8 9 and code def return if else for in print hello world").split()


def make_tokenizer(path, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 12)) for _ in range(300)] + ["<think>\n\n</think>\n\n", "user\nassistant\n"]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


def sentence(rng, n):
    return " ".join(rng.choice(WORDS, n))


def conversations(seed, n):
    """n chat samples (OpenAI and ShareGPT styles alternating), with the expected supervised
    texts for the plain template."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = int(rng.integers(1, 4))
        msgs = [{"role": "system", "content": "you are " + sentence(rng, 3)}] if i % 3 == 0 else []
        for _ in range(turns):
            msgs.append({"role": "user", "content": sentence(rng, int(rng.integers(2, 8)))})
            msgs.append({"role": "assistant", "content": sentence(rng, int(rng.integers(8, 20)))})
        if i % 2:
            role = {"system": "system", "user": "human", "assistant": "gpt"}
            obj = {"conversations": [{"from": role[m["role"]], "value": m["content"]} for m in msgs]}
        else:
            obj = {"messages": msgs}
        out.append((obj, msgs))
    return out


def supervised_runs(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("name,template", [("qwen25", QWEN25), ("qwen3", QWEN3), ("generation", GENERATION)])
def test_loss_mask_covers_exactly_the_assistant_turns(tmp_path, name, template):
    from transformers import AutoTokenizer
    model = make_tokenizer(str(tmp_path / "tok"), template)
    tok = AutoTokenizer.from_pretrained(model)
    samples = conversations(1, 24)
    inp = tmp_path / "chat.jsonl"
    inp.write_text("".join(json.dumps(o) + "\n" for o, _ in samples))
    log = io.StringIO()
    s = prepare_data.prepare(model, [str(inp)], str(tmp_path / "out"), block_size=1, log=log)
    assert s.malformed == 0 and s.too_few_supervised == 0 and s.written == len(samples), log.getvalue()
    docs = list(dflash_shard.iter_documents(sorted(str(p) for p in (tmp_path / "out").glob("*.dfshard"))))
    assert len(docs) == len(samples)
    renderer = prepare_data.Renderer(tok)
    for (obj, msgs), (ids, mask) in zip(samples, docs):
        # The ids are exactly the tokenized rendering of the conversation.
        assert list(ids) == tok(renderer.render(msgs), add_special_tokens=False)["input_ids"]
        expect = []
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                think = "<think>\n\n</think>\n\n" if name == "qwen3" and i > last_user else ""
                expect.append(think + m["content"] + "<|im_end|>\n")
        assert supervised_runs(tok, ids, mask) == expect
        # Nothing of the user/system text or the assistant header is supervised.
        assert mask[0] == 0


def test_malformed_lines_reported_with_line_numbers_and_short_samples_dropped(tmp_path):
    model = make_tokenizer(str(tmp_path / "tok"), QWEN25)
    good = {"messages": [{"role": "user", "content": "hello world"},
                         {"role": "assistant", "content": " ".join(["the quick brown fox"] * 10)}]}
    short = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "dog"}]}
    lines = [
        json.dumps(good),                                                    # 1
        "{not json",                                                         # 2
        json.dumps({"text": "no chat"}),                                     # 3
        "",                                                                  # 4 blank: ignored
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),    # 5
        json.dumps({"messages": [{"role": "user", "content": "only"}]}),     # 6
        json.dumps(short),                                                   # 7 dropped: too few
        json.dumps({"messages": [{"role": "user", "content": 3}]}),          # 8
        json.dumps(good),                                                    # 9
        "[1, 2]",                                                            # 10
    ]
    inp = tmp_path / "mixed.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    log = io.StringIO()
    s = prepare_data.prepare(model, [str(inp)], str(tmp_path / "out"), block_size=4, log=log)
    out = log.getvalue()
    for n, why in [(2, "invalid JSON"), (3, "'messages' or 'conversations'"), (5, "unknown role 'alien'"),
                   (6, "no assistant turn"), (8, "must be strings"), (10, "JSON object")]:
        assert f"{inp}:{n}: " in out and why in out, (n, why, out)
    for n in (1, 4, 7, 9):
        assert f"{inp}:{n}:" not in out, out
    assert (s.written, s.malformed, s.too_few_supervised, s.blank) == (2, 6, 1, 1)
    assert "1 with fewer than 8 supervised tokens" in out
    info = json.loads((tmp_path / "out" / "prepare_info.json").read_text())
    assert info["written"] == 2 and info["malformed"] == 6 and info["dropped_too_few_supervised"] == 1
    # The command line reports the same and exits 0; a file with nothing usable exits 1.
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "prepare_data.py"), "--model", model,
                        "--input", str(inp), "--out", str(tmp_path / "cli"), "--block-size", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and f"{inp}:5: " in r.stderr, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "prepare_data.py"), "--model", model,
                        "--input", str(bad), "--out", str(tmp_path / "cli2")], capture_output=True, text=True)
    assert r.returncode == 1 and f"{bad}:1: invalid JSON" in r.stderr and "no document" in r.stderr, r.stderr


# ---- an independent Python reading of docs/data_format.md's batch rules ------------------------
M64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def document_order(n, seed, epoch):
    s, first = splitmix64(seed & M64)
    s = first ^ ((epoch * 0xD1B54A32D192ED03 + 0x5851F42D4C957F2D) & M64)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = M64 - (M64 % bound)  # UINT64_MAX - UINT64_MAX % n
        while True:
            s, r = splitmix64(s)
            if r < limit:
                break
        j = r % bound
        order[i], order[j] = order[j], order[i]
    return order


def python_batches(docs, batch_tokens, max_seq_len, seed, epochs):
    out = []
    for e in range(epochs):
        cur, used = [], 0
        for g in document_order(len(docs), seed, e):
            n = min(len(docs[g][0]), max_seq_len)
            if n == 0:
                continue
            if used and used + n > batch_tokens:
                out.append((e, cur))
                cur, used = [], 0
            cur.append(g)
            used += n
    return out


def test_cpp_reader_matches_python_reference(tmp_path):
    dump = os.path.join(BUILD, "tests", "data", "dflash_shard_dump")
    if not os.path.exists(dump):
        pytest.skip(f"{dump} not built")
    rng = np.random.default_rng(5)
    docs = []
    for i in range(57):
        n = int(rng.integers(0, 90)) if i != 13 else 300
        docs.append((rng.integers(0, 5000, n), rng.integers(0, 2, n)))
    dflash_shard.write_shard(str(tmp_path / "a.dfshard"), docs[:30], 5000)
    dflash_shard.write_shard(str(tmp_path / "b.dfshard"), docs[30:], 5000)
    back, vocab = dflash_shard.read_shard(str(tmp_path / "b.dfshard"))
    assert vocab == 5000 and all((x == y).all() for (x, _), (y, _) in zip(back, docs[30:]))
    bt, msl, seed = 200, 120, 1234
    ref = python_batches(docs, bt, msl, seed, epochs=3)
    r = subprocess.run([dump, str(bt), str(msl), str(seed), "0", str(len(ref)), str(tmp_path)],
                       capture_output=True, text=True, check=True)
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(got) == len(ref)
    for k, ((epoch, gdocs), b) in enumerate(zip(ref, got)):
        assert b["k"] == k and b["epoch"] == epoch and b["docs"] == gdocs
        ids = np.concatenate([docs[g][0][:msl] for g in gdocs])
        mask = np.concatenate([docs[g][1][:msl] for g in gdocs])
        assert b["ids"] == ids.tolist() and b["mask"] == mask.tolist()
        assert b["cu"] == [0] + np.cumsum([min(len(docs[g][0]), msl) for g in gdocs]).tolist()
    # A corrupt shard: the reader names it, exit 2.
    raw = bytearray((tmp_path / "a.dfshard").read_bytes())
    raw[70] ^= 0xFF  # offsets[0] high byte... inside offsets[0]: document 0 no longer starts at 0
    (tmp_path / "a.dfshard").write_bytes(bytes(raw))
    r = subprocess.run([dump, str(bt), str(msl), str(seed), "0", "1", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and str(tmp_path / "a.dfshard") in r.stderr, r.stderr
