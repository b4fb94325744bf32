"""Gated DeltaNet (Qwen3.5's linear attention) in plain torch: the `linear_attention` slot's twin.

Per token t, per value head h (key heads repeated to value heads), with the state S [Dk, Dv]:

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T      (gated delta rule)
    o_t = S_t^T q_t * Dk^-0.5                                    (q, k l2-normalized in fp32)

The layer around it: `in_proj_qkv` -> depthwise causal `conv1d` (width `conv_kernel_size`, no bias)
-> SiLU -> split q | k | v; `beta = sigmoid(in_proj_b x)`, `g = -exp(A_log) * softplus(in_proj_a x +
dt_bias)`; the rule; a gated RMSNorm per value head (`norm.weight * rmsnorm(o) * silu(in_proj_z x)`,
in fp32); `out_proj`. Module and parameter names equal transformers' Qwen3_5GatedDeltaNet.

Two forms of the rule, both fp32: `chunked_gated_delta_rule` (chunks of 64 tokens, the UT transform
inside a chunk, a sequential scan over chunks: the layer's path) and `recurrent_gated_delta_rule`
(token by token: the test oracle). Packed sequences: `cu_seqlens` [S+1] over the B*T tokens of the
batch read as one stream; the conv window and the state restart at every sequence start.

Shape legend: B batch, T tokens, N = B*T, D model width, H key heads, HV value heads, Dk / Dv head
dims, C conv channels (2 * H * Dk + HV * Dv), W conv width.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee.checks import check_cu_seqlens, check_gdn_config
from bumblebee.norms import GatedRMSNorm, to_acc
from bumblebee.registry import register
def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _segments(B: int, T: int, cu_seqlens):
    """(row, start, end) of every sequence: whole rows, or the packed stream's sequences (row 0)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = check_cu_seqlens(cu_seqlens, B * T)
    return [(0, a, b) for a, b in zip(cu, cu[1:])]


