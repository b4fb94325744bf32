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
