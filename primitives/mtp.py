"""Multi-token prediction (DeepSeek-V3) through the model's `cross_entropy` slot.

Same recursion and loss as the twin `bumblebee.baselines.mtp.MaterializedMTP` (see there for the
formulation); what differs: each depth's loss goes through `loss_fn`, the model's `cross_entropy`
slot, so with `linear_ce` no depth materializes its [B*T, V] logits; without one (`loss_fn=None`)
it is `linear_ce` itself (`bumblebee.primitives.cross_entropy.linear_cross_entropy`, its default
options), never the twin's materialized logits; the shifted inputs are the token ids shifted (an int
copy), looked up once per depth, never a shifted copy of embeddings.
The depth modules (the model's layout and checkpoint names) and `run_block` come from the model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee.checks import check_mtp_inputs
from bumblebee.primitives.cross_entropy import linear_cross_entropy
from bumblebee.registry import register


def _shift_left(x_BT, shift, fill):
    return torch.cat([x_BT[:, shift:], x_BT.new_full((x_BT.shape[0], shift), fill)], dim=1)


@register("mtp", "lean", kind="primitive", twin="materialized", default=True)
class LeanMTP(nn.Module):
    """Depth losses through the `cross_entropy` slot (no logits with linear_ce); id shifts only."""

    def __init__(self, layers, *, loss_scale=0.3, ignore_index=-100):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss_scale, self.ignore_index = loss_scale, ignore_index

    def forward(self, hidden_BTD, input_ids_BT, labels_BT, *, embed, head_weight, run_block, loss_fn=None,
                segment_ids_BT=None):
        """(loss_scale / D * sum of the depth losses, the depth losses [D] detached)."""
        D = len(self.layers)
        check_mtp_inputs(D, hidden_BTD, input_ids_BT, labels_BT, segment_ids_BT)
        loss_fn = loss_fn or linear_cross_entropy  # no logits, as with the model's linear_ce slot
        W, ignore = hidden_BTD.shape[-1], self.ignore_index
        boundary = None  # [B, T] True where the next token starts another packed sequence
        if segment_ids_BT is not None:
            boundary = F.pad(segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1], (0, 1), value=False)

        def next_target(t_BT):  # target[t] <- target[t + 1], never across a sequence boundary
            t_BT = _shift_left(t_BT, 1, ignore)
            return t_BT if boundary is None else t_BT.masked_fill(boundary, ignore)

        h, losses = hidden_BTD, []
        ids, target = input_ids_BT, next_target(labels_BT)  # the main model's targets
        for layer in self.layers:
            ids = _shift_left(ids, 1, 0)  # the tail token is arbitrary: its targets are masked
            target = next_target(target)
            h = layer(embed(ids), h, run_block)
            losses.append(loss_fn(layer.head_norm(h).reshape(-1, W), head_weight, target.reshape(-1),
                                  ignore_index=ignore, reduction="mean"))
        losses = torch.stack(losses)
        return self.loss_scale / D * losses.sum(), losses.detach()