def _prepare(q, k, v, g, beta, cu_seqlens):
    """fp32 [B', HV, T', *] tensors (packed inputs flattened to one row), l2-normalized, scaled q."""
    B, T, H, Dk = k.shape
    HV = v.shape[2]
    if q.shape != k.shape or v.shape[:2] != (B, T) or g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"gated delta rule: q, k [B, T, H, Dk], v [B, T, HV, Dv], g and beta [B, T, HV] disagree: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    if HV % H:
        raise ValueError(f"gated delta rule: key heads ({H}) must divide value heads ({HV})")
    if cu_seqlens is not None:
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    q, k = (l2norm(to_acc(x)).repeat_interleave(HV // H, dim=2) for x in (q, k))
    q = q * Dk ** -0.5
    q, k, v, g, beta = (to_acc(x.transpose(1, 2)) for x in (q, k, v, g, beta))
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens=None):
    """The rule token by token (the oracle). q, k [B, T, H, Dk], v [B, T, HV, Dv], g, beta [B, T, HV]
    -> o [B, T, HV, Dv] in v's dtype; cu_seqlens: the B*T tokens are packed sequences."""
    B, T = v.shape[:2]
    q, k, v_, g, beta = _prepare(q, k, v, g, beta, cu_seqlens)
    o = torch.zeros_like(v_)
    for row, a, b in _segments(B, T, cu_seqlens):
        S = q.new_zeros(q.shape[1], q.shape[-1], v_.shape[-1])  # [HV, Dk, Dv]
        for t in range(a, b):
            S = S * g[row, :, t].exp()[:, None, None]
            kt, qt = k[row, :, t], q[row, :, t]
            delta = (v_[row, :, t] - torch.einsum("hkv,hk->hv", S, kt)) * beta[row, :, t, None]
            S = S + kt[:, :, None] * delta[:, None, :]
            o[row, :, t] = torch.einsum("hkv,hk->hv", S, qt)
    return o.transpose(1, 2).reshape(v.shape).to(v.dtype)


def _chunked_one(q, k, v, g, beta, chunk: int):
    """One sequence per row: [B, HV, L, *] fp32 -> o [B, HV, L, Dv] (transformers' chunked algorithm)."""
    L = q.shape[2]
    pad = (chunk - L % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    B, HV, Lp, Dk = k.shape
    Dv = v.shape[-1]
    n = Lp // chunk
    q, k, v = (x.reshape(B, HV, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, HV, n, chunk), beta.reshape(B, HV, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)  # log of the decay from the chunk start to each position
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay j -> i
    # UT transform: (I + tril(diag(beta) K K^T * decay, -1)) u = beta v, likewise for the decayed keys
    A = (k_beta @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(A, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair  # causal within the chunk (pair is 0 above the diagonal)
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    S = q.new_zeros(B, HV, Dk, Dv)
    o = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S  # what the old state does not already predict
        o[:, :, i] = q_dec[:, :, i] @ S + attn[:, :, i] @ v_new
        S = S * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    return o.reshape(B, HV, Lp, Dv)[:, :, :L]


def chunked_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens=None, chunk_size: int = 64):
    """The rule in chunks of `chunk_size` tokens, fp32 (the layer's path); same signature as the
    recurrent form plus the chunk size."""
    B, T = v.shape[:2]
    q_, k_, v_, g_, b_ = _prepare(q, k, v, g, beta, cu_seqlens)
    if cu_seqlens is None:
        o = _chunked_one(q_, k_, v_, g_, b_, chunk_size)
    else:
        o = torch.cat([_chunked_one(*(x[:, :, a:b] for x in (q_, k_, v_, g_, b_)), chunk_size)
                       for _, a, b in _segments(B, T, cu_seqlens)], dim=2)
    return o.transpose(1, 2).reshape(v.shape).to(v.dtype)


def causal_conv1d_silu(x_BTC, weight_CW, cu_seqlens=None):
    """SiLU(depthwise causal conv) over time, computed in fp32, in x's dtype; with cu_seqlens the
    window never reaches into the previous packed sequence."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    if cu_seqlens is None:
        y = F.conv1d(F.pad(to_acc(x_BTC).transpose(1, 2), (W - 1, 0)), to_acc(weight_CW)[:, None], groups=C)
        return F.silu(y).transpose(1, 2).to(x_BTC.dtype)
    cu = check_cu_seqlens(cu_seqlens, B * T)
    x = to_acc(x_BTC.reshape(B * T, C))
    pos = torch.arange(B * T, device=x.device)
    start = torch.repeat_interleave(torch.tensor(cu[:-1], device=x.device), torch.tensor(
        [b - a for a, b in zip(cu, cu[1:])], device=x.device))
    y = torch.zeros_like(x)
    for s in range(W):  # tap s reads the token s steps back, inside the same sequence only
        shifted = F.pad(x, (0, 0, s, 0))[:B * T]
        y = y + shifted * (pos - s >= start)[:, None] * to_acc(weight_CW[:, W - 1 - s])
    return F.silu(y).reshape(B, T, C).to(x_BTC.dtype)

@register("linear_attention", "torch_chunked", kind="baseline", twin="fla")
class ChunkedGatedDeltaNet(nn.Module):
    """Gated DeltaNet in torch: F.conv1d causal conv, chunked gated delta rule in fp32 (chunk 64)."""

    chunk_size = 64

    def __init__(self, hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, *, conv_kernel_size=4,
                 eps=1e-6):
        super().__init__()
        check_gdn_config(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size)
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1)  # only its weight [C, 1, W] is used
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

    def conv(self, x_BTC, cu_seqlens):
        return causal_conv1d_silu(x_BTC, self.conv1d.weight[:, 0], cu_seqlens)

    def rule(self, q, k, v, g, beta, cu_seqlens):
        return chunked_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)

    def forward(self, x_BTD, cu_seqlens=None):
        """x [B, T, D] -> [B, T, D]; cu_seqlens [S+1]: the B*T tokens are packed sequences."""
        B, T, _ = x_BTD.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B * T)
        qkv = self.conv(self.in_proj_qkv(x_BTD), cu_seqlens)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x_BTD).sigmoid()
        g = -to_acc(self.A_log).exp() * F.softplus(to_acc(self.in_proj_a(x_BTD)) + self.dt_bias)
        o = self.rule(q, k, v, g, beta, cu_seqlens)  # [B, T, HV, Dv]
        z = self.in_proj_z(x_BTD).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))
