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

Pre-tokenized rows {"input_ids": [...], "loss_mask": [...]} are written as they are (ids below the
tokenizer's vocabulary, mask 0/1, equal lengths).

Thinking (--thinking keep|drop, default keep, printed once): an assistant turn's
"reasoning_content" (what SGLang, vLLM and SpecForge's regeneration write for thinking models;
"reasoning" and "thinking" are read as the same) is passed to the chat template as
reasoning_content with `keep`, so it is rendered (and supervised) exactly as the template renders
it; a template that never mentions reasoning_content is refused then. `drop` removes the fields.
Supervision (--supervise all|last, default all): every assistant turn, or only the last one.
Held-out split (--holdout-frac F --holdout-out FILE.jsonl): a deterministic fraction F of the rows
(by a hash of the line) is not trained on; each is written as {"messages": the conversation up
to its last assistant turn, "reference": that turn} (pre-tokenized rows: {"input_ids": the ids
before the last supervised run, "reference_ids": that run}) for the evaluation.

Samples with fewer than 2 x block_size supervised tokens (within --max-seq-len when given) are
dropped and counted; malformed lines are reported as FILE:LINE: reason and skipped. Shards are
streamed (tools/dflash_shard.py ShardWriter: memory does not grow with the shard size). A
non-empty --out is refused unless --overwrite, which first removes the old shards and records.
prepare_info.json records the tokenizer's chat template (sha256), the template kwargs, the
thinking and supervision options and the counts; the trainer copies it into the run directory
and every export's config.json.

  python tools/prepare_data.py --model TARGET_DIR --input chat.jsonl --out data/shards \\
      --block-size 16 [--max-seq-len 3072] [--chat-template-kwargs '{"enable_thinking": false}'] \\
      [--thinking keep|drop] [--supervise all|last] [--holdout-frac 0.01 --holdout-out heldout.jsonl]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_shard  # noqa: E402

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "bing": "assistant", "system": "system"}
ROLES = {"system", "user", "assistant"}


class UsageError(Exception):
    """Bad command-line input or model: one line, exit 2."""


class Malformed(ValueError):
    """A line that is not a usable sample; the message says why."""


THINK_FIELDS = ("reasoning_content", "reasoning", "thinking")


def parse_row(line: str, thinking: str = "keep"):
    """One JSONL line -> ("chat", [{"role", "content"[, "reasoning_content"]}]) or ("ids", ids, mask);
    raises Malformed with a reason."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise Malformed(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise Malformed("expected a JSON object with 'messages', 'conversations' or 'input_ids' + 'loss_mask'")
    if "input_ids" in obj:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list):
            raise Malformed("pre-tokenized rows need lists 'input_ids' and 'loss_mask'")
        if len(ids) != len(mask):
            raise Malformed(f"'input_ids' has {len(ids)} entries but 'loss_mask' {len(mask)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise Malformed("'input_ids' must be non-negative integers")
        if not all(m in (0, 1) and not isinstance(m, bool) for m in mask):
            raise Malformed("'loss_mask' values must be 0 or 1")
        return "ids", ids, mask
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
        msg = {"role": role, "content": content}
        think = next((t[f] for f in THINK_FIELDS if isinstance(t.get(f), str) and t[f].strip()), None)
        if think is not None and role == "assistant" and thinking == "keep":
            msg["reasoning_content"] = think
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise Malformed("no assistant turn")
    return "chat", out


def parse_sample(line: str) -> List[Dict[str, str]]:
    """One chat JSONL line -> [{"role", "content"}] (thinking fields dropped); Malformed otherwise."""
    row = parse_row(line, thinking="drop")
    if row[0] != "chat":
        raise Malformed("expected a chat row")
    return row[1]


def last_run_only(mask: List[int]) -> List[int]:
    """The mask with only its last run of 1s kept (the last assistant turn)."""
    out = [0] * len(mask)
    j = len(mask) - 1
    while j >= 0 and not mask[j]:
        j -= 1
    while j >= 0 and mask[j]:
        out[j] = 1
        j -= 1
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
            raise UsageError("--model: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); dflash needs the target's own template")
        self.has_generation = "generation" in tpl and "{% generation" in tpl.replace("{%-", "{%")
        self.renders_reasoning = "reasoning_content" in tpl
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
                raise UsageError("cannot determine the chat template's end-of-turn text")
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
_opts: Dict[str, str] = {}


def _init_worker(model: str, kwargs: dict, opts: Dict[str, str]) -> None:
    global _worker, _opts
    from transformers import AutoTokenizer
    _worker = Renderer(AutoTokenizer.from_pretrained(model), kwargs)
    _opts = dict(opts)


def _heldout(line: str, frac: float) -> bool:
    """A pure function of the line's text: the same rows are held out on every run."""
    if frac <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(line.strip().encode("utf-8")).digest()[:8], "little")
    return h / 2.0**64 < frac


