"""Input validation shared by primitives and baselines: clear ValueErrors, never device asserts."""
from __future__ import annotations

import torch


def check_cross_entropy_inputs(hidden, weight, labels, *, ignore_index, reduction, label_smoothing,
                               temperature, vocab_offset=0, vocab_total=None):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [N={hidden.shape[0]}], got shape {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 or int32, got {labels.dtype}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = weight.shape[0] if vocab_total is None else vocab_total
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.numel() and bool(bad.any()):  # one host sync; a device-side assert would kill the process
        value = int(labels[bad][0])
        raise ValueError(f"labels hold {value}, outside [0, {vocab}) and not ignore_index={ignore_index}")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32, got {input_ids.dtype}")
    if input_ids.numel() and bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0]
        raise ValueError(f"{name} holds {int(bad)}, outside the vocabulary [0, {vocab_size})")


def check_attention_inputs(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, heads, T, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape[:3] + (k.shape[3],) or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k/v must be [B={q.shape[0]}, Hkv, T={q.shape[2]}, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")


def check_router_inputs(logits, top_k, *, bias=None, n_group=1, topk_group=1, routed_experts=None):
    """ValueError (naming the offending values) for every input the routers cannot route."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [T, E] tensor, got shape {tuple(getattr(logits, 'shape', ()))}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    E = logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got top_k={top_k}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != E):
        raise ValueError(f"bias must be [E={E}], got shape {tuple(bias.shape)}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"the number of experts E={E} must be a multiple of n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got topk_group={topk_group}")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"group-limited routing needs >= 2 experts per group, got E={E}, n_group={n_group}")
    if top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k={top_k} exceeds the experts of the kept groups "
                         f"(topk_group={topk_group} x {E // n_group} experts per group)")
    if routed_experts is not None:
        check_routed_experts(routed_experts, logits.shape[0], top_k, E)


def check_routed_experts(routed_experts, T, top_k, E):
    if routed_experts.shape != (T, top_k):
        raise ValueError(f"routed_experts must be [T={T}, k={top_k}], got shape {tuple(routed_experts.shape)}")
    if routed_experts.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"routed_experts must be int64 or int32, got {routed_experts.dtype}")
    bad = (routed_experts < 0) | (routed_experts >= E)
    if routed_experts.numel() and bool(bad.any()):
        raise ValueError(f"routed_experts hold {int(routed_experts[bad][0])}, outside the experts [0, {E})")
