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
(CUDA fp32 / float64). Grouped-query blocks (fewer key/value heads than query heads) go to the CUDA
kernels with their own heads; a kernel that refuses that shape, and the CPU twin, get them repeated.
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


def repeat_heads(t, groups: int):
    """K/V [B, K, S, D] -> [B, K * groups, S, D], each head repeated for its group of query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t, groups: int):
    """dK/dV of repeated heads [B, H, S, D] -> [B, H / groups, S, D], summed over each group in fp32."""
    if groups == 1:
        return t
    B, H, S, D = t.shape
    return to_acc(t).view(B, H // groups, groups, S, D).sum(2)


_GROUPED_REFUSED: set = set()  # (kernel, dtype, heads, key heads, head size, causal) refused as grouped


def _shape(kernel: str, q, k, causal: bool) -> tuple:
    return kernel, q.dtype, q.shape[1], k.shape[1], q.shape[3], causal


def _tries(kernel: str, q, k, causal: bool):
    """Repeat factors `kernel` is tried with: 1 (k's heads as they are) first, unless refused before for
    this shape, then q's heads."""
    groups = q.shape[1] // k.shape[1]
    return (groups,) if _shape(kernel, q, k, causal) in _GROUPED_REFUSED else (1, groups) if groups > 1 else (1,)


def _refused(kernel: str, q, k, causal: bool, g: int) -> None:
    if g == 1 and q.shape[1] != k.shape[1]:
        _GROUPED_REFUSED.add(_shape(kernel, q, k, causal))


def block_forward(q, k, v, causal: bool, scale: float):
    """(o in q's dtype, lse [B, H, L] fp32, what its backward needs); causal blocks are square. k, v may hold
    fewer heads than q (a divisor: grouped-query attention). CUDA's fused kernels take them as they are, each
    key/value head serving its group of query heads, so no repeated copy is written, read or, backward,
    folded; a kernel that refuses the grouped shape, and the CPU twin, get them repeated to q's heads here
    (`block_backward` then sums their gradients over each group)."""
    G = q.shape[1] // k.shape[1]
    if q.device.type != "cuda":
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, repeat_heads(k, G), repeat_heads(v, G), 0.0,
                                                                   causal, scale=scale)
        return o, to_acc(lse), ("cpu", G)
    if _cudnn() and q.shape[2] > 1 and k.shape[2] > 1:  # cuDNN's backward refuses s_q = s_kv = 1 (and a
        for g in _tries("cudnn", q, k, causal):  # refused backward left its graph cache crashing the next
            try:  # call): those go to flash
                r = aten._scaled_dot_product_cudnn_attention(q, repeat_heads(k, g), repeat_heads(v, g), None, True, 0.0,
                                                             causal, False, scale=scale)
            except RuntimeError:  # a shape cuDNN refuses (checked before launch): repeated, or flash
                _refused("cudnn", q, k, causal, g)
                continue
            lse = r[1]  # [B, H, L, 1]
            return r[0], to_acc(lse.reshape(lse.shape[:3])), ("cudnn", g, tuple(lse.shape), *r[2:8])
    for g in _tries("flash", q, k, causal):
        try:
            r = aten._scaled_dot_product_flash_attention(q, repeat_heads(k, g), repeat_heads(v, g), 0.0, causal, False,
                                                         scale=scale)
        except RuntimeError:
            if g == G:
                raise
            _refused("flash", q, k, causal, g)
            continue
        return r[0], to_acc(r[1][..., :q.shape[2]]), ("flash", g, *r[2:8])


def block_backward(do, q, k, v, o, lse, causal: bool, scale: float, aux):
    """(dq, dk, dv) of one block from the whole output o and log-sum-exp lse of its queries; dk, dv with k's
    heads (in fp32 where the kernel ran on repeated ones). A grouped backward its kernel refuses runs on
    the repeated heads instead (the same o and lse: the forward's math does not depend on the repeat)."""
    kind, g = aux[0], aux[1]
    G = q.shape[1] // k.shape[1]
    try:
        return _block_backward(do, q, k, v, o, lse, causal, scale, aux, g)
    except RuntimeError:
        if g == G or kind == "cpu":
            raise
        _refused(kind, q, k, causal, g)
        return _block_backward(do, q, k, v, o, lse, causal, scale, aux, G)


def _block_backward(do, q, k, v, o, lse, causal, scale, aux, g):
    kind = aux[0]
    kr, vr = repeat_heads(k, g), repeat_heads(v, g)
    if kind == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, kr, vr, o, lse, 0.0, causal,
                                                                               scale=scale)
    elif kind == "cudnn":
        _, _, shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do, q, kr, vr, o, lse.reshape(shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, causal, scale=scale)
    else:
        _, _, cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, kr, vr, o, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return dq, _sum_groups(dk, g), _sum_groups(dv, g)
