"""Multi-head latent attention over a context-parallel shard: all-gather of the latent and RoPE key.

Per token MLA's keys and values come from the normalized latent c [r] and one shared rope key [R]
(r + R = 576 numbers in DeepSeek-V3) where the expanded heads are H x (nope + R + v) (128 x 448 =
57344): so the ranks all-gather c and the roped key (differentiable; reduce-scatter backward) and
each rank expands K/V from the gathered latent with `kv_b_proj` for the keys its chunks need, 100x
fewer bytes on the wire than gathering the heads, for the cost of repeating the expansion matmul
on every rank. Queries stay local; masks as in `attention.py`. fp32 math on this path (float64 inputs: float64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel.attention import _mask, check_batch
from bumblebee.primitives.context_parallel.comm import gather
from bumblebee.primitives.context_parallel.layout import layout_index, rank_chunks
from bumblebee.primitives.mla import rope_pairs


def mla_forward(layer, x_BTD, cos, sin, cu_seqlens):
    """An MLA layer (the `mla` slot's parameters, `common/mla_projections.py`) on this rank's chunks;
    cos/sin [B, 2L, R] from the tokens' global positions."""
    batch = check_batch(cu_seqlens, x_BTD.transpose(1, 2))
    B, T2, _ = x_BTD.shape
    H, L, nope, R = layer.n_heads, batch.chunk, layer.nope, layer.rope_dim
    if layer.q_lora_rank is None:
        q = layer.q_proj(x_BTD)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x_BTD)))
    q_nope, q_rope = q.view(B, T2, H, layer.qk_dim).split([nope, R], dim=-1)
    q = torch.cat((q_nope, rope_pairs(q_rope, cos, sin, layer.rope_interleave)), dim=-1).transpose(1, 2)
    c_kv, k_rope = layer.kv_a_proj_with_mqa(x_BTD).split([layer.kv_lora_rank, R], dim=-1)
    k_rope = rope_pairs(k_rope[:, :, None], cos, sin, layer.rope_interleave)[:, :, 0]
    order = torch.argsort(layout_index(batch.T, batch.cp, x_BTD.device))
    latent = gather(torch.cat((layer.kv_a_layernorm(c_kv), k_rope), dim=-1), batch.group, dim=1)
    latent = latent.index_select(1, order)  # [B, T, r + R] in global order
    lo = min(batch.lo)
    hi = (max(rank_chunks(batch.rank, batch.cp)) + 1) * L
    c_all, kr_all = latent[:, lo:hi].split([layer.kv_lora_rank, R], dim=-1)
    kv = layer.kv_b_proj(c_all).view(B, hi - lo, H, nope + layer.v_dim)
    k_nope, v = kv.split([nope, layer.v_dim], dim=-1)
    k = torch.cat((k_nope, kr_all[:, :, None].expand(B, hi - lo, H, R)), dim=-1).transpose(1, 2)
    v = v.transpose(1, 2)
    pos = torch.arange(batch.T, device=x_BTD.device)
    outs = []
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        a, b = batch.lo[i] - lo, (c + 1) * L - lo
        mask = _mask(batch.chunk_index(i), batch.starts[i * L:(i + 1) * L], pos[lo + a:lo + b])
        o = F.scaled_dot_product_attention(to_acc(q[:, :, i * L:(i + 1) * L]), to_acc(k[:, :, a:b]),
                                           to_acc(v[:, :, a:b]), attn_mask=mask, scale=layer.softmax_scale)
        outs.append(o.to(x_BTD.dtype))
    o = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T2, H * layer.v_dim)
    return layer.o_proj(o)
