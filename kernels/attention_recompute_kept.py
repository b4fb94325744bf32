"""Causal attention that keeps its output through a model's full recompute, so the recompute skips it.

Under full recompute (`bumblebee.recompute`) a decoder layer runs attention twice: in its first forward
and again in the recompute just before its backward, a quarter of attention's kernel time (forward
1 + recompute 1 + backward ~2.5 forwards). Here the first forward runs the fused kernel with its
log-sum-exp and keeps both (16-bit [B, H, T, D] and fp32 [B, H, T]); the recompute takes the kept
output instead of running the kernel (the layer's o_proj still needs it), and the backward calls the
kernel's own backward on the recomputed q, k, v with the kept output and log-sum-exp. Only q, k and v
go through the checkpoint (recomputed), in both passes in the same order, as checkpoint requires.

A `Kernel` is a fused forward that returns its log-sum-exp and its own backward: PyTorch's cuDNN
attention on CUDA (the backend the SDPA path picks first) and CPU flash kernel here; the primitive
adds FlashAttention 4's where it runs FA4. A call none would serve runs its plain path in both passes.
The model's budget (`bumblebee.recompute.Kept`) caps the bytes kept at once across its layers, so long
sequences fall back to recomputing: the attention primitive reserves there, decides per call and hands
over between the passes (`primitives/attention.py`, `bumblebee/recompute.py`); the call's `release`
gives the bytes back.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend


def kept_bytes(q: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes one call keeps: the output [B, H, T, Dv] in the input dtype and the fp32 log-sum-exp [B, H, T]."""
    B, H, T = q.shape[:3]
    return B * H * T * (v.shape[-1] * v.element_size() + 4)


@dataclass(frozen=True)
class Kernel:
    """A fused causal attention kernel with its own backward, on the callers' [B, H, T, D] q, k, v.
    forward(q, k, v, scale) -> (out, kept): kept holds what the backward needs, kept[1] the fp32
    log-sum-exp; backward(dout, q, k, v, kept, scale) -> (dq, dk, dv)."""

    name: str
    forward: Callable
    backward: Callable


def _cudnn_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, (out, lse, seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_backward(dout, q, k, v, kept, scale):
    out, lse, seed, offset, cum_q, cum_k, max_q, max_k = kept
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)


def _cpu_flash_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, (out, lse)


def _cpu_flash_backward(dout, q, k, v, kept, scale):
    out, lse = kept
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, True, scale=scale)


CUDNN = Kernel("cudnn", _cudnn_forward, _cudnn_backward)
CPU_FLASH = Kernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)


def kernel_for(q: torch.Tensor, choice: int) -> Kernel | None:
    """The kept kernel matching SDPA's backend `choice` (torch._fused_sdp_choice) on q's device, if any."""
    if q.is_cuda:
        return CUDNN if choice == SDPBackend.CUDNN_ATTENTION.value else None
    if q.device.type == "cpu":
        return CPU_FLASH if choice == SDPBackend.FLASH_ATTENTION.value else None
    return None


class KeptAttention(torch.autograd.Function):
    """apply(q, k, v, scale, kernel, release, taken): the first forward (taken None) runs the kernel and
    holds its output and log-sum-exp until the backward; the recompute passes that output as `taken`.
    `release()` runs once the held values die."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kernel, release, taken):
        ctx.save_for_backward(q, k, v)  # recomputed by the checkpoint, in both passes
        ctx.scale, ctx.kernel, ctx.kept = scale, kernel, None
        if taken is not None:  # the recompute: its graph is discarded, the first forward's node runs the backward
            return taken.detach()
        out, kept = kernel.forward(q, k, v, scale)
        ctx.kept = kept
        weakref.finalize(kept[1], release)  # the log-sum-exp dies with the backward
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors  # runs the region's recompute, which takes the kept output
        if ctx.kept is None:
            raise RuntimeError("attention kept through a recompute was differentiated twice: a retained graph "
                               "of a full-recompute layer is not supported with the attention option "
                               "recompute_keep_bytes > 0")
        kept, ctx.kept = ctx.kept, None  # released here, not when the graph is
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, kept, ctx.scale)
        return dq, dk, dv, None, None, None, None
