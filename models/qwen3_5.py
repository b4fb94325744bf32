"""Qwen3.5, dense and MoE: hybrid gated-DeltaNet / gated-attention layers, MTP head, hub checkpoints.

Features: per-layer `layer_types` (`linear_attention` | `full_attention`; default: every
`full_attention_interval`-th layer full); zero-centred RMSNorm (`x * (1 + w)` in fp32, then cast) for
the block norms, final norm and q/k norms; gated full attention (`q_proj` yields query and gate per
head, `out * sigmoid(gate)` before `o_proj`) with partial RoPE on the first `partial_rotary_factor`
of each head (text positions: the multimodal rope reduces to it); the gated DeltaNet through the
`linear_attention` slot; dense SwiGLU or MoE (softmax top-k router, always renormalized, shared
expert scaled by `sigmoid(shared_expert_gate)`); the MTP head (`mtp.fc` on
`cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]`, one full-attention decoder layer,
`mtp.norm`, the shared head) through the `mtp` slot when `mtp_num_hidden_layers` is 1; packed
sequences through `cu_seqlens`; full recompute (`set_recompute`).

Slots: `linear_attention` (fla | torch_chunked), `attention` (sdpa | eager), `cross_entropy`,
`router` and `moe_dispatch` (MoE), `mtp` (lean | materialized). Module names equal transformers'
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (experts stored fused, see bumblebee.models.moe), so
state_dict keys are checkpoint keys. Checkpoints: the plain layout (`model.layers.*`, as
transformers saves a text model) and the hub's multimodal one (`model.language_model.*`, with
`model.visual.*` skipped and `mtp.*` loaded into the MTP head); ours at `mtp.layers.0.{fc,
pre_fc_norm_embedding, pre_fc_norm_hidden, norm}` and `mtp.layers.0.block.*` are `mtp.*` and
`mtp.layers.0.*` in checkpoints. `save_pretrained` writes the plain layout (`qwen3_5_text` /
`qwen3_5_moe_text`), which transformers loads (it ignores `mtp.*`).
"""
from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from bumblebee import hf_io
from bumblebee.fused import fused
from bumblebee.models import moe
from bumblebee.models.causal_lm import CausalLM, DecoderStack
from bumblebee.models.components import SwiGLU, mlp_residual, packed, rope_inv_freq, rotate_half
from bumblebee.models.config import hf_dtype, rope_parameters
from bumblebee.registry import resolve

log = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_theta": 10000000.0, "rope_type": "default"})
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    mtp_num_hidden_layers: int = 0
    mtp_loss_scale: float = 0.3
    dtype: torch.dtype = torch.float32
    model_type: str = "qwen3_5_text"

    @classmethod
    def text_fields(cls, hf: dict) -> dict:
        """The text model's config: hub configs nest it under `text_config`."""
        if "text_config" not in hf:
            return dict(hf)
        t = dict(hf["text_config"] or {})
        for k in ("tie_word_embeddings", "dtype", "torch_dtype"):
            if k not in t and k in hf:
                t[k] = hf[k]
        return t

    @classmethod
    def common(cls, t: dict) -> dict:
        if t.get("hidden_act", "silu") != "silu":
            raise ValueError(f"qwen3_5 supports hidden_act 'silu', got {t['hidden_act']!r}")
        L, heads = t["num_hidden_layers"], t["num_attention_heads"]
        types = t.get("layer_types")
        if types is None:
            every = t.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
        types = list(types)
        if len(types) != L or any(x not in LAYER_TYPES for x in types):
            raise ValueError(f"layer_types must list {L} entries from {LAYER_TYPES}, got {types}")
        rope = rope_parameters(t)
        partial = rope.pop("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        head_dim = t.get("head_dim") or t["hidden_size"] // heads
        if int(head_dim * partial) % 2 or int(head_dim * partial) <= 0:
            raise ValueError(f"partial_rotary_factor {partial} of head_dim {head_dim} must give an even rotary dim")
        mtp = t.get("mtp_num_hidden_layers", t.get("num_nextn_predict_layers", 0)) or 0
        if mtp not in (0, 1):
            raise ValueError(f"mtp_num_hidden_layers must be 0 or 1 here, got {mtp}")
        return dict(
            vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t.get("intermediate_size", 0),
            num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=head_dim, layer_types=types, linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=t.get("linear_key_head_dim", 128),
            linear_value_head_dim=t.get("linear_value_head_dim", 128),
            linear_num_key_heads=t.get("linear_num_key_heads", 16),
            linear_num_value_heads=t.get("linear_num_value_heads", 32), partial_rotary_factor=partial,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope=rope,
            tie_word_embeddings=t.get("tie_word_embeddings", False), attention_bias=t.get("attention_bias", False),
            max_position_embeddings=t.get("max_position_embeddings", 262144),
            initializer_range=t.get("initializer_range", 0.02), mtp_num_hidden_layers=mtp,
            mtp_loss_scale=t.get("mtp_loss_scale", 0.3), dtype=hf_dtype(t))

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3_5Config":
        t = cls.text_fields(hf)
        if t.get("num_experts"):
            raise ValueError("this config has num_experts: load it as qwen3_5_moe")
        return cls(**cls.common(t))

    def to_hf(self) -> dict:
        d = asdict(self)
        rope, dtype = d.pop("rope"), d.pop("dtype")
        d.pop("partial_rotary_factor")
        d.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                 rope_parameters={**rope, "partial_rotary_factor": self.partial_rotary_factor},
                 dtype=str(dtype).removeprefix("torch."), hidden_act="silu")
        return d

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass
class Qwen3_5MoeConfig(Qwen3_5Config):
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    model_type: str = "qwen3_5_moe_text"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3_5MoeConfig":
        t = cls.text_fields(hf)
        if not t.get("num_experts"):
            raise ValueError("qwen3_5_moe config needs num_experts > 0")
        return cls(**cls.common(t), moe_intermediate_size=t["moe_intermediate_size"],
                   shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 0),
                   num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
                   output_router_logits=t.get("output_router_logits", False),
                   router_aux_loss_coef=t.get("router_aux_loss_coef", 0.001))

    def to_hf(self) -> dict:
        d = super().to_hf()
        d.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
        return d


