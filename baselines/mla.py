"""Multi-head latent attention (DeepSeek-V2/V3), written out: the `mla` slot's reference twin.

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))      (or q_proj(x) when q_lora_rank is None)
    c, k_rope = kv_a_proj_with_mqa(x)                latent [r] and one shared rope key [R]
    k_nope, v = kv_b_proj(kv_a_layernorm(c))         expanded per head
    q_rope, k_rope get DeepSeek's interleaved-pair RoPE (written de-interleaved, as transformers does)
    o = softmax(q.k * scale + causal mask) v, fp32 softmax;  o_proj(o)

Module names equal transformers' DeepseekV3Attention, so state_dict keys are checkpoint keys. With
`cu_seqlens` the batch is one packed stream of B*T tokens; attention stays inside each sequence.
The twin of `bumblebee.primitives.mla.FlashMLA`. Shape legend: B batch, T tokens, D model width,
H heads, R rope dim, N = B*T.
"""
from __future__ import annotations

import torch

from bumblebee import packing
from bumblebee.checks import check_cu_seqlens, check_mla_inputs
from bumblebee.common.mla_projections import MLAProjections
from bumblebee.registry import register

def rope(x_BThR, cos_BTR, sin_BTR, interleave: bool):
    """RoPE on the last dim. interleave: pairs (x0, x1), (x2, x3)... rotate together (DeepSeek's
    layout); the result is written de-interleaved (evens then odds), as transformers does."""
    if interleave:
        x_BThR = x_BThR.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    x1, x2 = x_BThR.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BThR * cos_BTR[:, :, None] + rotated * sin_BTR[:, :, None]


@register("mla", "naive", kind="baseline", twin="flash")
class NaiveMLA(MLAProjections):
    """Per-head K/V expanded from the latent, explicit scores, fp32 softmax, causal (packed) mask."""

    def forward(self, x_BTD, cos, sin, cu_seqlens=None):
        """x [B, T, D], cos/sin [B, T, R] (per-token positions) -> [B, T, D]."""
        check_mla_inputs(x_BTD, cos, sin, self.dim, self.rope_dim)
        B, T, _ = x_BTD.shape
        H = self.n_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_nope, q_rope = q.view(B, T, H, self.qk_dim).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = rope(q_rope, cos, sin, self.rope_interleave)
        k_rope = rope(k_rope[:, :, None], cos, sin, self.rope_interleave)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, T, H, self.rope_dim)), dim=-1)

        if cu_seqlens is None:
            segment = torch.zeros(B, T, dtype=torch.long, device=x_BTD.device)
        else:  # one packed stream of B*T tokens
            segment = packing.sequence_ids(check_cu_seqlens(cu_seqlens, B * T), x_BTD.device)[None]
            q, k, v = (t.reshape(1, B * T, H, -1) for t in (q, k, v))
        n = q.shape[1]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.softmax_scale
        causal = torch.ones(n, n, dtype=torch.bool, device=x_BTD.device).tril()
        allowed = causal & (segment[:, :, None] == segment[:, None, :])  # [b, q, k]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.o_proj(o.reshape(B, T, H * self.v_dim))
