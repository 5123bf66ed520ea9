#!/usr/bin/env python3
"""A full-size target model with random weights (benchmarks, GPU runs): config.json plus sharded
bf16 safetensors with the names transformers writes, without building the model in Python.

  python3 tools/make_random_target.py --out /tmp/qwen3-8b-random [--preset qwen3-8b] [--seed 0]

Presets follow the real configs (DFLASH.md §7): qwen3-8b (36 layers, H 4096, 32/8 heads,
head_dim 128, I 12288, vocab 151936, untied), qwen3-4b (H 2560, I 9728, tied). Weights are
N(0, 0.02^2), norms 1; generated on the GPU when one is present (seconds), else on the CPU.
"""
import argparse
import json
import os
import shutil
import sys

PRESETS = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers-per-shard", type=int, default=8)
    a = ap.parse_args(argv)
    import torch
    from safetensors.torch import save_file
    c = PRESETS[a.preset]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(a.seed)
    H, I, L, nq, nkv, hd, V = (c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tmp = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    groups = [[("model.embed_tokens.weight", lambda: rnd(V, H))]]
    for i in range(L):
        if i % a.layers_per_shard == 0:
            groups.append([])
        p = f"model.layers.{i}."
        groups[-1] += [(p + "input_layernorm.weight", lambda: ones(H)),
                       (p + "post_attention_layernorm.weight", lambda: ones(H)),
                       (p + "self_attn.q_proj.weight", lambda: rnd(nq * hd, H)),
                       (p + "self_attn.k_proj.weight", lambda: rnd(nkv * hd, H)),
                       (p + "self_attn.v_proj.weight", lambda: rnd(nkv * hd, H)),
                       (p + "self_attn.o_proj.weight", lambda: rnd(H, nq * hd)),
                       (p + "self_attn.q_norm.weight", lambda: ones(hd)),
                       (p + "self_attn.k_norm.weight", lambda: ones(hd)),
                       (p + "mlp.gate_proj.weight", lambda: rnd(I, H)),
                       (p + "mlp.up_proj.weight", lambda: rnd(I, H)),
                       (p + "mlp.down_proj.weight", lambda: rnd(H, I))]
    last = [("model.norm.weight", lambda: ones(H))]
    if not c["tie_word_embeddings"]:
        last.append(("lm_head.weight", lambda: rnd(V, H)))
    groups.append(last)
    weight_map, total = {}, 0
    for n, grp in enumerate(groups):
        fname = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: make() for name, make in grp}
        total += sum(t.numel() * 2 for t in tensors.values())
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
               hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
               rope_scaling=None, use_sliding_window=False, sliding_window=None, max_window_layers=L,
               bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", initializer_range=0.02, **c)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.rmtree(a.out, ignore_errors=True)
    os.replace(tmp, a.out)
    print(f"make_random_target: {a.preset} ({total / 1e9:.1f} GB bf16, {len(groups)} shards) -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
