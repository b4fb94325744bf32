"""Causal attention on FlashAttention 4 (`flash_attn.cute`, package flash-attn-4) where it is installed.
Shared by the `attention` and `mla` slots (their primitives' FA4 path).

FA4 runs q/k head dim 192 with v head dim 128 (MLA) on Hopper and Blackwell, dense or packed
(`cu_seqlens`, all sequences in one launch). At 16K-32K tokens its MLA forward ran 1.12-1.14x faster
than SDPA's cuDNN backend on an H200 (1.19-1.24x on an H100) and forward + backward 1.03-1.05x
(benchmarks/mla/NOTES.md); GQA with head dim 128 1.10-1.13x (benchmarks/attention/results/history/probe_fa4_gqa.jsonl).

Its forward and backward are wrapped as two torch custom ops so that a selective activation
checkpoint sees one op (`bumblebee::fa4_causal_fwd`) whose outputs (o, lse) it can keep, as it keeps
SDPA's: the lean MLA backward then never reruns the attention forward.

Layout: q [B, T, H, d], k [B, T, H, d], v [B, T, H, e] (last dim contiguous; other strides free),
or packed [N, H, d] with cu_seqlens int32 [S + 1]. Output like v's leading dims with e columns.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# FA4's SM90 head dims in both directions: its forward accepts 8..256 (multiples of 8), but its backward
# failed to build at v head dim 16 (flash-attn-4 4.0.0b36, an H200: the dO tile's swizzled shared-memory
# layout); FA3's own head dims, which its SM90 tile table is written for, build both ways
HEAD_DIMS_SM90 = (64, 96, 128, 192, 256)


@functools.cache
def _interface():
    """FA4's interface module, or None when flash-attn-4 (or its CuTe DSL) is not installed."""
    try:
        from flash_attn.cute import interface
    except Exception:  # noqa: BLE001 - any import failure (missing package, missing CUDA libs) means "absent"
        return None
    return interface


def supports(device: torch.device, dtype: torch.dtype, d: int, e: int) -> bool:
    """True when FA4 can run attention with q/k head dim d and v head dim e here: installed, CUDA on
    compute capability 9.x or 10.x, 16-bit dtype, head dims FA4 runs forward and backward (SM90: HEAD_DIMS_SM90;
    SM100: up to 128, or 192/128)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or d % 8 or e % 8:
        return False
    major = torch.cuda.get_device_capability(device)[0]
    if major == 9:
        dims_ok = d in HEAD_DIMS_SM90 and e in HEAD_DIMS_SM90
    elif major == 10:
        dims_ok = (d <= 128 and e <= 128) or (d, e) == (192, 128)
    else:
        return False
    return dims_ok and _interface() is not None


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """`supports` for these q and v."""
    return supports(q.device, q.dtype, q.shape[-1], v.shape[-1])


def _unit_stride(t):
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("bumblebee::fa4_causal_fwd", mutates_args=(), device_types="cuda")
def fa4_causal_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                   max_seqlen: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q's leading dims with v's head dim; lse fp32, [B, H, T] or [H, N] packed."""
    out, lse, *_ = _interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=None if cu_seqlens is None else max_seqlen,
        max_seqlen_k=None if cu_seqlens is None else max_seqlen,
        softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@fa4_causal_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens is None else (q.shape[1], q.shape[0])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("bumblebee::fa4_causal_bwd", mutates_args=(), device_types="cuda")
def fa4_causal_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(
        q, k, v, out, _unit_stride(dout), lse, scale, True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=None if cu_seqlens is None else max_seqlen,
        max_seqlen_k=None if cu_seqlens is None else max_seqlen)[:3]
    return dq, dk, dv


@fa4_causal_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = fa4_causal_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


fa4_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(q, k, v, scale: float, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: int = 0):
    """Causal attention output (no lse). Dense: q/k [B, T, H, d], v [B, T, H, e] -> [B, T, H, e].
    Packed: q/k [N, H, d], v [N, H, e], cu_seqlens int32 [S + 1] on q's device, max_seqlen the longest
    sequence -> [N, H, e]. Call only where `available(q, v)` is True."""
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return fa4_causal_fwd(q, k, v, cu_seqlens, int(max_seqlen), float(scale))[0]


def kept_forward(q, k, v, scale: float):
    """Dense causal attention on the callers' [B, H, T, D] views (of [B, T, H, D] memory) -> (out [B, H, T, e],
    (out, lse)): what a backward needs, for attention kept through a recompute
    (`kernels/attention_recompute_kept.py`'s `Kernel`)."""
    out, lse = fa4_causal_fwd(*(_unit_stride(t.transpose(1, 2)) for t in (q, k, v)), None, 0, float(scale))
    return out.transpose(1, 2), (out, lse)


def kept_backward(dout, q, k, v, kept, scale: float):
    """(dq, dk, dv) [B, H, T, *] of `kept_forward`'s call."""
    out, lse = kept
    grads = fa4_causal_bwd(dout.transpose(1, 2), *(_unit_stride(t.transpose(1, 2)) for t in (q, k, v)),
                           out, lse, None, 0, float(scale))
    return tuple(g.transpose(1, 2) for g in grads)