class ZeroCenteredRMSNorm(nn.Module):
    """rmsnorm(x) * (1 + w) in fp32, then cast (weights start at zero)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return zero_centered_rms_norm(x, self.weight, self.eps)


# The elementwise chains below run compiled on CUDA (one kernel each way, bumblebee/fused.py), as
# Qwen3's RMSNorm and RoPE do; eagerly each op is a pass over the activation in the first forward,
# the recompute and the backward.
@fused
def zero_centered_rms_norm(x, weight, eps: float):
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 stays fp64)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(acc))).type_as(x)


class PartialRotaryEmbedding(nn.Module):
    """cos/sin [B, T, rotary_dim] for the first rotary_dim dims of a head (fp32, then cast)."""

    def __init__(self, rotary_dim: int, rope: dict):
        super().__init__()
        self.rotary_dim, self.rope = rotary_dim, dict(rope)

    def forward(self, position_ids, dtype):
        inv_freq, scale = rope_inv_freq(self.rotary_dim, self.rope)
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


@fused
def apply_partial_rope(x_BHTD, cos_BTR, sin_BTR):
    r = cos_BTR.shape[-1]
    x_rot, x_pass = x_BHTD[..., :r], x_BHTD[..., r:]
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


@fused
def zero_centered_norm_partial_rope(x_BTHD, weight, eps: float, cos_BTR, sin_BTR):
    """Per-head zero-centred norm then partial RoPE, [B, T, H, D] in, [B, H, T, D] out (a view): one
    compiled chain each way on CUDA (as models/components.py rms_norm_rope), the two eager chains elsewhere."""
    return apply_partial_rope.eager(zero_centered_rms_norm.eager(x_BTHD, weight, eps).transpose(1, 2),
                                    cos_BTR, sin_BTR)


@fused
def sigmoid_gated(x, gate):
    return x * torch.sigmoid(gate)


class GatedAttention(nn.Module):
    """GQA with a sigmoid output gate per head, zero-centred q/k norms and partial RoPE; the kernel
    is the `attention` slot (called per sequence for packed inputs)."""

    def __init__(self, c: Qwen3_5Config, impl: dict):
        super().__init__()
        H, K, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if H % K:
            raise ValueError(f"num_key_value_heads ({K}) must divide num_attention_heads ({H})")
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, Dh
        self.q_proj = nn.Linear(c.hidden_size, H * Dh * 2, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, K * Dh, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, K * Dh, bias=c.attention_bias)
        self.o_proj = nn.Linear(H * Dh, c.hidden_size, bias=c.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(Dh, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(Dh, c.rms_norm_eps)
        self.attend = resolve("attention", impl.get("attention"))

    def forward(self, x_BTD, cos, sin, cu_seqlens=None):
        B, T, _ = x_BTD.shape
        q, gate = self.q_proj(x_BTD).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = zero_centered_norm_partial_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        k = zero_centered_norm_partial_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        v = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        o = self.attend(q, k, v, scale=self.head_dim ** -0.5, **packed(cu_seqlens))  # [B, H, T, Dh]
        o = sigmoid_gated(o.transpose(1, 2).reshape(B, T, -1), gate.reshape(B, T, -1))
        return self.o_proj(o)


class MoE(moe.MoEBlock):
    """Softmax top-k (renormalized) routed experts plus the sigmoid-gated shared expert."""

    def __init__(self, c: Qwen3_5MoeConfig, impl: dict):
        super().__init__(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                         scoring="softmax", norm_topk_prob=True, shared_hidden=c.shared_expert_intermediate_size,
                         shared_expert_gate=True, impl=impl)


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3_5Config, layer_type: str, impl: dict):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = resolve("linear_attention", impl.get("linear_attention"))(
                c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                c.linear_value_head_dim, conv_kernel_size=c.linear_conv_kernel_dim, eps=c.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(c, impl)
        self.is_moe = isinstance(c, Qwen3_5MoeConfig)
        self.mlp = MoE(c, impl) if self.is_moe else SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None):
        """(hidden, router logits [B*T, E] or None for a dense layer)."""
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            x = x + self.linear_attn(h, cu_seqlens)
        else:
            x = x + self.self_attn(h, cos, sin, cu_seqlens)
        return mlp_residual(self, x)


class MTPDepth(nn.Module):
    """Qwen3.5's MTP depth: block(fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)])), norm."""

    def __init__(self, c: Qwen3_5Config, impl: dict):
        super().__init__()
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DecoderLayer(c, "full_attention", impl)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb_BTD, h_BTD, run_block):
        return run_block(self.block, self.fc(torch.cat([self.pre_fc_norm_embedding(emb_BTD),
                                                        self.pre_fc_norm_hidden(h_BTD)], dim=-1)))

    def head_norm(self, h_BTD):
        return self.norm(h_BTD)


class Qwen3_5Model(DecoderStack):
    def __init__(self, c: Qwen3_5Config, impl: dict):
        super().__init__(c.vocab_size, c.hidden_size, (DecoderLayer(c, t, impl) for t in c.layer_types),
                         ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps), PartialRotaryEmbedding(c.rotary_dim, c.rope))


_MTP_OWN = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")
_HUB = "model.language_model."


