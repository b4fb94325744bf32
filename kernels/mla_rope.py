"""MLA's Q/K assembly as one Triton kernel each way: split, RoPE, concatenation, rope-key broadcast.

`assemble_qk(q, k_nope, k_rope, cos, sin, interleave) -> (q_out, k_out)`, both new contiguous
[B, T, H, nope + R] tensors in q's dtype, the same values as `primitives/mla.py:FlashMLA._core`'s
torch assembly (which calls this instead under its option `fused_rope`, `primitives/mla.py`):

  q_out = cat(q[..., :nope], rope(q[..., nope:]))        q [B, T, H, nope + R], last dim contiguous
  k_out = cat(k_nope, rope(k_rope) broadcast over H)     k_nope [B, T, H, nope], k_rope [B, T, R]

rope(x) rotates pairs (x1, x2) (evens/odds when `interleave`, else the two halves) and writes them
de-interleaved: first R/2 columns x1 c - x2 s, last R/2 columns x2 c + x1 s, with c, s the first R/2
columns of cos/sin ([B, T, R] or [1, T, R], transformers' cat(freqs, freqs) layout). Any strides
with a unit last-dim stride (the projections' split views) are read in place.

Backward (no gradient for cos/sin): dq one contiguous [B, T, H, nope + R] (nope part copied, rope
part rotated back to its input positions), dk_nope [B, T, H, nope], dk_rope [B, T, R] = the rope
part of dk_out summed over heads (in fp32), rotated back.

  forward   grid (B T, H / BLOCK_H): each program writes whole q_out and k_out rows, its token's
            rotated rope key computed once and broadcast to its heads
  backward  grid (B T,): one program per token loops over the heads, so the head sum needs no atomics

Per token and head, each kernel reads its inputs from memory once (rope columns are loaded twice, by
pair index, the second time from cache) and writes each output once: forward q, k_nope -> q_out,
k_out; backward dq_out, dk_out -> dq, dk_nope (+ dk_rope per token). Rows are stored whole and the
nope columns loaded contiguously (16-byte vectors where alignment allows). The torch path runs, each
way, six to eight elementwise kernels over q's rope columns and concatenations that copy whole rows
(q and k forward, dq backward), plus a reduction over heads backward.

Precision: products and sums in fp32 (fp64 for fp64 inputs), one rounding to the output dtype. The
torch `rope_pairs` in bf16 rounds each product, so in bf16 the fused values are closer to the exact
ones (in fp32 both agree to the last bits). On CUDA tensors (or under TRITON_INTERPRET=1) the Triton
kernels run; elsewhere `assemble_torch` / `grads_torch`, the same math in torch.

Shape legend: B batch, T tokens, H heads, R rope dim, D = nope + R, N = B T.
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
MAX_TILE = 2048  # elements of one [BLOCK_H, BLOCK_D] tile: 16 per thread at 4 warps


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:
    @triton.jit
    def _rope_cols(NOPE: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per output column: nope?, rope?, pair index p, first half?, rope position j."""
        col = tl.arange(0, BLOCK_D)
        is_rope = (col >= NOPE) & (col < NOPE + R)
        j = tl.where(is_rope, col - NOPE, 0)
        first = j < R // 2
        p = tl.where(first, j, j - R // 2)
        return col, col < NOPE, is_rope, p, first, j

    @triton.jit
    def _assemble_fwd_kernel(q_ptr, kn_ptr, kr_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, H,
                             sq_b, sq_t, sq_h, skn_b, skn_t, skn_h, skr_b, skr_t, sc_b, sc_t, ss_b, ss_t,
                             NOPE: tl.constexpr, R: tl.constexpr, INTERLEAVE: tl.constexpr, F64: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        b, t = n // T, n % T
        acc = tl.float64 if F64 else tl.float32
        col, is_nope, is_rope, p, first, _ = _rope_cols(NOPE, R, BLOCK_D)
        if INTERLEAVE:  # source columns of pair p
            i1, i2 = 2 * p, 2 * p + 1
        else:
            i1, i2 = p, p + R // 2
        c = tl.load(cos_ptr + b * sc_b + t * sc_t + p, mask=is_rope, other=0.0).to(acc)
        s = tl.load(sin_ptr + b * ss_b + t * ss_t + p, mask=is_rope, other=0.0).to(acc)
        kr = kr_ptr + b * skr_b + t * skr_t
        x1 = tl.load(kr + i1, mask=is_rope, other=0.0).to(acc)
        x2 = tl.load(kr + i2, mask=is_rope, other=0.0).to(acc)
        k_rot = tl.where(first, x1 * c - x2 * s, x2 * c + x1 * s)

        h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
        h_ok = h < H
        rope_ok = h_ok & is_rope[None, :]
        qh = q_ptr + b * sq_b + t * sq_t + h * sq_h
        q1 = tl.load(qh + NOPE + i1[None, :], mask=rope_ok, other=0.0).to(acc)
        q2 = tl.load(qh + NOPE + i2[None, :], mask=rope_ok, other=0.0).to(acc)
        q_rot = tl.where(first[None, :], q1 * c[None, :] - q2 * s[None, :], q2 * c[None, :] + q1 * s[None, :])
        qn = tl.load(qh + col[None, :], mask=h_ok & is_nope[None, :], other=0.0).to(acc)
        kn = tl.load(kn_ptr + b * skn_b + t * skn_t + h * skn_h + col[None, :], mask=h_ok & is_nope[None, :],
                     other=0.0).to(acc)
        out = (n * H + h) * (NOPE + R) + col[None, :]
        ok = h_ok & (col < NOPE + R)[None, :]
        tl.store(qo_ptr + out, tl.where(is_nope[None, :], qn, q_rot).to(qo_ptr.dtype.element_ty), mask=ok)
        tl.store(ko_ptr + out, tl.where(is_nope[None, :], kn, k_rot[None, :]).to(ko_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _assemble_bwd_kernel(gq_ptr, gk_ptr, cos_ptr, sin_ptr, dq_ptr, dkn_ptr, dkr_ptr, T, H,
                             sgq_b, sgq_t, sgq_h, sgk_b, sgk_t, sgk_h, sc_b, sc_t, ss_b, ss_t,
                             NOPE: tl.constexpr, R: tl.constexpr, INTERLEAVE: tl.constexpr, F64: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        b, t = n // T, n % T
        acc = tl.float64 if F64 else tl.float32
        col, is_nope, is_rope, p, first, j = _rope_cols(NOPE, R, BLOCK_D)
        if INTERLEAVE:  # input column j holds pair j // 2, x1 at even j
            p, first = j // 2, j % 2 == 0
        c = tl.load(cos_ptr + b * sc_b + t * sc_t + p, mask=is_rope, other=0.0).to(acc)
        s = tl.load(sin_ptr + b * ss_b + t * ss_t + p, mask=is_rope, other=0.0).to(acc)
        sum1 = tl.zeros([BLOCK_D], dtype=acc)  # k's rope gradient summed over heads, first/second half
        sum2 = tl.zeros([BLOCK_D], dtype=acc)
        for h0 in tl.range(0, H, BLOCK_H):
            h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
            h_ok = h < H
            rope_ok = h_ok & is_rope[None, :]
            nope_ok = h_ok & is_nope[None, :]
            gq = gq_ptr + b * sgq_b + t * sgq_t + h * sgq_h
            g1 = tl.load(gq + NOPE + p[None, :], mask=rope_ok, other=0.0).to(acc)
            g2 = tl.load(gq + NOPE + R // 2 + p[None, :], mask=rope_ok, other=0.0).to(acc)
            dq = tl.where(first[None, :], g1 * c[None, :] + g2 * s[None, :], g2 * c[None, :] - g1 * s[None, :])
            dq = tl.where(is_nope[None, :], tl.load(gq + col[None, :], mask=nope_ok, other=0.0).to(acc), dq)
            tl.store(dq_ptr + (n * H + h) * (NOPE + R) + col[None, :], dq.to(dq_ptr.dtype.element_ty),
                     mask=h_ok & (col < NOPE + R)[None, :])
            gk = gk_ptr + b * sgk_b + t * sgk_t + h * sgk_h
            tl.store(dkn_ptr + (n * H + h) * NOPE + col[None, :], tl.load(gk + col[None, :], mask=nope_ok),
                     mask=nope_ok)
            sum1 += tl.sum(tl.load(gk + NOPE + p[None, :], mask=rope_ok, other=0.0).to(acc), axis=0)
            sum2 += tl.sum(tl.load(gk + NOPE + R // 2 + p[None, :], mask=rope_ok, other=0.0).to(acc), axis=0)
        dkr = tl.where(first, sum1 * c + sum2 * s, sum2 * c - sum1 * s)
        tl.store(dkr_ptr + n * R + j, dkr.to(dkr_ptr.dtype.element_ty), mask=is_rope)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit last-dim stride (other strides free)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _bt_strides(t: torch.Tensor, B: int):
    """(batch, token) strides; batch stride 0 for a [1, T, R] table shared by the batch."""
    return (t.stride(0) if t.shape[0] == B else 0), t.stride(1)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(H: int, D: int):
    block_d = triton.next_power_of_2(max(D, 16))
    return min(triton.next_power_of_2(H), max(1, MAX_TILE // block_d)), block_d


def _check(q, k_nope, k_rope, cos, sin):
    """A ValueError naming the argument on shapes, dtypes or devices that disagree."""
    if q.dim() != 4 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [B, T, H, nope + R] tensor, got {q.dtype} {tuple(q.shape)}")
    B, T, H, D = q.shape
    if k_nope.dim() != 4 or tuple(k_nope.shape[:3]) != (B, T, H):
        raise ValueError(f"k_nope must be [B, T, H, nope] = [{B}, {T}, {H}, nope], got {tuple(k_nope.shape)}")
    nope = k_nope.shape[-1]
    R = D - nope
    if R < 2 or R % 2:
        raise ValueError(f"q's last dim {D} minus k_nope's {nope} must be an even rope dim >= 2, got {R}")
    if tuple(k_rope.shape) != (B, T, R):
        raise ValueError(f"k_rope must be [B, T, R] = {[B, T, R]}, got {tuple(k_rope.shape)}")
    for name, t in (("k_nope", k_nope), ("k_rope", k_rope)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, "
                             f"{t.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (T, R):
            raise ValueError(f"{name} must be [B, T, R] or [1, T, R] with B={B}, T={T}, R={R}, got {tuple(t.shape)}")
        if not t.is_floating_point() or t.device != q.device:
            raise ValueError(f"{name} must be floating point on {q.device}, got {t.dtype} on {t.device}")
        if t.requires_grad:
            raise ValueError(f"{name} must not require grad: the fused assembly gives no gradient for it")


def _halves(cos, sin, dtype):
    R = cos.shape[-1]
    return cos[..., :R // 2].to(dtype), sin[..., :R // 2].to(dtype)


def _rotate(x, c, s, interleave):
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _unrotate(g, c, s, interleave):
    g1, g2 = g.chunk(2, dim=-1)
    d1, d2 = g1 * c + g2 * s, g2 * c - g1 * s
    return torch.stack((d1, d2), dim=-1).flatten(-2) if interleave else torch.cat((d1, d2), dim=-1)


def assemble_torch(q, k_nope, k_rope, cos, sin, interleave):
    """The forward in torch: rotation in fp32 (fp64 for fp64), one rounding."""
    B, T, H, D = q.shape
    nope, acc = k_nope.shape[-1], _acc(q.dtype)
    c, s = _halves(cos, sin, acc)
    q_rot = _rotate(q[..., nope:].to(acc), c[:, :, None], s[:, :, None], interleave)
    k_rot = _rotate(k_rope.to(acc), c, s, interleave).to(q.dtype)
    return (torch.cat((q[..., :nope], q_rot.to(q.dtype)), dim=-1),
            torch.cat((k_nope, k_rot[:, :, None].expand(B, T, H, D - nope)), dim=-1))


def grads_torch(gq, gk, cos, sin, nope, interleave):
    """The backward in torch: (dq, dk_nope, dk_rope), head sum and rotation in fp32 (fp64 for fp64)."""
    acc = _acc(gq.dtype)
    c, s = _halves(cos, sin, acc)
    dq_rot = _unrotate(gq[..., nope:].to(acc), c[:, :, None], s[:, :, None], interleave)
    dk_rope = _unrotate(gk[..., nope:].sum(dim=2, dtype=acc), c, s, interleave)
    return (torch.cat((gq[..., :nope], dq_rot.to(gq.dtype)), dim=-1), gk[..., :nope].contiguous(),
            dk_rope.to(gk.dtype))


def _assemble(q, k_nope, k_rope, cos, sin, interleave):
    if not use_triton(q):
        return assemble_torch(q, k_nope, k_rope, cos, sin, interleave)
    B, T, H, D = q.shape
    nope = k_nope.shape[-1]
    q_out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return q_out, k_out
    q, k_nope, k_rope, cos, sin = (_rows(t) for t in (q, k_nope, k_rope, cos, sin))
    BLOCK_H, BLOCK_D = _blocks(H, D)
    _assemble_fwd_kernel[(B * T, triton.cdiv(H, BLOCK_H))](
        q, k_nope, k_rope, cos, sin, q_out, k_out, T, H, *q.stride()[:3], *k_nope.stride()[:3], *k_rope.stride()[:2],
        *_bt_strides(cos, B), *_bt_strides(sin, B), NOPE=nope, R=D - nope, INTERLEAVE=bool(interleave),
        F64=q.dtype == torch.float64, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4)
    return q_out, k_out


def _grads(gq, gk, cos, sin, nope, interleave):
    if not use_triton(gq):
        return grads_torch(gq, gk, cos, sin, nope, interleave)
    B, T, H, D = gq.shape
    dq = torch.empty(B, T, H, D, dtype=gq.dtype, device=gq.device)
    dk_nope = torch.empty(B, T, H, nope, dtype=gk.dtype, device=gk.device)
    dk_rope = torch.empty(B, T, D - nope, dtype=gk.dtype, device=gk.device)
    if B * T == 0:
        return dq, dk_nope, dk_rope
    if H == 0:
        return dq, dk_nope, dk_rope.zero_()
    gq, gk, cos, sin = (_rows(t) for t in (gq, gk, cos, sin))
    BLOCK_H, BLOCK_D = _blocks(H, D)
    _assemble_bwd_kernel[(B * T,)](
        gq, gk, cos, sin, dq, dk_nope, dk_rope, T, H, *gq.stride()[:3], *gk.stride()[:3], *_bt_strides(cos, B),
        *_bt_strides(sin, B), NOPE=nope, R=D - nope, INTERLEAVE=bool(interleave),
        F64=gq.dtype == torch.float64, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4)
    return dq, dk_nope, dk_rope


class MLARopeAssemble(torch.autograd.Function):
    """(q, k_nope, k_rope, cos, sin, interleave) -> (q_out, k_out); cos/sin get no gradient."""

    @staticmethod
    def forward(ctx, q, k_nope, k_rope, cos, sin, interleave):
        ctx.save_for_backward(cos, sin)
        ctx.nope, ctx.interleave = k_nope.shape[-1], interleave
        return _assemble(q, k_nope, k_rope, cos, sin, interleave)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk_nope, dk_rope = _grads(gq, gk, cos, sin, ctx.nope, ctx.interleave)
        return dq, dk_nope, dk_rope, None, None, None


def assemble_qk(q, k_nope, k_rope, cos, sin, interleave: bool):
    """(q_out, k_out), contiguous [B, T, H, nope + R] in q's dtype: see the module docstring."""
    _check(q, k_nope, k_rope, cos, sin)
    return MLARopeAssemble.apply(q, k_nope, k_rope, cos, sin, bool(interleave))