def _holdout_record(row, ids, mask) -> dict:
    if row[0] == "chat":
        msgs = row[1]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return {"messages": msgs[:last], "reference": msgs[last]["content"]}
    j = len(mask) - 1
    while j >= 0 and not mask[j]:
        j -= 1
    end = j + 1
    while j >= 0 and mask[j]:
        j -= 1
    return {"input_ids": list(ids[:j + 1]), "reference_ids": list(ids[j + 1:end])}


def _process(item: Tuple[str, int, str]):
    """-> (path, lineno, kind, ids, mask, error, holdout record or None, had thinking)"""
    path, lineno, line = item
    try:
        row = parse_row(line, _opts.get("thinking", "keep"))
        had_think = row[0] == "chat" and any("reasoning_content" in m for m in row[1])
        if row[0] == "ids":
            ids, mask = list(row[1]), list(row[2])
        else:
            if had_think and not _worker.renders_reasoning:
                raise Malformed("has reasoning_content, but the chat template never renders reasoning_content "
                                "(--thinking keep would lose it): use --thinking drop")
            ids, mask = _worker.encode(row[1])
        if _opts.get("supervise") == "last":
            mask = last_run_only(mask)
        hold = _holdout_record(row, ids, mask) if _heldout(line, float(_opts.get("holdout_frac", 0))) else None
        return path, lineno, row[0], ids, mask, None, hold, had_think
    except Malformed as e:
        return path, lineno, None, None, None, str(e), None, False


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
    pretokenized: int = 0
    with_thinking: int = 0
    held_out: int = 0
    errors: List[str] = field(default_factory=list)


def _lines(paths: Sequence[str]):
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield p, n, line


def _windows(it, n):
    """Consecutive lists of at most n items: the pool never holds more than one window."""
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def prepared_files(out: str) -> List[str]:
    """What a previous run left in `out` (removed by --overwrite)."""
    if not os.path.isdir(out):
        return []
    return sorted(f for f in os.listdir(out)
                  if f.endswith(dflash_shard.EXTENSION) or f == "prepare_info.json" or f.endswith(".tmp"))


def load_tokenizer(model: str):
    if not os.path.isdir(model):
        raise UsageError(f"--model: directory '{model}' does not exist")
    if not any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UsageError(f"--model: '{model}' has no tokenizer (tokenizer.json or tokenizer_config.json); "
                         "expected the target's Hugging Face directory")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model: cannot load the tokenizer of '{model}': {msg}") from None


