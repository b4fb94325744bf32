"""Packed causal attention on PyTorch's own FlashAttention 2 varlen kernel: every sequence of a packed
stream in one launch (`aten._flash_attention_forward` with cu_seqlens; native GQA; differentiable).

The packed path where FA4 is not installed. Forward + backward on an H200 over 32K tokens
(benchmarks/results/probe_varlen_backends.jsonl) against one SDPA call per sequence (cuDNN):

| packing | Qwen3 (32/8 heads, d 128) | Qwen3.5 (16/2, d 256) | MLA core (128 heads, 192/128) |
|---|---|---|---|
| 64 x 512 | 3.46 vs 40.73 ms | 3.19 vs 35.29 | 21.85 vs 290.22 |
| 32 x 1024 | 4.82 vs 22.66 | 4.90 vs 27.17 | 31.53 vs 156.83 |
| 16 x 2048 | 7.58 vs 15.59 | 8.37 vs 14.74 | 51.04 vs 93.38 |
| 8 x 4096 | 13.35 vs 12.70 | 15.25 vs 13.87 | 90.06 vs 76.45 |

so callers take it while `worthwhile`: mean sequence length under `MAX_MEAN_LENGTH`.
cuDNN's ragged SDPA (`aten._cudnn_attention_forward` with cu_seqlens) returned non-finite gradients in
the same probe (torch 2.11, cuDNN 9.19) and ran 3-30x slower, so it is not used.

Layout: q [N, Hq, d], k [N, Hk, d], v [N, Hk, e] with e <= d (v is zero-padded to d inside, since the
kernel takes one head dim, and the extra output columns are dropped), cu_seqlens [S + 1] on q's device.
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


def causal_attention(q, k, v, scale: float, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """Causal attention inside each packed sequence; output [N, Hq, e]."""
    d, e = q.shape[-1], v.shape[-1]
    if e < d:
        v = F.pad(v, (0, d - e))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    o = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False,
                                                scale=scale)[0]
    return o[..., :e] if e < d else o
