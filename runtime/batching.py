"""Batches and micro-batches. A `Batch` is token-aligned [B, T]: padded rows, or (with `cu_seqlens`)
one packed stream of sequences. `plan` cuts it into micro-batches of whole sequences under a token
budget; every micro-batch is a set of flat token indices into the B*T stream (rows of a padded
batch, spans of a packed one), so its tensors are gathered and its outputs scattered back alike.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from bumblebee.checks import check_batch_shape
from bumblebee.packing import segments

TOKEN_FIELDS = ("loss_mask", "weights", "advantages", "sampler_logprobs", "ref_logprobs", "position_ids")
FLOAT_FIELDS = ("weights", "advantages", "sampler_logprobs", "ref_logprobs")


@dataclass
class Batch:
    """[B, T] token-aligned inputs. `loss_mask` (bool): the tokens trained on (default: all that
    have a prefix); `weights`: per-token loss weights (default 1); `advantages` and
    `sampler_logprobs` (the log-probs of the policy that sampled the tokens, PPO's old policy) for
    the policy-gradient losses; `ref_logprobs`: the reference policy's, for the KL term;
    `cu_seqlens` [S + 1]: the B*T tokens are one packed stream of sequences; `routed_experts`
    [B, T, layers, k] (int): the experts the rollout engine chose per MoE decoder layer, replayed
    by the routers."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def check(self):
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"batch.input_ids must be an int [B, T] tensor, got "
                             f"{getattr(ids, 'dtype', type(ids))} of shape {tuple(getattr(ids, 'shape', ()))}")
        check_batch_shape(ids, "batch.input_ids")
        for name in TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
                raise ValueError(f"batch.{name} must be a [B, T] = {tuple(ids.shape)} tensor like input_ids, got "
                                 f"shape {tuple(getattr(t, 'shape', ()))}")
        if self.loss_mask is not None and self.loss_mask.dtype != torch.bool:
            raise ValueError(f"batch.loss_mask must be bool, got {self.loss_mask.dtype}")
        for name in FLOAT_FIELDS:
            t = getattr(self, name)
            if t is not None and not t.is_floating_point():
                raise ValueError(f"batch.{name} must be a floating-point tensor, got {t.dtype}")
        r = self.routed_experts
        if r is not None and (not isinstance(r, torch.Tensor) or r.dim() != 4 or r.shape[:2] != ids.shape
                              or r.is_floating_point()):
            raise ValueError(f"batch.routed_experts must be an int [B, T, layers, k] tensor with [B, T] = "
                             f"{tuple(ids.shape)}, got {getattr(r, 'dtype', type(r))} of shape "
                             f"{tuple(getattr(r, 'shape', ()))}")
        return self

    def trained(self) -> torch.Tensor:
        """bool [B, T]: the tokens with a log-prob to train on (masked in, not a sequence's first)."""
        ids = self.input_ids
        mask = torch.ones_like(ids, dtype=torch.bool) if self.loss_mask is None else self.loss_mask.clone()
        flat = mask.view(-1)
        flat[self.starts()] = False
        return mask

    def starts(self) -> list[int]:
        """Flat indices of every sequence's first token."""
        return [a for a, _ in self.spans()]

    def spans(self) -> list[tuple[int, int]]:
        """[(start, end)) of every sequence in the flat B*T stream (rows when not packed)."""
        B, T = self.input_ids.shape
        if self.cu_seqlens is None:
            return [(b * T, (b + 1) * T) for b in range(B)]
        return segments(self.cu_seqlens, B * T)

    def sequence_ids(self) -> torch.Tensor:
        """long [B, T]: the sequence of every token (its row, or its packed segment)."""
        spans = self.spans()
        lengths = torch.tensor([b - a for a, b in spans], device=self.input_ids.device)
        ids = torch.repeat_interleave(torch.arange(len(spans), device=self.input_ids.device), lengths)
        return ids.view_as(self.input_ids)


