"""Fused MoE un-permute kernels (Triton): gather + routing weight + sum over K in one pass per row.

Same functions, arguments and return values as `unpermute`, `unpermute_grads` and `sum_copies` in
`common/moe_dispatch_permute.py` (the torch path the twins use); the chunked expert-parallel primitive
calls these where `ChunkedDispatch.fused_permute` is on, and their `*_torch` algorithm elsewhere
(never the twins' functions). Each output row is
written by one program from the rows it needs, read once; nothing [M, D]-sized is materialized, no
atomics (deterministic). Shape legend: N tokens, K copies per token, M = N K copies (sorted order),
D width; inv_M maps token-major copy id n K + k to its sorted row.

  unpermute        out[n] = sum_k w[n, k] * y[inv[n K + k]]       grid (N, D / BLOCK_D)
  sum_copies       gx[n]  = sum_k dx[inv[n K + k]]                 the same kernel without weights
  unpermute_grads  gy[p]  = w[p] * g[token[p]]   (y's dtype)      grid (M,), one program per row,
                   gw[p]  = <g[token[p]], y[p]>  (fp32)           looping over D in BLOCK_D blocks

Precision: products and sums in fp32 (fp64 for fp64 inputs), one rounding to the output dtype.
The torch `unpermute` rounds each product w * y to y's dtype before its fp32 sum over K, and the
torch `unpermute_grads` rounds each product g * y to the inputs' dtype before its fp32 sum over D;
here neither product is rounded, so in bf16/fp16 the fused results are closer to the exact value
(in fp32 both paths agree to the last bits). gy is w * g rounded once in both.

Bytes moved (elements of [., D] rows; weights, indices and gw are O(M) and left out), with
out/gy in the inputs' dtype:

  op               torch path                                      fused
  unpermute        gather 2 MD, weight mul_ 2 MD, sum 1 MD + ND     1 MD + ND
  unpermute_grads  gather 2 MD, g * y 3 MD, sum 1 MD, mul_ 2 MD     3 MD (read g rows, y rows, write gy)
  sum_copies       gather 2 MD, sum 1 MD + ND                       1 MD + ND
  all three        16 MD + 2 ND (= 16.25 MD at K = 8)               5 MD + 2 ND (= 5.25 MD at K = 8)

At 16K tokens/rank, D = 2048, K = 8, bf16 (M D = 0.27 G elements, 0.54 GB): 8.7 GB vs 2.8 GB per
layer forward + backward. The torch path's broadcast `mul_` is also a slow non-vectorized kernel
(2 M D elements each way at ~1 TB/s measured), so the time saved may exceed the byte ratio.

`add_group_copies` serves the one-rank grouped backward (`primitives/moe_dispatch_local.py`): for one
expert group, the sorted rows [r0, r1) (R = r1 - r0 rows of dx), each token's copies there are summed
in fp32 in k order and added to the fp32 [N, D] input gradient by one read-modify-write of its row;
a token without a copy in the group reads its K indices and stops. Grid (N, D / BLOCK_D), one program
per (token, column block): no atomics, deterministic. Bytes per group with bf16 dx: 2 RD + 8 TD for
the T <= R tokens touched, where an fp32 copy of dx and an accumulating `index_put_` (which also sorts
its indices) move 6 RD + 12 RD. Its torch path is `add_group_copies_torch` (same order of sums).

On CUDA tensors (or under TRITON_INTERPRET=1) the Triton kernels run; elsewhere `*_torch`, the
same algorithm (fp32 products and sums) in torch.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is absent on some CPU-only installs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCK_D = 1024  # 8 bf16 (16 bytes) per thread at 4 warps
# add_group_copies: a whole 2048-wide row per program at 2 warps ran faster on an H200 than 1024 at 4
# (D = 2048, K = 8; most programs only read their K indices)
MAX_BLOCK_D_GROUP = 2048


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:
    @triton.jit
    def _gather_sum_kernel(y_ptr, w_ptr, inv_ptr, out_ptr, D, stride_y, stride_wn, stride_wk, stride_out,
                           K: tl.constexpr, HAS_W: tl.constexpr, F64: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[n, cols] = sum_k (w[n, k] *) y[inv[n K + k], cols]; K unrolled, so all K row loads
        are in flight together."""
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float64 if F64 else tl.float32)
        for k in tl.static_range(K):
            src = tl.load(inv_ptr + n * K + k).to(tl.int64)
            row = tl.load(y_ptr + src * stride_y + cols, mask=ok, other=0.0).to(acc.dtype)
            if HAS_W:
                row = row * tl.load(w_ptr + n * stride_wn + k * stride_wk).to(acc.dtype)
            acc += row
        tl.store(out_ptr + n * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_group_copies_kernel(dx_ptr, inv_ptr, gx_ptr, D, r0, r1, stride_dx, stride_gx,
                                 K: tl.constexpr, F64: tl.constexpr, BLOCK_D: tl.constexpr):
        """gx[n, cols] += sum_k dx[inv[n K + k] - r0, cols] over the copies in rows [r0, r1); a token
        with no copy there leaves its row untouched (neither read nor written)."""
        n = tl.program_id(0).to(tl.int64)
        hits = 0
        for k in tl.static_range(K):
            src = tl.load(inv_ptr + n * K + k).to(tl.int64)
            hits += ((src >= r0) & (src < r1)).to(tl.int32)
        if hits > 0:
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            ok = cols < D
            gx = tl.load(gx_ptr + n * stride_gx + cols, mask=ok, other=0.0)
            acc = tl.zeros([BLOCK_D], dtype=tl.float64 if F64 else tl.float32)
            for k in tl.static_range(K):
                src = tl.load(inv_ptr + n * K + k).to(tl.int64)  # again: cached, and no [K] vector to index
                width = tl.where((src >= r0) & (src < r1), D, 0)  # a copy outside the group reads nothing
                acc += tl.load(dx_ptr + (src - r0) * stride_dx + cols, mask=cols < width, other=0.0).to(acc.dtype)
            tl.store(gx_ptr + n * stride_gx + cols, (gx.to(acc.dtype) + acc).to(gx_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _unpermute_grads_kernel(g_ptr, y_ptr, w_ptr, tok_ptr, gy_ptr, gw_ptr, D, stride_g, stride_y, stride_w,
                                stride_gy, NEED_W: tl.constexpr, F64: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row p: gy[p] = w[p] g[token[p]] and gw[p] = <g[token[p]], y[p]>, g and y read once."""
        p = tl.program_id(0).to(tl.int64)
        t = tl.load(tok_ptr + p).to(tl.int64)
        dot = tl.zeros([BLOCK_D], dtype=tl.float64 if F64 else tl.float32)
        w = tl.load(w_ptr + p * stride_w).to(dot.dtype)
        for d0 in tl.range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            g = tl.load(g_ptr + t * stride_g + cols, mask=ok, other=0.0).to(dot.dtype)
            tl.store(gy_ptr + p * stride_gy + cols, (g * w).to(gy_ptr.dtype.element_ty), mask=ok)
            if NEED_W:
                dot += g * tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0).to(dot.dtype)
        if NEED_W:
            tl.store(gw_ptr + p, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along D (row stride free: a row slice of a bigger buffer is fine)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _block(D: int):
    b = min(MAX_BLOCK_D, triton.next_power_of_2(max(D, 16)))
    return b, max(1, min(8, b // 256))


def _f64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def _out_for(out, N, D, dtype, device):
    if out is None:
        return torch.empty(N, D, dtype=dtype, device=device)
    if tuple(out.shape) != (N, D):
        raise ValueError(f"out must be [{N}, {D}], got {tuple(out.shape)}")
    return out


def _gather_sum(y_MD, w_NK, inv_M, K, out, dtype, kernel=True):
    """Shared launcher of unpermute (w_NK given) and sum_copies (w_NK None); kernel=False: the torch path."""
    if y_MD.dim() != 2 or K < 1 or inv_M.numel() % K:
        raise ValueError(f"y must be [M, D] and inv_M a multiple of K={K} long; got {tuple(y_MD.shape)}, "
                         f"{inv_M.numel()}")
    N, D = inv_M.numel() // K, y_MD.shape[1]
    out = _out_for(out, N, D, dtype or y_MD.dtype, y_MD.device)
    if N == 0 or D == 0:
        return out
    if not (kernel and use_triton(y_MD)):
        return out.copy_(_gather_sum_torch(y_MD, w_NK, inv_M, K, out.dtype))
    y, inv = _rows(y_MD), inv_M.contiguous()
    dst = out if out.stride(-1) == 1 else torch.empty(N, D, dtype=out.dtype, device=out.device)
    BLOCK_D, warps = _block(D)
    w = w_NK if w_NK is not None else y
    swn, swk = (w_NK.stride(0), w_NK.stride(1)) if w_NK is not None else (0, 0)
    _gather_sum_kernel[(N, triton.cdiv(D, BLOCK_D))](
        y, w, inv, dst, D, y.stride(0), swn, swk, dst.stride(0),
        K=K, HAS_W=w_NK is not None, F64=_f64(y_MD, w_NK, out), BLOCK_D=BLOCK_D, num_warps=warps)
    return out if dst is out else out.copy_(dst)


def _acc_dtype(*ts):
    return torch.float64 if _f64(*ts) else torch.float32


def _gather_sum_torch(y_MD, w_NK, inv_M, K, dtype):
    acc = _acc_dtype(y_MD, w_NK)
    t = y_MD.index_select(0, inv_M).view(-1, K, y_MD.shape[-1]).to(acc)
    if w_NK is not None:
        t.mul_(w_NK.to(acc).unsqueeze(-1))  # in place: t is a fresh gathered copy (a cast's or index_select's)
    return t.sum(1).to(dtype)


def unpermute(y_MD, weights_NK, inv_M, out=None, dtype=None):
    """out[n] = sum_k weights[n, k] * y_MD[inv_M[n K + k]], fp32 products and sum, one rounding to
    out's dtype (else `dtype`, else y's). `out` may be a row slice of a bigger buffer."""
    N, K = weights_NK.shape
    if inv_M.numel() != N * K:
        raise ValueError(f"inv_M has {inv_M.numel()} entries for weights [{N}, {K}]")
    return _gather_sum(y_MD, weights_NK, inv_M, K, out, dtype)


def sum_copies(dx_MD, inv_M, K, out=None):
    """gx[n] = sum_k dx_MD[inv_M[n K + k]], fp32 sum, one rounding to out's dtype (else dx's)."""
    return _gather_sum(dx_MD, None, inv_M, K, out, None)


def unpermute_torch(y_MD, weights_NK, inv_M, out=None, dtype=None):
    """`unpermute`'s algorithm in torch on any device (the primitive's path where the kernel is off)."""
    N, K = weights_NK.shape
    if inv_M.numel() != N * K:
        raise ValueError(f"inv_M has {inv_M.numel()} entries for weights [{N}, {K}]")
    return _gather_sum(y_MD, weights_NK, inv_M, K, out, dtype, kernel=False)


def sum_copies_torch(dx_MD, inv_M, K, out=None):
    """`sum_copies`'s algorithm in torch on any device."""
    return _gather_sum(dx_MD, None, inv_M, K, out, None, kernel=False)


def add_group_copies(gx_ND, dx_RD, inv_M, r0, r1):
    """gx_ND[n] += sum_k dx_RD[inv_M[n K + k] - r0] over token n's copies whose sorted row lies in
    [r0, r1) (dx_RD holds those rows), summed in fp32 (fp64 for fp64) in k order, then added with one
    read-modify-write of gx's row; rows of tokens without a copy there are not touched. No atomics:
    deterministic. Returns gx_ND (updated in place; any row stride)."""
    N, D = gx_ND.shape
    if (inv_M.numel() % N if N else inv_M.numel()) or dx_RD.shape != (r1 - r0, D):
        raise ValueError(f"gx [N, D], inv_M N K long and dx [r1 - r0, D] expected; got {tuple(gx_ND.shape)}, "
                         f"{inv_M.numel()}, {tuple(dx_RD.shape)} for rows [{r0}, {r1})")
    if N == 0 or r1 == r0 or D == 0:
        return gx_ND
    if not use_triton(dx_RD):
        return add_group_copies_torch(gx_ND, dx_RD, inv_M, r0, r1)
    dx, inv = _rows(dx_RD), inv_M.contiguous()
    dst = gx_ND if gx_ND.stride(-1) == 1 else gx_ND.contiguous()
    BLOCK_D = min(MAX_BLOCK_D_GROUP, triton.next_power_of_2(max(D, 16)))
    warps = 2 if BLOCK_D >= 1024 else 1
    _add_group_copies_kernel[(N, triton.cdiv(D, BLOCK_D))](
        dx, inv, dst, D, r0, r1, dx.stride(0), dst.stride(0), K=inv_M.numel() // N, F64=_f64(gx_ND, dx_RD),
        BLOCK_D=BLOCK_D, num_warps=warps)
    return gx_ND if dst is gx_ND else gx_ND.copy_(dst)


def add_group_copies_torch(gx_ND, dx_RD, inv_M, r0, r1):
    N, R = gx_ND.shape[0], r1 - r0
    src_NK = inv_M.view(N, -1) - r0
    hit_NK = (src_NK >= 0) & (src_NK < R)
    tok = hit_NK.any(1).nonzero().squeeze(1)  # the touched tokens, each once
    src, hit = src_NK[tok].clamp(0, R - 1), hit_NK[tok]
    acc = torch.zeros(tok.numel(), gx_ND.shape[1], dtype=_acc_dtype(gx_ND, dx_RD), device=gx_ND.device)
    for k in range(src.shape[1]):  # k order, as the kernel
        acc += torch.where(hit[:, k, None], dx_RD.index_select(0, src[:, k]).to(acc.dtype), 0)
    return gx_ND.index_copy_(0, tok, (gx_ND.index_select(0, tok).to(acc.dtype) + acc).to(gx_ND.dtype))


def unpermute_grads(g_ND, y_MD, w_sorted_M, token_M, need_w=True):
    """(gy [M, D] in y's dtype, gw [M] fp32 or None; float64 for float64 inputs): gy[p] = w[p] * g[token[p]]
    (one rounding), gw[p] = <g[token[p]], y[p]> with fp32 products and sum (float64 ones for float64)."""
    M, D = y_MD.shape
    if token_M.numel() != M or w_sorted_M.numel() != M:
        raise ValueError(f"token_M ({token_M.numel()}) and w_sorted_M ({w_sorted_M.numel()}) must have M={M} entries")
    if not use_triton(y_MD):
        return unpermute_grads_torch(g_ND, y_MD, w_sorted_M, token_M, need_w)
    gy = torch.empty(M, D, dtype=y_MD.dtype, device=y_MD.device)
    gw = torch.empty(M, dtype=_acc_dtype(g_ND, y_MD, w_sorted_M), device=y_MD.device) if need_w else None
    if M == 0:
        return gy, gw
    if D == 0:
        return gy, gw.zero_() if need_w else None
    g, y, w, tok = _rows(g_ND), _rows(y_MD), w_sorted_M.reshape(-1), token_M.contiguous()
    BLOCK_D, warps = _block(D)
    _unpermute_grads_kernel[(M,)](
        g, y, w, tok, gy, gw if need_w else gy, D, g.stride(0), y.stride(0), w.stride(0), gy.stride(0),
        NEED_W=bool(need_w), F64=_f64(g_ND, y_MD, w_sorted_M), BLOCK_D=BLOCK_D, num_warps=warps)
    return gy, gw


def unpermute_grads_torch(g_ND, y_MD, w_sorted_M, token_M, need_w=True):
    acc = _acc_dtype(g_ND, y_MD, w_sorted_M)
    g = g_ND.index_select(0, token_M).to(acc)
    gw = (g * y_MD.to(acc)).sum(-1) if need_w else None
    return (g * w_sorted_M.to(acc).unsqueeze(-1)).to(y_MD.dtype), gw
