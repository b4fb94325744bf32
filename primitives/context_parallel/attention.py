"""Causal GQA attention over a context-parallel shard: all-gather of K/V, or a ring exchange.

Queries stay local ([B, H, 2L, D]: the rank's chunks c0 = r and c1 = 2 CP - 1 - r, L tokens each);
keys and values come from every rank. A query at global position i attends to the key at j when
start(i) <= j <= i (start: its document's first position), so packed documents need no alignment.

- `allgather`: one differentiable all-gather of K and V (backward: a reduce-scatter of dK, dV), then
  per piece of a local chunk (its rows of one document) one SDPA call against the keys it sees.
  Exact through autograd; moves (CP - 1) / CP of the sequence's K/V to every rank at once.
- `ring`: K/V blocks (a rank's two chunks) travel around the ring, the next block's transfer
  overlapping this block's compute; each (query piece, key chunk) block with a visible key gives a
  partial output and log-sum-exp, merged in fp32. The backward runs the ring again from the saved
  log-sum-exp, the next K/V block in flight during each step's compute, and sends each block's dK,
  dV accumulators after it (another tag), so after CP steps every rank holds its own keys' full
  gradient.

Both run on fused kernels (`flash.py`), packed rows or not; `fused` is the dispatch decision. The
one exception is the ring on CUDA in fp32/float64 (flash takes 16-bit only): `masked_ring` here, the
FlashAttention recurrence in torch with a [L, L] mask per chunk pair, computing in fp32 (float64
inputs: float64). Shape legend: B batch, H query heads, K key/value heads, G = H / K, T global
tokens, L chunk length, D head dim.
"""
from __future__ import annotations

import torch

from bumblebee.checks import check_attention_inputs
from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel import flash
from bumblebee.primitives.context_parallel.comm import ring_shift
from bumblebee.primitives.context_parallel.layout import CPBatch, rank_chunks


def check_batch(batch, q) -> CPBatch:
    if not isinstance(batch, CPBatch):
        raise ValueError("a context-parallel layer takes cu_seqlens=CPBatch (primitives/context_parallel "
                         f"shard_batch(...).batch), got {type(batch).__name__}")
    if q.shape[2] != batch.local:
        raise ValueError(f"q holds {q.shape[2]} tokens, the cp shard {batch.local} (T={batch.T}, CP={batch.cp})")
    return batch


def _mask(q_pos, q_start, k_pos):
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= q_start[:, None])


def fused(q: torch.Tensor, exchange: str) -> bool:
    """Whether `exchange` runs on the fused kernels for q (packed or not): the all-gather always (SDPA
    takes every dtype), the ring where the flash op takes q's dtype (`flash.ring_usable`)."""
    return exchange == "allgather" or flash.ring_usable(q)


def allgather_attention(q, k, v, *, scale, batch: CPBatch, block_keys: int = flash.BLOCK_KEYS):
    """q [B, H, 2L, D], k, v [B, K, 2L, D] of this rank -> o [B, H, 2L, D] in q's dtype; a piece's
    earlier keys go in fused blocks of at most `block_keys` (0: one block)."""
    check_attention_inputs(q, k, v)
    return flash.allgather_dense(q, k, v, scale=scale, batch=check_batch(batch, q), block_keys=block_keys)


def _pairs(batch: CPBatch, src: int):
    """(query chunk slot, key chunk slot, mask) of every pair of this rank's chunks with the chunks
    of rank `src` that has an allowed entry."""
    L, dev = batch.chunk, batch.index.device
    out = []
    for i, cq in enumerate(rank_chunks(batch.rank, batch.cp)):
        for j, ck in enumerate(rank_chunks(src, batch.cp)):
            if ck > cq or (ck + 1) * L <= batch.lo[i]:
                continue  # all in the future, or all before the chunk's earliest document
            k_pos = torch.arange(ck * L, (ck + 1) * L, device=dev)
            out.append((i, j, _mask(batch.chunk_index(i), batch.starts[i * L:(i + 1) * L], k_pos)))
    return out


