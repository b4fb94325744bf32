"""SwiGLU expert GEMMs with the data gradient (dgrad) split from the weight gradient (wgrad).

The three pieces are plain tensor functions so that any schedule can order them itself:

    y, saved = expert_forward(x_MD, tpe, w1_E2ID, w2_EDI)      # h = x @ w1[e].T, a = silu(gate) * up, y = a @ w2[e].T
    dx, job  = expert_dgrad(g_MD, saved, w1, w2)                 # dgrad now, wgrad inputs kept in `job`
    dw1, dw2 = expert_wgrad(job)                                 # any time later (after other chunks' dgrad)

`SwiGLUExperts` wraps them as an autograd function: with `wgrad_store=None` its backward returns
the weight gradients like any op; with a `WgradStore` its backward computes only dgrad, queues the
wgrad, and `store.backward_dw()` runs every queued wgrad later and accumulates into `.grad`
(Megatron/TE's `backward_dw()` pattern), so a schedule can overlap it with communication.

`swiglu=` / `swiglu_grads=` replace the SwiGLU elementwise torch ops with fused functions (the
chunked expert-parallel primitive passes `kernels/moe_dispatch_swiglu.py`'s; the twins keep the torch ops).

Rows arrive grouped by expert (`tpe`: tokens per expert). On CUDA in bf16 with widths that meet
its 16-byte stride rule the GEMMs are `torch._grouped_mm` (forward and dgrad as 2D x 3D, wgrad as
2D x 2D with offsets on the reduced dimension, one launch each); elsewhere a loop over experts.

Shape legend: M rows (routed copies), D model width, I expert width, E (local) experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TokensPerExpert:
    """Row counts per expert, on the device (offsets for grouped_mm) and on the host (loop).
    `offsets` (int32 cumulative counts) may be given; otherwise computed once, on first use."""
    device: torch.Tensor  # [E] int
    host: list
    offsets: torch.Tensor | None = None

    @property
    def offs(self):
        if self.offsets is None:
            self.offsets = torch.cumsum(self.device, 0, dtype=torch.int32)
        return self.offsets


def use_grouped_mm(x, w1, w2, mode="auto"):
    if mode != "auto":
        return mode == "always"
    return (x.is_cuda and x.dtype == torch.bfloat16 and w1.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and w1.shape[-1] % 8 == 0 and w2.shape[-1] % 8 == 0)


def _segments(tpe: TokensPerExpert):
    start = 0
    for e, n in enumerate(tpe.host):
        if n:
            yield e, slice(start, start + n)
        start += n


def _gmm(a, b, tpe, grouped):
    """out[rows of e] = a[rows of e] @ b[e]   (a [M, K], b [E, K, N])."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[-1])
    if grouped:
        return torch._grouped_mm(a, b, offs=tpe.offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    for e, s in _segments(tpe):
        torch.mm(a[s], b[e], out=out[s])
    return out


def _gmm_wgrad(a, b, tpe, grouped, num_experts):
    """out[e] = a[rows of e].T @ b[rows of e]   (a [M, P], b [M, Q]) -> [E, P, Q]; zero for empty experts."""
    if grouped and a.shape[0]:
        return torch._grouped_mm(a.t(), b, offs=tpe.offs)
    out = a.new_zeros(num_experts, a.shape[1], b.shape[1])
    for e, s in _segments(tpe):
        torch.mm(a[s].t(), b[s], out=out[e])
    return out


def expert_forward(x_MD, tpe: TokensPerExpert, w1_E2ID, w2_EDI, mode="auto", swiglu=None, fc2=True):
    """y [M, D] and what the backward needs: (x, h = x @ w1.T [M, 2I], tpe, grouped).
    `swiglu(h) -> a`: a fused replacement for silu(gate) * up. fc2=False: y is None (h only, for a
    recompute whose backward needs no y, see `expert_dgrad_weighted`)."""
    grouped = use_grouped_mm(x_MD, w1_E2ID, w2_EDI, mode)
    h_M2I = _gmm(x_MD, w1_E2ID.transpose(-2, -1), tpe, grouped)
    if not fc2:
        return None, (x_MD, h_M2I, tpe, grouped)
    if swiglu is not None:
        a_MI = swiglu(h_M2I)
    else:
        gate, up = h_M2I.chunk(2, dim=-1)
        a_MI = F.silu(gate) * up
    y_MD = _gmm(a_MI, w2_EDI.transpose(-2, -1), tpe, grouped)
    return y_MD, (x_MD, h_M2I, tpe, grouped)


@dataclass
class WgradJob:
    x_MD: torch.Tensor
    dh_M2I: torch.Tensor
    a_MI: torch.Tensor
    g_MD: torch.Tensor
    tpe: TokensPerExpert
    grouped: bool
    num_experts: int


def expert_dgrad(g_MD, saved, w1_E2ID, w2_EDI, *, dh_out=None, a_out=None, swiglu_grads=None):
    """dx [M, D] now, and the job that computes the weight gradients later. dh_out [M, 2I] / a_out
    [M, I]: where to write the wgrad inputs dh and a (e.g. slices of a buffer shared by chunks).
    `swiglu_grads(h, da, dh_out=, a_out=) -> (a, dh)`: a fused replacement for the torch ops."""
    x_MD, h_M2I, tpe, grouped = saved
    da_MI = _gmm(g_MD, w2_EDI, tpe, grouped)
    a_MI, dh_M2I = (swiglu_grads or _swiglu_grads)(h_M2I, da_MI, dh_out=dh_out, a_out=a_out)
    dx_MD = _gmm(dh_M2I, w1_E2ID, tpe, grouped)
    return dx_MD, WgradJob(x_MD, dh_M2I, a_MI, g_MD, tpe, grouped, w1_E2ID.shape[0])


def expert_dgrad_weighted(g_MD, saved, w1_E2ID, w2_EDI, w_M, *, dh_out=None, a_out=None,
                          swiglu_grads_weighted=None):
    """`expert_dgrad` for rows whose routing weight is applied here: the output was w * (a @ w2.T)
    per row, g_MD is the gradient before the weighting, w_M [M] fp32. Returns dx [M, D], the
    weights' gradient gw [M] fp32 = <g, a @ w2.T> = <g @ w2, a>, and the wgrad job (its a scaled by
    w). Needs no y, so a recompute of the forward can skip fc2. `swiglu_grads_weighted(h, du, w,
    dh_out=, a_out=) -> (w a, dh, gw)`: a fused replacement for the torch ops."""
    x_MD, h_M2I, tpe, grouped = saved
    du_MI = _gmm(g_MD, w2_EDI, tpe, grouped)  # the fc2 dgrad of the unweighted rows
    a_MI, dh_M2I, gw_M = (swiglu_grads_weighted or _swiglu_grads_weighted)(h_M2I, du_MI, w_M, dh_out=dh_out,
                                                                           a_out=a_out)
    dx_MD = _gmm(dh_M2I, w1_E2ID, tpe, grouped)
    return dx_MD, gw_M, WgradJob(x_MD, dh_M2I, a_MI, g_MD, tpe, grouped, w1_E2ID.shape[0])


def _swiglu_grads_weighted(h_M2I, du_MI, w_M, dh_out=None, a_out=None):
    """(w a, dh, gw) of `expert_dgrad_weighted` with the torch ops."""
    acc = torch.promote_types(torch.promote_types(du_MI.dtype, w_M.dtype), torch.float32)  # float64 stays
    w_M1 = w_M.to(acc).unsqueeze(1)
    da_MI = (du_MI.to(acc) * w_M1).to(du_MI.dtype)
    a_MI, dh_M2I = _swiglu_grads(h_M2I, da_MI, dh_out=dh_out, a_out=a_out)
    gw_M = (du_MI.to(acc) * a_MI.to(acc)).sum(1)
    a_MI.copy_(a_MI.to(acc) * w_M1)  # dW2 = sum of g^T (w a)
    return a_MI, dh_M2I, gw_M


def _swiglu_grads(h_M2I, da_MI, dh_out=None, a_out=None):
    """(a, dh = [dgate | dup]) of a = silu(gate) * up with the torch ops (a recomputed: the wgrad of
    w2 needs it)."""
    gate, up = h_M2I.chunk(2, dim=-1)
    I = gate.shape[-1]
    silu = F.silu(gate)
    a_MI = torch.mul(silu, up, out=a_out) if a_out is not None else silu * up
    dh_M2I = torch.empty_like(h_M2I) if dh_out is None else dh_out  # [dgate | dup], each written in place
    torch.mul(da_MI, silu, out=dh_M2I[:, I:])
    torch.ops.aten.silu_backward.grad_input(da_MI * up, gate, grad_input=dh_M2I[:, :I])  # one fused kernel
    return a_MI, dh_M2I


def expert_wgrad(job: WgradJob):
    """(dw1 [E, 2I, D], dw2 [E, D, I]) of one job."""
    dw1 = _gmm_wgrad(job.dh_M2I, job.x_MD, job.tpe, job.grouped, job.num_experts)
    dw2 = _gmm_wgrad(job.g_MD, job.a_MI, job.tpe, job.grouped, job.num_experts)
    return dw1, dw2


class WgradStore:
    """Queued weight-gradient work; `backward_dw()` runs it and accumulates into the weights' .grad."""

    def __init__(self):
        self.jobs: list[tuple[torch.Tensor, torch.Tensor, WgradJob]] = []

    def __len__(self):
        return len(self.jobs)

    @torch.no_grad()
    def backward_dw(self):
        jobs, self.jobs = self.jobs, []
        for w1, w2, job in jobs:
            for w, dw in zip((w1, w2), expert_wgrad(job)):
                dw = dw.to(w.dtype)
                if w.grad is None:
                    w.grad = dw
                else:
                    w.grad += dw


class SwiGLUExperts(torch.autograd.Function):
    """y = SwiGLU experts(x) over expert-grouped rows, with optional delayed wgrad (see module doc)."""

    @staticmethod
    def forward(ctx, x_MD, w1_E2ID, w2_EDI, tpe, mode, wgrad_store):
        y_MD, (x, h, tpe, grouped) = expert_forward(x_MD, tpe, w1_E2ID, w2_EDI, mode)
        ctx.save_for_backward(x, h, w1_E2ID, w2_EDI)
        ctx.tpe, ctx.grouped, ctx.store = tpe, grouped, wgrad_store
        return y_MD

    @staticmethod
    def backward(ctx, g_MD):
        x, h, w1, w2 = ctx.saved_tensors
        dx, job = expert_dgrad(g_MD.contiguous(), (x, h, ctx.tpe, ctx.grouped), w1, w2)
        if ctx.store is not None:
            ctx.store.jobs.append((w1, w2, job))
            return dx, None, None, None, None, None
        dw1, dw2 = expert_wgrad(job)
        return dx, dw1, dw2, None, None, None


def swiglu_experts(x_MD, tokens_per_expert_E, w1_E2ID, w2_EDI, *, wgrad_store: WgradStore | None = None,
                   mode="auto"):
    """Autograd entry point. `tokens_per_expert_E`: a device tensor (one host sync for the loop
    path) or a `TokensPerExpert`. With `wgrad_store`, the weights' gradients arrive only when
    `wgrad_store.backward_dw()` is called (they must be leaf tensors, e.g. parameters)."""
    tpe = tokens_per_expert_E
    if not isinstance(tpe, TokensPerExpert):
        tpe = TokensPerExpert(tpe, tpe.tolist())
    return SwiGLUExperts.apply(x_MD, w1_E2ID, w2_EDI, tpe, mode, wgrad_store)
