#!/usr/bin/env python3
"""Chat JSONL -> the pre-tokenised prompts file of `dflash_rank eval` (docs/eval.md).

Each input line is a conversation in the formats tools/prepare_data.py reads (OpenAI
"messages" or ShareGPT "conversations"). The prompt is the conversation up to its first
assistant turn (all of it when it has none), rendered with the target's own chat template
(transformers apply_chat_template, add_generation_prompt=True) and tokenised with the target's
tokenizer; the template writes the special tokens, so none are added. Output, one line each:
  {"id": "<file>:<line>", "input_ids": [...]}

Held out: --exclude TRAIN.jsonl ... drops every prompt whose rendering equals a prompt of those
files (the training data), so the eval measures prompts the drafter never saw; --limit N keeps
the first N prompts left. Malformed lines are reported as FILE:LINE: reason and skipped
(--strict: exit 2 instead).

  python tools/prepare_prompts.py --model TARGET_DIR --in chat.jsonl --out prompts.jsonl \\
      [--exclude train.jsonl] [--limit 64] [--chat-template-kwargs '{"enable_thinking": false}']
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterator, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_data import ROLES, SHAREGPT_ROLES, Malformed  # noqa: E402


def prompt_messages(line: str) -> List[Dict[str, str]]:
    """One JSONL line -> the messages before its first assistant turn; raises Malformed."""
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
        role = SHAREGPT_ROLES.get(role.lower()) if key == "conversations" else role
        if role not in ROLES:
            raise Malformed(f"{key}[{i}]: unknown role {t[rk]!r}")
        if role == "assistant":
            break
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise Malformed("no user turn before the first assistant turn")
    return out


def lines(paths: Sequence[str]) -> Iterator[Tuple[str, int, str]]:
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield p, n, line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model directory (tokenizer + chat template)")
    ap.add_argument("--in", dest="inputs", required=True, nargs="+", help="chat JSONL file(s)")
    ap.add_argument("--out", required=True, help="prompts JSONL for eval.prompts")
    ap.add_argument("--exclude", nargs="*", default=[], help="chat JSONL (training data) whose prompts to leave out")
    ap.add_argument("--limit", type=int, default=0, help="keep the first N prompts (0: all)")
    ap.add_argument("--chat-template-kwargs", default="{}", help="JSON passed to apply_chat_template")
    ap.add_argument("--strict", action="store_true", help="a malformed line is an error (exit 2)")
    a = ap.parse_args(argv)
    try:
        kwargs = json.loads(a.chat_template_kwargs)
        assert isinstance(kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        print(f"error: --chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    if not isinstance(tok.chat_template, str) or not tok.chat_template:
        print(f"error: {a.model}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
              "chat_template.jinja)", file=sys.stderr)
        return 2

    def render(msgs):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)

    seen = set()
    for path, n, line in lines(a.exclude):
        try:
            seen.add(render(prompt_messages(line)))
        except Malformed:
            pass
    bad = kept = dropped = 0
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for path, n, line in lines(a.inputs):
            if a.limit and kept >= a.limit:
                break
            try:
                text = render(prompt_messages(line))
            except Malformed as e:
                if a.strict:
                    os.remove(tmp)
                    print(f"error: {path}:{n}: {e}", file=sys.stderr)
                    return 2
                print(f"{path}:{n}: skipped: {e}", file=sys.stderr)
                bad += 1
                continue
            if text in seen:
                dropped += 1
                continue
            seen.add(text)  # duplicates inside the input once only
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.write(json.dumps({"id": f"{os.path.basename(path)}:{n}", "input_ids": ids}) + "\n")
            kept += 1
    os.replace(tmp, a.out)
    print(f"prepare_prompts: {kept} prompts -> {a.out} ({dropped} left out as seen in --exclude or duplicate, "
          f"{bad} malformed lines skipped)", file=sys.stderr)
    return 0 if kept else 2


if __name__ == "__main__":
    sys.exit(main())
