"""Input validation shared by primitives and baselines: clear ValueErrors, never device asserts."""
from __future__ import annotations

import math

import torch


def check_cross_entropy_inputs(hidden, weight, labels, *, ignore_index, reduction, label_smoothing,
                               temperature, vocab_offset=0, vocab_total=None, z_loss_scale=0.0):
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
    # inf would divide every logit to 0 (the uniform loss), nan poisons the loss: both are refused
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not (math.isfinite(z_loss_scale) and z_loss_scale >= 0):  # a negative scale was silently ignored
        raise ValueError(f"z_loss_scale must be a finite number >= 0, got {z_loss_scale}")
    vocab = weight.shape[0] if vocab_total is None else vocab_total
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.numel() and bool(bad.any()):  # one host sync; a device-side assert would kill the process
        value = int(labels[bad][0])
        raise ValueError(f"labels hold {value}, outside [0, {vocab}) and not ignore_index={ignore_index}")


def check_is_tensor(name: str, value, what: str) -> None:
    """TypeError naming the argument when `value` is not a tensor (a list fails later, obscurely)."""
    if not isinstance(value, torch.Tensor):
        hint = "; convert it with torch.tensor(...)" if isinstance(value, (list, tuple)) else ""
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(value).__name__}{hint}")


def check_batch_shape(input_ids, name: str = "input_ids") -> None:
    """A [B, T] batch of at least one token: every model refuses an empty one alike (B = 0 or T = 0
    has no token to predict; the layers would fail deep inside on their reshapes)."""
    check_is_tensor(name, input_ids, "of token ids [B, T] (int64 or int32)")
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"{name} is an empty batch of shape {tuple(input_ids.shape)}: B and T must both be >= 1 "
                         f"(leave an empty batch out before the forward)")


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
    if not routed_experts.numel():
        return
    bad = (routed_experts < 0) | (routed_experts >= E)
    ordered = routed_experts.sort(dim=1).values
    repeat_T = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)  # a token would count twice for one expert
    out_of_range, repeated = torch.stack([bad.any(), repeat_T.any()]).tolist()  # one host sync
    if out_of_range:
        raise ValueError(f"routed_experts hold {int(routed_experts[bad][0])}, outside the experts [0, {E})")
    if repeated:
        t = int(repeat_T.nonzero()[0, 0])
        raise ValueError(f"routed_experts repeat an expert within a token: token {t} has "
                         f"{routed_experts[t].tolist()}; a token's k experts must differ")


def check_cu_seqlens(cu_seqlens, n_tokens: int) -> list[int]:
    """Packed-sequence boundaries as Python ints (one host sync); ValueError unless
    0 = c0 < c1 < ... < cS = B*T."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        what = f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} of shape {tuple(getattr(cu_seqlens, 'shape', ()))}"
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [S+1] of sequence boundaries, got {what}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at the batch's B*T={n_tokens} tokens, "
                         f"got {cu[0]}..{cu[-1]}")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {cu}")
    return cu


def check_mla_config(dim, n_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
    for name, value in (("dim", dim), ("n_heads", n_heads), ("kv_lora_rank", kv_lora_rank),
                        ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                        ("v_head_dim", v_head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank < 1):
        raise ValueError(f"q_lora_rank must be None or a positive int, got {q_lora_rank!r}")
    if qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {qk_rope_head_dim}")


def check_mla_inputs(x, cos, sin, dim, rope_dim):
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x must be [B, T, dim={dim}], got shape {tuple(x.shape)}")
    want = (x.shape[0], x.shape[1], rope_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want and tuple(t.shape) != (1,) + want[1:]:
            raise ValueError(f"{name} must be [B, T, qk_rope_head_dim] = {list(want)}, got {tuple(t.shape)}")


def check_mtp_inputs(depth, hidden, input_ids, labels, segment_ids):
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2] or labels.shape != input_ids.shape:
        raise ValueError(f"hidden [B, T, D], input_ids and labels [B, T] disagree: {tuple(hidden.shape)}, "
                         f"{tuple(input_ids.shape)}, {tuple(labels.shape)}")
    if segment_ids is not None and segment_ids.shape != input_ids.shape:
        raise ValueError(f"segment_ids must be [B, T] = {list(input_ids.shape)}, got {tuple(segment_ids.shape)}")
    T = input_ids.shape[1]
    if depth + 1 >= T:
        raise ValueError(f"MTP depth D={depth} (num_nextn_predict_layers) reaches beyond the sequence length "
                         f"T={T} of input_ids: depth k predicts token t+k+1, so T must exceed D+1")


MAX_CONV_KERNEL = 4  # the widths the fast causal convolutions serve (Qwen3.5 uses 4)


def check_gdn_config(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size):
    for name, v in (("hidden_size", hidden_size), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                    ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_v_heads % num_k_heads:
        raise ValueError(f"linear attention: key heads ({num_k_heads}) must divide value heads ({num_v_heads})")
    if not isinstance(conv_kernel_size, int) or not 2 <= conv_kernel_size <= MAX_CONV_KERNEL:
        raise ValueError(f"linear attention: conv_kernel_size must be in 2..{MAX_CONV_KERNEL}, got {conv_kernel_size!r}")
