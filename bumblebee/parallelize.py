"""Parallelism applied to a built model, beside state sharding: expert parallelism.

`shard_experts(model, ep_group)` keeps this rank's E/EP experts of every expert module and sets its
`ep_group`, after the full checkpoint is loaded; state sharding (`state_sharding` slot) then shards
what each rank holds. An expert module says which of its parameters are per-expert stacks (leading
dimension E) with `expert_parallel_params` and carries `num_experts`, `ep_group`,
`num_local_experts` and `expert_offset` (`models/moe.py:GroupedExperts`); the models define their
modules, the slicing happens here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def shard_experts(model: nn.Module, ep_group) -> nn.Module:
    """Keep only this rank's E/EP experts of every expert module in `model` (sliced from the full
    weights it holds now) and set their `ep_group`; use with moe_dispatch 'all_to_all' or 'chunked'.
    Returns the model."""
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for m in model.modules():
        names = getattr(m, "expert_parallel_params", None)
        if not names:
            continue
        if m.ep_group is not None:
            raise ValueError("experts are already sharded")
        if m.num_experts % ep:
            raise ValueError(f"num_experts={m.num_experts} is not divisible by the ep group size {ep}")
        L = m.num_experts // ep
        m.ep_group, m.num_local_experts, m.expert_offset = ep_group, L, rank * L
        for name in names:
            p = getattr(m, name)
            setattr(m, name, nn.Parameter(p[rank * L:(rank + 1) * L].clone(), requires_grad=p.requires_grad))
    return model
