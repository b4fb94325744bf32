"""Gated DeltaNet over a context-parallel shard on flash-linear-attention's own CP kernels (CUDA).

fla 0.6's `build_cp_context(cu_seqlens, group, layout="zigzag")` is this project's layout: rank r
holds the sequence's parts r and 2 CP - 1 - r, concatenated [front; back] (`layout.py`). With that
context:
- the causal conv takes each part's W - 1 halo tokens from the part before it: one all-gather of every
  part's tail for q, k and v together (`conv_entering_states`; fla's `causal_conv1d(..., cp_context=)`
  runs one a conv, each way), then fla's plain conv from those entering states over the rank's local
  sequences, the same kernels fla's CP conv runs; the halo's gradient goes back by the gather's backward;
- `chunk_gated_delta_rule(..., cp_context=)` first computes every part's affine state map at the
  state's width (the transition alone, from the WY factors the rule makes anyway), all-gathers and
  composes them in the chain's order (TF32x3 dots: fp32-class accuracy), then runs the plain rule
  from the entering state; its backward runs the same chain for the state gradients.
So each rank runs the single layer's kernels on its tokens (q, k and v projected and convolved
apart, contiguous: `fla_qkv`, the single layer's own) plus the chain pass: no widened values
and no fp32 copies of [T, C] activations, the costs `gdn.py`'s own maps pay
(`benchmarks/context_parallel/NOTES.md`).

fla's context describes one row of packed documents (B = 1): unpacked rows of B > 1 run one by one.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel import gdn_fla_chain as chain
from bumblebee.primitives.context_parallel.comm import gather
from bumblebee.primitives.context_parallel.layout import CPBatch, gather_slot
from bumblebee.primitives.linear_attention import fla_falls_back, fla_ops, fla_qkv, scoped

# CPBatch -> {ChainPass: fla's context}: one a batch and chain-pass options (the layers of a step share it)
_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def fla_cp_available() -> bool:
    """Whether the installed fla has the CP kernels with the zigzag layout (fla >= 0.6)."""
    try:
        from fla.ops.cp import build_cp_context  # noqa: F401
        from fla.ops.cp.context import FLACPContext
    except Exception:
        return False
    return "layout" in getattr(FLACPContext, "__dataclass_fields__", {})


def why_not_fla_cp(x: torch.Tensor, head_k_dim: int | None = None) -> str | None:
    """Why fla's CP kernels cannot run the layer (keys of `head_k_dim` a head) on x, or None."""
    if head_k_dim is not None and head_k_dim > 256:
        return f"fla's CP kernels take keys of at most 256 a head, got {head_k_dim}"
    why = fla_falls_back(x.device, x.dtype, training=torch.is_grad_enabled())
    if why is not None:
        return why
    if not fla_cp_available():
        return "the installed flash-linear-attention has no context-parallel kernels (fla.ops.cp, fla >= 0.6)"
    return None


def fla_context(batch: CPBatch, conv_width: int, device, concurrent_parts: bool = False, transition: str = "fla"):
    """fla's zigzag CP context of `batch` (built once a batch and options: the layers of a step share
    it); with `concurrent_parts` its chain passes summarize the rank's two parts at once, with a
    `transition` other than "fla" the transition maps come from `kernels/context_parallel_gdn_transition.py`
    (both `gdn_fla_chain.py`); else fla's own chain passes."""
    how = chain.ChainPass(concurrent_parts, transition)
    ctx = _CONTEXTS.setdefault(batch, {}).get(how)
    if ctx is None:
        from fla.ops.cp import build_cp_context
        cu_cpu = torch.tensor(batch.bounds, dtype=torch.long)
        ctx = build_cp_context(cu_cpu.to(device), group=batch.group, conv1d_kernel_size=conv_width,
                               cu_seqlens_cpu=cu_cpu, layout="zigzag")
        if how != chain.ChainPass():
            chain.install()
            chain.register(ctx, how)
        _CONTEXTS[batch][how] = ctx
    return ctx


