"""Qwen3 dense: GQA with per-head q/k RMSNorm, half-rotation RoPE, SwiGLU, tied or untied head.

Slots: `attention` (sdpa | eager), `cross_entropy` (materialized_ce | linear_ce). Module names equal
transformers' Qwen3ForCausalLM, so state_dict keys are the Hugging Face checkpoint keys.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from bumblebee.checks import check_token_ids
from bumblebee.models.components import (CausalLMOutput, GQAttention, RMSNorm, RotaryEmbedding, SwiGLU,
                                         causal_lm_loss)
from bumblebee.models.config import Qwen3Config
from bumblebee.models.hf_io import HFCheckpointMixin
from bumblebee.registry import check_impl, resolve


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config, impl: dict):
        super().__init__()
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     eps=c.rms_norm_eps, bias=c.attention_bias,
                                     attention=impl.get("attention"))
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, c: Qwen3Config, impl: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, impl) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope)
        self.recompute = False  # full activation recompute: keep only each layer's input

    def forward(self, input_ids, position_ids):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.norm(x)


class Qwen3ForCausalLM(HFCheckpointMixin, nn.Module):
    config_class = Qwen3Config

    def __init__(self, config: Qwen3Config, impl: dict | None = None):
        super().__init__()
        self.config, self.impl = config, check_impl(impl)
        self.model = Qwen3Model(config, self.impl)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_fn = resolve("cross_entropy", self.impl.get("cross_entropy"))
        self.tie_weights()

    def set_recompute(self, enabled: bool = True):
        """Full activation recompute: every decoder layer reruns its forward in the backward."""
        self.model.recompute = enabled
        return self

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None, position_ids=None, return_logits=None):
        """Logits [B, T, V] when labels is None (or return_logits); the loss never needs them."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.model(input_ids, position_ids)
        out = CausalLMOutput()
        if labels is not None:
            out.loss = causal_lm_loss(self.loss_fn, hidden, self.lm_head.weight, labels)
        if labels is None or return_logits:
            out.logits = self.lm_head(hidden)
        return out
