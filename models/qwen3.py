"""Qwen3 dense: GQA with per-head q/k RMSNorm, half-rotation RoPE, SwiGLU, tied or untied head.

Slots: `attention` (sdpa | eager), `cross_entropy` (materialized_ce | linear_ce). Packed sequences
through `cu_seqlens`. Module names equal
transformers' Qwen3ForCausalLM, so state_dict keys are the Hugging Face checkpoint keys.
"""
from __future__ import annotations

import torch.nn as nn

from bumblebee.models.causal_lm import CausalLM, run_layer
from bumblebee.recompute import Kept
from bumblebee.models.components import GQAttention, RMSNorm, RotaryEmbedding, SwiGLU
from bumblebee.models.config import Qwen3Config


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config, impl: dict):
        super().__init__()
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     eps=c.rms_norm_eps, bias=c.attention_bias,
                                     attention=impl.get("attention"))
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, c: Qwen3Config, impl: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, impl) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope)
        self.recompute = False  # full activation recompute: keep only each layer's input
        self.kept = Kept()  # this model's bytes kept through its recompute, per slot

    def forward(self, input_ids, position_ids, cu_seqlens=None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        for layer in self.layers:
            x = run_layer(layer, self.recompute, x, cos, sin, cu_seqlens, kept=self.kept)
        return self.norm(x)


class Qwen3ForCausalLM(CausalLM):
    config_class = Qwen3Config

    def __init__(self, config: Qwen3Config, impl: dict | None = None):
        super().__init__(config, impl, Qwen3Model)

    def forward(self, input_ids, labels=None, position_ids=None, cu_seqlens=None, return_logits=None):
        """Logits [B, T, V] when labels is None (or return_logits); the loss never needs them.
        cu_seqlens: the B*T tokens are one packed stream of sequences (positions restart per sequence
        unless given; no target crosses one)."""
        if cu_seqlens is not None:
            _, position_ids, labels = self.packed_inputs(input_ids, labels, position_ids, cu_seqlens)
        position_ids = self.check_inputs(input_ids, labels, position_ids)
        return self.lm_outputs(self.model(input_ids, position_ids, cu_seqlens), labels, return_logits)