def conv_entering_states(projected, *, context, width: int):
    """The causal conv's entering states [N, C, W] of this rank's local sequences (fla's zigzag
    `context`; C the channels of `projected`, the q, k, v projections [1, T, C_i] in order): each part's
    first sequence takes the W - 1 tokens before the part (the previous part's tail, another rank's,
    cut at its document start) in its last columns, as fla's CP conv lays them out; other rows zero.
    Every part's tail of all three goes in one differentiable all-gather (its backward a reduce-scatter,
    which returns the halo's gradient to the tail's rank), where fla's CP conv runs one all-gather a
    conv each way: 2 collectives a layer instead of 6, and fewer small host ops."""
    W, L = width, context.part_len
    if L < W - 1:
        raise ValueError(f"conv width {W} needs parts of at least {W - 1} tokens, got {L}")
    tails = torch.cat([torch.stack([p[0, L - (W - 1):L], p[0, -(W - 1):]]) for p in projected], dim=-1)
    got = gather(tails, context.group, dim=0)  # [2 CP, W-1, C]: rank r's front part at 2r, its back at 2r + 1
    world, rank = dist.get_world_size(context.group), dist.get_rank(context.group)
    N, C = len(context.cu_seqlens) - 1, tails.shape[-1]
    blocks, row_next = [], 0
    for part, row in enumerate((0, context.front_num_seqs)):
        valid = 0 if context.is_first_by_part[part] else min(W - 1, context.pre_num_conv_tokens_by_part[part])
        if valid <= 0:
            continue
        before = (rank if part == 0 else 2 * world - 1 - rank) - 1  # the chain position of the part before
        tail = got[gather_slot(before, world), -valid:].transpose(0, 1)  # [C, valid]
        blocks += [tails.new_zeros(row - row_next, C, W), F.pad(tail, (W - valid, 0))[None]]
        row_next = row + 1
    if not blocks:
        return tails.new_zeros(N, C, W)
    return torch.cat(blocks + [tails.new_zeros(N - row_next, C, W)])


def fla_cp_forward(layer, x_BTD, batch: CPBatch, concurrent_parts: bool = False, transition: str = "fla"):
    """The layer (the `linear_attention` slot's parameters) on this rank's two parts through fla's CP
    kernels: x [B, 2L, D] -> [B, 2L, D]. Raises where they cannot run (`why_not_fla_cp`).
    `concurrent_parts`, `transition`: `ContextParallel.fla_concurrent_parts` / `.fla_transition` (`fla_context`)."""
    why = why_not_fla_cp(x_BTD, layer.head_k_dim)
    if why is not None:
        raise RuntimeError(f"ContextParallel(deltanet='fla') cannot run here: {why}")
    rule = fla_ops()[1]
    B, T, _ = x_BTD.shape
    if batch.packed and B != 1:
        raise ValueError(f"packed documents under context parallelism come as one row: x [1, T/CP, D], got B={B}")
    W = layer.conv1d.weight.shape[-1]
    ctx = fla_context(batch, W, x_BTD.device, concurrent_parts, transition)
    scale = layer.head_k_dim ** -0.5

    def one_row(x_1TD):
        # q, k, v apart, as the single layer; their halos from one exchange (fla's CP conv: one a call, each way)
        parts = fla_qkv(layer, x_1TD, entering=functools.partial(conv_entering_states, context=ctx, width=W),
                        cu_seqlens=ctx.cu_seqlens, cu_seqlens_cpu=ctx.cu_seqlens_cpu)
        beta = layer.in_proj_b(x_1TD).sigmoid()
        g = -to_acc(layer.A_log).exp() * F.softplus(to_acc(layer.in_proj_a(x_1TD)) + layer.dt_bias)

        def run(q, k, v, g, beta):
            return rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True, cp_context=ctx)[0]
        return scoped(run, *parts, g.float(), beta.to(parts[0].dtype))

    o = torch.cat([one_row(x_BTD[b:b + 1]) for b in range(B)]) if B > 1 else one_row(x_BTD)
    z = layer.in_proj_z(x_BTD).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
    return layer.out_proj(layer.norm(o, z).reshape(B, T, layer.value_dim))
