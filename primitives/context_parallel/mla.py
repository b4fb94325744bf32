"""Multi-head latent attention over a context-parallel shard: the latent (or the heads) on the wire.

Per token MLA's keys and values come from the normalized latent c [r] and one shared roped key [R]:
r + R = 576 numbers in DeepSeek-V3, where the expanded heads are H x (qk + v) = 128 x (192 + 128) =
40960. Two exchanges, chosen per layer by the numbers each puts on the wire per token
(`wire_numbers`, `choose`; `ContextParallel.mla_exchange` forces one):

- `latent`: one differentiable all-gather of [c | roped k] (reduce-scatter of its gradient in the
  backward, `comm.py`); each rank attends to the keys its chunks can see (global positions
  [lo, (c1 + 1) L): lo its chunks' earliest document start, c1 its later chunk) one key chunk at a
  time (`mla_blocks.py`): the chunk's latent expanded with `kv_b_proj`, its (piece, key chunk)
  blocks attended with an online fp32 log-sum-exp merge, and the expansion recomputed per chunk in
  the backward, so a rank keeps the gathered latent [S, r + R] and O(local tokens), never the
  expanded K/V of all S keys. 71x fewer bytes than the heads for DeepSeek-V3, for repeating the
  expansion matmul of the keys on every rank (twice: forward and backward).
- `heads`: each rank expands its own tokens' K/V and `attention.allgather_attention` gathers them
  (the cheaper wire only for few heads over a wide latent).

The latent path stays in the activations' dtype on the wire and into kv_b_proj; its attention
blocks compute in fp32 (float64 inputs: float64), as the merge needs.
Shape legend: B batch, H heads, T global tokens, L chunk length, S keys a rank expands.
"""
from __future__ import annotations

import torch

from bumblebee.primitives.context_parallel.attention import allgather_attention, check_batch
from bumblebee.primitives.context_parallel.comm import gather
from bumblebee.primitives.context_parallel.layout import layout_index, rank_chunks
from bumblebee.primitives.context_parallel.mla_blocks import expand, latent_attention, mla_dims
from bumblebee.primitives.mla import rope_pairs

EXCHANGES = ("auto", "latent", "heads")


def wire_numbers(layer) -> dict[str, int]:
    """Numbers per token each exchange all-gathers (and reduce-scatters back), in the same dtype:
    latent [c | roped k]; heads K [H, qk] and V [H, v]."""
    return {"latent": layer.kv_lora_rank + layer.rope_dim, "heads": layer.n_heads * (layer.qk_dim + layer.v_dim)}


def choose(layer, exchange: str) -> str:
    """The exchange a layer runs: `exchange` unless "auto", then whichever moves fewer bytes."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}; got {exchange!r}")
    if exchange != "auto":
        return exchange
    n = wire_numbers(layer)
    return "latent" if n["latent"] <= n["heads"] else "heads"


def _expand(layer, latent_BSX):
    """[c | roped k] [B, S, r + R] -> k [B, H, S, qk], v [B, H, S, v] (kv_b_proj, the rope key shared)."""
    return expand(latent_BSX, layer.kv_b_proj.weight, layer.kv_b_proj.bias, mla_dims(layer))


def mla_forward(layer, x_BTD, cos, sin, cu_seqlens, exchange: str = "auto"):
    """An MLA layer (the `mla` slot's parameters, `common/mla_projections.py`) on this rank's chunks;
    cos/sin [B, 2L, R] from the tokens' global positions; `exchange` one of `EXCHANGES`."""
    batch = check_batch(cu_seqlens, x_BTD.transpose(1, 2))
    B, T2, _ = x_BTD.shape
    H, R = layer.n_heads, layer.rope_dim
    if layer.q_lora_rank is None:
        q = layer.q_proj(x_BTD)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x_BTD)))
    q_nope, q_rope = q.view(B, T2, H, layer.qk_dim).split([layer.nope, R], dim=-1)
    q = torch.cat((q_nope, rope_pairs(q_rope, cos, sin, layer.rope_interleave)), dim=-1).transpose(1, 2)
    c_kv, k_rope = layer.kv_a_proj_with_mqa(x_BTD).split([layer.kv_lora_rank, R], dim=-1)
    k_rope = rope_pairs(k_rope[:, :, None], cos, sin, layer.rope_interleave)[:, :, 0]
    latent = torch.cat((layer.kv_a_layernorm(c_kv).to(c_kv.dtype), k_rope.to(c_kv.dtype)), dim=-1)  # [B, 2L, r + R]
    if choose(layer, exchange) == "heads":
        o = allgather_attention(q, *_expand(layer, latent), scale=layer.softmax_scale, batch=batch)
    else:
        lo = min(batch.lo)  # packed: no query of this rank sees a key before its chunks' first document
        hi = (max(rank_chunks(batch.rank, batch.cp)) + 1) * batch.chunk
        order = torch.argsort(layout_index(batch.T, batch.cp, x_BTD.device))  # layout -> global order
        keys = gather(latent, batch.group, dim=1).index_select(1, order[lo:hi])  # [B, hi - lo, r + R]
        o = latent_attention(layer, q, keys, batch=batch, lo=lo)
    return layer.o_proj(o.transpose(1, 2).reshape(B, T2, H * layer.v_dim))
