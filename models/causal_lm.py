"""What every thin causal-LM file shares: input checks, tied head, recompute, loss via the slot.

A model file defines its backbone (`self.model`, returning final-normed hidden states) and its
forward; `CausalLM` holds the rest so model files stay a list of their features.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from bumblebee.checks import check_token_ids
from bumblebee.models.components import CausalLMOutput, causal_lm_loss
from bumblebee.models.hf_io import HFCheckpointMixin
from bumblebee.registry import check_impl, resolve


def run_layer(layer, recompute: bool, *args):
    """One decoder layer; under full recompute only its inputs are kept for the backward."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)


class CausalLM(HFCheckpointMixin, nn.Module):
    def __init__(self, config, impl: dict | None, backbone: type[nn.Module]):
        super().__init__()
        self.config, self.impl = config, check_impl(impl)
        self.model = backbone(config, self.impl)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_fn = resolve("cross_entropy", self.impl.get("cross_entropy"))
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_recompute(self, enabled: bool = True):
        """Full activation recompute: every decoder layer reruns its forward in the backward."""
        self.model.recompute = enabled
        return self

    def check_inputs(self, input_ids, labels, position_ids):
        """Validated inputs; returns position_ids (0..T-1 per row when None)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return position_ids

    def lm_outputs(self, hidden, labels, return_logits, out: CausalLMOutput | None = None) -> CausalLMOutput:
        """Loss through the `cross_entropy` slot; logits only when labels is None or asked for."""
        out = CausalLMOutput() if out is None else out
        if labels is not None:
            out.loss = causal_lm_loss(self.loss_fn, hidden, self.lm_head.weight, labels)
        if labels is None or return_logits:
            out.logits = self.lm_head(hidden)
        return out
