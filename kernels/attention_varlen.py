"""Packed causal attention on PyTorch's own FlashAttention 2 varlen kernel: every sequence of a packed
stream in one launch (`aten._flash_attention_forward` with cu_seqlens; native GQA; differentiable).

Shared by the `attention` and `mla` slots: their primitives' packed path where FA4 is not installed.
Forward + backward on an H200 over 32K tokens (benchmarks/attention/results/history/probe_varlen_backends.jsonl) against
one SDPA call per sequence (cuDNN):

| packing | Qwen3 (32/8 heads, d 128) | Qwen3.5 (16/2, d 256) | MLA core (128 heads, 192/128) |
|---|---|---|---|
| 64 x 512 | 3.46 vs 40.73 ms | 3.19 vs 35.29 | 21.85 vs 290.22 |
| 32 x 1024 | 4.82 vs 22.66 | 4.90 vs 27.17 | 31.53 vs 156.83 |
| 16 x 2048 | 7.58 vs 15.59 | 8.37 vs 14.74 | 51.04 vs 93.38 |
| 8 x 4096 | 13.35 vs 12.70 | 15.25 vs 13.87 | 90.06 vs 76.45 |

so callers take it while `worthwhile`: mean sequence length under `MAX_MEAN_LENGTH`.
cuDNN's ragged SDPA (`aten._cudnn_attention_forward` with cu_seqlens) returned non-finite gradients in
the same probe (torch 2.11, cuDNN 9.19) and ran 3-30x slower, so it is not used.

Layout: q [N, Hq, d], k [N, Hk, d], v [N, Hk, e] with e <= d, cu_seqlens [S + 1] on q's device. The
kernel takes one head dim, so v is zero-padded to d inside; the padded output columns are exactly zero
and are dropped. Forward and backward are two torch custom ops (`bumblebee::varlen_causal_fwd` /
`_bwd`) so that a selective activation checkpoint (MLA's lean backward) keeps the unpadded output and
the log-sum-exp, not the padded output, and the backward pads o and dO again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_MEAN_LENGTH = 4096  # tokens per sequence: between the measured 2048 (varlen ahead) and 4096 (behind)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the kernel runs these tensors: CUDA (compute capability 8+), one 16-bit dtype,
    q/k head dim a multiple of 8 up to 256, v head dim at most that."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return False
    d, e = q.shape[-1], v.shape[-1]
    return d % 8 == 0 and e <= d <= 256 and torch.cuda.get_device_capability(q.device)[0] >= 8


def worthwhile(tokens: int, sequences: int) -> bool:
    """One varlen launch beats one SDPA call per sequence: short sequences on average."""
    return tokens < MAX_MEAN_LENGTH * sequences


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans) -> bool:
    """`supports` these tensors and `worthwhile` for the packed sequences spans [(start, end)]."""
    return supports(q, k, v) and worthwhile(spans[-1][1] - spans[0][0], len(spans))


def _padded(t: torch.Tensor, d: int) -> torch.Tensor:
    return F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t


@torch.library.custom_op("bumblebee::varlen_causal_fwd", mutates_args=(), device_types="cuda")
def varlen_causal_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [N, Hq, e], lse fp32 [Hq, N])."""
    e = v.shape[-1]
    o, lse = torch.ops.aten._flash_attention_forward(q, k, _padded(v, q.shape[-1]), cu_seqlens, cu_seqlens, max_seqlen,
                                                     max_seqlen, 0.0, True, False, scale=scale)[:2]
    return (o[..., :e].contiguous() if o.shape[-1] > e else o), lse


@varlen_causal_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("bumblebee::varlen_causal_bwd", mutates_args=(), device_types="cuda")
def varlen_causal_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, e = q.shape[-1], v.shape[-1]
    rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)  # no dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _padded(dout, d), q, k, _padded(v, d), _padded(out, d), lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        0.0, True, rng, unused, scale=scale)
    return dq, dk, (dv[..., :e].contiguous() if e < d else dv)


@varlen_causal_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = varlen_causal_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(q, k, v, scale: float, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """Causal attention inside each packed sequence; output [N, Hq, e]."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return varlen_causal_fwd(q, k, v, cu, int(max_seqlen), float(scale))[0]
