"""Attention over a context-parallel shard of unpacked rows on PyTorch's fused attention kernels.

Without packed documents every (query chunk, key chunk) pair is either all visible (an earlier key
chunk), causal on its diagonal (the same chunk) or empty (a later one), so no mask is ever built:

- `allgather_dense`: the all-gathered K/V in global order, then per local chunk c one SDPA call of its
  L queries against the (c + 1) L keys before and in it with a lower-right causal mask
  (`torch.nn.attention.bias.causal_lower_right`: FlashAttention on CUDA, no mask in memory).
- `ring_dense`: the ring of `attention.py` with each block on the flash kernel's own forward (output
  and log-sum-exp) and backward (from the merged output and log-sum-exp, as FlashAttention's backward
  takes them): `aten._scaled_dot_product_flash_attention[_backward]` on CUDA, its CPU twin
  `..._for_cpu[_backward]` elsewhere. Partial outputs merge in fp32; dQ, dK, dV accumulate in fp32.
  Backward: the K/V blocks travel the ring again (the next one in flight during each step's
  compute) and each block's dK/dV accumulator travels with it, arriving at its owner after CP steps:
  the exchange of the forward, with the gradients riding it back home.

Key/value heads are repeated to the query heads on the receiving rank (the wire carries K heads);
dK/dV sum over each group. Inputs keep their dtype (bf16 in training); the kernels accumulate in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel.comm import gather, ring_shift
from bumblebee.primitives.context_parallel.layout import CPBatch, layout_index, rank_chunks

HALF = (torch.bfloat16, torch.float16)


def usable(q: torch.Tensor, batch: CPBatch) -> bool:
    """Whether the fused path serves: unpacked rows, and on CUDA a 16-bit dtype (flash's)."""
    return not batch.packed and (q.device.type != "cuda" or q.dtype in HALF)


def _expand(t, groups):
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t, groups):
    """dK/dV of the repeated heads [B, H, S, D] -> [B, H / groups, S, D] (sum over each group)."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def allgather_dense(q, k, v, *, scale, batch: CPBatch):
    """q [B, H, 2L, D], k, v [B, K, 2L, D] of this rank -> o [B, H, 2L, D]."""
    L, G = batch.chunk, q.shape[1] // k.shape[1]
    order = torch.argsort(layout_index(batch.T, batch.cp, q.device))
    k_all, v_all = (_expand(gather(t, batch.group, dim=2).index_select(2, order), G) for t in (k, v))
    outs = []
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        hi = (c + 1) * L
        outs.append(F.scaled_dot_product_attention(q[:, :, i * L:(i + 1) * L], k_all[:, :, :hi], v_all[:, :, :hi],
                                                   attn_mask=causal_lower_right(L, hi), scale=scale))
    return torch.cat(outs, dim=2)


def block_forward(q, k, v, causal: bool, scale: float):
    """One block on the flash kernel: (o in q's dtype, lse [B, H, L] fp32, what its backward needs)."""
    if q.device.type == "cuda":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], to_acc(r[1][..., :q.shape[2]]), tuple(r[2:8])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, to_acc(lse), None


def block_backward(do, q, k, v, o, lse, causal: bool, scale: float, aux):
    """(dq, dk, dv) of one block from the whole output o and log-sum-exp lse of its queries."""
    if q.device.type == "cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                             scale=scale)


def _pairs(batch: CPBatch, src: int):
    """(query slot, key slot, causal) of this rank's chunks against rank `src`'s with any visible key."""
    return [(i, j, ck == cq) for i, cq in enumerate(rank_chunks(batch.rank, batch.cp))
            for j, ck in enumerate(rank_chunks(src, batch.cp)) if ck <= cq]


def _halves(t, L):
    return [t[:, :, :L], t[:, :, L:]]


class _RingDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, batch):
        L, cp, rank, G = batch.chunk, batch.cp, batch.rank, q.shape[1] // k.shape[1]
        qs = [t.contiguous() for t in _halves(q, L)]
        o, lse, aux = [None, None], [None, None], None
        kv = [k, v]
        for s in range(cp):
            pending = ring_shift(kv, batch.group) if s < cp - 1 else None  # the next block in flight
            ks, vs = (_halves(_expand(t, G), L) for t in kv)
            for i, j, causal in _pairs(batch, (rank - s) % cp):
                ob, lb, a = block_forward(qs[i], ks[j].contiguous(), vs[j].contiguous(), causal, scale)
                aux = a if aux is None else aux
                if o[i] is None:
                    o[i], lse[i] = to_acc(ob), lb
                else:  # log-sum-exp merge in fp32
                    new = torch.logaddexp(lse[i], lb)
                    o[i] = o[i] * (lse[i] - new).exp()[..., None] + to_acc(ob) * (lb - new).exp()[..., None]
                    lse[i] = new
            if pending is not None:
                bufs, reqs = pending
                for r in reqs:
                    r.wait()
                kv = bufs
        out = torch.cat(o, dim=2).to(q.dtype)  # every query sees itself: both halves are set
        ctx.save_for_backward(q, k, v, out, torch.cat(lse, dim=2))
        ctx.scale, ctx.batch, ctx.aux = scale, batch, aux
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        batch, scale, aux = ctx.batch, ctx.scale, ctx.aux
        L, cp, rank, G = batch.chunk, batch.cp, batch.rank, q.shape[1] // k.shape[1]
        qs, os_, dos = ([t.contiguous() for t in _halves(x, L)] for x in (q, out, do.to(q.dtype)))
        lses = [lse[:, :, :L].contiguous(), lse[:, :, L:].contiguous()]
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulators (float64 inputs: float64)
        dq = [torch.zeros_like(t, dtype=acc) for t in qs]
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
        for s in range(cp):
            prefetch = ring_shift(kv, batch.group, tag=1) if s < cp - 1 else None
            ks, vs = (_halves(_expand(t, G), L) for t in kv)
            dk, dv = _halves(dkv[0].clone(), L), _halves(dkv[1].clone(), L)
            for i, j, causal in _pairs(batch, (rank - s) % cp):
                gq, gk, gv = block_backward(dos[i], qs[i], ks[j].contiguous(), vs[j].contiguous(), os_[i], lses[i],
                                            causal, scale, aux)
                dq[i] = dq[i] + to_acc(gq)
                dk[j] = dk[j] + _fold(to_acc(gk), G)
                dv[j] = dv[j] + _fold(to_acc(gv), G)
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
