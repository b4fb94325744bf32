"""MLA's latent exchange, blockwise: expand one key chunk at a time and recompute it in the backward.

After the all-gather a rank holds the latent and roped key [c | k_rope] of every key its chunks see
(global positions [lo, hi): up to the whole sequence for rank 0, whose later chunk is the last).
Expanding all of them with `kv_b_proj` at once, and keeping the expanded K/V [S, H, qk + v] for the
backward, makes a rank's memory grow with T rather than T / CP. Here the keys are taken one global
chunk (L = T / (2 CP) tokens) at a time: the chunk's latent is expanded, every (query piece, key
chunk) block that sees it is attended, and the partial outputs merge online by their log-sum-exp in
fp32 (float64 inputs: float64) — the FlashAttention recurrence. The backward saves only q, the
gathered latent slice [S, r + R], the merged output and log-sum-exp (O(local tokens) beside the
latent) and, per key chunk, expands it again under autograd, runs the blocks' attention backward
from the saved log-sum-exp (fp32), and pulls dK, dV back through the expansion to the latent and
`kv_b_proj`'s weight. So at most one chunk's expanded K/V lives at a time, forward or backward, for
one more expansion matmul per key in the backward.

Blocks are those of `flash.blocks` over global key chunks: a piece [a, b) of query chunk cq whose
document starts at s sees key chunk ck < cq clipped at s (all visible) and its own rows [a, b) of
chunk cq causally (square). Each block runs on the flash op's forward (output + log-sum-exp) and
backward (from the merged output and log-sum-exp), `flash.block_forward` / `block_backward`, with
q, k, v zero-padded to one head size (flash's rule; DeepSeek-V3: v 128 -> 192); where flash does not
take q's dtype (CUDA fp32/float64, `flash.ring_usable`) the block's [piece, L] scores are built in
torch instead, as `attention.masked_ring` does.
Shape legend: B batch, H heads, L chunk length, S keys [lo, hi), r latent rank, R rope dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel import flash
from bumblebee.primitives.context_parallel.attention import _block_backward, _block_forward, _merge
from bumblebee.primitives.context_parallel.layout import CPBatch, rank_chunks


def mla_dims(layer) -> tuple[int, int, int, int, int]:
    """(H, nope, v, r, R) of an MLA layer: what `expand` needs besides kv_b_proj."""
    return layer.n_heads, layer.nope, layer.v_dim, layer.kv_lora_rank, layer.rope_dim


def expand(latent_BSX, weight, bias, dims):
    """[c | roped k] [B, S, r + R] -> k [B, H, S, qk], v [B, H, S, v]: kv_b_proj (weight, bias) on the
    latent, the roped key shared by every head. dims = (H, nope, v, r, R)."""
    H, nope, vd, r, R = dims
    B, S, _ = latent_BSX.shape
    c, k_rope = latent_BSX.split([r, R], dim=-1)
    k_nope, v = F.linear(c, weight, bias).view(B, S, H, nope + vd).split([nope, vd], dim=-1)
    k = torch.cat((k_nope, k_rope[:, :, None].expand(B, S, H, R)), dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


def key_blocks(batch: CPBatch, lo: int) -> list[tuple[int, int, list[tuple]]]:
    """(key chunk ck, its first key's global position base >= lo, [(query slot i, rows a:b of chunk i,
    key rows ka:kb of chunk ck, causal)]) for every global chunk holding a key this rank's pieces see."""
    L, out = batch.chunk, {}
    for i, cq in enumerate(rank_chunks(batch.rank, batch.cp)):
        for a, b, start in batch.segments(i):
            for ck in range(start // L, cq + 1):  # earlier chunks from the document's first on
                causal = ck == cq
                out.setdefault(ck, []).append((i, a, b, a if causal else max(start - ck * L, 0), b if causal else L,
                                               causal))
    return [(ck, max(ck * L, lo), entries) for ck, entries in sorted(out.items())]


def _visible(n, m, causal, device):
    mask = torch.ones(n, m, dtype=torch.bool, device=device)
    return mask.tril() if causal else mask


def _block_rows(batch, ck, base, entry):
    """(query rows of this rank [2L], key rows of the chunk's expansion, which starts at base)."""
    i, a, b, ka, kb, _ = entry
    L = batch.chunk
    off = base - ck * L
    return slice(i * L + a, i * L + b), slice(ka - off, kb - off)


def _pad(t, D):
    """Head dim padded with zeros to D: flash takes one head size for q, k and v; zero columns of q, k
    leave the scores, of v the output's first columns, unchanged (and get zero gradients)."""
    return t if t.shape[-1] == D else F.pad(t, (0, D - t.shape[-1]))


class _LatentBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, weight, bias, dims, scale, batch, lo):
        B, H, T2, qk = q.shape
        L, vd, fused = batch.chunk, dims[2], flash.ring_usable(q)
        D = max(qk, vd)
        qa = _pad(q, D) if fused else to_acc(q)
        o = to_acc(q).new_zeros(B, H, T2, vd)
        lse = to_acc(q).new_full((B, H, T2), float("-inf"))
        aux = []  # what each flash block's backward needs (CUDA: its sizes and seed), in block order
        for ck, base, entries in key_blocks(batch, lo):
            k, v = expand(keys[:, base - lo:(ck + 1) * L - lo], weight, bias, dims)
            k, v = (_pad(k, D), _pad(v, D)) if fused else (to_acc(k), to_acc(v))
            for e in entries:
                rows, ks = _block_rows(batch, ck, base, e)
                if fused:  # the flash op's forward: output and log-sum-exp, no score matrix in memory
                    ob, lb, x = flash.block_forward(qa[:, :, rows].contiguous(), k[:, :, ks].contiguous(),
                                                    v[:, :, ks].contiguous(), e[5], scale)
                    ob, _ = to_acc(ob)[..., :vd], aux.append(x)
                else:  # CUDA fp32/float64 (flash: 16-bit only): the scores of the block in torch
                    mask = _visible(rows.stop - rows.start, ks.stop - ks.start, e[5], q.device)
                    ob, lb = (t[:, :, 0] for t in _block_forward(qa[:, :, None, rows], k[:, :, None, ks],
                                                                 v[:, :, None, ks], mask, scale))
                o[:, :, rows], lse[:, :, rows] = _merge(o[:, :, rows], lse[:, :, rows], ob, lb)
        ctx.save_for_backward(q, keys, weight, bias, o, lse)  # every query sees itself: every row is set
        ctx.dims, ctx.scale, ctx.batch, ctx.lo, ctx.aux = dims, scale, batch, lo, aux
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, keys, weight, bias, o, lse = ctx.saved_tensors
        batch, lo, scale, L, aux = ctx.batch, ctx.lo, ctx.scale, ctx.batch.chunk, iter(ctx.aux)
        qk, vd, fused = q.shape[-1], ctx.dims[2], flash.ring_usable(q)
        D = max(qk, vd)
        if fused:  # flash's backward takes the merged output and log-sum-exp in q's dtype / fp32
            qa, do, o = _pad(q, D), _pad(do.to(q.dtype), D), _pad(o.to(q.dtype), D)
        else:
            qa, do = to_acc(q), to_acc(do)
            delta = (do * o).sum(-1)
        dq, dkeys = torch.zeros_like(to_acc(q)), torch.zeros_like(to_acc(keys))
        params = [t for t in (weight, bias) if t is not None]
        dparams = [torch.zeros_like(to_acc(t)) for t in params]
        for ck, base, entries in key_blocks(batch, lo):
            span = slice(base - lo, (ck + 1) * L - lo)
            with torch.enable_grad():  # the chunk's expansion again, its graph alive for this chunk only
                lat = keys[:, span].detach().requires_grad_()
                ps = [t.detach().requires_grad_() for t in params]
                k, v = expand(lat, ps[0], ps[1] if bias is not None else None, ctx.dims)
            ka, va = (_pad(k.detach(), D), _pad(v.detach(), D)) if fused else (to_acc(k.detach()), to_acc(v.detach()))
            dk, dv = torch.zeros_like(to_acc(k)), torch.zeros_like(to_acc(v))
            for e in entries:
                rows, ks = _block_rows(batch, ck, base, e)
                if fused:
                    gq, gk, gv = flash.block_backward(
                        do[:, :, rows].contiguous(), qa[:, :, rows].contiguous(), ka[:, :, ks].contiguous(),
                        va[:, :, ks].contiguous(), o[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), e[5],
                        scale, next(aux))
                    dq[:, :, rows] += to_acc(gq)[..., :qk]
                    dk[:, :, ks] += to_acc(gk)[..., :qk]
                    dv[:, :, ks] += to_acc(gv)[..., :vd]
                    continue
                mask = _visible(rows.stop - rows.start, ks.stop - ks.start, e[5], q.device)
                gq, gk, gv = _block_backward(qa[:, :, rows], ka[:, :, ks], va[:, :, ks], do[:, :, rows],
                                             lse[:, :, rows], delta[:, :, rows], mask, scale)
                dq[:, :, rows] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
            grads = torch.autograd.grad((k, v), [lat, *ps], (dk.to(k.dtype), dv.to(v.dtype)))
            dkeys[:, span] += to_acc(grads[0])
            for acc, g in zip(dparams, grads[1:]):
                acc += to_acc(g)
        dw = dparams[0].to(weight.dtype)
        db = dparams[1].to(bias.dtype) if bias is not None else None
        return dq.to(q.dtype), dkeys.to(keys.dtype), dw, db, None, None, None, None


def latent_attention(layer, q, keys, *, batch: CPBatch, lo: int):
    """q [B, H, 2L, qk] of this rank against the gathered [c | roped k] [B, hi - lo, r + R] of the
    keys at global positions lo, lo + 1, ... -> o [B, H, 2L, v] in q's dtype, one key chunk at a time."""
    proj = layer.kv_b_proj
    if not isinstance(proj, torch.nn.Linear):
        raise TypeError(f"layer.kv_b_proj must be a torch.nn.Linear for the latent exchange, got {type(proj).__name__}")
    return _LatentBlocks.apply(q, keys, proj.weight, proj.bias, mla_dims(layer), layer.softmax_scale, batch, lo)
