"""Materialized cross-entropy: the full [N, V] fp32 logits, then the textbook formulas.

The twin of `bumblebee.primitives.cross_entropy.linear_cross_entropy`; written for clarity.
"""
from __future__ import annotations

import torch

from bumblebee.checks import check_cross_entropy_inputs
from bumblebee.distributed import all_reduce_max, copy_to_group, reduce_from_group, vocab_range
from bumblebee.registry import register


@register("cross_entropy", "materialized_ce", kind="baseline", twin="linear_ce")
def materialized_cross_entropy(hidden, weight, labels, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, z_loss_scale=0.0, temperature=1.0,
                               return_entropy=False, process_group=None):
    """Full fp32 logits, then log-softmax: per-token CE (+ label smoothing, z-loss, entropy)."""
    offset, vocab = vocab_range(weight.shape[0], process_group, hidden.device)
    check_cross_entropy_inputs(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing, temperature=temperature,
                               vocab_offset=offset, vocab_total=vocab, z_loss_scale=z_loss_scale)
    hidden = copy_to_group(hidden, process_group)
    logits = hidden @ weight.t()  # [N, V_local], fp32 (float64 stays float64: the reference)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    valid = labels != ignore_index
    # log-sum-exp over the (possibly sharded) vocabulary
    m = all_reduce_max(logits.max(dim=-1).values, process_group)
    sum_exp = reduce_from_group(torch.exp(logits - m[:, None]).sum(-1), process_group)
    lse = m + torch.log(sum_exp)
    local = labels.long() - offset
    owned = valid & (local >= 0) & (local < weight.shape[0])
    target = torch.where(owned, logits.gather(1, local.clamp(0, weight.shape[0] - 1)[:, None])[:, 0], 0.0)
    target = reduce_from_group(target, process_group)
    loss = lse - target
    if label_smoothing > 0:
        mean_logit = reduce_from_group(logits.sum(-1), process_group) / vocab
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mean_logit)
    if z_loss_scale > 0:
        loss = loss + z_loss_scale * lse.square()
    zero = torch.zeros((), device=loss.device, dtype=loss.dtype)
    loss = torch.where(valid, loss, zero)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum().clamp(min=1)
    if not return_entropy:
        return loss
    probs = torch.exp(logits - lse[:, None])
    entropy = lse - reduce_from_group((probs * logits).sum(-1), process_group)
    return loss, torch.where(valid, entropy, zero)
