"""Generated samples and the trainer's batch: per-token versions and their spans, GRPO advantages,
DAPO's dynamic sampling, and the padded token-aligned Batch the runtime trains on."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bumblebee.runtime.batching import Batch


@dataclass
class Completion:
    """One sampled completion: its tokens, the sampler's log-prob of each (pi_behave) and the weights
    version that sampled each token."""
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]

    def __post_init__(self):
        if not (len(self.tokens) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"tokens, logprobs and versions must have one entry per token, got "
                             f"{len(self.tokens)}, {len(self.logprobs)}, {len(self.versions)}")

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        return version_spans(self.versions)


@dataclass
class Group:
    """`completions` of one prompt and their rule rewards; `group` is its admission index."""
    group: int
    ticket: int
    prompt: list[int]
    completions: list[Completion]
    rewards: list[float]
    producer: str | int = 0  # the producer (incarnation) that generated it
    meta: dict = field(default_factory=dict)

    def oldest_version(self) -> int:
        return min(min(c.versions) for c in self.completions if c.versions)


def version_spans(versions: list[int]) -> list[tuple[int, int, int]]:
    """[(version, start, end)] runs of equal versions over a completion's tokens (end exclusive);
    more than one span means the weights changed mid-generation."""
    spans = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], i + 1)
        else:
            if spans and v < spans[-1][0]:
                raise ValueError(f"versions must not decrease along a completion, got {versions}")
            spans.append((v, i, i + 1))
    return spans


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage of each completion: its reward minus its group's mean, divided by the group's
    (unbiased) std + eps when `scale_by_std`. `rewards` [groups, group_size]."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(1, keepdim=True)
    return centered / (rewards.std(1, keepdim=True) + eps) if scale_by_std else centered


def informative(groups: list[Group]) -> list[Group]:
    """DAPO's dynamic sampling: the groups whose rewards are not all equal (the others have zero
    advantage everywhere and would only dilute the token mean)."""
    return [g for g in groups if max(g.rewards) != min(g.rewards)]


def to_batch(groups: list[Group], pad_id: int, *, scale_by_std: bool = True, device="cpu"):
    """(Batch, versions): rows prompt + completion right-padded with `pad_id`; `loss_mask` on the
    completion tokens, `sampler_logprobs` the sampler's (pi_behave), `advantages` GRPO's per row;
    `versions` [B, T] long, the version of each completion token (-1 elsewhere). The batch's
    tensors on `device` (the trainer's), built on the CPU."""
    rows = [(g.prompt, c) for g in groups for c in g.completions]
    if not rows:
        raise ValueError("groups holds no completion")
    T = max(len(p) + len(c.tokens) for p, c in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    behave = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n, m = len(p), len(c.tokens)
        ids[i, :n] = torch.tensor(p)
        if m:
            ids[i, n:n + m] = torch.tensor(c.tokens)
            mask[i, n:n + m] = True
            behave[i, n:n + m] = torch.tensor(c.logprobs)
            versions[i, n:n + m] = torch.tensor(c.versions)
    adv = grpo_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float32), scale_by_std=scale_by_std)
    adv = adv.reshape(-1, 1).expand(B, T).contiguous()
    return Batch(*(t.to(device) for t in (ids, mask)), sampler_logprobs=behave.to(device),
                 advantages=adv.to(device)), versions
