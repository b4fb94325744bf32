"""What every thin causal-LM file shares: input checks, tied head, recompute, loss via the slot.

A model file defines its backbone (`self.model`, returning final-normed hidden states) and its
forward; `CausalLM` holds the rest so model files stay a list of their features.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from bumblebee import packing
from bumblebee import recompute as recompute_phase
from bumblebee.checks import check_batch_shape, check_cu_seqlens, check_is_tensor, check_token_ids
from bumblebee.models.components import CausalLMOutput, causal_lm_loss, next_token_labels
from bumblebee.hf_io import HFCheckpointMixin
from bumblebee.models.moe import MoECausalLMOutput, load_balancing_loss
from bumblebee.registry import check_impl, resolve


@dataclass
class MTPCausalLMOutput(MoECausalLMOutput):
    mtp_loss: torch.Tensor | None = None  # the scaled MTP term included in `loss` (detached)
    mtp_losses: torch.Tensor | None = None  # [D] the mean CE of every depth (detached)


def run_layer(layer, recompute: bool, *args, kept: recompute_phase.Kept | None = None):
    """One decoder layer; under full recompute only its inputs are kept for the backward, and the
    layer can tell its first forward from the recompute (`bumblebee.recompute.phase()`). `kept`: the
    model's budgets of outputs kept through its recompute (its stack's `kept`)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False, context_fn=lambda: recompute_phase.contexts(kept))
    return layer(*args)


