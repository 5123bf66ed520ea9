#!/usr/bin/env python3
"""Prompts -> chat JSONL whose assistant turns are the target's own responses (the data step
before training: DFlash trains the drafter on what the target itself writes).

Python renders and decodes, C++ generates:
  1. every prompt (chat JSONL: {"messages": [...]} or ShareGPT {"conversations": [...]}; the
     turns before the first assistant turn, ending with a user turn) is rendered with the
     target's chat template (add_generation_prompt=True) and tokenised with its tokenizer, as
     tools/prepare_data.py does;
  2. `dflash_rank regenerate` (trainer/eval/regenerate.h) runs the target on the ids: batched,
     KV cache, continuous batching, greedy or sampled (--temperature, --top-p), --samples
     responses per prompt, each with its own seed; it appends one line per finished response to
     OUT.work/results.jsonl, flushed at once;
  3. the new tokens are decoded and OUT is written (temp file + rename) in prompt order:
     {"messages": [...prompt..., {"role": "assistant", "content": ...}], "id", "sample",
      "finish": "stop" | "length", plus the prompt line's other keys}.
Resumable: killed and restarted with the same arguments, it reads OUT.work/results.jsonl (a torn
last line is dropped), generates only what is missing and writes the same OUT as an
uninterrupted run (greedy; sampled runs too, up to floating-point ties). Settings that change
the responses (model, prompts, samples, temperature, top-p, seed, max new tokens) are recorded
in OUT.work/settings.json and must match on a restart.

  python tools/regenerate.py --model TARGET_DIR --prompts train.jsonl --out chat.jsonl \\
      [--samples 1] [--temperature 0] [--top-p 1] [--seed 0] [--batch-size 64] \\
      [--max-new-tokens 512] [--max-prompt-tokens 1024] [--device auto] [--dtype auto]
      [--engine auto|static|cache] [--check-every 8] [--cuda-graphs on|off]
Exit codes: 0 done, 2 bad input (one line: file:line and what), other: the generator's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = {"system", "user", "assistant"}
SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "model": "assistant", "system": "system"}
TOOL = "regenerate"


class UserError(Exception):
    pass


# ---- prompts ------------------------------------------------------------------------------------

def parse_prompt(line: str) -> Tuple[List[Dict[str, str]], dict]:
    """One JSONL line -> (the turns before the first assistant turn, the line's object)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'messages' or 'conversations'")
    if "messages" in obj:
        turns, rk, ck, key = obj["messages"], "role", "content", "messages"
    elif "conversations" in obj:
        turns, rk, ck, key = obj["conversations"], "from", "value", "conversations"
    else:
        raise ValueError(f"expected a key 'messages' or 'conversations', found {sorted(obj)[:5]}")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{key}' must be a non-empty list")
    msgs = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get(rk), str) or not isinstance(t.get(ck), str):
            raise ValueError(f"{key}[{i}] must be an object with string '{rk}' and '{ck}'")
        role = SHAREGPT.get(t[rk].lower()) if key == "conversations" else t[rk]
        if role not in ROLES:
            raise ValueError(f"{key}[{i}]: unknown role {t[rk]!r}")
        if role == "assistant":
            break
        msgs.append({"role": role, "content": t[ck]})
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError("the prompt (the turns before the first assistant turn) must end with a user turn")
    return msgs, obj


def read_prompts(paths: List[str]) -> List[Tuple[List[Dict[str, str]], dict]]:
    out = []
    for p in paths:
        if not os.path.isfile(p):
            raise UserError(f"prompts file {p} does not exist")
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(parse_prompt(line))
                except ValueError as e:
                    raise UserError(f"{p}:{n}: {e}") from None
    if not out:
        raise UserError(f"no prompts in {', '.join(paths)}")
    return out


