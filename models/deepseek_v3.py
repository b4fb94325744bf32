"""DeepSeek-V3: MLA attention, dense-then-MoE feed-forward, auxiliary-loss-free routing, MTP.

Features: multi-head latent attention (`q_lora_rank` or a plain `q_proj`, interleaved-pair RoPE,
YaRN with the softmax scale times mscale(factor, mscale_all_dim)^2); dense SwiGLU for the first
`first_k_dense_replace` layers, MoE after (sigmoid scores + `e_score_correction_bias`, `n_group` /
`topk_group` group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`, shared experts);
multi-token prediction of depth `num_nextn_predict_layers` added to the loss times
`mtp_loss_scale` (reported apart in `out.mtp_loss`, per depth in `out.mtp_losses`); packed
sequences through `cu_seqlens`; full recompute (`set_recompute`).

Slots: `mla` (flash | naive; flash's lean backward and kernels are its options, e.g.
`impl={"mla": "flash:lean_backward=off"}`), `mtp` (lean | materialized), `cross_entropy`, `router` (aux_free),
`moe_dispatch`. Module names equal transformers' DeepseekV3ForCausalLM except the experts (stored
fused, see bumblebee.models.moe) and the MTP depths: ours live at `mtp.layers.{k}` (the decoder block
as `.block`), checkpoints hold them at `model.layers.{num_hidden_layers + k}.*` as DeepSeek publishes
them (with copies of the shared `embed_tokens` and `shared_head.head`, ignored on load).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from bumblebee import hf_io
from bumblebee.models import moe
from bumblebee.models.causal_lm import CausalLM, DecoderStack
from bumblebee.models.components import RMSNorm, RotaryEmbedding, SwiGLU, mlp_residual
from bumblebee.models.config import hf_dtype, rope_parameters
from bumblebee.registry import resolve


@dataclass
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    num_nextn_predict_layers: int = 1
    mtp_loss_scale: float = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, 0.1 after
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    dtype: torch.dtype = torch.float32
    model_type: str = "deepseek_v3"

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV3Config":
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ValueError(f"deepseek_v3 needs num_key_value_heads == num_attention_heads ({heads}), "
                             f"got {hf['num_key_value_heads']}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"deepseek_v3 supports hidden_act 'silu', got {hf['hidden_act']!r}")
        rope = rope_parameters(hf)
        if rope["rope_type"] == "yarn" and rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = hf.get("max_position_embeddings", 4096)
        depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], n_routed_experts=hf["n_routed_experts"],
            n_shared_experts=hf.get("n_shared_experts") or 0, num_experts_per_tok=hf["num_experts_per_tok"],
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0), n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1, norm_topk_prob=hf.get("norm_topk_prob", True),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0, num_nextn_predict_layers=depth or 0,
            mtp_loss_scale=hf.get("mtp_loss_scale", 0.3), rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope=rope,
            rope_interleave=hf.get("rope_interleave", True), attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            initializer_range=hf.get("initializer_range", 0.02), dtype=hf_dtype(hf))

    def to_hf(self) -> dict:
        d = asdict(self)
        rope, dtype = d.pop("rope"), d.pop("dtype")
        d.update(architectures=["DeepseekV3ForCausalLM"], rope_parameters=rope, rope_theta=rope["rope_theta"],
                 dtype=str(dtype).removeprefix("torch."), hidden_act="silu",
                 num_key_value_heads=self.num_attention_heads)
        return d

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled RoPE (as transformers)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        m_all, factor = self.rope.get("mscale_all_dim", 0), self.rope.get("factor", 1.0)
        if self.rope.get("rope_type", "default") != "default" and m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale = scale * m * m
        return scale


class DeepseekV3MoE(moe.MoEBlock):
    """The shared MoE block with DeepSeek's `shared_experts` (plural, ungated) as transformers names it."""

    def __init__(self, c: DeepseekV3Config, impl: dict):
        super().__init__(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                         scoring="sigmoid", norm_topk_prob=c.norm_topk_prob, n_group=c.n_group,
                         topk_group=c.topk_group, scaling_factor=c.routed_scaling_factor, impl=impl)
        if c.n_shared_experts:
            self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def forward(self, x_BTD):
        y, logits = super().forward(x_BTD)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x_BTD)
        return y, logits


class DecoderLayer(nn.Module):
    def __init__(self, c: DeepseekV3Config, i: int, impl: dict):
        super().__init__()
        self.self_attn = resolve("mla", impl.get("mla"))(
            c.hidden_size, c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            softmax_scale=c.softmax_scale, rope_interleave=c.rope_interleave, bias=c.attention_bias)
        self.is_moe = i >= c.first_k_dense_replace
        self.mlp = DeepseekV3MoE(c, impl) if self.is_moe else SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None):
        """(hidden, router logits [B*T, E] or None for a dense layer)."""
        return mlp_residual(self, x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens))


