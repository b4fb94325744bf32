"""verl's TensorDict micro-batches <-> the runtime's token-aligned `Batch`, and back.

verl hands the engine packed ("no padding") micro-batches: `input_ids` and `position_ids` are jagged
nested tensors [bsz, j1] (prompt + response of each sample, padding stripped). verl's log-probs are
*next-token aligned*: entry t of a sample is log p(token t + 1 | tokens <= t), its last entry is
unused. The runtime's are *token aligned* (entry t is log p(token t | tokens < t), 0 at a sequence's
first token), so verl's values are the runtime's shifted left by one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.runtime import Batch


def _nested(data, key: str) -> torch.Tensor:
    t = data.get(key, None)
    if t is None or not getattr(t, "is_nested", False):
        raise ValueError(f"data[{key!r}] must be a jagged nested tensor [bsz, j1] (verl's no-padding layout, "
                         f"see verl.workers.utils.padding.left_right_2_no_padding), got "
                         f"{type(t).__name__ if t is None else (t.dtype, tuple(t.shape))}")
    return t


def packed_batch(data) -> tuple[Batch, torch.Tensor]:
    """(Batch [1, N] of the micro-batch's samples packed end to end with `cu_seqlens`, offsets [bsz + 1])."""
    ids = _nested(data, "input_ids")
    offsets = ids.offsets()
    position_ids = data.get("position_ids", None)
    pos = None
    if position_ids is not None:
        if position_ids.dim() == 3:
            raise ValueError("data['position_ids'] is 3-D (multimodal rope): the bumblebee engine serves "
                             "text models only")
        pos = _nested(data, "position_ids").values().unsqueeze(0).long()
    routed = data.get("routed_experts", None)  # the rollout's expert choices [bsz, j1, layers, k], replayed
    if routed is not None:
        routed = _nested(data, "routed_experts").values().unsqueeze(0).long()
    batch = Batch(ids.values().unsqueeze(0).long(), cu_seqlens=offsets.to(torch.int64), position_ids=pos,
                  routed_experts=routed)
    return batch, offsets


def temperature_of(data) -> float:
    """The sampler's temperature: verl stores a number, or one per sample (which must then agree)."""
    from verl.utils import tensordict_utils as tu
    t = tu.get(data, "temperature", default=1.0)
    if isinstance(t, (list, tuple)):
        t = torch.tensor(t, dtype=torch.float64)
    if isinstance(t, torch.Tensor):
        flat = t.reshape(-1).float()
        if flat.numel() == 0 or not torch.all(flat == flat[0]):
            raise ValueError(f"data['temperature'] per sample must be one value for the whole micro-batch, got "
                             f"{flat.tolist()[:8]}")
        return float(flat[0])
    return float(t)


def next_token_aligned(token_aligned_1N: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The runtime's [1, N] token-aligned values as verl's jagged [bsz, j1] next-token-aligned ones
    (differentiable): entry t moves to t - 1; each sample's last entry is 0 (it has no next token)."""
    if token_aligned_1N.shape != (1, int(offsets[-1])):
        raise ValueError(f"expected the packed [1, {int(offsets[-1])}] values of the micro-batch, got "
                         f"{tuple(token_aligned_1N.shape)}")
    shifted = F.pad(token_aligned_1N[0, 1:], (0, 1))  # the next sample's first entry is 0: no leak
    return torch.nested.nested_tensor_from_jagged(shifted, offsets.to(shifted.device))
