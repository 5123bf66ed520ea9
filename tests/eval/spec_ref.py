"""An independent implementation of DFlash speculative decoding, written from DFLASH.md §6 (the
reference loop) and §1 (the drafter), for the tests of `dflash_rank eval`.

Deliberately the simplest form, sharing nothing with the C++ code but the formulas:
- the target is transformers' model, run WITHOUT a KV cache: every prefill/verify recomputes
  the whole sequence (so cache cropping cannot be wrong here); features are the outputs of the
  decoder layers target_layer_ids (forward hooks: DFLASH.md §1.1's definition);
- the draft of each step is the drafter's TRAINING forward of tests/drafter/dflash_ref.py with one
  block anchored at the block start (context = features of the positions before it, block =
  [last token, MASK x (bs - 1)], positions start .. start + bs - 1), i.e. no draft cache either:
  the context is recomputed from all features each step;
- greedy acceptance: the longest prefix with draft[1 + i] == argmax of the target at block
  offset i, plus the bonus token; tau = mean over steps of (accepted + 1).
CPU, float32. One prompt at a time (rows are independent by definition).
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)  # tiny ops: one thread is fastest, and immune to a busy machine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "drafter"))
import dflash_ref  # noqa: E402


class Target:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.embed = self.model.model.embed_tokens.weight.detach()
        self.lm_head = self.model.lm_head.weight.detach()

    def run(self, ids, layer_ids=()):
        """logits [T, V] and the captured layer outputs [T, K*H] of one sequence."""
        outs = {}
        hooks = [self.model.model.layers[i].register_forward_hook(
            lambda m, inp, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o).detach()))
            for i in layer_ids]
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0]
        finally:
            for h in hooks:
                h.remove()
        feats = torch.cat([outs[i][0] for i in layer_ids], -1) if layer_ids else None
        return logits, feats


class Drafter:
    def __init__(self, export_dir, target):
        from safetensors.torch import load_file
        self.cfg = json.load(open(os.path.join(export_dir, "config.json")))
        self.cfg["mask_token_id"] = self.cfg["dflash_config"]["mask_token_id"]
        self.layer_ids = self.cfg["dflash_config"]["target_layer_ids"]
        self.P = {k: v.float() for k, v in load_file(os.path.join(export_dir, "model.safetensors")).items()}
        self.target = target

    def propose(self, seq, start, feats, bs):
        """bs - 1 draft tokens for the block [seq[start], MASK...] given the features of positions < start."""
        cfg = dict(self.cfg, block_size=bs, gamma=1.0)  # gamma only weights the loss (unused)
        S = start + bs
        ids = torch.zeros(1, S, dtype=torch.long)
        ids[0, :start + 1] = torch.tensor(seq[:start + 1])
        f = torch.zeros(1, S, feats.shape[-1])
        f[0, :start] = feats[:start]
        loss_mask = torch.ones(1, S, dtype=torch.long)
        with torch.no_grad():
            _, logits, _, _, _ = dflash_ref.forward(cfg, self.P, self.target.embed, self.target.lm_head, ids, loss_mask,
                                                    f, None, torch.tensor([[start]]), torch.tensor([[True]]))
        return logits[0, 1:].argmax(-1).tolist()


def speculative(target, drafter, prompt, bs, max_new, stop_ids=()):
    """(new tokens, accepted drafts per step) of one prompt."""
    stop = set(stop_ids)
    logits, _ = target.run(prompt)
    seq = list(prompt) + [int(logits[-1].argmax())]
    out, accepted = [seq[-1]], []
    done = out[-1] in stop or len(out) >= max_new
    start = len(prompt)  # position of the last committed token; the context is seq[:start]
    while not done:
        _, feats = target.run(seq[:start], drafter.layer_ids)
        draft = drafter.propose(seq, start, feats, bs)
        vlogits, _ = target.run(seq[:start + 1] + draft)
        post = vlogits[start:start + bs].argmax(-1).tolist()
        a = 0
        while a < bs - 1 and draft[a] == post[a]:
            a += 1
        accepted.append(a)
        commit = post[:a + 1]  # = draft[:a] + the bonus post[a]
        seq = seq[:start + 1] + commit
        start += a + 1
        for t in commit:
            out.append(t)
            if t in stop or len(out) >= max_new:
                done = True
                break
    return out, accepted
