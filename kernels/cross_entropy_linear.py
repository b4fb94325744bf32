"""Blockwise softmax statistics and logit gradients for linear cross-entropy (Triton, and the same in torch).

The LM-head matmul is done by cuBLAS one vocabulary chunk at a time (`z_NC = hidden @ w_C^T / T`,
fp32 output); these kernels do the per-chunk work around it, so no [N, V] tensor ever exists:

- `chunk_stats_`: online update of per-token fp32 statistics over one chunk of columns:
  running max `m_N`, rescaled sum of exponentials `d_N`, target logit `tgt_N`, sum of logits
  `zsum_N` (label smoothing), rescaled sum of `exp(z - m) * z` `pz_N` (entropy).
- `chunk_grad`: the logit gradient of one chunk from the final statistics and per-token
  coefficients, `g = (p * (a + ge * (S - z)) - b * [col == label] - c) / T` with `p = exp(z - lse)`,
  computed in fp32 and written in the dtype of the matmul operands.

Each function runs its Triton kernel on CUDA tensors (or everywhere when TRITON_INTERPRET=1) and
the same formula in torch elsewhere (`*_torch`). Shape suffixes: N tokens, C chunk columns.
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
NEG_INIT = -1e30  # finite "minus infinity" for the running max: exp(NEG_INIT - m) is exactly 0


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:

    @triton.jit
    def _stats_kernel(z_ptr, stride_z, n_cols, lab_ptr, m_ptr, d_ptr, tgt_ptr, zsum_ptr, pz_ptr,
                      inv_temp, HAS_SMOOTH: tl.constexpr, HAS_ENT: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride_z
        m = tl.load(m_ptr + row)
        d = tl.load(d_ptr + row)
        zero = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        pz = zero
        if HAS_ENT:
            pz = tl.load(pz_ptr + row)
        zs = zero
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
            xm = tl.where(mask, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(xm, axis=0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(xm - m_new)
            d = d * alpha + tl.sum(e, axis=0)
            if HAS_ENT:
                pz = pz * alpha + tl.sum(tl.where(mask, e * x, 0.0), axis=0)
            if HAS_SMOOTH:
                zs += tl.sum(tl.where(mask, x, 0.0), axis=0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(d_ptr + row, d)
        if HAS_ENT:
            tl.store(pz_ptr + row, pz)
        if HAS_SMOOTH:
            tl.store(zsum_ptr + row, tl.load(zsum_ptr + row) + zs)
        lab = tl.load(lab_ptr + row)
        owned = (lab >= 0) & (lab < n_cols)
        t = tl.load(base + tl.where(owned, lab, 0)).to(tl.float32) * inv_temp
        tl.store(tgt_ptr + row, tl.load(tgt_ptr + row) + tl.where(owned, t, 0.0))

    @triton.jit
    def _grad_kernel(z_ptr, stride_z, g_ptr, stride_g, n_cols, lab_ptr, lse_ptr, a_ptr, b_ptr,
                     c_ptr, ge_ptr, s_ptr, inv_temp, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        zb = z_ptr + row * stride_z
        gb = g_ptr + row * stride_g
        lse = tl.load(lse_ptr + row)
        a = tl.load(a_ptr + row)
        b = tl.load(b_ptr + row)
        c = tl.load(c_ptr + row)
        lab = tl.load(lab_ptr + row)
        if HAS_ENT:
            ge = tl.load(ge_ptr + row)
            s = tl.load(s_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(zb + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
            p = tl.exp(x - lse)
            coef = a
            if HAS_ENT:
                coef = a + ge * (s - x)
            g = (p * coef - tl.where(cols == lab, b, 0.0) - c) * inv_temp
            # g may be written over z (16-bit g in the first half of each fp32 row): every warp
            # must have read this block before any warp stores into it (or into earlier blocks).
            tl.debug_barrier()
            tl.store(gb + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(n_cols))) if triton is not None else 0


def chunk_stats_(z_NC, lab_N, m_N, d_N, tgt_N, zsum_N, pz_N, inv_temp, *, smooth, entropy):
    """Fold one chunk of raw logits into the running statistics (all stats fp32, updated in place).

    z_NC: raw logits of the chunk (scaled by inv_temp here); lab_N: label index inside the chunk
    (anything outside [0, C) means "not in this chunk"). zsum_N / pz_N are touched only when
    smooth / entropy is set. Statistics in float64 (float64 inputs) take the torch path.
    """
    n, c = z_NC.shape
    if n == 0:
        return
    if use_triton(z_NC) and m_N.dtype == torch.float32:
        assert z_NC.stride(1) == 1
        _stats_kernel[(n,)](z_NC, z_NC.stride(0), c, lab_N, m_N, d_N, tgt_N, zsum_N, pz_N,
                            float(inv_temp), HAS_SMOOTH=bool(smooth), HAS_ENT=bool(entropy),
                            BLOCK=_block(c), num_warps=8)
        return
    chunk_stats_torch_(z_NC, lab_N, m_N, d_N, tgt_N, zsum_N, pz_N, inv_temp, smooth=smooth,
                     entropy=entropy)


def chunk_stats_torch_(z_NC, lab_N, m_N, d_N, tgt_N, zsum_N, pz_N, inv_temp, *, smooth, entropy):
    """`chunk_stats_` in torch (same online formula, vectorized over the chunk)."""
    x = z_NC.to(m_N.dtype) * inv_temp
    m_new = torch.maximum(m_N, x.max(dim=1).values)
    alpha = torch.exp(m_N - m_new)
    e = torch.exp(x - m_new[:, None])
    d_N.mul_(alpha).add_(e.sum(1))
    if entropy:
        pz_N.mul_(alpha).add_((e * x).sum(1))
    if smooth:
        zsum_N.add_(x.sum(1))
    m_N.copy_(m_new)
    owned = (lab_N >= 0) & (lab_N < x.shape[1])
    t = x.gather(1, lab_N.clamp(0, x.shape[1] - 1)[:, None].long())[:, 0]
    tgt_N.add_(torch.where(owned, t, torch.zeros_like(t)))


def chunk_grad(z_NC, g_NC, lab_N, lse_N, a_N, b_N, c_N, ge_N, s_N, inv_temp):
    """Write the logit gradient of one chunk into g_NC (fp32 math, stored in g_NC's dtype).

    Per token: a = gl * (1 + 2 * z_loss * lse) (+ nothing else), b = gl * (1 - smoothing) (target),
    c = gl * smoothing / V; with entropy, ge (its upstream gradient) and s = E_p[z] (else None).
    """
    n, c = z_NC.shape
    if n == 0:
        return g_NC
    if use_triton(z_NC) and lse_N.dtype == torch.float32:
        assert z_NC.stride(1) == 1 and g_NC.stride(1) == 1
        ent = ge_N is not None
        _grad_kernel[(n,)](z_NC, z_NC.stride(0), g_NC, g_NC.stride(0), c, lab_N, lse_N, a_N, b_N,
                           c_N, ge_N if ent else a_N, s_N if ent else a_N, float(inv_temp),
                           HAS_ENT=ent, BLOCK=_block(c), num_warps=8)
        return g_NC
    return chunk_grad_torch(z_NC, g_NC, lab_N, lse_N, a_N, b_N, c_N, ge_N, s_N, inv_temp)


def chunk_grad_torch(z_NC, g_NC, lab_N, lse_N, a_N, b_N, c_N, ge_N, s_N, inv_temp):
    """`chunk_grad` in torch."""
    x = z_NC.to(lse_N.dtype) * inv_temp
    p = torch.exp(x - lse_N[:, None])
    coef = a_N[:, None] if ge_N is None else a_N[:, None] + ge_N[:, None] * (s_N[:, None] - x)
    g = p * coef - c_N[:, None]
    cols = torch.arange(x.shape[1], device=x.device)
    g = g - torch.where(cols[None, :] == lab_N[:, None], b_N[:, None], torch.zeros_like(g))
    g_NC.copy_(g * inv_temp)
    return g_NC
