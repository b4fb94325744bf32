"""Chunked expert-parallel dispatch/combine: all_to_all overlapped with the expert GEMMs.

Same function as `baselines/moe_dispatch.py:all_to_all_dispatch` (the no-chunk twin): experts
sharded over `experts.ep_group`, dropless. The layer's N local tokens are split into C chunks
(`chunks=C`, default 2, or a sequence of relative sizes for unequal chunks). One count exchange
for all chunks up front (the one host sync), then a pipeline, on CUDA with communication on its
own stream ("comm", one per device) ordered against the compute stream by events:

  forward   compute: P(all chunks) | E0 | E1 | E2 ...      | U0 U1 U2 ...
            comm   :             D0 D1 C0 D2 C1 D3 C2 C3 ...
  backward  compute: G(all) | dX0 | dX1 | dX2 ... | W(all chunks) | S0 S1 ...
            comm   :       B0 B1 A0 B2 A1 B3 A2 ... A_last
  P permute, D dispatch all_to_all, E experts (grouped GEMMs), C combine all_to_all, U weight and
  add back; G gradient of the weighting, B combine-backward, dX expert dgrad, A dispatch-backward,
  W the expert wgrad of every chunk (delayed: it runs after the last dgrad, while the tail A runs),
  S scatter-add of the input gradient.
Chunk i+1's dispatch and chunk i-1's combine run while chunk i's experts compute. The expert math
comes from `kernels/expert_gemm.py` (dgrad/wgrad split). On the CPU (gloo) there are no
streams: the same chunk schedule runs in issue order, sequentially.

The whole layer is one autograd function whose tensors go through `save_for_backward`, so it runs
inside `torch.utils.checkpoint` (the recomputed forward repeats the same collectives on every rank).

Chunk count: chunks that hold no token on any rank are dropped (so C > N clamps to the tokens
available; every rank drops the same chunks, from the token counts in the count exchange).
Errors: ranks that disagree on expert count, top-k, width or chunking fail on the first call (a
fixed-size all_gather, then the same ValueError on every rank); bad local inputs (shapes, expert
ids out of range) travel in the count exchange's header, so every rank raises and none hangs.

Shape legend: N tokens, K experts per token, M routed copies, D model width, E experts, EP ranks,
L = E/EP local experts, R rows received, I expert width, C chunks.
"""
from __future__ import annotations


import weakref

import torch
import torch.distributed as dist

from bumblebee.distributed import agree_once
from bumblebee.kernels.expert_gemm import (TokensPerExpert, expert_dgrad, expert_forward, expert_wgrad,
                                           use_grouped_mm)
from bumblebee.registry import register

_AGREED = weakref.WeakKeyDictionary()  # experts -> the config its first-call agreement check passed
_COMM_STREAMS: dict = {}
_HEAD = 5  # header words per message: local token count, bad-shape flag, bad-index flag, E, chunking


def chunk_bounds(n: int, spec: tuple) -> list:
    """Token boundaries [0, b1, ..., n] of the chunks: floor(n * cumulative share)."""
    total, acc, out = sum(spec), 0, [0]
    for s in spec:
        acc += s
        out.append(n * acc // total)
    return out


def _chunk_spec(chunks) -> tuple:
    if chunks is None:
        return (1, 1)
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        return (1,) * chunks
    spec = tuple(int(c) for c in chunks)
    if not spec or min(spec) < 1 or any(int(c) != c for c in chunks):
        raise ValueError(f"chunks must be an int >= 1 or a sequence of positive integer relative sizes, got {chunks}")
    return spec


def _spec_word(spec: tuple) -> int:
    return hash(spec) & 0xFFFFFFFF


class _Schedule:
    """Compute stream = the current stream; comm = one extra stream per device. CPU: no-ops."""

    def __init__(self, device, group):
        self.cuda = device.type == "cuda" and group is not None
        self.group = group
        self.keep = []  # buffers touched by the comm side, held until compute has waited for it
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in _COMM_STREAMS:
                _COMM_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)
            self.comm = _COMM_STREAMS[idx]

    def all_to_all(self, x, out_splits, in_splits):
        """Issue x's exchange on the comm stream after the compute work issued so far; returns
        (output, event). The output is allocated here on the compute stream's pool and kept alive."""
        if self.group is None:
            return x, None
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if not self.cuda:
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
            return out, None
        self.keep += [x, out]
        self.comm.wait_stream(self.compute)
        with torch.cuda.stream(self.comm):
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
            x.record_stream(self.comm)
            out.record_stream(self.comm)
        ev = torch.cuda.Event()
        ev.record(self.comm)
        return out, ev

    def wait(self, ev):
        if ev is not None:
            self.compute.wait_event(ev)

    def finish(self):
        if self.cuda:
            self.compute.wait_stream(self.comm)
        self.keep.clear()


