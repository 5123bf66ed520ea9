#!/usr/bin/env python3
"""Chat data -> dflash token shards (docs/data_format.md), with the target's own tokenizer and
chat template (transformers AutoTokenizer.apply_chat_template).

Input: JSONL files, one sample per line, either
  OpenAI style:   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  ShareGPT style: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
(ShareGPT roles human/user -> user, gpt/assistant/chatgpt/model -> assistant, system -> system.)

Loss mask: 1 on every assistant turn, from its first token through its end-of-turn token
(e.g. "<|im_end|>\\n" for Qwen), 0 elsewhere (DFLASH.md §2.1). Assistant spans are found by
  1. the template's {% generation %} markers (return_assistant_tokens_mask) when it has them;
  2. otherwise by rendering prefixes of the conversation incrementally: the text of
     messages[:i] + the generation prompt ends where assistant turn i begins, the text of
     messages[:i+1] ends where it ends — used when every such prefix is a prefix of the full
     rendering;
  3. otherwise (templates that rewrite earlier turns, e.g. Qwen3's thinking blocks): turn i
     starts where messages[:i] + generation prompt stops agreeing with the full rendering, and
     ends after its content and the template's end-of-turn text (learned from a probe
     conversation).
Character spans become token masks through the fast tokenizer's offset mapping.

Samples with fewer than 2 x block_size supervised tokens (within --max-seq-len when given) are
dropped and counted; malformed lines are reported as FILE:LINE: reason and skipped.

  python tools/prepare_data.py --model TARGET_DIR --input chat.jsonl --out data/shards \\
      --block-size 16 [--max-seq-len 3072] [--chat-template-kwargs '{"enable_thinking": false}']
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_shard  # noqa: E402

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "bing": "assistant", "system": "system"}
ROLES = {"system", "user", "assistant"}


class Malformed(ValueError):
    """A line that is not a usable sample; the message says why."""


def parse_sample(line: str) -> List[Dict[str, str]]:
    """One JSONL line -> [{"role", "content"}]; raises Malformed with a reason."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise Malformed(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise Malformed("expected a JSON object with 'messages' or 'conversations'")
    if "messages" in obj:
        turns, rk, ck, key = obj["messages"], "role", "content", "messages"
    elif "conversations" in obj:
        turns, rk, ck, key = obj["conversations"], "from", "value", "conversations"
    else:
        raise Malformed(f"expected a key 'messages' or 'conversations', found {sorted(obj)[:5]}")
    if not isinstance(turns, list) or not turns:
        raise Malformed(f"'{key}' must be a non-empty list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or rk not in t or ck not in t:
            raise Malformed(f"{key}[{i}] must be an object with '{rk}' and '{ck}'")
        role, content = t[rk], t[ck]
        if not isinstance(role, str) or not isinstance(content, str):
            raise Malformed(f"{key}[{i}]: '{rk}' and '{ck}' must be strings")
        role = SHAREGPT_ROLES.get(role.lower(), None) if key == "conversations" else role
        if role not in ROLES:
            raise Malformed(f"{key}[{i}]: unknown role {t[rk]!r} (expected one of "
                            f"{sorted(SHAREGPT_ROLES) if key == 'conversations' else sorted(ROLES)})")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise Malformed("no assistant turn")
    return out


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Renderer:
    """Renders conversations with a tokenizer's chat template and finds assistant spans."""

    def __init__(self, tokenizer, template_kwargs: Optional[dict] = None):
        self.tok = tokenizer
        self.kw = dict(template_kwargs or {})
        tpl = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        if not tpl:
            raise SystemExit("error: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); dflash needs the target's own template")
        self.has_generation = "generation" in tpl and "{% generation" in tpl.replace("{%-", "{%")
        self._eot = None

    def render(self, msgs, add_generation_prompt=False) -> str:
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.kw)

    def end_of_turn(self) -> str:
        """The text a template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
        if self._eot is None:
            probe = "dflashprobe"
            base = [{"role": "user", "content": "hi"}]
            full = self.render(base + [{"role": "assistant", "content": probe},
                                       {"role": "user", "content": "again"}])
            nxt = self.render(base + [{"role": "assistant", "content": probe}], add_generation_prompt=False)
            j = full.find(probe)
            tail = full[j + len(probe):]
            # up to where the next (user) turn's header begins: the longest prefix of `tail`
            # that the two-turn rendering also has right after the probe
            alone = nxt[nxt.find(probe) + len(probe):]
            self._eot = tail[:_common_prefix(tail, alone)] if alone else ""
            if not self._eot:
                raise SystemExit("error: cannot determine the chat template's end-of-turn text")
        return self._eot

    def spans(self, msgs) -> List[Tuple[int, int]]:
        """Character spans [start, end) of the assistant turns in render(msgs)."""
        full = self.render(msgs)
        idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        out = []
        prefix_ok = True
        for i in idx:
            if i == 0:
                raise Malformed("the conversation starts with an assistant turn")
            before = self.render(msgs[:i], add_generation_prompt=True)
            after = self.render(msgs[:i + 1])
            if not (full.startswith(before) and full.startswith(after) and len(after) > len(before)):
                prefix_ok = False
                break
            out.append((len(before), len(after)))
        if prefix_ok:
            return out
        # Fallback 3: templates that rewrite earlier turns.
        eot = self.end_of_turn()
        out, cursor = [], 0
        for i in idx:
            before = self.render(msgs[:i], add_generation_prompt=True)
            start = max(_common_prefix(before, full), cursor)
            content = msgs[i]["content"].strip()
            j = full.find(content, start) if content else start
            if j < 0:
                raise Malformed(f"cannot locate assistant turn {i} in the rendered conversation")
            k = full.find(eot, j + len(content))
            if k < 0:
                raise Malformed(f"cannot find the end of assistant turn {i} ({eot!r})")
            out.append((start, k + len(eot)))
            cursor = k + len(eot)
        return out

    def encode(self, msgs) -> Tuple[List[int], List[int]]:
        """-> (ids, loss_mask) of one conversation."""
        if self.has_generation:
            enc = self.tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, **self.kw)
            ids = list(enc["input_ids"])
            mask = [int(x) for x in enc["assistant_masks"]]
            return ids, mask
        spans = self.spans(msgs)
        text = self.render(msgs)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        s = 0
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            while s < len(spans) and spans[s][1] <= a:
                s += 1
            if s < len(spans) and spans[s][0] <= a < spans[s][1] and b > a:
                mask[t] = 1
        return ids, mask


# ---- parallel driver ------------------------------------------------------------------------
_worker: Optional[Renderer] = None


def _init_worker(model: str, kwargs: dict) -> None:
    global _worker
    from transformers import AutoTokenizer
    _worker = Renderer(AutoTokenizer.from_pretrained(model), kwargs)


def _process(item: Tuple[str, int, str]):
    path, lineno, line = item
    try:
        msgs = parse_sample(line)
        ids, mask = _worker.encode(msgs)
        return path, lineno, ids, mask, None
    except Malformed as e:
        return path, lineno, None, None, str(e)


@dataclass
class Summary:
    lines: int = 0
    written: int = 0
    malformed: int = 0
    too_few_supervised: int = 0
    blank: int = 0
    tokens: int = 0
    supervised: int = 0
    truncated: int = 0
    errors: List[str] = field(default_factory=list)


def _lines(paths: Sequence[str]):
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield p, n, line


def prepare(model: str, inputs: Sequence[str], out: str, block_size: int, max_seq_len: int = 0,
            template_kwargs: Optional[dict] = None, workers: int = 1, tokens_per_shard: int = 1 << 28,
            max_reported: int = 50, log=sys.stderr) -> Summary:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    kwargs = dict(template_kwargs or {})
    writer = dflash_shard.ShardWriter(out, vocab, tokens_per_shard)
    summ = Summary()

    def items():
        for p, n, line in _lines(inputs):
            summ.lines += 1
            if not line.strip():
                summ.blank += 1
                continue
            yield p, n, line

    if workers > 1:
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (model, kwargs))
        results = pool.imap(_process, items(), chunksize=32)
    else:
        global _worker
        _worker = Renderer(tok, kwargs)
        pool = None
        results = map(_process, items())
    min_sup = 2 * block_size
    for path, lineno, ids, mask, err in results:
        if err is not None:
            summ.malformed += 1
            msg = f"{path}:{lineno}: {err}"
            summ.errors.append(msg)
            if summ.malformed <= max_reported:
                print(f"prepare_data: skipped {msg}", file=log)
            continue
        if max_seq_len and len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            summ.truncated += 1
        if sum(mask) < min_sup:
            summ.too_few_supervised += 1
            continue
        writer.add(ids, mask)
        summ.written += 1
        summ.tokens += len(ids)
        summ.supervised += sum(mask)
    if pool is not None:
        pool.close()
        pool.join()
    paths = writer.close()
    if summ.malformed > max_reported:
        print(f"prepare_data: ... {summ.malformed - max_reported} more malformed lines", file=log)
    info = {"model": os.path.abspath(model), "inputs": [os.path.abspath(p) for p in inputs],
            "vocab_size": vocab, "block_size": block_size, "max_seq_len": max_seq_len,
            "chat_template_kwargs": kwargs, "shards": [os.path.basename(p) for p in paths],
            "lines": summ.lines, "written": summ.written, "malformed": summ.malformed,
            "dropped_too_few_supervised": summ.too_few_supervised, "blank": summ.blank,
            "truncated": summ.truncated, "tokens": summ.tokens, "supervised_tokens": summ.supervised}
    tmp = os.path.join(out, "prepare_info.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, os.path.join(out, "prepare_info.json"))
    print(f"prepare_data: {summ.lines} lines -> {summ.written} documents ({summ.tokens} tokens, "
          f"{summ.supervised} supervised) in {len(paths)} shard(s) under {out}; dropped: "
          f"{summ.malformed} malformed, {summ.too_few_supervised} with fewer than {min_sup} supervised tokens, "
          f"{summ.blank} blank; {summ.truncated} truncated to {max_seq_len}", file=log)
    return summ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model directory (tokenizer + chat template)")
    ap.add_argument("--input", required=True, nargs="+", help="chat JSONL file(s)")
    ap.add_argument("--out", required=True, help="output directory for *.dfshard files")
    ap.add_argument("--block-size", type=int, default=16, help="drafter block size (drop rule: 2 x block size)")
    ap.add_argument("--max-seq-len", type=int, default=0, help="truncate documents (0: keep; the trainer "
                    "truncates to data.max_seq_len anyway)")
    ap.add_argument("--chat-template-kwargs", default="{}", help="JSON passed to apply_chat_template, "
                    "e.g. '{\"enable_thinking\": false}' for Qwen3 non-thinking drafters")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--tokens-per-shard", type=int, default=1 << 28)
    a = ap.parse_args(argv)
    for p in a.input:
        if not os.path.isfile(p):
            print(f"prepare_data: error: input {p} does not exist", file=sys.stderr)
            return 2
    try:
        kwargs = json.loads(a.chat_template_kwargs)
        assert isinstance(kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        print(f"prepare_data: error: --chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}",
              file=sys.stderr)
        return 2
    s = prepare(a.model, a.input, a.out, a.block_size, a.max_seq_len, kwargs, a.workers, a.tokens_per_shard)
    if s.written == 0:
        print("prepare_data: error: no document was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
