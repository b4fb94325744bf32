"""Token permutation of the twin MoE dispatchers `local` and `all_to_all`.

Every token has exactly K routed copies. The dispatchers sort the copies by a key (expert, or
chunk * E + expert with chunks that are contiguous token ranges), run the experts on the sorted
rows and bring the results back to their tokens. Everything here is a gather (`index_select`) or a
gather with an inverse permutation, plus plain reductions: no atomics, so the
results are deterministic, and no host sync.

  order_M  sorted position -> token-major copy id (n * K + k)    x_sorted = x_ND[order_M // K]
  inv_M    token-major copy id -> sorted position                 (the inverse permutation)
  unpermute:   out[n] = sum_k w[n, k] * y_sorted[inv[n K + k]]    gather to token-major, weight, sum
               over K (accumulated in fp32 for bf16/fp16, one rounding of the sum; the products
               w * y are rounded to y's dtype first)
  sum_copies:  gx[n] = sum_k dx_sorted[inv[n K + k]]              the input gradient of the permute
  regroup:     rows that arrive from an all_to_all in (chunk, source, expert) order, to (chunk,
               expert, source) order, as one destination index computed from the counts

`Permute`, `Unpermute` and `RowPermutation` are the autograd forms. The chunked primitive has its own
permutation (its kernels, their algorithms in torch, `primitives/moe_dispatch_rows.py`); of this file
it uses only `copy_order` on CUDA, the one radix sort.

Shape legend: N tokens, K copies per token, M = N K copies, D width, E experts (keys), C chunks,
S source ranks, L local experts, R received rows.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def _chunk_ids(M: int, bounds: tuple, scale: int, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """scale * (chunk of each token-major copy), chunk c holding the copies [bounds[c], bounds[c + 1]),
    in the keys' dtype. Cached, read only: the MoE layers of a step ask for the same token count one
    after another (at most 4 tensors of M ids stay alive)."""
    pos_M = torch.arange(M, device=device)
    chunk_M = torch.zeros_like(pos_M)
    for b in bounds[1:-1]:
        chunk_M += pos_M >= b
    return (chunk_M * scale).to(dtype)


def _chunk_keys(flat_M: torch.Tensor, num_keys: int, bounds: list, chunk_major: bool = True) -> torch.Tensor:
    """Per copy: chunk * num_keys + key (chunk_major), or key * C + chunk; chunk c holds the copies
    [bounds[c], bounds[c + 1]). One kernel per call (the chunk ids are cached)."""
    key_M = flat_M.reshape(-1)
    C = len(bounds) - 1
    if C == 1:
        return key_M
    ids = _chunk_ids(key_M.numel(), tuple(bounds), num_keys if chunk_major else 1, key_M.device, key_M.dtype)
    return torch.add(ids, key_M) if chunk_major else torch.add(ids, key_M, alpha=C)


def copy_order(flat_M: torch.Tensor, num_keys: int, copy_bounds=None, chunk_major: bool = True):
    """Stable sort of the copies by key = chunk * num_keys + expert; chunk c holds the copies
    [copy_bounds[c], copy_bounds[c + 1]) (token-major). Returns (order_M, inv_M, counts [C, num_keys]).
    chunk_major=False sorts by expert * C + chunk: the order of a sort by expert alone (a stable sort
    keeps each expert's copies in token order, and the chunks are token ranges), counted per chunk.
    flat_M must already lie in [0, num_keys); int32 keys (C * num_keys < 2^31) sort in half the radix
    passes of int64 ones. No host sync (bincount would sync on CUDA)."""
    M, dev = flat_M.numel(), flat_M.device
    bounds = [0, M] if copy_bounds is None else list(copy_bounds)
    C = len(bounds) - 1
    key_M = _chunk_keys(flat_M, num_keys, bounds, chunk_major)
    sorted_M, order_M = torch.sort(key_M, stable=True)
    edges = torch.searchsorted(sorted_M, torch.arange(C * num_keys + 1, device=dev, dtype=sorted_M.dtype))
    counts = edges[1:] - edges[:-1]
    counts = counts.view(C, num_keys) if chunk_major else counts.view(num_keys, C).t().contiguous()
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(M, device=dev))
    return order_M, inv_M, counts


def _exclusive_cumsum(t):
    return t.cumsum(-1) - t


def regroup_index(counts_CSL: torch.Tensor, rows: int):
    """Received rows of C chunks, concatenated, each chunk in (source, expert) order with
    counts_CSL[c, s, e] rows per segment -> for every row its position inside its own chunk in
    (expert, source) order ("dest"). One call covers every chunk: chunk c's index is the slice of
    its rows. `rows` = counts_CSL.sum() known on the host (keeps repeat_interleave sync-free)."""
    C, S, L = counts_CSL.shape
    src_start = _exclusive_cumsum(counts_CSL.reshape(-1)).view(C, S, L)
    dst_start = _exclusive_cumsum(counts_CSL.transpose(1, 2).reshape(C, L * S)).view(C, L, S).transpose(1, 2)
    shift = (dst_start - src_start).reshape(-1)
    return torch.arange(rows, device=counts_CSL.device) + torch.repeat_interleave(
        shift, counts_CSL.reshape(-1), output_size=rows)


def regroup_rows(counts_CSL: torch.Tensor, chunk_rows: list):
    """(dest_R, src_R, counts_CL, offs_CL) for rows received in (chunk, source, expert) blocks of
    counts_CSL [C, S, L]: `regroup_index`, its inverse within each chunk (chunk c's rows, chunk_rows[c]
    of them, host-known, are one range), rows per (chunk, expert) and their int32 inclusive offsets.
    `kernels/moe_dispatch_regroup.py:regroup` computes the same in one launch."""
    dest_R = regroup_index(counts_CSL, sum(chunk_rows))
    ends = [sum(chunk_rows[:c + 1]) for c in range(len(chunk_rows))]
    src = [inverse_index(dest_R[e - r:e]) for r, e in zip(chunk_rows, ends)]
    src_R = src[0] if len(src) == 1 else torch.cat(src) if src else dest_R
    counts_CL = counts_CSL.sum(1)
    return dest_R, src_R, counts_CL, torch.cumsum(counts_CL, 1, dtype=torch.int32)


def expert_major_index(counts_CL: torch.Tensor, rows: int):
    """Rows of C chunks concatenated, each chunk grouped by expert (counts_CL[c, e] rows) -> their
    positions in one buffer grouped by expert, chunks in order inside each expert."""
    C, L = counts_CL.shape
    here = _exclusive_cumsum(counts_CL.reshape(-1))
    there = _exclusive_cumsum(counts_CL.t().reshape(-1)).view(L, C).t().reshape(-1)
    return torch.arange(rows, device=counts_CL.device) + torch.repeat_interleave(
        there - here, counts_CL.reshape(-1), output_size=rows)


def inverse_index(dest):
    """src with src[dest[i]] = i, for a permutation dest: x.index_select(0, src) puts row i at
    dest[i] (a gather: coalesced and vectorized, where index_copy_ with dest is not)."""
    return torch.empty_like(dest).scatter_(0, dest, torch.arange(dest.numel(), device=dest.device))


def unpermute(y_MD, weights_NK, inv_M, out=None, dtype=None):
    """out[n] = sum_k weights[n, k] * y_MD[inv_M[n K + k]]. inv_M may be the slice of one chunk
    (positions into y_MD); weights_NK then holds that chunk's tokens."""
    N, K = weights_NK.shape
    y_tok = y_MD.index_select(0, inv_M).view(N, K, y_MD.shape[-1])
    y_tok.mul_(weights_NK.unsqueeze(-1))  # in place on our gathered copy: computed in fp32, stored in y's dtype
    return _sum_k(y_tok, out, dtype)


def _sum_k(t_NKD, out, dtype):
    """Sum over K (reduced-precision inputs accumulate in fp32), one rounding to the output dtype."""
    dtype = out.dtype if out is not None else (dtype or t_NKD.dtype)
    if dtype == t_NKD.dtype:
        return torch.sum(t_NKD, 1, out=out) if out is not None else t_NKD.sum(1)
    s = t_NKD.sum(1, dtype=torch.promote_types(t_NKD.dtype, torch.float32)).to(dtype)
    return s if out is None else out.copy_(s)


def unpermute_grads(g_ND, y_MD, w_sorted_M, token_M, need_w=True):
    """Gradients of `unpermute` in sorted order: gy[p] = w[p] * g[token[p]], and gw[p] =
    <g[token[p]], y[p]> accumulated in fp32, or in the inputs' dtype where it is wider (None unless need_w).
    token_M/w_sorted_M may be a chunk's slice."""
    g_MD = g_ND.index_select(0, token_M)
    acc = torch.promote_types(torch.promote_types(g_MD.dtype, y_MD.dtype), torch.float32)
    gw_M = (g_MD * y_MD).sum(-1, dtype=acc) if need_w else None
    g_MD.mul_(w_sorted_M.unsqueeze(-1))
    return g_MD.to(y_MD.dtype), gw_M


def sum_copies(dx_MD, inv_M, K, out=None):
    """gx[n] = sum_k dx_MD[inv_M[n K + k]]: the gradient of x_ND.index_select(0, order // K)."""
    g = dx_MD.index_select(0, inv_M).view(inv_M.numel() // K, K, dx_MD.shape[-1])
    return _sum_k(g, out, None)


# ---- autograd forms (twins) -------------------------------------------------------------------------

class Permute(torch.autograd.Function):
    """x_MD = x_ND[token_M]; backward: sum of each token's K copies (no atomics)."""

    @staticmethod
    def forward(ctx, x_ND, token_M, inv_M, K):
        ctx.save_for_backward(inv_M)
        ctx.K, ctx.dtype = K, x_ND.dtype
        return x_ND.index_select(0, token_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_M,) = ctx.saved_tensors
        return sum_copies(g_MD.contiguous(), inv_M, ctx.K).to(ctx.dtype), None, None, None


class Unpermute(torch.autograd.Function):
    """out[n] = sum_k w[n, k] y_MD[inv[n K + k]] in dtype; y_MD in sorted order."""

    @staticmethod
    def forward(ctx, y_MD, weights_NK, order_M, inv_M, dtype):
        ctx.save_for_backward(y_MD, weights_NK, order_M, inv_M)
        return unpermute(y_MD, weights_NK, inv_M, dtype=dtype)

    @staticmethod
    def backward(ctx, g_ND):
        y_MD, w_NK, order_M, inv_M = ctx.saved_tensors
        K = w_NK.shape[1]
        w_sorted = w_NK.reshape(-1).index_select(0, order_M)
        gy, gw = unpermute_grads(g_ND.contiguous(), y_MD, w_sorted, order_M // K, ctx.needs_input_grad[1])
        if gw is not None:
            gw = gw.index_select(0, inv_M).view_as(w_NK).to(w_NK.dtype)
        return gy, gw, None, None, None


class RowPermutation(torch.autograd.Function):
    """out = x[fwd_idx]; the backward gathers the gradient with bwd_idx (the inverse permutation)."""

    @staticmethod
    def forward(ctx, x, fwd_idx, bwd_idx):
        ctx.save_for_backward(bwd_idx)
        return x.index_select(0, fwd_idx)

    @staticmethod
    def backward(ctx, g):
        (bwd_idx,) = ctx.saved_tensors
        return g.contiguous().index_select(0, bwd_idx), None, None
