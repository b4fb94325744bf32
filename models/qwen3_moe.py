"""Qwen3-MoE: Qwen3's attention with MoE feed-forward layers (softmax top-k router, no shared expert).

Features: `decoder_sparse_step` and `mlp_only_layers` (dense SwiGLU layers among the MoE ones),
`norm_topk_prob`, `output_router_logits` with transformers' load-balancing loss added to the loss
times `router_aux_loss_coef`. Slots: `attention`, `cross_entropy`, `router` (softmax_fused |
softmax_topk), `moe_dispatch` (local). Module names equal transformers' Qwen3MoeForCausalLM except
the experts, stored fused (see bumblebee.models.moe); checkpoints hold per-expert keys, as
transformers saves.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.nn as nn

from bumblebee.models import moe
from bumblebee.models.causal_lm import CausalLM, DecoderStack
from bumblebee.models.components import GQAttention, RMSNorm, RotaryEmbedding, SwiGLU, mlp_residual
from bumblebee.models.config import Qwen3Config


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    model_type: str = "qwen3_moe"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        base = super().from_hf(hf)
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ValueError("qwen3_moe config.json needs num_experts (or num_local_experts)")
        return dataclasses.replace(
            base, moe_intermediate_size=hf["moe_intermediate_size"], num_experts=experts,
            num_experts_per_tok=hf["num_experts_per_tok"], norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
            output_router_logits=hf.get("output_router_logits", False),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), model_type="qwen3_moe")

    def to_hf(self) -> dict:
        d = super().to_hf()
        d.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        return d

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3MoeConfig, i: int, impl: dict):
        super().__init__()
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     eps=c.rms_norm_eps, bias=c.attention_bias, attention=impl.get("attention"))
        self.is_moe = c.is_moe_layer(i)
        if self.is_moe:
            self.mlp = moe.MoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                    scoring="softmax", norm_topk_prob=c.norm_topk_prob, impl=impl)
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None):
        """(hidden, router logits [B*T, E] or None for a dense layer)."""
        return mlp_residual(self, x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens))


class Qwen3MoeModel(DecoderStack):
    def __init__(self, c: Qwen3MoeConfig, impl: dict):
        super().__init__(c.vocab_size, c.hidden_size, (DecoderLayer(c, i, impl) for i in range(c.num_hidden_layers)),
                         RMSNorm(c.hidden_size, c.rms_norm_eps), RotaryEmbedding(c.head_dim, c.rope))


class Qwen3MoeForCausalLM(CausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, config: Qwen3MoeConfig, impl: dict | None = None):
        super().__init__(config, impl, Qwen3MoeModel)

    def hf_to_ours_sources(self, checkpoint_names):
        return moe.hf_to_ours_sources(self, checkpoint_names)

    def ours_to_hf_state(self, state):
        return moe.ours_to_hf_state(state)

    def forward(self, input_ids, labels=None, position_ids=None, cu_seqlens=None, return_logits=None,
                output_router_logits=None):
        """Logits [B, T, V] when labels is None (or return_logits); aux_loss and router_logits when
        output_router_logits (default: the config's), the loss then including coef * aux_loss.
        cu_seqlens: the B*T tokens are one packed stream of sequences (positions restart per sequence
        unless given; no target crosses one)."""
        out, router_logits = self.packed_forward(input_ids, labels, position_ids, cu_seqlens, return_logits)
        return self.add_aux_loss(out, router_logits, output_router_logits)