def _scores(q, k, mask, scale):
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, mask, scale):
    """q [B, K, G, L, D], k, v [B, K, 1, L, D] fp32 -> (o, lse [B, K, G, L]; -inf on empty rows)."""
    s = _scores(q, k, mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = (s - m).exp()
    l = p.sum(-1, keepdim=True)  # noqa: E741
    return (p @ v) / l.clamp_min(torch.finfo(l.dtype).tiny), (l.log() + m)[..., 0]


def _block_backward(q, k, v, do, lse, delta, mask, scale):
    """One block's attention backward from the merged rows' log-sum-exp and delta = rowsum(dO * O)
    (FlashAttention's recurrence): (dq, dk, dv) of the block, fp32; dk, dv not yet summed over the
    query heads that share a key head (q [..., G, n, D] against k, v [..., 1, m, D])."""
    p = (_scores(q, k, mask, scale) - lse[..., None]).exp()
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def _merge(o, lse, o_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    w, w_b = (lse - new).exp(), (lse_b - new).exp()
    return o * w[..., None] + o_b * w_b[..., None], new


def _split(t, L):
    return [t[..., :L, :], t[..., L:, :]]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, batch):
        B, H, T2, D = q.shape
        K, L, cp, rank = k.shape[1], batch.chunk, batch.cp, batch.rank
        qg = to_acc(q).view(B, K, H // K, T2, D)
        kv = [to_acc(k)[:, :, None], to_acc(v)[:, :, None]]
        o = [None, None]
        lse = [None, None]
        for s in range(cp):
            src = (rank - s) % cp
            pending = ring_shift(kv, batch.group) if s < cp - 1 else None  # next block in flight
            ks, vs = _split(kv[0], L), _split(kv[1], L)
            for i, j, mask in _pairs(batch, src):
                ob, lb = _block_forward(_split(qg, L)[i], ks[j], vs[j], mask, scale)
                o[i], lse[i] = (ob, lb) if o[i] is None else _merge(o[i], lse[i], ob, lb)
            if pending is not None:
                bufs, reqs = pending
                for r in reqs:
                    r.wait()
                kv = bufs
        o, lse = torch.cat(o, dim=-2), torch.cat(lse, dim=-1)  # every query sees itself: both set
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.batch = scale, batch
        return o.reshape(B, H, T2, D).to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        batch, scale = ctx.batch, ctx.scale
        B, H, T2, D = q.shape
        K, L, cp, rank = k.shape[1], batch.chunk, batch.cp, batch.rank
        qg = _split(to_acc(q).view(B, K, H // K, T2, D), L)
        dog = to_acc(do).reshape(o.shape)
        delta = (dog * o).sum(-1)
        dog, lse, delta = _split(dog, L), [lse[..., :L], lse[..., L:]], [delta[..., :L], delta[..., L:]]
        dq = [torch.zeros_like(t) for t in qg]
        kv = [to_acc(k)[:, :, None], to_acc(v)[:, :, None]]
        dkv = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]  # dK, dV of the held block
        for s in range(cp):
            src = (rank - s) % cp
            prefetch = ring_shift(kv, batch.group, tag=1) if s < cp - 1 else None  # next block in flight
            ks, vs = _split(kv[0], L), _split(kv[1], L)
            dk, dv = _split(dkv[0].clone(), L), _split(dkv[1].clone(), L)
            for i, j, mask in _pairs(batch, src):
                gq, gk, gv = _block_backward(qg[i], ks[j], vs[j], dog[i], lse[i], delta[i], mask, scale)
                dq[i] = dq[i] + gq
                dk[j] = dk[j] + gk.sum(2, keepdim=True)
                dv[j] = dv[j] + gv.sum(2, keepdim=True)
            # the block's gradients follow it; after the last step they arrive at their owner
            dkv, reqs = ring_shift([torch.cat(dk, dim=-2), torch.cat(dv, dim=-2)], batch.group, tag=2)
            if prefetch is not None:
                kv, more = prefetch
                reqs = reqs + more
            for r in reqs:
                r.wait()
        dq = torch.cat(dq, dim=-2).reshape(q.shape).to(q.dtype)
        return dq, dkv[0][:, :, 0].to(k.dtype), dkv[1][:, :, 0].to(v.dtype), None, None


def ring_attention(q, k, v, *, scale, batch: CPBatch):
    """q [B, H, 2L, D], k, v [B, K, 2L, D] of this rank -> o [B, H, 2L, D] in q's dtype."""
    check_attention_inputs(q, k, v)
    batch = check_batch(batch, q)
    if fused(q, "ring"):
        return flash.ring_dense(q, k, v, scale=scale, batch=batch)
    if batch.cp == 1:  # nothing to exchange
        return flash.allgather_dense(q, k, v, scale=scale, batch=batch)
    return _Ring.apply(q, k, v, scale, batch)


def masked_ring(q, k, v, *, scale, batch: CPBatch):
    """The ring in torch with a mask per chunk pair (what `ring` runs on CUDA in fp32/float64)."""
    check_attention_inputs(q, k, v)
    return _Ring.apply(q, k, v, scale, check_batch(batch, q))


EXCHANGES = {"allgather": allgather_attention, "ring": ring_attention}
