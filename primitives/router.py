"""Top-k routers as fused Triton kernels: auxiliary-loss-free (DeepSeek-V3) and softmax (Qwen3-MoE).

Auxiliary-loss-free (`aux_free_topk`): on CUDA the forward is
`bumblebee.kernels.router.aux_free_topk_fwd` (scores, bias, group selection, top-k, weights and
per-expert counts in one pass over the logits); the backward recomputes the k selected sigmoid
scores from the saved logits and indices in torch. Elsewhere (and in float64) the kernel's
algorithm runs in torch, block by block, through the same autograd function:
`bumblebee.kernels.router.aux_free_topk_torch`. Replay selects nothing: the weights of the given
experts come from the backward's own recomputation, under autograd.

Softmax (`softmax_topk_fused`, the default for softmax scoring): the same scheme around
`bumblebee.kernels.router_softmax.softmax_topk_fwd` (softmax, top-k, weights and counts in one
pass) and its algorithm in torch, `softmax_topk_torch`; the backward recomputes the k weights from
a full-row fp32 softmax in torch. Replay runs the same function with the experts given (the same
arithmetic as a selection, so a recorded route replays bit for bit).

Under TRITON_INTERPRET=1 both kernels also run on CPU tensors (tests). Nothing here calls the
twins' code.
"""
from __future__ import annotations

import os

import torch

from bumblebee.kernels.router import aux_free_topk_fwd, aux_free_topk_torch
from bumblebee.kernels.router_softmax import softmax_topk_fwd, softmax_topk_torch
from bumblebee.registry import register
from bumblebee.checks import check_router_inputs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _falls_back(device, dtype):
    """Why routing on `device` in `dtype` runs the kernel's algorithm in torch, or None (the fused kernel)."""
    if not (device.type == "cuda" or _INTERPRET):
        return "the fused Triton kernel needs CUDA: its algorithm runs in torch"
    if dtype == torch.float64:
        return "float64 runs the kernel's algorithm in torch (the kernel computes in fp32)"
    return None


def _kernel_usable(logits):
    return _falls_back(logits.device, logits.dtype) is None


def _logits_grad(logits, grad_weights, weights_of):
    """The gradient of the router logits: the k weights recomputed from them in torch, under autograd."""
    with torch.enable_grad():
        x = logits.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(weights_of(x), x, grad_weights)
    return grad


def _weights_from_logits(logits_TE, indices_TK, scaling_factor, norm_topk_prob):
    w = torch.sigmoid(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)).gather(1, indices_TK))
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling_factor


class _FusedAuxFreeTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob):
        fwd = aux_free_topk_fwd if _kernel_usable(logits) else aux_free_topk_torch
        weights, indices, counts = fwd(logits.detach(), bias.detach(), top_k, n_group, topk_group, scaling_factor,
                                       norm_topk_prob)
        ctx.save_for_backward(logits, indices)
        ctx.scaling_factor, ctx.norm_topk_prob = scaling_factor, norm_topk_prob
        ctx.mark_non_differentiable(indices, counts)
        return weights, indices, counts

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices, _grad_counts):
        logits, indices = ctx.saved_tensors
        grad = _logits_grad(logits, grad_weights,
                            lambda x: _weights_from_logits(x, indices, ctx.scaling_factor, ctx.norm_topk_prob))
        return grad, None, None, None, None, None, None


@register("router", "aux_free", kind="primitive", twin="aux_free_ref", default=False, falls_back=_falls_back)
def aux_free_topk(logits, bias, *, top_k, n_group, topk_group, scaling_factor=1.0, norm_topk_prob=True,
                  routed_experts=None, return_counts=False):
    """Auxiliary-loss-free sigmoid top-k with group limits, one fused Triton kernel on CUDA (its algorithm
    in torch elsewhere)."""
    check_router_inputs(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                        routed_experts=routed_experts)
    if routed_experts is not None:  # replay: the given experts, their weights under autograd
        indices = routed_experts.long()
        weights = _weights_from_logits(logits, indices, scaling_factor, norm_topk_prob)
        counts = torch.bincount(indices.reshape(-1), minlength=logits.shape[1])
    else:
        weights, indices, counts = _FusedAuxFreeTopK.apply(logits, bias, top_k, n_group, topk_group,
                                                           float(scaling_factor), bool(norm_topk_prob))
    return (weights, indices, counts) if return_counts else (weights, indices)


aux_free_topk.scoring = "sigmoid"


def _softmax_weights(logits_TE, indices_TK, norm_topk_prob):
    """The k weights from the full-row softmax (fp32; fp64 stays fp64), in the logits' dtype."""
    probs_TE = torch.softmax(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), dim=-1)
    w = probs_TE.gather(1, indices_TK)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits_TE.dtype)


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
        grad = _logits_grad(logits, grad_weights, lambda x: _softmax_weights(x, indices, ctx.norm_topk_prob))
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
