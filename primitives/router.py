"""Top-k routers as fused Triton kernels: auxiliary-loss-free (DeepSeek-V3) and softmax (Qwen3-MoE).

Auxiliary-loss-free (`aux_free_topk`): on CUDA the forward is
`bumblebee.kernels.router_aux_free.aux_free_topk_fwd` (scores, bias, group selection, top-k, weights and
per-expert counts in one pass over the logits). Elsewhere (and in float64) the kernel's algorithm
runs in torch, block by block, through the same autograd function:
`bumblebee.kernels.router_aux_free.aux_free_topk_torch`. Replay selects nothing: the given experts are
weighed in torch, through the same function and backward.

Softmax (`softmax_topk_fused`, the default for softmax scoring): the same scheme around
`bumblebee.kernels.router_softmax.softmax_topk_fwd` (softmax, top-k, weights and counts in one
pass) and its algorithm in torch, `softmax_topk_torch`. Replay runs the same function with the
experts given (the same arithmetic as a selection, so a recorded route replays bit for bit).

Both backwards are closed forms written out in torch, the same on every device (`_aux_free_grad`,
`_softmax_grad`): the Jacobian-vector products of the weights (sigmoid or softmax, the
normalization over the k, the scaling) from the k selected logits, scattered into the [T, E]
gradient once. No autograd runs through a forward expression. With `norm_topk_prob` the softmax
weights are the softmax of the k selected logits alone (the row's normalizer cancels), so the
softmax backward touches [T, k] values only and the experts not selected get an exact zero.

Under TRITON_INTERPRET=1 both kernels also run on CPU tensors (tests). Nothing here calls the
twins' code.
"""
from __future__ import annotations

import os

import torch

from bumblebee.kernels.router_aux_free import aux_free_topk_fwd, aux_free_topk_torch
from bumblebee.kernels.router_softmax import softmax_topk_fwd, softmax_topk_torch
from bumblebee.kernels import router_aux_free as _aux_free_kernel
from bumblebee.kernels import router_softmax as _softmax_kernel
from bumblebee.registry import needs_triton, register
from bumblebee.checks import check_router_inputs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _on_device(device, dtype):
    """Why routing on `device` in `dtype` runs the kernel's algorithm in torch, or None (the fused kernel)."""
    if not (device.type == "cuda" or _INTERPRET):
        return "the fused Triton kernel needs CUDA: its algorithm runs in torch"
    if dtype == torch.float64:
        return "float64 runs the kernel's algorithm in torch (the kernel computes in fp32)"
    return None


_falls_back = needs_triton(_aux_free_kernel, _softmax_kernel, then=_on_device)  # without Triton: says so


def _kernel_usable(logits):
    return _falls_back(logits.device, logits.dtype) is None


def _acc(dtype):
    return torch.promote_types(dtype, torch.float32)  # fp32 (fp64 stays fp64)


def _scattered(logits_TE, indices_TK, grad_TK):
    """The [T, E] gradient: grad_TK at the selected experts (distinct within a row: a scatter, no
    accumulation), exact zeros elsewhere, in the logits' dtype."""
    return torch.zeros_like(logits_TE).scatter_(1, indices_TK, grad_TK.to(logits_TE.dtype))


def _aux_free_weights(logits_TE, indices_TK, scaling_factor, norm_topk_prob):
    """Replay's weights of the given experts (no autograd: `_aux_free_grad` is their backward)."""
    w = torch.sigmoid(logits_TE.gather(1, indices_TK).to(_acc(logits_TE.dtype)))
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling_factor


def _aux_free_grad(logits_TE, indices_TK, grad_TK, scaling_factor, norm_topk_prob):
    """d/d logits of w_j = c s_j / (S + 1e-20) (or c s_j), s = sigmoid(x) at the k selected experts and
    S = sum_j s_j, given g = dL/dw:
        dL/ds_j = (c g_j - <c g, s> / (S + 1e-20)) / (S + 1e-20)      (c g_j without the normalization)
        dL/dx_j = dL/ds_j * s_j * sigmoid(-x_j)                         (1 - s_j without its cancellation)
    """
    x_TK = logits_TE.gather(1, indices_TK).to(_acc(logits_TE.dtype))
    s_TK = torch.sigmoid(x_TK)
    g_TK = grad_TK.to(s_TK.dtype) * scaling_factor
    if norm_topk_prob:
        inv_T1 = 1.0 / (s_TK.sum(dim=1, keepdim=True) + 1e-20)
        g_TK = (g_TK - (g_TK * s_TK).sum(dim=1, keepdim=True) * inv_T1) * inv_T1
    return _scattered(logits_TE, indices_TK, g_TK * s_TK * torch.sigmoid(-x_TK))


