"""Gated DeltaNet's chunked rule kept through a model's full recompute, so the recompute skips it.

Under full recompute a DeltaNet layer runs its chunked rule twice before the backward: in the first
forward and again in the recompute. fla's backward rebuilds its own chunk states (w, u, h) from q, k,
v, g, beta and the WY matrix A, so the recompute's run serves only the output, for the layer's gated
norm and out_proj. Here the first forward keeps that output (16-bit [B, T, HV, V]) and what the
kernel's backward needs beyond its inputs (fla: A, 16-bit [B, T, HV, 64], and the chunk-local gate
cumsum, fp32 [B, T, HV]); the recompute takes the output instead of running the rule, and the
backward runs the kernel's own backward on the recomputed q, k, v, g, beta. Only those five go
through the checkpoint (recomputed), the same in both passes, as checkpoint requires.

A `RuleKernel` is a forward returning (o, kept) and its backward. `FLA` runs what fla 0.6's
`ChunkGatedDeltaRuleFunction` runs for q/k l2-norm in the kernel, no initial or final state: its
internal `chunk_gated_delta_rule_fwd` / `_bwd` and l2-norm kernels, reached through fla's own
modules (so a dq/dk/dw/dg kernel installed into fla's registry serves here too). It bypasses the
public function's backend dispatch: where another backend (FlashQLA) would serve the public call,
this path still runs fla's Triton kernels. `fla_available()` says whether fla's internals have the
signatures used here. The primitive (`primitives/linear_attention.py`) adds its CPU kernel (fla's
algorithm in torch) and decides per call, within its `recompute_keep_bytes`.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

CHUNK = 64  # fla's chunk size for the gated rule (its default, and the one its fused intra kernel takes)


@dataclass(frozen=True)
class RuleKernel:
    """forward(q, k, v, g, beta, scale, cu_seqlens) -> (o, kept); backward(do, q, k, v, g, beta, kept,
    scale, cu_seqlens) -> (dq, dk, dv, dg, dbeta); kept_bytes(q, v) -> the bytes one call keeps,
    the output included."""

    name: str
    forward: Callable
    backward: Callable
    kept_bytes: Callable


class _Held:
    """What one call keeps until its backward; its finalizer returns the bytes to the budget when the
    backward drops it or the graph is freed without a backward."""

    def __init__(self, kept, on_release):
        self.kept = kept
        weakref.finalize(self, on_release)


class KeptRule(torch.autograd.Function):
    """apply(q, k, v, g, beta, scale, cu_seqlens, kernel, release, taken): the first forward (taken
    None) runs the kernel and holds what its backward needs; the recompute passes the first forward's
    output as `taken`. `release()` runs once the held values die."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, cu_seqlens, kernel, release, taken):
        ctx.save_for_backward(q, k, v, g, beta)  # recomputed by the checkpoint, in both passes
        ctx.scale, ctx.cu_seqlens, ctx.kernel, ctx.held = scale, cu_seqlens, kernel, None
        if taken is not None:  # the recompute: its graph is discarded, the first forward's node runs the backward
            return taken.detach()
        o, kept = kernel.forward(q, k, v, g, beta, scale, cu_seqlens)
        ctx.held = _Held(kept, release)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta = ctx.saved_tensors  # runs the region's recompute, which takes the kept output
        if ctx.held is None:
            raise RuntimeError("a DeltaNet rule kept through a recompute was differentiated twice: a retained "
                               "graph of a full-recompute layer is not supported with the linear_attention "
                               "option recompute_keep_bytes > 0")
        held, ctx.held = ctx.held, None  # released here, not when the graph is
        grads = ctx.kernel.backward(do, q, k, v, g, beta, held.kept, ctx.scale, ctx.cu_seqlens)
        return (*grads, None, None, None, None, None)


# ---- fla ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _fla():
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.gated_delta_rule import chunk as gdr
    from fla.ops.utils.index import prepare_chunk_indices

    return SimpleNamespace(l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, fwd=gdr.chunk_gated_delta_rule_fwd,
                           bwd=gdr.chunk_gated_delta_rule_bwd, chunk_indices=prepare_chunk_indices)


_FWD_ARGS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
             "chunk_indices", "chunk_size")
_BWD_ARGS = ("q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "cu_seqlens",
             "chunk_indices", "chunk_size")


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    """fla imports here and its internal forward / backward take the arguments this file passes."""
    try:
        f = _fla()
        return all(set(names) <= set(inspect.signature(fn).parameters)
                   for fn, names in ((f.fwd, _FWD_ARGS), (f.bwd, _BWD_ARGS)))
    except Exception:  # not installed, no usable Triton, or internals that moved
        return False


def _chunk_indices(cu_seqlens):
    return None if cu_seqlens is None else _fla().chunk_indices(cu_seqlens, CHUNK)


def _fla_forward(q, k, v, g, beta, scale, cu_seqlens):
    f = _fla()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # as fla's input_guard
    with torch.cuda.device(q.device):
        qn, _ = f.l2norm_fwd(q)
        kn, _ = f.l2norm_fwd(k)
        g_cum, o, A, _, _, _ = f.fwd(q=qn, k=kn, v=v, g=g, beta=beta, scale=scale, initial_state=None,
                                     output_final_state=False, cu_seqlens=cu_seqlens,
                                     chunk_indices=_chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return o.to(q.dtype), (A, g_cum)


def _fla_backward(do, q, k, v, g, beta, kept, scale, cu_seqlens):
    f = _fla()
    A, g_cum = kept
    q, k, v, beta, do = (t.contiguous() for t in (q, k, v, beta, do))
    with torch.cuda.device(q.device):
        qn, q_rstd = f.l2norm_fwd(q)  # elementwise and deterministic: the first forward's values
        kn, k_rstd = f.l2norm_fwd(k)
        dq, dk, dv, db, dg, _, _, _ = f.bwd(q=qn, k=kn, v=v, g=g_cum, beta=beta, A=A, scale=scale,
                                            initial_state=None, do=do, dht=None, cu_seqlens=cu_seqlens,
                                            chunk_indices=_chunk_indices(cu_seqlens), chunk_size=CHUNK)
        dq = f.l2norm_bwd(qn, q_rstd, dq)
        dk = f.l2norm_bwd(kn, k_rstd, dk)
    return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta)


def _fla_kept_bytes(q, v):
    B, T, HV, V = v.shape
    return B * T * HV * (V * v.element_size() + CHUNK * q.element_size() + 4)  # o, A, fp32 gate cumsum


FLA = RuleKernel("fla", _fla_forward, _fla_backward, _fla_kept_bytes)
