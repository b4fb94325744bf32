"""One attention block of a context-parallel shard on PyTorch's fused kernels: its output and
log-sum-exp forward, and its backward from the merged output and log-sum-exp of its queries (the
block's share of the gradient, as FlashAttention-style backwards take them).

On CUDA in bf16/fp16 the block runs on SDPA's cuDNN kernel (`aten._scaled_dot_product_cudnn_attention`
and its backward) where SDPA's cuDNN backend is enabled (`torch.backends.cuda.cudnn_sdp_enabled()`,
what `torch.nn.attention.sdpa_kernel` sets) and takes the block's shape, else on its flash kernel: on an H200 at 16 heads of 256
the cuDNN pair of blocks of a 64K CP = 2 chunk ran 57.6 ms against flash's 87.4 ms, with the same
float64 error (`benchmarks/context_parallel/probes/probe_cudnn_blocks.py`). A block of one query or
one key (a one-token document) runs on flash: cuDNN's backward refuses s_q = s_kv = 1. On the CPU, the flash op's
CPU twin (any dtype). The masked torch blocks of `attention.py` serve what none of these takes
(CUDA fp32 / float64).
"""
from __future__ import annotations

import torch

from bumblebee.norms import to_acc

HALF = (torch.bfloat16, torch.float16)
aten = torch.ops.aten


def ring_usable(q: torch.Tensor) -> bool:
    """Whether blocks of q run on a fused kernel here: any dtype on CPU, 16-bit on CUDA."""
    return q.device.type != "cuda" or q.dtype in HALF


def _cudnn() -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available()


def block_forward(q, k, v, causal: bool, scale: float):
    """(o in q's dtype, lse [B, H, L] fp32, what its backward needs); causal blocks are square."""
    if q.device.type != "cuda":
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, to_acc(lse), None
    if _cudnn() and q.shape[2] > 1 and k.shape[2] > 1:  # cuDNN's backward refuses s_q = s_kv = 1 (and a
        try:  # refused backward left its graph cache crashing the next call): one-token blocks go to flash
            r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        except RuntimeError:  # a shape cuDNN refuses (checked before launch): the flash kernel takes it
            r = None
        if r is not None:
            lse = r[1]  # [B, H, L, 1]
            return r[0], to_acc(lse.reshape(lse.shape[:3])), ("cudnn", tuple(lse.shape), *r[2:8])
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], to_acc(r[1][..., :q.shape[2]]), ("flash", *r[2:8])


def block_backward(do, q, k, v, o, lse, causal: bool, scale: float, aux):
    """(dq, dk, dv) of one block from the whole output o and log-sum-exp lse of its queries."""
    if aux is None:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                       scale=scale)
    if aux[0] == "cudnn":
        _, shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.reshape(shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, causal, scale=scale)
    _, cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
