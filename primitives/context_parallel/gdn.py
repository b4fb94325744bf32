"""Gated DeltaNet over a context-parallel shard: conv halo and exact fp32 state passing.

The recurrence runs over the chunks in global order 0 .. 2 CP - 1, while rank r holds chunks r and
2 CP - 1 - r (the attention layers' layout, `layout.py`). Per chunk c the state leaving it is an
affine map of the state entering it, S_out = A_c S_in + B_c (A_c [Dk, Dk], B_c [Dk, Dv] per value
head): within a 64-token block of the chunked rule, h' = (exp(G_last) I - k_dec^T w) h + k_dec^T u,
and A_c is the product of those matrices (A_c = 0 when a document starts inside the chunk). Each rank
computes the maps of its two chunks with a zero entering state, one differentiable all-gather brings
every chunk's (A, B), and every rank composes them in chunk order in fp32 for the states entering
its chunks; then it reruns the part of each chunk before its first document start from that state.
Gradients flow back through the composition and the all-gather's reduce-scatter to the ranks that
made each map. The causal conv takes its W - 1 halo tokens of chunk c from the tail of chunk c - 1
(another all-gather of 2 CP x (W - 1) tokens); taps stop at the token's document start.

The CPU path (torch, fp32): the chunked rule with a triangular solve (not fla's 16 x 16 blocks).
Shape legend: B batch, L chunk length, HV value heads, Dk / Dv head dims, C conv channels, W width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel.attention import check_batch
from bumblebee.primitives.context_parallel.comm import gather
from bumblebee.primitives.context_parallel.layout import CPBatch, rank_chunks

BLOCK = 64


def _slot(c: int, cp: int) -> int:
    """Where chunk c sits in a gather of every rank's two chunks (layout order)."""
    return 2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1


