"""Causal SDPA with cuDNN first on CUDA, the priority change scoped to the call; shared by the
`attention` and `mla` slots (their primitives' SDPA path).

Why the helper: PyTorch sets its default SDPA priority order lazily, at the first CUDA SDPA call of
the process (cuDNN first on sm90/sm100, `check_prefer_cudnn_attention`). `sdpa_kernel(...,
set_priority=True)` saves the current order on entry and restores it on exit; entered before that
first call, it saves the uninitialized order (flash first), the call inside initializes the default,
and the exit writes the flash-first order back over it: every later plain SDPA call in the process,
transformers' included, then runs FlashAttention 2 instead of cuDNN (seen with torch 2.11 on an
H200: 876 ms against 682 ms for transformers' training step). So the default is initialized first,
by asking torch which backend it would choose (no kernel runs), and only then is the order scoped.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH]
_default_order_ready = False  # torch's lazy default initialized in this process (a fact, not a switch)


def _init_default_order(q: torch.Tensor) -> None:
    global _default_order_ready
    if not _default_order_ready:
        x = torch.empty(1, 1, 8, q.shape[-1], device=q.device, dtype=q.dtype)
        torch._fused_sdp_choice(x, x, x, is_causal=True)  # runs torch's priority_order(): its lazy init
        _default_order_ready = True


def _cuda_order(q):
    """The SDPA path's backend order for one call on CUDA (torch's default initialized first); nothing
    elsewhere."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    _init_default_order(q)
    return sdpa_kernel(CUDA_ORDER, set_priority=True)


def choice(q, k, v, scale, enable_gqa: bool = False) -> int:
    """The backend (SDPBackend value) `causal_sdpa` would run for these inputs; no kernel runs."""
    with _cuda_order(q):
        return torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)


def causal_sdpa(q, k, v, scale, enable_gqa: bool = False):
    """F.scaled_dot_product_attention(is_causal=True); on CUDA cuDNN, flash, memory-efficient, math
    in that order for this call only, the process-wide order left as it was."""
    with _cuda_order(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
