# dflash.py: the transformers modeling file of a dflash export (written by the dflash project from
# its algorithm notes; shipped in every export next to config.json, whose auto_map names it), so
#
#     AutoModel.from_pretrained(export_dir, trust_remote_code=True)
#
# gives a DFlashDraftModel holding the export's tensors under their names (fc, hidden_norm,
# layers.{i}.*, norm). The drafter has no embedding and no LM head: both are the target's.
#
# One draft step (block size bs, K captured target layers, hidden size H):
#   noise_embedding  [B, Q, H]    the target's embed_tokens of [last token, MASK x (bs-1)]
#   target_hidden    [B, S, K*H]  the outputs of the target layers dflash_config.target_layer_ids
#                                 (HF hidden_states[id + 1]) of the S context tokens, concatenated
#   position_ids     [B, S+Q]     context positions then block positions (default 0..S+Q-1)
#   -> norm(h)       [B, Q, H];   logits = target.lm_head(norm(h)) (the target's final norm is
#                                 not applied); draft token k = argmax of logits[:, k-1 + 1]
# Per layer: Q from the block only; K and V from [fc-fused context ; block] with one k_proj /
# v_proj; per-head RMSNorm on q and k, then RoPE; non-causal attention over all keys (an optional
# boolean attention_mask [B, 1, Q, S+Q], True = visible, restricts it); SwiGLU MLP.
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_outputs import BaseModelOutput


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(getattr(config, "rope_theta", 1e6))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x, cos, sin):  # x [B, heads, T, d]; cos/sin [B, 1, T, d]
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.heads
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention_mask=None):
        B, Q, _ = x.shape
        S = context.shape[1]
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, d)).transpose(1, 2)
        kv_in = torch.cat([context, x], dim=1)  # context keys first, then the block
        k = self.k_norm(self.k_proj(kv_in).view(B, S + Q, self.kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, S + Q, self.kv_heads, d).transpose(1, 2)
        q = _rope(q, cos[:, :, S:], sin[:, :, S:])
        k = _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False,
                                           scale=1.0 / math.sqrt(d))
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, h, context, cos, sin, attention_mask=None):
        # The context is not normed per layer (only the global hidden_norm) and not updated.
        h = h + self.self_attn(self.input_layernorm(h), context, cos, sin, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config  # config.json says model_type "qwen3" (what SGLang and vLLM expect)
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config):
        super().__init__(config)
        dc = config.dflash_config
        self.target_layer_ids = list(dc["target_layer_ids"])
        self.mask_token_id = int(dc["mask_token_id"])
        self.block_size = int(getattr(config, "block_size", None) or dc["block_size"])
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        self.rope_theta = _rope_theta(config)
        self.post_init()

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def rope(self, position_ids, dtype):
        # computed per call, not a buffer: transformers may build the module without running
        # buffer initialisers, and rotary frequencies are not a weight of the export
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=position_ids.device) / d))
        freqs = (position_ids[:, :, None].double() * inv[None, None, :]).float()
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                return_dict: bool = True, **kwargs):
        B, Q, _ = noise_embedding.shape
        S = target_hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(S + Q, device=noise_embedding.device).expand(B, -1)
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(position_ids, noise_embedding.dtype)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, context, cos, sin, attention_mask)
        h = self.norm(h)
        return BaseModelOutput(last_hidden_state=h) if return_dict else (h,)