class Qwen3_5ForCausalLM(CausalLM):
    config_class = Qwen3_5Config

    def __init__(self, config: Qwen3_5Config, impl: dict | None = None):
        super().__init__(config, impl, Qwen3_5Model)
        if config.mtp_num_hidden_layers:
            self.mtp = resolve("mtp", self.impl.get("mtp"))([MTPDepth(config, self.impl)],
                                                           loss_scale=config.mtp_loss_scale)

    def init_extra_weights(self, seed: int = 0):
        """transformers' init where the generic one differs: zero-centred norms at 0, dt_bias 1,
        A_log = log(U(1, 16))."""
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, ZeroCenteredRMSNorm):
                    m.weight.zero_()
                if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                    m.dt_bias.fill_(1.0)
                    m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(1, 16, generator=g).log())

    def forward(self, input_ids, labels=None, position_ids=None, cu_seqlens=None, return_logits=None,
                output_router_logits=None):
        """Logits [B, T, V] when labels is None (or return_logits). With labels: the loss, plus the MTP
        term (out.mtp_loss) when the model has an MTP head; MoE: aux_loss (times router_aux_loss_coef in
        the loss) when output_router_logits (default: the config's). cu_seqlens: the B*T tokens are one
        packed stream of sequences (positions restart per sequence unless given; no target crosses one)."""
        out, router_logits = self.packed_forward(input_ids, labels, position_ids, cu_seqlens, return_logits)
        self.add_aux_loss(out, router_logits, output_router_logits)
        return out

    # ---- checkpoint names: plain / hub layouts, MTP head, fused experts ---------------------------

    @staticmethod
    def _hf_name(ours: str, hub: bool = False) -> str:
        m = re.match(r"^mtp\.layers\.0\.(block\.)?(.*)$", ours)
        if m:
            return f"mtp.layers.0.{m[2]}" if m[1] else f"mtp.{m[2]}"
        return _HUB + ours[len("model."):] if hub and ours.startswith("model.") else ours

    @staticmethod
    def _our_name(hf: str) -> str:
        if hf.startswith(_HUB):
            return "model." + hf[len(_HUB):]
        if hf.startswith("mtp."):
            rest = hf[len("mtp."):]
            m = re.match(r"^layers\.0\.(.*)$", rest)
            return f"mtp.layers.0.block.{m[1]}" if m else f"mtp.layers.0.{rest}"
        return hf

    def hf_to_ours_sources(self, checkpoint_names):
        names = set(checkpoint_names)
        hub = any(n.startswith(_HUB) for n in names)
        fused = moe.hf_to_ours_sources(self, [self._our_name(n) for n in names])
        out = {ours: ([self._hf_name(s, hub) for s in srcs], combine) for ours, (srcs, combine) in fused.items()}
        for ours in self.state_dict():
            hf = self._hf_name(ours, hub)
            if hf != ours and ours not in out and hf in names:
                out[ours] = ([hf], lambda ts: ts[0])
        return {ours: src for ours, src in out.items() if all(s in names for s in src[0])}

    def ours_to_hf_state(self, state):
        return {self._hf_name(k): v for k, v in moe.ours_to_hf_state(state).items()}

    def checkpoint_extras(self, path):
        """(optional, ignored prefixes) for loading `path`: the vision tower (hub checkpoints) is skipped
        with one log line; `mtp.*` is ignored when the config has no MTP head, and a checkpoint without
        any `mtp.*` tensor (transformers saves none) leaves the MTP head freshly initialized here."""
        names = hf_io.checkpoint_names(path)
        ignore = ("model.visual.",)
        visual = sum(n.startswith("model.visual.") for n in names)
        if visual:
            log.info("qwen3_5: skipping the vision tower (%d model.visual.* tensors) of %s", visual, path)
        if not hasattr(self, "mtp"):
            return (), ignore + ("mtp.",)
        if any(n.startswith("mtp.") for n in names):
            return (), ignore
        return self.init_missing_mtp(norm_value=0.0, path=path), ignore  # zero-centred norms


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    config_class = Qwen3_5MoeConfig
