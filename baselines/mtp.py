"""Multi-token prediction (DeepSeek-V3), written out with materialized logits: the `mtp` slot's twin.

At depth k = 1..D, with h_0 the main model's final-normed hidden state:

    h_k    = layers[k-1](emb(tokens shifted left by k), h_{k-1})
             (DeepSeek: block(eh_proj(cat[enorm(emb), hnorm(h)])))
    logits = head_norm(h_k) @ head_weight.T                           (the main model's head: shared)
    L_k    = mean CE against the labels shifted left by k + 1 (the tail, and with packed sequences
             every target in another sequence, masked)
    loss   = loss_scale / D * sum_k L_k

The depth modules belong to the model (their layout and checkpoint names are the model's); this slot
is the recursion and the loss. A depth module is called as `layer(emb_BTD, h_BTD, run_block)` and
exposes `layer.head_norm(h_BTD)`; `run_block(block, x_BTD)` runs a decoder block the model's way
(positions, packed sequences, recompute). The twin of `bumblebee.primitives.mtp.LeanMTP`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee.checks import check_mtp_inputs
from bumblebee.norms import to_acc
from bumblebee.registry import register


def shifted_labels(labels_BT, shift, segment_ids_BT=None, ignore_index=-100):
    """target[:, t] = labels[:, t + shift] where that token exists and lies in t's sequence."""
    T = labels_BT.shape[1]
    target = torch.full_like(labels_BT, ignore_index)
    target[:, :T - shift] = labels_BT[:, shift:]
    if segment_ids_BT is not None:
        same = torch.zeros_like(labels_BT, dtype=torch.bool)
        same[:, :T - shift] = segment_ids_BT[:, shift:] == segment_ids_BT[:, :T - shift]
        target = target.masked_fill(~same, ignore_index)
    return target


@register("mtp", "materialized", kind="baseline", twin="lean")
class MaterializedMTP(nn.Module):
    """Shifted embedding copies, full fp32 logits per depth, F.cross_entropy."""

    def __init__(self, layers, *, loss_scale=0.3, ignore_index=-100):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss_scale, self.ignore_index = loss_scale, ignore_index

    def forward(self, hidden_BTD, input_ids_BT, labels_BT, *, embed, head_weight, run_block, loss_fn=None,
                segment_ids_BT=None):
        """(loss_scale / D * sum of the depth losses, the depth losses [D] detached)."""
        D = len(self.layers)
        check_mtp_inputs(D, hidden_BTD, input_ids_BT, labels_BT, segment_ids_BT)
        B, T, W = hidden_BTD.shape
        emb = embed(input_ids_BT)
        h, losses = hidden_BTD, []
        for k, layer in enumerate(self.layers, start=1):
            emb_k = torch.cat([emb[:, k:], emb[:, -1:].expand(B, k, W)], dim=1)  # the tail is masked below
            h = layer(emb_k, h, run_block)
            logits = to_acc(F.linear(layer.head_norm(h), head_weight))  # fp32 (a float64 reference stays float64)
            target = shifted_labels(labels_BT, k + 1, segment_ids_BT, self.ignore_index).reshape(-1)
            total = F.cross_entropy(logits.reshape(B * T, -1), target, ignore_index=self.ignore_index,
                                    reduction="sum")
            losses.append(total / (target != self.ignore_index).sum().clamp(min=1))
        losses = torch.stack(losses)
        return self.loss_scale / D * losses.sum(), losses.detach()
