"""Top-k routers in plain torch: the `router` slot's reference implementations.

- `softmax_topk` (Qwen3-MoE, Qwen3.5-MoE): softmax in fp32 over the router logits, sorted top-k,
  optional renormalization, weights cast back to the logits' dtype (transformers' order of ops).
  The twin of `bumblebee.primitives.router.softmax_topk_fused` (one fused Triton kernel).
- `aux_free_topk` (DeepSeek-V3, auxiliary-loss-free balancing): sigmoid of fp32 logits, a bias
  added for the selection only, group-limited top-k (group score = sum of the top-2 biased scores,
  dropped groups masked to -inf as in the DeepSeek-V3 reference), weights gathered from the
  unbiased scores, renormalized with a 1e-20 guard, times `scaling_factor`. The twin of
  `bumblebee.primitives.router.aux_free_topk` (one fused Triton kernel).

Both take `routed_experts` [T, k] to replay given routes: the experts are kept, the weights are
recomputed from the current scores (so gradients flow to the logits). With `return_counts=True`
both also return the number of tokens routed to each expert, [E] int64.

Shape legend: T tokens, E experts, k experts per token, G groups.
"""
from __future__ import annotations

import torch

from bumblebee.registry import register
from bumblebee.checks import check_router_inputs


def expert_counts(indices_TK, num_experts):
    """Tokens routed to each expert, [E] int64."""
    return torch.bincount(indices_TK.reshape(-1), minlength=num_experts)


@register("router", "softmax_topk", kind="baseline", twin="softmax_fused")
def softmax_topk(logits, *, top_k, norm_topk_prob=True, routed_experts=None, return_counts=False):
    """Softmax top-k routing in torch (Qwen3-MoE): weights in the logits' dtype, int64 indices."""
    check_router_inputs(logits, top_k, routed_experts=routed_experts)
    # fp32 for narrow dtypes, fp64 stays: the contract's float64 reference must really be float64
    probs_TE = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    if routed_experts is None:
        weights_TK, indices_TK = torch.topk(probs_TE, top_k, dim=-1)
    else:
        indices_TK = routed_experts.long()
        weights_TK = probs_TE.gather(1, indices_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    weights_TK = weights_TK.to(logits.dtype)
    if return_counts:
        return weights_TK, indices_TK, expert_counts(indices_TK, logits.shape[1])
    return weights_TK, indices_TK


softmax_topk.scoring = "softmax"


def aux_free_select(scores_TE, bias_E, *, top_k, n_group, topk_group):
    """Indices [T, k] of the group-limited top-k of the biased scores (DeepSeek-V3 reference)."""
    T, E = scores_TE.shape
    biased_TE = scores_TE + bias_E.to(scores_TE.dtype)
    if n_group > 1:
        group_TG = biased_TE.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        kept_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        kept_TG.scatter_(1, group_TG.topk(topk_group, dim=-1)[1], True)
        kept_TE = kept_TG.repeat_interleave(E // n_group, dim=1)
        biased_TE = biased_TE.masked_fill(~kept_TE, float("-inf"))
    return biased_TE.topk(top_k, dim=-1)[1]


@register("router", "aux_free_ref", kind="baseline", twin="aux_free")
def aux_free_topk(logits, bias, *, top_k, n_group, topk_group, scaling_factor=1.0, norm_topk_prob=True,
                  routed_experts=None, return_counts=False):
    """Auxiliary-loss-free sigmoid top-k with group limits in torch (DeepSeek-V3 reference)."""
    check_router_inputs(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                        routed_experts=routed_experts)
    scores_TE = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))  # fp32 (fp64 stays)
    if routed_experts is None:
        with torch.no_grad():
            indices_TK = aux_free_select(scores_TE, bias, top_k=top_k, n_group=n_group, topk_group=topk_group)
    else:
        indices_TK = routed_experts.long()
    weights_TK = scores_TE.gather(1, indices_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    weights_TK = weights_TK * scaling_factor
    if return_counts:
        return weights_TK, indices_TK, expert_counts(indices_TK, logits.shape[1])
    return weights_TK, indices_TK


aux_free_topk.scoring = "sigmoid"