@dataclass
class MicroBatch:
    """Flat token indices `index` into the parent's B*T stream, viewed as `shape`; `spans` in the
    micro-batch's own stream when packed. A `dummy` micro-batch (a copy of a sequence, nothing
    trained) only keeps the ranks' collectives in step: its outputs are dropped."""
    index: torch.Tensor
    shape: tuple[int, int]
    spans: list[tuple[int, int]] | None
    dummy: bool = False

    def take(self, batch: Batch) -> Batch:
        """The micro-batch's own Batch."""
        if self.index.numel() == batch.input_ids.numel():
            return batch
        out = {}
        for f in fields(Batch):
            t = getattr(batch, f.name)
            if t is None or f.name == "cu_seqlens":
                continue
            flat = t.reshape(-1, *t.shape[2:])
            out[f.name] = flat[self.index.to(flat.device)].reshape(*self.shape, *t.shape[2:])
        if self.spans is not None:
            cu = [0] + [b for _, b in self.spans]
            out["cu_seqlens"] = torch.tensor(cu, dtype=batch.cu_seqlens.dtype, device=batch.cu_seqlens.device)
        if self.dummy:
            out["loss_mask"] = torch.zeros(self.shape, dtype=torch.bool, device=batch.input_ids.device)
        return Batch(**out)

    def put(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """Scatter a micro-batch output [b, t, ...] into the full [B, T, ...] tensor."""
        if not self.dummy:
            full.view(-1, *full.shape[2:])[self.index.to(full.device)] = part.reshape(-1, *part.shape[2:])


def plan(batch: Batch, micro_batch_tokens: int | None, group=None) -> list[MicroBatch]:
    """Micro-batches of whole sequences, in order, each of at most `micro_batch_tokens` tokens (a
    padded batch: rows of T tokens; a packed one: sequences repacked into one stream). With `group`
    the ranks agree on the count (an all-reduce of the maximum): a rank with fewer adds dummy
    micro-batches, since every forward holds collectives (FSDP2's gathers, expert dispatch)."""
    B, T = batch.input_ids.shape
    spans = batch.spans()
    if micro_batch_tokens is None:
        return [MicroBatch(torch.arange(B * T), (B, T), None)]
    if not (isinstance(micro_batch_tokens, int) and micro_batch_tokens > 0):
        raise ValueError(f"micro_batch_tokens must be an int > 0 or None, got {micro_batch_tokens!r}")
    longest = max(b - a for a, b in spans)
    if micro_batch_tokens < longest:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} is smaller than the batch's longest sequence "
                         f"({longest} tokens{'' if batch.cu_seqlens is not None else ', a padded row'}): "
                         f"a sequence is never split")
    groups, size = [[]], 0
    for a, b in spans:
        if groups[-1] and size + (b - a) > micro_batch_tokens:
            groups.append([])
            size = 0
        groups[-1].append((a, b))
        size += b - a
    out = [_micro(g, batch.cu_seqlens is not None, T) for g in groups]
    if group is not None:
        count = all_reduce_ints([len(out)], group, dist.ReduceOp.MAX)[0]
        shortest = min(spans, key=lambda s: s[1] - s[0])
        while len(out) < count:
            out.append(_micro([shortest], batch.cu_seqlens is not None, T, dummy=True))
    return out


def _micro(group: list[tuple[int, int]], packed: bool, T: int, dummy: bool = False) -> MicroBatch:
    index = torch.cat([torch.arange(a, b) for a, b in group])
    if not packed:
        return MicroBatch(index, (len(group), T), None, dummy)
    spans, at = [], 0
    for a, b in group:
        spans.append((at, at + b - a))
        at += b - a
    return MicroBatch(index, (1, at), spans, dummy)


def all_reduce_ints(values: list[int], group, op=dist.ReduceOp.SUM) -> list[int]:
    """All-reduced Python ints over `group` (on the device its backend needs)."""
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()