def _exchange_counts(x_ND, weights_NK, indices_NK, E, spec, group, EP):
    """Sorted copy order, and the host view of every chunk's splits (the one host sync)."""
    N, K = indices_NK.shape
    L, C = E // EP, len(spec)
    shape_bad = x_ND.dim() != 2 or x_ND.shape[0] != N or weights_NK.shape != (N, K)
    flat_M = indices_NK.reshape(-1)
    bad_idx = ((flat_M < 0) | (flat_M >= E)).any()
    flat_M = flat_M.clamp(0, E - 1)
    bounds = chunk_bounds(N, spec)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    dev = flat_M.device
    chunk_M = torch.repeat_interleave(torch.arange(C, device=dev), torch.tensor(sizes, device=dev) * K,
                                      output_size=N * K)
    key_M = chunk_M * E + flat_M  # chunks are contiguous in token order: sorting by key keeps them apart
    order_M = torch.argsort(key_M, stable=True)
    counts_RCL = torch.bincount(key_M, minlength=C * E).view(C, EP, L).transpose(0, 1)
    word = lambda v: torch.full((), v, device=dev, dtype=torch.int64)  # noqa: E731
    head = torch.stack([word(N), word(int(shape_bad)), bad_idx.to(torch.int64), word(E), word(_spec_word(spec))])
    msg = torch.cat([head.expand(EP, _HEAD), counts_RCL.reshape(EP, C * L)], dim=1)
    if group is None:
        recv = msg
    else:
        recv = torch.empty_like(msg)
        dist.all_to_all_single(recv, msg, group=group)
    host = torch.cat([msg.reshape(-1), recv.reshape(-1)]).tolist()  # the one host sync
    W = _HEAD + C * L
    sent = [host[r * W:(r + 1) * W] for r in range(EP)]
    got = [host[EP * W + s * W:EP * W + (s + 1) * W] for s in range(EP)]
    for s, row in enumerate(got):
        if row[3] != E or row[4] != _spec_word(spec):  # changed after the first-call check, same message size
            raise ValueError(f"ranks of the ep group disagree on num_experts or chunks: rank {s} has "
                             f"E={row[3]}, chunking {row[4]:#x}; this rank E={E}, chunking {_spec_word(spec):#x}")
        if row[1] or row[2]:
            what = "inputs of mismatched shapes" if row[1] else f"expert indices outside [0, {E})"
            if s == (dist.get_rank(group) if group is not None else 0) and row[1]:
                what += (f": x {tuple(x_ND.shape)}, weights {tuple(weights_NK.shape)}, "
                         f"indices {tuple(indices_NK.shape)}")
            raise ValueError(f"moe_dispatch: rank {s} of the ep group passed {what}")
    # A chunk that is empty on every rank is dropped by every rank alike (clamps C to the tokens).
    active = [c for c in range(C) if any(b[c + 1] > b[c] for b in (chunk_bounds(row[0], spec) for row in got))]
    plan = []
    for c in active:
        recv_SL = [row[_HEAD + c * L:_HEAD + (c + 1) * L] for row in got]
        plan.append(dict(
            copies=(bounds[c] * K, bounds[c + 1] * K),
            in_splits=[sum(row[_HEAD + c * L:_HEAD + (c + 1) * L]) for row in sent],
            out_splits=[sum(r) for r in recv_SL],
            tpe=[sum(r[e] for r in recv_SL) for e in range(L)],
            recv_SL=recv[:, _HEAD + c * L:_HEAD + (c + 1) * L],
        ))
    return order_M, plan


