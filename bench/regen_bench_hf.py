#!/usr/bin/env python3
"""transformers' generate() on the prompts of a regeneration, for the tokens/s comparison with
`dflash_rank regenerate` (bench/gpu/quality.sh runs both on the same prompts at the same batch
size in the same run).

Same work as tools/regenerate.py: each prompt rendered with the target's chat template
(tools/regenerate.py's render), greedy, up to --max-new-tokens, a row ends at the target's eos
ids. transformers decodes in static batches of --batch-size (left padding; a batch runs until
its longest row ends, which is how generate() works); the count is the useful tokens: each
row's new tokens up to and including its first eos. One warm-up batch of 4 prompts runs first
and is not timed (kernel selection, allocator growth: in dflash's favour nothing like it is
excluded).

  python bench/regen_bench_hf.py --model DIR --prompts train.jsonl --limit 512 --batch-size 512 \\
      --max-new-tokens 384 [--device cuda] [--dtype bfloat16] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import regenerate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, nargs="+")
    ap.add_argument("--limit", type=int, default=512, help="first N prompts")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped (as regenerate.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM
    tok = regenerate.load_tokenizer(a.model)
    prompts = regenerate.read_prompts(a.prompts)[: a.limit]
    ids = [regenerate.render(tok, m, {}) for m, _ in prompts]
    ids = [x for x in ids if len(x) <= a.max_prompt_tokens]
    stops = regenerate.stop_ids(tok, a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]

    def run(batch):
        n = max(len(x) for x in batch)
        inp = torch.tensor([[pad] * (n - len(x)) + x for x in batch], device=a.device)
        att = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in batch], device=a.device)
        with torch.no_grad():
            out = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=a.max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=pad)[:, n:].tolist()
        useful = 0
        for row in out:
            k = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            useful += k
        return useful

    run(ids[:4])
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.time()
    tokens = 0
    for i in range(0, len(ids), a.batch_size):
        tokens += run(ids[i:i + a.batch_size])
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.time() - t0
    res = {"items": len(ids), "new_tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
           "batch_size": a.batch_size, "max_new_tokens": a.max_new_tokens, "device": a.device, "dtype": a.dtype,
           "implementation": "transformers generate (greedy, static batches)"}
    print(f"regen_bench_hf: {len(ids)} prompts, {tokens} new tokens in {dt:.1f} s: {tokens / dt:.0f} tokens/s "
          f"(batch {a.batch_size})", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