class MTPLayer(nn.Module):
    """One MTP depth, DeepSeek's layout: block(eh_proj(cat[enorm(emb), hnorm(h)])), then shared_head.norm."""

    def __init__(self, c: DeepseekV3Config, i: int, impl: dict):
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DecoderLayer(c, i, impl)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(c.hidden_size, c.rms_norm_eps)})

    def forward(self, emb_BTD, h_BTD, run_block):
        return run_block(self.block, self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1)))

    def head_norm(self, h_BTD):
        return self.shared_head["norm"](h_BTD)


class DeepseekV3Model(DecoderStack):
    def __init__(self, c: DeepseekV3Config, impl: dict):
        super().__init__(c.vocab_size, c.hidden_size, (DecoderLayer(c, i, impl) for i in range(c.num_hidden_layers)),
                         RMSNorm(c.hidden_size, c.rms_norm_eps), RotaryEmbedding(c.qk_rope_head_dim, c.rope))


_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DeepseekV3ForCausalLM(CausalLM):
    config_class = DeepseekV3Config

    def __init__(self, config: DeepseekV3Config, impl: dict | None = None):
        super().__init__(config, impl, DeepseekV3Model)
        L, D = config.num_hidden_layers, config.num_nextn_predict_layers
        if D:
            self.mtp = resolve("mtp", self.impl.get("mtp"))([MTPLayer(config, L + k, self.impl) for k in range(D)],
                                                           loss_scale=config.mtp_loss_scale)

    def forward(self, input_ids, labels=None, position_ids=None, cu_seqlens=None, return_logits=None,
                output_router_logits=None):
        """Logits [B, T, V] when labels is None (or return_logits). With labels: the loss, plus the MTP
        term (out.mtp_loss) when the model has MTP depths. cu_seqlens: the B*T tokens are one packed
        stream of sequences (positions restart per sequence unless given; no target crosses one)."""
        out, router_logits = self.packed_forward(input_ids, labels, position_ids, cu_seqlens, return_logits)
        if output_router_logits:
            out.router_logits = router_logits
        return out

    # ---- checkpoint names: fused experts and MTP depths <-> the published layout ----------------

    def _hf_name(self, ours: str) -> str:
        m = re.match(r"^mtp\.layers\.(\d+)\.(?:block\.)?(.*)$", ours)
        return f"model.layers.{self.config.num_hidden_layers + int(m[1])}.{m[2]}" if m else ours

    def _our_name(self, hf: str) -> str:
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", hf)
        L = self.config.num_hidden_layers
        if not m or int(m[1]) < L:
            return hf
        k, rest = int(m[1]) - L, m[2]
        return f"mtp.layers.{k}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.layers.{k}.block.{rest}"

    def hf_to_ours_sources(self, checkpoint_names):
        names = set(checkpoint_names)
        fused = moe.hf_to_ours_sources(self, [self._our_name(n) for n in names])
        out = {ours: ([self._hf_name(s) for s in srcs], combine) for ours, (srcs, combine) in fused.items()}
        for ours in self.state_dict():
            hf = self._hf_name(ours)
            if hf != ours and ours not in out and hf in names:
                out[ours] = ([hf], lambda ts: ts[0])
        return {ours: src for ours, src in out.items() if all(s in names for s in src[0])}

    def ours_to_hf_state(self, state):
        state = {self._hf_name(k): v for k, v in moe.ours_to_hf_state(state).items()}
        L = self.config.num_hidden_layers
        embed = state["model.embed_tokens.weight"]
        head = state.get("lm_head.weight", embed)  # absent when tied
        for k in range(self.config.num_nextn_predict_layers):  # the published layout keeps copies
            # from `state`, not the live modules: under FSDP2 those hold shards (or freed storage)
            state[f"model.layers.{L + k}.embed_tokens.weight"] = embed.detach().clone()
            state[f"model.layers.{L + k}.shared_head.head.weight"] = head.detach().clone()
        return state

    def checkpoint_extras(self, path):
        """(optional, ignored prefixes) for loading `path`: the copies of the shared embedding and head
        in MTP depths are ignored; a checkpoint without any MTP tensor (transformers saves none) leaves
        the MTP depths freshly initialized here, and a partial one is an error of the loader."""
        L, D = self.config.num_hidden_layers, self.config.num_nextn_predict_layers
        ignore = tuple(f"model.layers.{L + k}.{w}." for k in range(D) for w in ("embed_tokens", "shared_head.head"))
        names = hf_io.checkpoint_names(path)
        if not D or any(n.startswith(f"model.layers.{L + k}.") for n in names for k in range(D)):
            return (), ignore
        return self.init_missing_mtp(norm_value=1.0, path=path), ignore
