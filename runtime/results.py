"""What the runtime's operations return, and what a caller's loss function receives."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bumblebee.runtime.batching import Batch
from bumblebee.runtime.losses import Norm


@dataclass
class ForwardResult:
    """`Runtime.forward` / `forward_backward`: every [B, T] tensor token-aligned with the batch and
    detached. `loss`: this rank's part of the loss (the sum of its micro-batches'; summed over the
    data-parallel ranks it is the batch's loss), None for `forward`. `metrics`: the named losses'
    (tokens, clip_fraction, sampler_kl, ratio_max, kl) over the whole batch; a caller's `loss_fn`
    metrics as one list per key (a value per micro-batch). `routed_experts` [B, T, layers, k]: the
    experts every MoE decoder layer chose, when asked for."""
    log_probs: torch.Tensor
    trained: torch.Tensor  # bool [B, T]: tokens with a log-prob (masked in and with a prefix)
    entropy: torch.Tensor | None = None
    loss: float | None = None
    metrics: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None


@dataclass
class LossInputs:
    """The `data` a caller's `loss_fn(model_output, data, dp_group) -> (loss, metrics)` gets for one
    micro-batch: its `batch` (advantages, sampler_logprobs, ... of its tokens), `trained` (bool
    [b, t]) and `norm` (global trained tokens and sequences over every micro-batch and rank, and
    the micro-batch's sequence ids). `model_output` is {"log_probs", "entropy", "trained"} ([b, t],
    log-probs differentiable). The loss returned is the micro-batch's part of the global loss (e.g.
    `losses.aggregate(term, w, data.trained, "token-mean", data.norm)`): the runtime sums the
    micro-batches and the ranks."""
    batch: Batch
    trained: torch.Tensor
    norm: Norm
    micro_batch: int
    micro_batches: int