def prepare(model: str, inputs: Sequence[str], out: str, block_size: int, max_seq_len: int = 0,
            template_kwargs: Optional[dict] = None, workers: int = 1, tokens_per_shard: int = 1 << 28,
            max_reported: int = 50, log=sys.stderr, thinking: str = "keep", supervise: str = "all",
            holdout_frac: float = 0.0, holdout_out: Optional[str] = None, overwrite: bool = False,
            progress: bool = True) -> Summary:
    if thinking not in ("keep", "drop"):
        raise UsageError(f"--thinking must be keep or drop, got {thinking!r}")
    if supervise not in ("all", "last"):
        raise UsageError(f"--supervise must be all or last, got {supervise!r}")
    if not 0 <= holdout_frac < 1:
        raise UsageError(f"--holdout-frac must be in [0, 1), got {holdout_frac}")
    if holdout_frac > 0 and not holdout_out:
        raise UsageError("--holdout-frac needs --holdout-out FILE.jsonl")
    old = prepared_files(out)
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UsageError(f"--out: '{out}' is not empty ({len(old)} shard/record file(s) of an earlier run); "
                         "pass --overwrite to replace them, or choose another directory")
    tok = load_tokenizer(model)
    vocab = len(tok)
    kwargs = dict(template_kwargs or {})
    renderer = Renderer(tok, kwargs)
    for f in old:  # --overwrite: the old shards go first, so only the new ones remain
        os.unlink(os.path.join(out, f))
    if old:
        print(f"prepare_data: --overwrite: removed {len(old)} file(s) of an earlier run from {out}", file=log)
    print(f"prepare_data: --thinking {thinking}: " + (
        "assistant reasoning_content (also 'reasoning', 'thinking') is passed to the chat template, which renders "
        "it inside the supervised turn" if thinking == "keep" else
        "assistant reasoning_content / reasoning / thinking fields are dropped") +
        f"; --supervise {supervise}; template kwargs {json.dumps(kwargs)}", file=log)
    writer = dflash_shard.ShardWriter(out, vocab, tokens_per_shard)
    summ = Summary()
    opts = {"thinking": thinking, "supervise": supervise, "holdout_frac": str(holdout_frac)}
    hold_tmp = holdout_out + ".tmp" if holdout_out else None
    hold_f = open(hold_tmp, "w", encoding="utf-8") if hold_tmp else None
    total_bytes = sum(os.path.getsize(p) for p in inputs)

    def items():
        for p, n, line in _lines(inputs):
            summ.lines += 1
            if not line.strip():
                summ.blank += 1
                continue
            yield p, n, line

    global _worker, _opts
    if workers > 1:
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (model, kwargs, opts))
        results = (r for w in _windows(items(), 256 * workers) for r in pool.imap(_process, w, chunksize=16))
    else:
        _worker, _opts = renderer, opts
        pool = None
        results = map(_process, items())
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare_data", file=log, mininterval=0.5,
                   dynamic_ncols=False, ncols=110)
    done_bytes = 0

    def say(msg):  # a line above the progress bar
        if bar is not None:
            bar.write(msg, file=log)
        else:
            print(msg, file=log)
    t0 = time.monotonic()
    min_sup = 2 * block_size
    try:
        for path, lineno, kind, ids, mask, err, hold, had_think in results:
            if err is not None:
                summ.malformed += 1
                msg = f"{path}:{lineno}: {err}"
                summ.errors.append(msg)
                if summ.malformed <= max_reported:
                    say(f"prepare_data: skipped {msg}")
                continue
            summ.with_thinking += int(had_think)
            if hold is not None:
                hold_f.write(json.dumps(hold, ensure_ascii=False) + "\n")
                summ.held_out += 1
                continue
            if kind == "ids" and ids and max(ids) >= vocab:
                summ.malformed += 1
                msg = f"{path}:{lineno}: token id {max(ids)} is not below the tokenizer's vocabulary {vocab}"
                summ.errors.append(msg)
                if summ.malformed <= max_reported:
                    say(f"prepare_data: skipped {msg}")
                continue
            if max_seq_len and len(ids) > max_seq_len:
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                summ.truncated += 1
            if sum(mask) < min_sup:
                summ.too_few_supervised += 1
                continue
            writer.add(ids, mask)
            summ.pretokenized += int(kind == "ids")
            summ.written += 1
            summ.tokens += len(ids)
            summ.supervised += sum(mask)
            if bar is not None:
                # progress in input bytes (known in advance, so tqdm gives the ETA); tokens/s beside it
                pos = _byte_pos(inputs, path, lineno)
                if pos > done_bytes:
                    bar.update(pos - done_bytes)
                    done_bytes = pos
                dt = max(1e-9, time.monotonic() - t0)
                bar.set_postfix_str(f"{summ.tokens / dt / 1e3:.1f}K tok/s, {summ.written} docs", refresh=False)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if hold_f is not None:
            hold_f.close()
    if bar is not None:
        bar.update(total_bytes - done_bytes)
        bar.close()
    paths = writer.close()
    if hold_tmp:
        os.replace(hold_tmp, holdout_out)
    if summ.malformed > max_reported:
        print(f"prepare_data: ... {summ.malformed - max_reported} more malformed lines", file=log)
    tpl = tok.chat_template if isinstance(tok.chat_template, str) else ""
    info = {"model": os.path.abspath(model), "inputs": [os.path.abspath(p) for p in inputs],
            "vocab_size": vocab, "block_size": block_size, "max_seq_len": max_seq_len,
            "chat_template_sha256": hashlib.sha256(tpl.encode("utf-8")).hexdigest(),
            "chat_template_kwargs": kwargs, "thinking": thinking, "supervise": supervise,
            "holdout_frac": holdout_frac, "holdout_out": os.path.abspath(holdout_out) if holdout_out else None,
            "shards": [os.path.basename(p) for p in paths],
            "lines": summ.lines, "written": summ.written, "malformed": summ.malformed,
            "dropped_too_few_supervised": summ.too_few_supervised, "blank": summ.blank,
            "truncated": summ.truncated, "pretokenized": summ.pretokenized, "with_thinking": summ.with_thinking,
            "held_out": summ.held_out, "tokens": summ.tokens, "supervised_tokens": summ.supervised}
    tmp = os.path.join(out, "prepare_info.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, os.path.join(out, "prepare_info.json"))
    print(f"prepare_data: {summ.lines} lines -> {summ.written} documents ({summ.tokens} tokens, "
          f"{summ.supervised} supervised; {summ.pretokenized} pre-tokenized, {summ.with_thinking} with thinking) "
          f"in {len(paths)} shard(s) under {out}; held out {summ.held_out}; dropped: "
          f"{summ.malformed} malformed, {summ.too_few_supervised} with fewer than {min_sup} supervised tokens, "
          f"{summ.blank} blank; {summ.truncated} truncated to {max_seq_len}", file=log)
    return summ


_offsets_cache: Dict[str, List[int]] = {}


def _byte_pos(inputs: Sequence[str], path: str, lineno: int) -> int:
    """Bytes of input consumed up to the end of `path`:`lineno` (for the progress bar); only
    whole-file boundaries are exact, lines inside a file are estimated from the file's mean line
    length, which needs no second pass over it."""
    before = 0
    for p in inputs:
        if p == path:
            break
        before += os.path.getsize(p)
    lines = _offsets_cache.get(path)
    if lines is None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        per_line = max(1.0, len(head) / max(1, head.count(b"\n")))
        lines = _offsets_cache[path] = [size, per_line]
    size, per_line = lines
    return before + min(size, int(lineno * per_line))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model directory (tokenizer + chat template)")
    ap.add_argument("--input", required=True, nargs="+", help="chat or pre-tokenized JSONL file(s)")
    ap.add_argument("--out", required=True, help="output directory for *.dfshard files (must be empty)")
    ap.add_argument("--overwrite", action="store_true", help="replace the shards and record already in --out")
    ap.add_argument("--block-size", type=int, default=16, help="drafter block size (drop rule: 2 x block size)")
    ap.add_argument("--max-seq-len", type=int, default=0, help="truncate documents (0: keep; the trainer "
                    "truncates to data.max_seq_len anyway)")
    ap.add_argument("--chat-template-kwargs", default="{}", help="JSON passed to apply_chat_template, "
                    "e.g. '{\"enable_thinking\": false}' for Qwen3 non-thinking drafters")
    ap.add_argument("--thinking", choices=["keep", "drop"], default="keep",
                    help="assistant reasoning_content: keep (rendered by the template, supervised) or drop "
                         "(default keep)")
    ap.add_argument("--supervise", choices=["all", "last"], default="all",
                    help="supervise every assistant turn, or only the last one (default all)")
    ap.add_argument("--holdout-frac", type=float, default=0.0, help="fraction of rows held out for the eval")
    ap.add_argument("--holdout-out", default=None, help="JSONL file for the held-out prompts")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--tokens-per-shard", type=int, default=1 << 28)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    try:
        s = prepare(a.model, a.input, a.out, a.block_size, a.max_seq_len, kwargs, a.workers, a.tokens_per_shard,
                    thinking=a.thinking, supervise=a.supervise, holdout_frac=a.holdout_frac,
                    holdout_out=a.holdout_out, overwrite=a.overwrite, progress=not a.no_progress)
    except UsageError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    if s.written == 0:
        print("prepare_data: error: no document was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
