"""Shared model components (no math of the swappable slots: those come from the registry).

Shape legend: B batch, T tokens per sequence, N = B*T, D model width, H heads, K key/value heads,
Dh head dim, F MLP width, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee.fused import fused
from bumblebee.norms import RMSNorm, rms_norm
from bumblebee.registry import resolve

def mlp_residual(layer: nn.Module, x: torch.Tensor):
    """A decoder layer's second half, x + mlp(post_attention_layernorm(x)): (hidden, router logits
    [B*T, E] of an MoE `mlp`, or None for a dense one, as `layer.is_moe` says)."""
    h = layer.post_attention_layernorm(x)
    if layer.is_moe:
        h, logits = layer.mlp(h)
        return x + h, logits
    return x + layer.mlp(h), None


def rope_inv_freq(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a `rope_parameters` dict."""
    theta, kind = rope["rope_theta"], rope.get("rope_type", "default")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, rope)
    raise ValueError(f"unsupported rope_type {kind!r}; accepted: ['default', 'linear', 'yarn']")


def _yarn(inv_freq, head_dim, rope):
    # YaRN: interpolate low frequencies, keep high ones, blend linearly between (as transformers does).
    factor, theta = rope["factor"], rope["rope_theta"]
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn rope_parameters need original_max_position_embeddings")
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin for half-rotation RoPE, computed per call in fp32 (no buffers: meta-init safe)."""

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim, self.rope = head_dim, dict(rope)

    def forward(self, position_ids, dtype):
        inv_freq, scale = rope_inv_freq(self.head_dim, self.rope)
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, Dh]
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@fused
def apply_rope(x_BHTD, cos_BTD, sin_BTD):
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BHTD * cos + rotate_half(x_BHTD) * sin


@fused
def rms_norm_rope(x_BTHD, weight, eps: float, cos_BTD, sin_BTD):
    """Per-head RMSNorm then RoPE, [B, T, H, D] in, [B, H, T, D] out (a view): one compiled kernel each way
    on CUDA instead of two (the probe benchmarks/training_step/probes/probe_rope_layout.py: 3.6 -> 2.9 ms
    a layer's q and k forward + backward at 32K; the norm's output is then not rounded to 16 bits before
    RoPE), the two eager chains elsewhere."""
    return apply_rope.eager(rms_norm.eager(x_BTHD, weight, eps).transpose(1, 2), cos_BTD, sin_BTD)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm; the kernel is the `attention` slot."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim, *, eps, bias=False, qk_norm=True, attention="sdpa"):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm
        self.attend = resolve("attention", attention)

    def forward(self, x_BTD, cos, sin, cu_seqlens=None):
        """cu_seqlens: the B*T tokens are one packed stream of sequences (cos/sin per token)."""
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q = rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
            k = rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        else:
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        o = self.attend(q, k, v.transpose(1, 2), scale=self.head_dim ** -0.5, **packed(cu_seqlens))  # [B, H, T, Dh]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def packed(cu_seqlens) -> dict:
    """The attention slot's packed-sequence keyword, given only for a packed batch: an implementation
    registered without `cu_seqlens` still serves unpacked ones."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def next_token_labels(labels_BT, ignore_index=-100):
    """Labels shifted left: row t's target is token t + 1 (ignore_index after each row's end)."""
    return F.pad(labels_BT, (0, 1), value=ignore_index)[:, 1:]


def causal_lm_loss(loss_fn, hidden_BTD, weight_VD, labels_BT, ignore_index=-100):
    """Next-token loss as transformers computes it: labels shifted left inside, mean over valid."""
    shifted = next_token_labels(labels_BT, ignore_index)
    return loss_fn(hidden_BTD.reshape(-1, hidden_BTD.shape[-1]), weight_VD, shifted.reshape(-1),
                   ignore_index=ignore_index, reduction="mean")
