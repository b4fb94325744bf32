"""Attention over a context-parallel shard on PyTorch's fused attention kernels, packed rows included.

A local chunk's queries, cut at the document starts inside it (`CPBatch.segments`), fall into
pieces of one document each. A piece of rows [a, b) of chunk c whose document starts at s sees the
keys [s, cL + b) of the global sequence, and those keys are causal to it bottom-right aligned: the
piece's last query sees every key of the range, its first the range less b - a - 1. Per piece and
key chunk that is all visible (an earlier key chunk, clipped at s), causal on the diagonal (the same
chunk: square) or empty, so no mask is ever built; unpacked rows are the one-piece case (s = 0).

- `allgather_dense`: the all-gathered K/V in global order, then per piece two blocks: its document's
  keys before its rows (all visible; cut into blocks of at most `block_keys` keys, so a block's
  gradients, and K/V where a kernel repeats them, stay that size at any T) and its own rows
  (square, causal). Where no fused block kernel
  takes q's dtype (CUDA fp32) or v's head size differs from q's (MLA's `heads` exchange), one SDPA
  call per piece with a lower-right causal mask
  (`torch.nn.attention.bias.causal_lower_right`) instead: on an H200 that mask ran 2.4x slower than
  the two cuDNN blocks (`benchmarks/context_parallel/probes/probe_cudnn_blocks.py`).
- `ring_dense`: the ring of `attention.py` with each (piece, key chunk) block on a fused kernel's
  own forward (output and log-sum-exp) and backward (from the merged output and log-sum-exp, as
  FlashAttention's backward takes them): `kernels.py` (cuDNN or flash on CUDA, flash's CPU twin
  elsewhere). Partial outputs merge in fp32 (a query's
  log-sum-exp starts at -inf: its first block sets it); dQ, dK, dV accumulate in fp32.
  Backward: the K/V blocks travel the ring again (the next one in flight during each step's
  compute) and each block's dK/dV accumulator travels with it, arriving at its owner after CP steps:
  the exchange of the forward, with the gradients riding it back home.

The wire carries the key/value heads; the CUDA blocks take them as they are, each serving its group of
query heads (`kernels.py`: repeated only where a kernel refuses the grouped shape, and on the CPU).
Inputs keep their dtype (bf16 in training); the kernels accumulate in fp32.
A packed row costs one kernel call per piece: many short documents mean many small calls (varlen
kernels would take them in one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel.comm import gather, ring_shift
from bumblebee.primitives.context_parallel.kernels import (  # noqa: F401  (ring_usable: the dispatch's)
    block_backward, block_forward, repeat_heads, ring_usable)
from bumblebee.primitives.context_parallel.layout import CPBatch, layout_index, rank_chunks


BLOCK_KEYS = 65536  # the all-gather's default most keys a block: where a kernel repeats K/V to the query heads
# (the CPU twin, a refused grouped shape), ~3 GiB of bf16 repeated K/V and gradients at 16 query heads of 256
# (Qwen3.5), against ~41 GiB for the last chunk's earlier keys at 1M, CP = 4


def allgather_dense(q, k, v, *, scale, batch: CPBatch, block_keys: int = BLOCK_KEYS):
    """q [B, H, 2L, D], k, v [B, K, 2L, D] of this rank -> o [B, H, 2L, D]; a piece's earlier keys
    go in blocks of at most `block_keys` (0: one block)."""
    if isinstance(block_keys, bool) or not isinstance(block_keys, int) or block_keys < 0:
        raise ValueError(f"block_keys must be an int >= 0 (0: no cut), got {block_keys!r}")
    G = q.shape[1] // k.shape[1]
    order = torch.argsort(layout_index(batch.T, batch.cp, q.device))
    k_all, v_all = (gather(t, batch.group, dim=2).index_select(2, order) for t in (k, v))
    if ring_usable(q) and v.shape[-1] == q.shape[-1]:  # per piece two fused blocks (flash's CPU op
        # wants one head size): its document's earlier keys, and its own rows
        return _GatheredBlocks.apply(q, k_all, v_all, scale, batch, block_keys)
    k_all, v_all = repeat_heads(k_all, G), repeat_heads(v_all, G)
    L = batch.chunk
    outs = []  # CUDA fp32: per piece one lower-right causal SDPA call against the keys up to itself
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        for a, b, start in batch.segments(i):
            hi = c * L + b
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * L + a:i * L + b], k_all[:, :, start:hi], v_all[:, :, start:hi],
                attn_mask=causal_lower_right(b - a, hi - start), scale=scale))
    return torch.cat(outs, dim=2)


def _gathered_blocks(batch: CPBatch, block_keys: int = 0):
    """(query rows a:b of the rank's 2L, key rows ka:kb of the global T, causal) of every block: per
    piece its document's keys before its chunk rows (all visible; in blocks of at most `block_keys`,
    0: one), then its own rows (square, causal)."""
    L, out = batch.chunk, []
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        for a, b, start in batch.segments(i):
            end = c * L + a
            step = block_keys or max(end - start, 1)
            for ka in range(start, end, step):
                out.append((i * L + a, i * L + b, ka, min(ka + step, end), False))
            out.append((i * L + a, i * L + b, c * L + a, c * L + b, True))
    return out


class _GatheredBlocks(torch.autograd.Function):
    """The all-gather's attention on the fused blocks, merged in fp32 per piece. K/V [B, K, T, D] go to
    each block with their own heads (`kernels.block_forward` repeats them only where its kernel needs
    it), so no repeated K/V and no per-block gradient exists for the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, scale, batch, block_keys):
        acc = torch.promote_types(q.dtype, torch.float32)
        o = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
        bl, aux = _gathered_blocks(batch, block_keys), []
        for a, b, ka, kb, causal in bl:
            ob, lb, x = block_forward(_rows(q, a, b), _rows(k, ka, kb), _rows(v, ka, kb), causal, scale)
            aux.append(x)
            new = torch.logaddexp(lse[:, :, a:b], lb)
            o[:, :, a:b] = (o[:, :, a:b] * (lse[:, :, a:b] - new).exp()[..., None]
                            + to_acc(ob) * (lb - new).exp()[..., None])
            lse[:, :, a:b] = new
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.blocks, ctx.aux = scale, bl, aux
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        acc = torch.promote_types(q.dtype, torch.float32)
        do = do.to(q.dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        for (a, b, ka, kb, causal), x in zip(ctx.blocks, ctx.aux):
            gq, gk, gv = block_backward(_rows(do, a, b), _rows(q, a, b), _rows(k, ka, kb), _rows(v, ka, kb),
                                        _rows(out, a, b), lse[:, :, a:b].contiguous(), causal, ctx.scale, x)
            dq[:, :, a:b] += to_acc(gq)
            dk[:, :, ka:kb] += to_acc(gk)
            dv[:, :, ka:kb] += to_acc(gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def blocks(batch: CPBatch, src: int) -> list[tuple]:
    """(query slot i, key slot j, rows a:b of chunk i, key rows ka:kb of chunk j, causal) of every
    block of this rank's pieces against rank `src`'s chunks with a visible key."""
    L, out = batch.chunk, []
    for i, cq in enumerate(rank_chunks(batch.rank, batch.cp)):
        pieces = batch.segments(i)
        for j, ck in enumerate(rank_chunks(src, batch.cp)):
            for a, b, start in pieces:
                if ck == cq:  # the piece against its own rows: square, causal
                    out.append((i, j, a, b, a, b, True))
                elif ck < cq and start < (ck + 1) * L:  # an earlier chunk, clipped at the document start
                    out.append((i, j, a, b, max(start - ck * L, 0), L, False))
    return out


def _halves(t, L):
    return [t[:, :, :L], t[:, :, L:]]


def _rows(t, a, b):
    return t[:, :, a:b].contiguous()


class _RingDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, batch):
        L, cp, rank = batch.chunk, batch.cp, batch.rank
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulators (float64 inputs: float64)
        qs = _halves(q, L)
        o = [q.new_zeros(t.shape, dtype=acc) for t in qs]
        lse = [q.new_full(t.shape[:3], float("-inf"), dtype=acc) for t in qs]
        kv, aux = [k, v], []
        for s in range(cp):
            pending = ring_shift(kv, batch.group) if s < cp - 1 else None  # the next block in flight
            ks, vs = (_halves(t, L) for t in kv)
            for i, j, a, b, ka, kb, causal in blocks(batch, (rank - s) % cp):
                ob, lb, x = block_forward(_rows(qs[i], a, b), _rows(ks[j], ka, kb), _rows(vs[j], ka, kb), causal,
                                          scale)
                aux.append(x)
                new = torch.logaddexp(lse[i][:, :, a:b], lb)  # log-sum-exp merge in fp32
                o[i][:, :, a:b] = (o[i][:, :, a:b] * (lse[i][:, :, a:b] - new).exp()[..., None]
                                   + to_acc(ob) * (lb - new).exp()[..., None])
                lse[i][:, :, a:b] = new
            if pending is not None:
                bufs, reqs = pending
                for r in reqs:
                    r.wait()
                kv = bufs
        out = torch.cat(o, dim=2).to(q.dtype)  # every query sees itself: every row is set
        ctx.save_for_backward(q, k, v, out, torch.cat(lse, dim=2))
        ctx.scale, ctx.batch, ctx.aux = scale, batch, aux
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        batch, scale, aux = ctx.batch, ctx.scale, iter(ctx.aux)  # the blocks come in the forward's order
        L, cp, rank = batch.chunk, batch.cp, batch.rank
        qs, os_, dos, lses = (_halves(x, L) for x in (q, out, do.to(q.dtype), lse))
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulators (float64 inputs: float64)
        dq = [torch.zeros_like(t, dtype=acc) for t in qs]
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
        for s in range(cp):
            prefetch = ring_shift(kv, batch.group, tag=1) if s < cp - 1 else None
            ks, vs = (_halves(t, L) for t in kv)
            dk, dv = _halves(dkv[0].clone(), L), _halves(dkv[1].clone(), L)
            for i, j, a, b, ka, kb, causal in blocks(batch, (rank - s) % cp):
                gq, gk, gv = block_backward(_rows(dos[i], a, b), _rows(qs[i], a, b), _rows(ks[j], ka, kb),
                                            _rows(vs[j], ka, kb), _rows(os_[i], a, b),
                                            lses[i][:, :, a:b].contiguous(), causal, scale, next(aux))
                dq[i][:, :, a:b] += to_acc(gq)
                dk[j][:, :, ka:kb] += to_acc(gk)
                dv[j][:, :, ka:kb] += to_acc(gv)
            # the block's gradients follow it: after the last step they arrive at their owner
            dkv, reqs = [torch.cat(dk, dim=2), torch.cat(dv, dim=2)], []
            if cp > 1:
                dkv, reqs = ring_shift(dkv, batch.group, tag=2)
            if prefetch is not None:
                kv, more = prefetch
                reqs = reqs + more
            for r in reqs:
                r.wait()
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_dense(q, k, v, *, scale, batch: CPBatch):
    """q [B, H, 2L, D], k, v [B, K, 2L, D] of this rank -> o [B, H, 2L, D] in q's dtype."""
    return _RingDense.apply(q, k, v, scale, batch)