def load_tokenizer(model: str):
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise UserError(f"{model} is not a model directory (no config.json)")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model)
    except Exception as e:
        raise UserError(f"{model}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(getattr(tok, "chat_template", None), str) or not tok.chat_template:
        raise UserError(f"{model}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                        f"chat_template.jinja); regeneration renders prompts with the target's own template")
    return tok


def render(tok, msgs, kwargs) -> List[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def stop_ids(tok, model: str) -> List[int]:
    ids = set()
    for f in ("config.json", "generation_config.json"):
        p = os.path.join(model, f)
        if os.path.isfile(p):
            e = json.load(open(p)).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(ids)


def item_seed(seed: int, idx: int, sample: int) -> int:
    h = hashlib.blake2b(f"{seed}:{idx}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


# ---- the results log ----------------------------------------------------------------------------

def read_results(path: str) -> Dict[str, dict]:
    """Finished responses by key; a torn last line (a killed writer) is cut off the file."""
    done: Dict[str, dict] = {}
    if not os.path.exists(path):
        return done
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            done[r["key"]] = r
        except (json.JSONDecodeError, KeyError):
            raise UserError(f"{path}:{n}: not a result line; delete {os.path.dirname(path)} to start over") from None
    return done


def dflash_rank_path(arg: Optional[str]) -> str:
    p = arg or os.path.join(os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build")), "trainer", "dflash_rank")
    if not os.access(p, os.X_OK):
        raise UserError(f"{p} is not an executable (build dflash_rank, or pass --dflash-rank)")
    return p


def _die_with_parent():  # the generator must not outlive a killed wrapper
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run(a) -> int:
    kwargs = json.loads(a.chat_template_kwargs)
    tok = load_tokenizer(a.model)
    prompts = read_prompts(a.prompts)
    if a.limit:
        prompts = prompts[: a.limit]
    work = a.out + ".work"
    settings = {"model": os.path.abspath(a.model), "prompts": [os.path.abspath(p) for p in a.prompts],
                "prompts_sha256": hashlib.sha256(b"".join(open(p, "rb").read() for p in a.prompts)).hexdigest(),
                "limit": a.limit, "samples": a.samples, "temperature": a.temperature, "top_p": a.top_p,
                "seed": a.seed, "max_new_tokens": a.max_new_tokens, "max_prompt_tokens": a.max_prompt_tokens,
                "chat_template_kwargs": kwargs}
    os.makedirs(work, exist_ok=True)
    sp = os.path.join(work, "settings.json")
    if os.path.exists(sp):
        old = json.load(open(sp))
        diff = sorted(k for k in settings if old.get(k) != settings[k])
        if diff:
            raise UserError(f"{work} holds a run with other settings ({', '.join(diff)}); delete it or use another --out")
    else:
        with open(sp + ".tmp", "w") as f:
            json.dump(settings, f, indent=1)
        os.replace(sp + ".tmp", sp)
    results_path = os.path.join(work, "results.jsonl")
    done = read_results(results_path)

    t0 = time.time()
    rendered, too_long = [], 0
    ctx = json.load(open(os.path.join(a.model, "config.json"))).get("max_position_embeddings", 1 << 30)
    limit = min(a.max_prompt_tokens, ctx - a.max_new_tokens)
    for i, (msgs, _) in enumerate(prompts):
        ids = render(tok, msgs, kwargs)
        if len(ids) > limit:
            too_long += 1
            ids = None
        rendered.append(ids)
    keys = [(i, s) for i, ids in enumerate(rendered) if ids is not None for s in range(a.samples)]
    pending = [(i, s) for i, s in keys if f"{i}:{s}" not in done]
    # Longest prompts first: rows decoded together then hold prompts of similar lengths, so the
    # attention over the cache (as long as the longest active row) wastes little on padding.
    pending.sort(key=lambda k: (-len(rendered[k[0]]), k))
    print(f"{TOOL}: {len(prompts)} prompts x {a.samples} samples ({too_long} longer than {limit} tokens skipped), "
          f"rendered in {time.time() - t0:.1f} s; {len(keys) - len(pending)} responses already in {results_path}, "
          f"{len(pending)} to generate", file=sys.stderr, flush=True)
    if pending:
        items = os.path.join(work, "items.jsonl")
        with open(items + ".tmp", "w") as f:
            for i, s in pending:
                f.write(json.dumps({"key": f"{i}:{s}", "input_ids": rendered[i],
                                    "seed": item_seed(a.seed, i, s)}) + "\n")
        os.replace(items + ".tmp", items)
        stats = os.path.join(work, f"stats-{int(time.time())}.json")
        cmd = [dflash_rank_path(a.dflash_rank), "regenerate", "--model", a.model, "--in", items, "--out", results_path,
               "--batch-size", str(a.batch_size), "--max-new-tokens", str(a.max_new_tokens),
               "--temperature", str(a.temperature), "--top-p", str(a.top_p),
               "--stop-ids", ",".join(map(str, stop_ids(tok, a.model))), "--device", a.device, "--dtype", a.dtype,
               "--progress-s", str(a.progress_s), "--stats", stats]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        if a.refill_rows:
            cmd += ["--refill-rows", str(a.refill_rows)]
        cmd += ["--engine", a.engine, "--check-every", str(a.check_every), "--cuda-graphs", a.cuda_graphs]
        r = subprocess.run(cmd, preexec_fn=_die_with_parent)
        if r.returncode != 0:
            return r.returncode
        done = read_results(results_path)
        st = json.load(open(stats))
        print(f"{TOOL}: generated {st['new_tokens']} tokens for {st['items']} responses in {st['seconds']:.1f} s: "
              f"{st['tokens_per_s']:.0f} tokens/s (batch {st['batch_size']}, {st['device']})", file=sys.stderr)
    missing = [k for k in keys if f"{k[0]}:{k[1]}" not in done]
    if missing:
        raise UserError(f"{len(missing)} responses missing from {results_path} after generation (first: {missing[0]})")

    n_stop = n_len = n_dropped = 0
    stops = set(stop_ids(tok, a.model))
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for i, s in keys:
            r = done[f"{i}:{s}"]
            toks = r["tokens"]
            if r["stopped"] and toks and toks[-1] in stops:
                toks = toks[:-1]  # the template writes the end of turn itself
            finish = "stop" if r["stopped"] else "length"
            if finish == "length" and a.drop_unfinished:
                n_dropped += 1
                continue
            n_stop += finish == "stop"
            n_len += finish == "length"
            msgs, obj = prompts[i]
            line = {k: v for k, v in obj.items() if k not in ("messages", "conversations")}
            line.update({"messages": msgs + [{"role": "assistant", "content": tok.decode(toks)}],
                         "id": obj.get("id", i), "sample": s, "finish": finish})
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, a.out)
    print(f"{TOOL}: wrote {n_stop + n_len} conversations to {a.out} ({n_stop} ended by the model, {n_len} cut at "
          f"{a.max_new_tokens} tokens{f', {n_dropped} of those dropped' if n_dropped else ''})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model directory (config.json, weights, tokenizer)")
    ap.add_argument("--prompts", required=True, nargs="+", help="chat JSONL file(s) of prompts")
    ap.add_argument("--out", required=True, help="output chat JSONL (work files in OUT.work/)")
    ap.add_argument("--samples", type=int, default=1, help="responses per prompt (use --temperature > 0)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (each response has its own stream)")
    ap.add_argument("--batch-size", type=int, default=64, help="rows decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    ap.add_argument("--limit", type=int, default=0, help="use the first N prompts (0: all)")
    ap.add_argument("--drop-unfinished", action="store_true", help="leave out responses cut at --max-new-tokens")
    ap.add_argument("--device", default="auto", help="auto (cuda:0 if present), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, f32 on CPU), bf16, f16, f32")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of the generator (0: default)")
    ap.add_argument("--refill-rows", type=int, default=0,
                    help="free rows that trigger a refill prefill (0: batch size / 16)")
    ap.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--engine", default="auto", choices=["auto", "static", "cache"],
                    help="generator engine: static (dense targets, the default) or cache (see dflash_rank regenerate --help)")
    ap.add_argument("--check-every", type=int, default=8, help="static engine: decode steps between host reads")
    ap.add_argument("--cuda-graphs", default="on", choices=["on", "off"], help="static engine on CUDA: graph the decode step")
    ap.add_argument("--chat-template-kwargs", default="{}", help="JSON object for apply_chat_template")
    ap.add_argument("--dflash-rank", help="the dflash_rank binary (default: $DFLASH_BUILD_DIR or build/)")
    a = ap.parse_args(argv)
    if a.samples < 1 or a.batch_size < 1 or a.max_new_tokens < 1:
        ap.error("--samples, --batch-size and --max-new-tokens must be >= 1")
    if a.samples > 1 and a.temperature == 0:
        ap.error("--samples > 1 with greedy decoding gives identical copies: set --temperature")
    try:
        if not isinstance(json.loads(a.chat_template_kwargs), dict):
            raise ValueError
    except ValueError:
        ap.error(f"--chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}")
    try:
        return run(a)
    except UserError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