def halo_conv_silu(x_BTC, weight_CW, batch: CPBatch):
    """SiLU(depthwise causal conv) of this rank's two chunks, fp32 inside, in x's dtype; tap s reads
    the token s steps back (on the previous chunk's rank for the first W - 1 tokens) within the
    token's document."""
    B, _, C = x_BTC.shape
    W, L = weight_CW.shape[-1], batch.chunk
    if W - 1 > L:
        raise ValueError(f"conv width {W} needs chunks of at least {W - 1} tokens, got {L} "
                         f"(T={batch.T}, CP={batch.cp})")
    x, w = to_acc(x_BTC), to_acc(weight_CW)
    tails = torch.stack([x[:, (i + 1) * L - (W - 1):(i + 1) * L] for i in range(2)], dim=1)  # [B, 2, W-1, C]
    tails = gather(tails, batch.group, dim=1)  # [B, 2 CP, W-1, C]
    out = []
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        halo = tails[:, _slot(c - 1, batch.cp)] if c > 0 else x.new_zeros(B, W - 1, C)
        ext = torch.cat([halo, x[:, i * L:(i + 1) * L]], dim=1)
        in_doc = batch.chunk_index(i) - batch.starts[i * L:(i + 1) * L]  # position inside the document
        y = 0
        for s in range(W):
            y = y + ext[:, W - 1 - s:W - 1 - s + L] * (in_doc >= s)[:, None].to(x.dtype) * w[:, W - 1 - s]
        out.append(y)
    return F.silu(torch.cat(out, dim=1)).to(x_BTC.dtype)


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _run(q, k, v, g, beta, h0, want_map: bool):
    """The chunked rule on one piece of a sequence: [B, HV, n, *] fp32 (q scaled), entering state h0
    [B, HV, Dk, Dv] -> (o [B, HV, n, Dv], leaving state, A [B, HV, Dk, Dk] or None)."""
    n = q.shape[2]
    pad = (-n) % BLOCK  # zero keys and beta, zero log decay: padding leaves the state alone
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    Bn, HV, N, Dk = k.shape
    nb = N // BLOCK
    q, k, v = (t.reshape(Bn, HV, nb, BLOCK, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(Bn, HV, nb, BLOCK), beta.reshape(Bn, HV, nb, BLOCK)
    G = g.cumsum(-1)
    lower = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # unit diagonal: beta k.k is replaced by 1 below
    A = A.tril(-1) + torch.eye(BLOCK, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec, k_dec = q * G.exp()[..., None], k * (G[..., -1:] - G).exp()[..., None]
    eye = torch.eye(Dk, dtype=q.dtype, device=q.device)
    h, M, outs = h0, None, []
    for b in range(nb):
        v_new = u[:, :, b] - w[:, :, b] @ h
        outs.append(q_dec[:, :, b] @ h + attn[:, :, b] @ v_new)
        last = G[:, :, b, -1].exp()[..., None, None]
        h = h * last + k_dec[:, :, b].transpose(-1, -2) @ v_new
        if want_map:
            step = eye * last - k_dec[:, :, b].transpose(-1, -2) @ w[:, :, b]
            M = step if M is None else step @ M
    return torch.cat(outs, dim=2)[:, :, :n], h, M


def gated_delta_rule(q, k, v, g, beta, *, scale: float, batch: CPBatch):
    """q, k [B, 2L, H, Dk], v [B, 2L, HV, Dv], g (log decays), beta [B, 2L, HV] of this rank's chunks
    -> o [B, 2L, HV, Dv] in v's dtype; q and k are l2-normalized here."""
    B, T2, H, Dk = k.shape
    HV, Dv = v.shape[2:]
    L, cp, dtype = batch.chunk, batch.cp, v.dtype
    rep = HV // H
    q, k = (l2norm(to_acc(t)).repeat_interleave(rep, dim=2).transpose(1, 2) for t in (q, k))
    q = q * scale
    v, g, beta = (to_acc(t).transpose(1, 2) for t in (v, g, beta))
    zero = q.new_zeros(B, HV, Dk, Dv)
    pieces, maps, firsts = [], [], []
    for i in range(2):
        bounds = sorted({0, L, *batch.cuts[i]})
        segs = [(i * L + a, i * L + b) for a, b in zip(bounds, bounds[1:])]
        continues = 0 not in batch.cuts[i]
        outs, h, M = [], zero, None
        for a, b in segs:  # a chunk with a document start inside maps every entering state to 0
            o, h, m = _run(*(t[:, :, a:b] for t in (q, k, v, g, beta)), zero, want_map=continues and len(segs) == 1)
            outs.append(o)
            M = m if m is not None else M
        maps.append(torch.cat([zero.new_zeros(B, HV, Dk, Dk) if M is None else M, h], dim=-1))
        firsts.append(segs[0] if continues else None)
        pieces.append(outs)
    AB = gather(torch.stack(maps, dim=1), batch.group, dim=1)  # [B, 2 CP, HV, Dk, Dk + Dv]: (A | B) per chunk
    A_all, B_all = AB[..., :Dk], AB[..., Dk:]
    chunks = rank_chunks(batch.rank, cp)
    entering, S = {}, zero
    for c in range(max(chunks)):  # the scan in chunk order, fp32
        S = A_all[:, _slot(c, cp)] @ S + B_all[:, _slot(c, cp)]
        entering[c + 1] = S
    for i, c in enumerate(chunks):
        if firsts[i] is not None:  # the piece before the first document start, from its entering state
            a, b = firsts[i]
            pieces[i][0] = _run(*(t[:, :, a:b] for t in (q, k, v, g, beta)), entering[c], want_map=False)[0]
    return torch.cat([p for outs in pieces for p in outs], dim=2).transpose(1, 2).to(dtype)


def gdn_forward(layer, x_BTD, cu_seqlens):
    """A gated DeltaNet layer (the `linear_attention` slot's parameters) on this rank's chunks."""
    batch = check_batch(cu_seqlens, x_BTD.transpose(1, 2))  # tokens on dim 2, as attention's q
    B, T, _ = x_BTD.shape
    qkv = halo_conv_silu(layer.in_proj_qkv(x_BTD), layer.conv1d.weight[:, 0], batch)
    heads = ((layer.num_k_heads, layer.head_k_dim),) * 2 + ((layer.num_v_heads, layer.head_v_dim),)
    q, k, v = (t.reshape(B, T, *hd) for t, hd in
               zip(qkv.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1), heads))
    beta = layer.in_proj_b(x_BTD).sigmoid()
    g = -to_acc(layer.A_log).exp() * F.softplus(to_acc(layer.in_proj_a(x_BTD)) + layer.dt_bias)
    o = gated_delta_rule(q, k, v, g, beta, scale=layer.head_k_dim ** -0.5, batch=batch)
    z = layer.in_proj_z(x_BTD).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
    return layer.out_proj(layer.norm(o, z).reshape(B, T, layer.value_dim))