class DecoderStack(nn.Module):
    """embed_tokens -> decoder layers -> final norm, with transformers' module names.

    Each layer takes (x, cos, sin, *extra) and returns (x, router logits or None); the stack returns
    (final-normed hidden, tuple of the MoE layers' router logits). `rotary_emb` is held here, where
    transformers keeps it, and called by the model's forward.
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers, norm: nn.Module, rotary_emb: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.recompute = False  # full activation recompute: keep only each layer's input
        self.kept = recompute_phase.Kept()  # this model's bytes kept through its recompute, per slot

    def forward(self, input_ids, cos, sin, *extra):
        x = self.embed_tokens(input_ids)
        router_logits = []
        for layer in self.layers:
            x, logits = run_layer(layer, self.recompute, x, cos, sin, *extra, kept=self.kept)
            if logits is not None:
                router_logits.append(logits)
        return self.norm(x), tuple(router_logits)


class CausalLM(HFCheckpointMixin, nn.Module):
    def __init__(self, config, impl: dict | None, backbone: type[nn.Module]):
        super().__init__()
        self.config, self.impl = config, check_impl(impl)
        self.model = backbone(config, self.impl)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_fn = resolve("cross_entropy", self.impl.get("cross_entropy"))
        self.head_fn = None  # see `custom_head`
        self.tie_weights()

    @contextlib.contextmanager
    def custom_head(self, fn):
        """Within: a forward with labels hands `fn(hidden [N, H], lm_head weight [V, H], next-token
        labels [N])` (labels shifted as the loss shifts them, -100 where no target) the head's inputs
        instead of the loss slot, and returns its result as `out.loss`; MTP depths are skipped. Going
        through the model's own forward keeps FSDP2's hooks (the head's weight is whole in there)."""
        self.head_fn = fn
        try:
            yield self
        finally:
            self.head_fn = None

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layers compute in (RoPE tables follow it): the head's. FSDP2 keeps the head
        unsharded in the root unit, in its compute dtype, during the forward; the embedding is a unit
        of its own whose parameter reads as the fp32 master between its own forwards."""
        return self.lm_head.weight.dtype

    def set_recompute(self, enabled: bool = True):
        """Full activation recompute: every decoder layer reruns its forward in the backward."""
        self.model.recompute = enabled
        return self

    def check_inputs(self, input_ids, labels, position_ids):
        """Validated inputs; returns position_ids (0..T-1 per row when None)."""
        check_batch_shape(input_ids)
        self._check_types(labels, position_ids)
        check_token_ids(input_ids, self.config.vocab_size)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return position_ids

    def packed_inputs(self, input_ids, labels, position_ids, cu_seqlens):
        """For a packed batch (the B*T tokens are sequences cut at `cu_seqlens` [S+1]): segment ids
        [B, T], positions restarting per sequence (unless given), and labels whose target never
        crosses a sequence boundary. Returns (segment_ids, position_ids, labels)."""
        if getattr(cu_seqlens, "context_parallel", False):  # a cp shard's CPBatch (primitives/context_parallel):
            return None, position_ids, labels  # positions and targets were set on the full sequence
        check_batch_shape(input_ids)
        self._check_types(labels, position_ids)
        n, dev = input_ids.numel(), input_ids.device
        cu = check_cu_seqlens(cu_seqlens, n)  # one host sync per packed batch
        segment_ids = packing.sequence_ids(cu, dev)
        if position_ids is None:
            starts = torch.tensor(cu[:-1], device=dev)[segment_ids]
            position_ids = (torch.arange(n, device=dev) - starts).view_as(input_ids)
        segment_ids = segment_ids.view_as(input_ids)
        if labels is not None:  # the last token of a sequence does not predict the next one's first
            first = torch.zeros(n, dtype=torch.bool, device=dev)
            first[cu[1:-1]] = True
            labels = labels.masked_fill(first.view_as(labels), -100)
        return segment_ids, position_ids, labels

    def packed_forward(self, input_ids, labels, position_ids, cu_seqlens, return_logits):
        """The forward of a decoder with MTP depths and packed-sequence support: (outputs with the
        loss and MTP term, router logits of the layers). cu_seqlens: the B*T tokens are one packed
        stream of sequences (positions restart per sequence unless given; no target crosses one)."""
        segment_ids = None
        if cu_seqlens is not None:
            segment_ids, position_ids, labels = self.packed_inputs(input_ids, labels, position_ids, cu_seqlens)
        position_ids = self.check_inputs(input_ids, labels, position_ids)
        cos, sin = self.model.rotary_emb(position_ids, self.compute_dtype())
        hidden, router_logits = self.model(input_ids, cos, sin, cu_seqlens)
        out = self.lm_outputs(hidden, labels, return_logits, MTPCausalLMOutput())
        self.add_mtp_loss(out, hidden, input_ids, labels, cos, sin, cu_seqlens, segment_ids)
        return out, router_logits

    def add_mtp_loss(self, out, hidden, input_ids, labels, cos, sin, cu_seqlens=None, segment_ids=None):
        """Multi-token prediction through the `mtp` slot (when the model has depths): adds the
        scaled term to out.loss; out.mtp_loss (detached) and out.mtp_losses [D] report it."""
        if labels is None or not hasattr(self, "mtp") or self.head_fn is not None:
            return out

        def run_block(block, x):
            return run_layer(block, self.model.recompute, x, cos, sin, cu_seqlens, kept=self.model.kept)[0]

        mtp_loss, out.mtp_losses = self.mtp(hidden, input_ids, labels, embed=self.model.embed_tokens,
                                            head_weight=self.lm_head.weight, run_block=run_block,
                                            loss_fn=self.loss_fn, segment_ids_BT=segment_ids)
        out.loss = out.loss + mtp_loss
        out.mtp_loss = mtp_loss.detach()
        return out

    def add_aux_loss(self, out, router_logits, output_router_logits=None):
        """transformers' load-balancing loss of the softmax routers, when output_router_logits (default:
        the config's): out.router_logits, out.aux_loss, and coef * aux_loss added to out.loss."""
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        if output_router_logits and router_logits:
            out.router_logits = router_logits
            out.aux_loss = load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok)
            if out.loss is not None:
                out.loss = out.loss + self.config.router_aux_loss_coef * out.aux_loss
        return out

    def init_missing_mtp(self, norm_value: float, path=None) -> tuple[str, ...]:
        """Fresh MTP depths for a checkpoint (at `path`) that holds none (transformers saves none):
        normal(0, initializer_range) matrices, norms at `norm_value`, biases 0, with a warning naming
        them (as transformers' "newly initialized" one). Returns their names, which the loader then
        treats as optional."""
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, t in self.mtp.state_dict(keep_vars=True).items():
                if t.dim() > 1:
                    t.copy_(torch.randn(t.shape, generator=g) * self.config.initializer_range)
                else:
                    t.fill_(norm_value if name.endswith("norm.weight") else 0.0)
        names = tuple(f"mtp.{name}" for name in self.mtp.state_dict())
        warnings.warn(f"Some weights of {type(self).__name__} were not initialized from the model checkpoint"
                      f"{'' if path is None else f' at {path}'} and are newly initialized: {list(names)}. The "
                      f"checkpoint holds no MTP weights; train them before relying on the MTP loss or on "
                      f"speculative decoding with them", stacklevel=2)
        return names

    def lm_outputs(self, hidden, labels, return_logits, out: CausalLMOutput | None = None) -> CausalLMOutput:
        """Loss through the `cross_entropy` slot; logits only when labels is None or asked for."""
        out = CausalLMOutput() if out is None else out
        if labels is not None and self.head_fn is not None:
            out.loss = self.head_fn(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                    next_token_labels(labels).reshape(-1))
        elif labels is not None:
            out.loss = causal_lm_loss(self.loss_fn, hidden, self.lm_head.weight, labels)
        if labels is None or return_logits:
            out.logits = self.lm_head(hidden)
        return out

    def slots_used(self) -> tuple[str, ...]:
        """The slots this model looked up while it was built (see `registry.SlotChoices`)."""
        return tuple(sorted(self.impl.asked))

    def impl_configs(self) -> dict[str, dict]:
        """{slot: {"impl": name, **its options}} of every slot this model uses, defaults included:
        what a report or a result records of what ran."""
        return self.impl.configs()

    @staticmethod
    def _check_types(labels, position_ids):
        for name, value in (("labels", labels), ("position_ids", position_ids)):
            if value is not None:
                check_is_tensor(name, value, "[B, T] like input_ids")
        if position_ids is not None and (position_ids.is_floating_point() or position_ids.is_complex()
                                         or position_ids.dtype == torch.bool):  # rotary angles of 0.5 are no position
            raise ValueError(f"position_ids must be an integer tensor (int64 or int32), got {position_ids.dtype}")