class _FusedAuxFreeTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob, routed_experts):
        if routed_experts is None:
            fwd = aux_free_topk_fwd if _kernel_usable(logits) else aux_free_topk_torch
            weights, indices, counts = fwd(logits.detach(), bias.detach(), top_k, n_group, topk_group,
                                           scaling_factor, norm_topk_prob)
        else:  # replay: the given experts, weighed in torch
            indices = routed_experts.long()
            weights = _aux_free_weights(logits.detach(), indices, scaling_factor, norm_topk_prob)
            counts = torch.bincount(indices.reshape(-1), minlength=logits.shape[1])
        ctx.save_for_backward(logits, indices)
        ctx.scaling_factor, ctx.norm_topk_prob = scaling_factor, norm_topk_prob
        ctx.mark_non_differentiable(indices, counts)
        return weights, indices, counts

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices, _grad_counts):
        logits, indices = ctx.saved_tensors
        grad = _aux_free_grad(logits, indices, grad_weights, ctx.scaling_factor, ctx.norm_topk_prob)
        return grad, None, None, None, None, None, None, None


@register("router", "aux_free", kind="primitive", twin="aux_free_ref", default=False, falls_back=_falls_back)
def aux_free_topk(logits, bias, *, top_k, n_group, topk_group, scaling_factor=1.0, norm_topk_prob=True,
                  routed_experts=None, return_counts=False):
    """Auxiliary-loss-free sigmoid top-k with group limits, one fused Triton kernel on CUDA (its algorithm
    in torch elsewhere)."""
    check_router_inputs(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                        routed_experts=routed_experts)
    weights, indices, counts = _FusedAuxFreeTopK.apply(logits, bias, top_k, n_group, topk_group, float(scaling_factor),
                                                       bool(norm_topk_prob), routed_experts)
    return (weights, indices, counts) if return_counts else (weights, indices)


aux_free_topk.scoring = "sigmoid"


def _softmax_grad(logits_TE, indices_TK, grad_TK, norm_topk_prob):
    """d/d logits of the k weights w_j = p_{i_j} (p the row's softmax), given g = dL/dw.
    norm_topk_prob: w is the softmax of the k selected logits alone (the row's normalizer cancels), so
        dL/dx_{i_j} = w_j (g_j - <g, w>), zero for every expert not selected;
    else the row's softmax Jacobian: dL/dx_e = [e = i_j] p_e g_j - p_e <g, w>."""
    acc = _acc(logits_TE.dtype)
    g_TK = grad_TK.to(acc)
    if norm_topk_prob:
        x_TK = logits_TE.gather(1, indices_TK).to(acc)
        e_TK = torch.exp(x_TK - x_TK.max(dim=1, keepdim=True).values)
        w_TK = e_TK / e_TK.sum(dim=1, keepdim=True)
        return _scattered(logits_TE, indices_TK, w_TK * (g_TK - (g_TK * w_TK).sum(dim=1, keepdim=True)))
    p_TE = torch.softmax(logits_TE, dim=1, dtype=acc)
    gw_TK = g_TK * p_TE.gather(1, indices_TK)
    grad_TE = p_TE.mul_(-gw_TK.sum(dim=1, keepdim=True))  # in place: p is not needed again
    return grad_TE.scatter_add_(1, indices_TK, gw_TK).to(logits_TE.dtype)


class _FusedSoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, norm_topk_prob, routed_experts):
        fwd = softmax_topk_fwd if _kernel_usable(logits) else softmax_topk_torch
        weights, indices, counts = fwd(logits.detach(), top_k, norm_topk_prob, routed_experts)
        ctx.save_for_backward(logits, indices)
        ctx.norm_topk_prob = norm_topk_prob
        ctx.mark_non_differentiable(indices, counts)
        return weights, indices, counts

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices, _grad_counts):
        logits, indices = ctx.saved_tensors
        grad = _softmax_grad(logits, indices, grad_weights, ctx.norm_topk_prob)
        return grad, None, None, None


@register("router", "softmax_fused", kind="primitive", twin="softmax_topk", default=True, falls_back=_falls_back)
def softmax_topk_fused(logits, *, top_k, norm_topk_prob=True, routed_experts=None, return_counts=False):
    """Softmax top-k routing (Qwen3-MoE) as one fused Triton kernel on CUDA (its algorithm in torch
    elsewhere): weights in the logits' dtype, int64 indices."""
    check_router_inputs(logits, top_k, routed_experts=routed_experts)
    # replay (routed_experts given) weighs the given experts by the selection's own arithmetic: a
    # recorded route replayed on the same logits reproduces the forward bit for bit
    weights, indices, counts = _FusedSoftmaxTopK.apply(logits, top_k, bool(norm_topk_prob), routed_experts)
    return (weights, indices, counts) if return_counts else (weights, indices)


softmax_topk_fused.scoring = "softmax"