def _regroup_perm(recv_SL, rows: int):
    """Row permutation from (source, expert) order to (expert, source) order; no host sync."""
    EP, L = recv_SL.shape
    expert_of_segment = torch.arange(L, device=recv_SL.device).repeat(EP)
    return torch.argsort(torch.repeat_interleave(expert_of_segment, recv_SL.reshape(-1), output_size=rows),
                         stable=True)


class _ChunkedEP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, weights_NK, w1_L2ID, w2_LDI, indices_NK, E, spec, group, mode):
        EP = dist.get_world_size(group) if group is not None else 1
        order_M, plan = _exchange_counts(x_ND, weights_NK, indices_NK, E, spec, group, EP)
        K = indices_NK.shape[1]
        w_M = weights_NK.reshape(-1)[order_M]
        sched = _Schedule(x_ND.device, group)
        out_ND = torch.zeros_like(x_ND)
        tok, xs, disp = [], [], []
        for p in plan:  # P: permute every chunk's copies (cheap gathers) first
            tok.append(order_M[p["copies"][0]:p["copies"][1]] // K)
            xs.append(x_ND[tok[-1]])
        perms, tpes, saved, comb = [], [], [], []
        if plan:
            disp.append(sched.all_to_all(xs[0], plan[0]["out_splits"], plan[0]["in_splits"]))
        for c, p in enumerate(plan):
            if c + 1 < len(plan):  # next chunk's dispatch goes ahead of this chunk's combine on comm
                q = plan[c + 1]
                disp.append(sched.all_to_all(xs[c + 1], q["out_splits"], q["in_splits"]))
            x_RD, ev = disp[c]
            sched.wait(ev)
            R = sum(p["out_splits"])
            perm_R = _regroup_perm(p["recv_SL"], R)
            tpe = TokensPerExpert(p["recv_SL"].sum(0), p["tpe"])
            y_RD, (x_e, h_e, _, _) = expert_forward(x_RD[perm_R], tpe, w1_L2ID, w2_LDI, mode)
            y_RD = torch.empty_like(y_RD).index_copy_(0, perm_R, y_RD)
            comb.append(sched.all_to_all(y_RD, p["in_splits"], p["out_splits"]))
            perms.append(perm_R)
            tpes.append(tpe.device)
            saved += [x_e, h_e]
        ys = []
        for c, p in enumerate(plan):  # U: weight and add back, as each combine lands
            y_MD, ev = comb[c]
            sched.wait(ev)
            a, b = p["copies"]
            out_ND.index_add_(0, tok[c], (y_MD * w_M[a:b].unsqueeze(-1)).to(x_ND.dtype))
            ys.append(y_MD)
        sched.finish()
        ctx.plan, ctx.K, ctx.group = plan, K, group
        ctx.grouped = use_grouped_mm(x_ND, w1_L2ID, w2_LDI, mode)
        ctx.n = len(plan)
        ctx.save_for_backward(order_M, weights_NK, w1_L2ID, w2_LDI, *perms, *tpes, *saved, *ys)
        return out_ND

    @staticmethod
    def backward(ctx, g_ND):
        n, plan, K = ctx.n, ctx.plan, ctx.K
        order_M, weights_NK, w1, w2, *rest = ctx.saved_tensors
        perms, tpes, saved, ys = rest[:n], rest[n:2 * n], rest[2 * n:4 * n], rest[4 * n:]
        g_ND = g_ND.contiguous()
        sched = _Schedule(g_ND.device, ctx.group)
        w_M = weights_NK.reshape(-1)[order_M]
        gw_M = torch.zeros_like(w_M)
        gs, tok = [], []
        for c, p in enumerate(plan):  # G: gradient of the weighting, per copy
            a, b = p["copies"]
            tok.append(order_M[a:b] // K)
            y_MD = ys[c]
            g_MD = g_ND[tok[-1]].to(torch.promote_types(y_MD.dtype, w_M.dtype))
            gw_M[a:b] = (g_MD * y_MD).sum(-1).to(w_M.dtype)
            gs.append((g_MD * w_M[a:b].unsqueeze(-1)).to(y_MD.dtype))
        cb, db, jobs = [], [], []
        if plan:
            cb.append(sched.all_to_all(gs[0], plan[0]["out_splits"], plan[0]["in_splits"]))
        for c, p in enumerate(plan):
            if c + 1 < n:
                q = plan[c + 1]
                cb.append(sched.all_to_all(gs[c + 1], q["out_splits"], q["in_splits"]))
            g_RD, ev = cb[c]
            sched.wait(ev)
            tpe = TokensPerExpert(tpes[c], p["tpe"])
            grouped = ctx.grouped
            dx_e, job = expert_dgrad(g_RD[perms[c]], (saved[2 * c], saved[2 * c + 1], tpe, grouped), w1, w2)
            jobs.append(job)
            dx_RD = torch.empty_like(dx_e).index_copy_(0, perms[c], dx_e)
            db.append(sched.all_to_all(dx_RD, p["in_splits"], p["out_splits"]))
        # W: every chunk's wgrad after the last dgrad, while the tail dispatch-backward runs
        # (per-chunk GEMMs summed in the weights' dtype: C - 1 weight-sized adds; the inputs of every
        # chunk's wgrad stay alive until here, R x (3I + D) elements in all)
        dw1 = dw2 = None
        for job in jobs:
            a1, a2 = expert_wgrad(job)
            dw1, dw2 = (a1, a2) if dw1 is None else (dw1.add_(a1), dw2.add_(a2))
        if dw1 is None:
            dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
        gx_ND = torch.zeros_like(g_ND)
        for c in range(n):  # S: scatter the input gradient as each dispatch-backward lands
            dx_MD, ev = db[c]
            sched.wait(ev)
            gx_ND.index_add_(0, tok[c], dx_MD.to(gx_ND.dtype))
        sched.finish()
        gw_NK = torch.zeros_like(gw_M).index_copy_(0, order_M, gw_M).view_as(weights_NK)
        return gx_ND, gw_NK, dw1, dw2, None, None, None, None, None


@register("moe_dispatch", "chunked", kind="primitive", twin="all_to_all")
def chunked_dispatch(x_ND, weights_NK, indices_NK, experts, num_experts, *, chunks=None):
    """Expert parallel over experts.ep_group in C chunks: all_to_all overlapped with expert GEMMs."""
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
        raise TypeError("chunked dispatch computes the SwiGLU experts itself: `experts` must hold "
                        "gate_up_proj [L, 2I, D] and down_proj [L, D, I] (GroupedExperts does)")
    group = getattr(experts, "ep_group", None)
    EP = dist.get_world_size(group) if group is not None else 1
    group = group if EP > 1 else None
    spec = _chunk_spec(chunks)
    K = indices_NK.shape[1] if indices_NK.dim() == 2 else -1
    agree_once(experts, group, x_ND.device, {
        "impl (all_to_all=1, chunked=2)": 2, "num_experts": num_experts, "ep size": EP, "top_k": K,
        "model width": x_ND.shape[-1] if x_ND.dim() == 2 else -1, "chunk count": len(spec),
        "chunk sizes": _spec_word(spec)}, _AGREED)
    if num_experts % EP:
        raise ValueError(f"num_experts={num_experts} is not divisible by the ep group size {EP}")
    if indices_NK.dim() != 2:
        raise ValueError(f"indices must be [N, K], got shape {tuple(indices_NK.shape)}")
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if w1.shape[0] != num_experts // EP or w2.shape[0] != num_experts // EP:
        raise ValueError(f"experts hold {w1.shape[0]} experts; expected num_experts / ep size = {num_experts // EP}")
    w1, w2 = w1.to(x_ND.dtype), w2.to(x_ND.dtype)
    mode = getattr(experts, "grouped_mm", "auto")
    return _ChunkedEP.apply(x_ND, weights_NK, w1, w2, indices_NK, num_experts, spec, group, mode)
