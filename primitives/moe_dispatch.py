"""Chunked expert-parallel dispatch/combine: all_to_all overlapped with the expert GEMMs.

Same function as `baselines/moe_dispatch.py:all_to_all_dispatch` (the no-chunk twin): experts
sharded over `experts.ep_group`, dropless. The layer's N local tokens are split into C chunks
(`chunks=C`, or a sequence of relative sizes for unequal chunks; default "auto": two chunks of
relative sizes (1, 2), the first one third of the tokens, where the ep group's largest token count
is >= auto_min_tokens for the ep size, else one chunk, decided alike on every rank from the count
exchange). One count exchange for all chunks up front (the one host sync; the plan every rank
derives from it: `primitives/moe_dispatch_plan.py`), then a pipeline, on
CUDA with communication on its own stream ("comm", one per device) ordered against the compute stream by events:

  forward   compute: P0 P1 | E0 | P2 E1 | P3 E2 ...      | U0 U1 U2 ...
            comm   :  D0   D1 C0   D2 C1   D3 C2 C3 ...
  backward  compute: G0 G1 | dX0 | G2 dX1 | G3 dX2 ... | W(all chunks) | S0 S1 ...
            comm   :  B0   B1 A0   B2 A1    B3 A2 ... A_last
  P gather a chunk's copies, D dispatch all_to_all, E experts (grouped GEMMs), C combine
  all_to_all, U weight and sum each token's K copies; G gradient of the weighting, B
  combine-backward, dX expert dgrad, A dispatch-backward, W the expert wgrad of every chunk
  (delayed: it runs after the last dgrad, while the tail A runs), S sum of each token's K
  input-gradient copies.
Chunk i+1's dispatch and chunk i-1's combine run while chunk i's experts compute; chunk 0's
dispatch starts right after its own gather. The expert math comes from `kernels/moe_dispatch_expert_gemm.py`
(dgrad/wgrad split); the permutation is the primitive's own (`kernels/moe_dispatch_fused_permute.py` and
`kernels/moe_dispatch_regroup.py`, their algorithms in torch where they do not run, and the row
bookkeeping of `primitives/moe_dispatch_rows.py`: a counting sort off CUDA), not the twin's: every
un-permute is a gather and a sum over K, no atomics, deterministic. Chunks are contiguous token
ranges and the copies sort by chunk * E + expert, so chunk c's copies are one range of the sorted
order and U/S write disjoint rows of the output. On the CPU (gloo) there are no streams: the same
chunk schedule runs in issue order, sequentially. Options: `ChunkedDispatch`
(`primitives/moe_dispatch_options.py`). `fused_permute` runs U, G and S as fused Triton kernels on
CUDA (`kernels/moe_dispatch_fused_permute.py`: gather, weight and sum in one pass) and builds the row indices
after the count exchange in one launch (`kernels/moe_dispatch_regroup.py`); `fused_swiglu`
the experts' SwiGLU elementwise (`kernels/moe_dispatch_swiglu.py`). Chunk 0's gather P0 is
issued before the count exchange's host sync, so the GPU works while the host waits, and chunk 0's
dispatch before the row indices are built, so the host builds them while it runs. With one chunk the
exchanges that nothing can overlap run inline on the compute stream. `sm_carveout`
leaves that many SMs to NCCL during the overlapped GEMMs.

Delayed wgrad of C > 1 chunks, chosen per call from host-known row counts (`_wgrad_by_gather`):
either every chunk's wgrad inputs are written into chunk-major buffers (x in the forward, dh, a and
g with each chunk's dgrad), regrouped by expert with one gather each and one GEMM per weight runs,
or one GEMM per chunk plus C - 1 weight-sized adds; whichever moves fewer bytes.

The whole layer is one autograd function whose tensors go through `save_for_backward`, so it runs
inside `torch.utils.checkpoint` (the recomputed forward repeats the same collectives on every rank).
Under the models' full recompute (`bumblebee.recompute` phases, `fused_recompute`) with an ep group, both
passes send each row's routing weight with it and save the experts' x, h and weights instead of
the combined outputs; the recompute then stops after fc1 (no fc2, combine or un-permute; its output
is zeros and discarded), and the backward weights the rows on the expert side
(`expert_dgrad_weighted`), returning the weights' gradient by one more small exchange per chunk.
Without an ep group it runs `primitives/moe_dispatch_local.py` instead: nothing saved per routed row,
the backward walks the experts in groups (memory, not overlap, decides at one rank).

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
from bumblebee.kernels.moe_dispatch_expert_gemm import (TokensPerExpert, WgradJob, expert_dgrad, expert_dgrad_weighted,
                                           expert_forward, expert_wgrad, use_grouped_mm)
from bumblebee.options import Bound
from bumblebee.primitives.moe_dispatch_local import LocalGroupedExperts
from bumblebee.primitives.moe_dispatch_options import (TRITON_KERNELS, ChunkedDispatch, chunk_spec, fused_recompute_phase,
                                                       min_tokens, permute_fns, sm_carveout, swiglu_fns)
from bumblebee.primitives.moe_dispatch_plan import exchange_counts, spec_word
from bumblebee.primitives.moe_dispatch_rows import expert_major_rows
from bumblebee.registry import needs_triton, register

_AGREED = weakref.WeakKeyDictionary()  # experts -> the config its first-call agreement check passed
_COMM_STREAMS: dict = {}


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

    def all_to_all(self, x, out_splits, in_splits, inline=False):
        """Issue x's exchange on the comm stream after the compute work issued so far; returns
        (output, event). The output is allocated here on the compute stream's pool and kept alive.
        inline: on the compute stream, for an exchange nothing can overlap (one chunk): the stream
        hand-over costs host time, and a small step is bound by the host."""
        if self.group is None:
            return x, None
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if inline or not self.cuda:
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


def _chunk_positions(inv_M, a, b):
    """Sorted positions of the copies a..b (one chunk, token order) relative to the chunk's start."""
    return inv_M[a:b] - a if a else inv_M[a:b]


def _wgrad_by_gather(plan, D, I, L, mode: str) -> bool:
    """Delayed wgrad of several chunks: one GEMM per weight over every chunk's rows gathered into one
    expert-major buffer (moves 2 R (2D + 3I) elements), or one GEMM per chunk and C - 1 weight-sized
    adds (each extra chunk: one more [L, 3I, D] GEMM output plus an add, 4 x 3 L I D elements).
    Picked by the element count from the host-known row count (`ChunkedDispatch.wgrad` "gather" | "add"
    overrides)."""
    if mode != "auto":
        return mode == "gather"
    R = plan[-1]["rows"][1] if plan else 0
    return 2 * R * (2 * D + 3 * I) < 4 * (len(plan) - 1) * 3 * L * I * D


class _ChunkedEP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, weights_NK, w1_L2ID, w2_LDI, indices_NK, E, spec, group, mode, auto, cfg):
        ctx.permute = permute_fns(cfg, x_ND)  # one function set for the forward and its backward
        ctx.swiglu = swiglu_fns(cfg, x_ND)  # one set for the forward and its backward
        ctx.cfg = cfg
        EP = dist.get_world_size(group) if group is not None else 1
        K = indices_NK.shape[1]
        # inside a recompute region: the weighting's backward on the expert side, so that the
        # recompute can skip fc2 and the combine (see fused_recompute_phase)
        phase = fused_recompute_phase(cfg)
        fused, skip = phase is not None, phase == "recompute"

        def first_gather(order_M, copy_bounds):  # chunk 0's P, issued before the host sync
            return x_ND.index_select(0, order_M[copy_bounds[0]:copy_bounds[1]] // K)
        order_M, inv_M, plan, recv_CSL, x0 = exchange_counts(
            x_ND, weights_NK, indices_NK, E, spec, group, EP, min_tokens(cfg, EP), early=first_gather, auto=auto)
        one = len(plan) == 1  # nothing to overlap: the exchanges run inline on the compute stream
        token_M = None if one and x0 is not None else order_M // K
        sched = _Schedule(x_ND.device, group)
        out_ND = torch.empty_like(x_ND)  # every token is in an active chunk: all rows get written
        w_acc = torch.promote_types(weights_NK.dtype, torch.float32)  # fp32, float64 for float64 weights
        w_sorted_M = weights_NK.reshape(-1).to(w_acc).index_select(0, order_M) if fused else None

        def dispatch(p):  # P: gather the chunk's copies, then D: send them (and their weights)
            a, b = p["copies"]
            x_MD = x0 if p["chunk"] == 0 and x0 is not None else x_ND.index_select(0, token_M[a:b])
            x_RD, ev = sched.all_to_all(x_MD, p["out_splits"], p["in_splits"], inline=one)
            if not fused:
                return x_RD, None, ev
            w_R, ev = sched.all_to_all(w_sorted_M[a:b], p["out_splits"], p["in_splits"], inline=one)  # after x
            return x_RD, w_R, ev

        L, I2, D = w1_L2ID.shape
        gather = len(plan) > 1 and _wgrad_by_gather(plan, D, I2 // 2, L, cfg.wgrad)
        R = plan[-1]["rows"][1] if plan else 0
        # gather mode: every chunk's wgrad x lands in one chunk-major buffer, regrouped by expert for the wgrad
        x_cm = x_ND.new_empty(R, D) if gather else torch.empty(0, device=x_ND.device)
        disp = [dispatch(plan[0])] if plan else []
        # every chunk's (source, expert) -> (expert, source) rows, tokens per expert and offsets, built
        # after the first dispatch is issued: the host works while the exchange runs
        dest_R, src_R, counts_CL, offs_CL = ctx.permute[3](recv_CSL, [p["rows"][1] - p["rows"][0] for p in plan])
        overlap = sched.cuda and len(plan) > 1  # GEMMs run next to NCCL kernels
        xs, hs, ws, comb = [], [], [], []
        for c, p in enumerate(plan):
            if c + 1 < len(plan):  # next chunk's dispatch goes ahead of this chunk's combine on comm
                disp.append(dispatch(plan[c + 1]))
            x_RD, w_R, ev = disp[c]
            sched.wait(ev)
            r0, r1 = p["rows"]
            dest, src = dest_R[r0:r1], src_R[r0:r1]
            tpe = TokensPerExpert(counts_CL[c], p["tpe"], offs_CL[c])
            x_e = torch.index_select(x_RD, 0, src, out=x_cm[r0:r1]) if gather else x_RD.index_select(0, src)
            with sm_carveout(cfg, overlap, x_ND.device, EP):
                y_e, (x_e, h_e, _, _) = expert_forward(x_e, tpe, w1_L2ID, w2_LDI, mode, swiglu=ctx.swiglu[0],
                                                       fc2=not skip)
            if not skip:
                comb.append(sched.all_to_all(y_e.index_select(0, dest), p["in_splits"], p["out_splits"], inline=one))
            if not gather:
                xs.append(x_e)
            if fused:
                ws.append(w_R.index_select(0, src))
            hs.append(h_e)
        ys = []
        for c, (y_MD, ev) in enumerate(comb):  # U: weight and sum each token's copies, as each combine lands
            sched.wait(ev)
            (t0, t1), (a, b) = plan[c]["tokens"], plan[c]["copies"]
            ctx.permute[0](y_MD, weights_NK[t0:t1], _chunk_positions(inv_M, a, b), out=out_ND[t0:t1])
            ys.append(y_MD)
        sched.finish()
        if skip:  # the recompute's output is discarded (recompute.py); zeros rather than stale memory
            out_ND.zero_()
        ctx.plan, ctx.K, ctx.group, ctx.EP = plan, K, group, EP
        ctx.grouped = use_grouped_mm(x_ND, w1_L2ID, w2_LDI, mode)
        ctx.n, ctx.gather, ctx.fused = len(plan), gather, fused
        # fused: the experts' routing weights instead of the combined outputs (same set in both passes)
        ctx.save_for_backward(order_M, inv_M, weights_NK, w1_L2ID, w2_LDI, dest_R, src_R, counts_CL, offs_CL, x_cm,
                              *hs, *(ws if fused else ys), *xs)
        return out_ND

    @staticmethod
    def backward(ctx, g_ND):
        n, plan, K = ctx.n, ctx.plan, ctx.K
        unpermute_grads_fn, sum_copies_fn = ctx.permute[1:3]
        order_M, inv_M, weights_NK, w1, w2, dest_R, src_R, counts_CL, offs_CL, x_cm, *rest = ctx.saved_tensors
        hs, mid, xs = rest[:n], rest[n:2 * n], rest[2 * n:]
        ys, ws = (None, mid) if ctx.fused else (mid, None)  # combined outputs, or the experts' row weights
        g_ND = g_ND.contiguous()
        sched = _Schedule(g_ND.device, ctx.group)
        token_M = order_M // K
        need_w = ctx.needs_input_grad[1]
        w_sorted_M = None if ctx.fused else weights_NK.reshape(-1).index_select(0, order_M)  # fused: experts weight
        gws = []  # the routing weights' gradient per chunk (fp32 at least), sorted order (chunks are in order)

        def weighting_grad(c, p):  # G: gradient of the weighting, then B: send it back to the experts
            a, b = p["copies"]
            inline = n == 1  # the dgrad waits for it: nothing to overlap
            if ctx.fused:  # the experts weight it and compute gw
                return sched.all_to_all(g_ND.index_select(0, token_M[a:b]), p["out_splits"], p["in_splits"],
                                        inline=inline)
            g_MD, gw = unpermute_grads_fn(g_ND, ys[c], w_sorted_M[a:b], token_M[a:b], need_w)
            if need_w:
                gws.append(gw)
            return sched.all_to_all(g_MD, p["out_splits"], p["in_splits"], inline=inline)

        L = w1.shape[0]
        gather = ctx.gather
        overlap = sched.cuda and n > 1
        if gather:  # the other wgrad inputs of every chunk, written chunk-major as they appear
            R = x_cm.shape[0]
            I = w2.shape[-1]
            g_cm, dh_cm, a_cm = (x_cm.new_empty(R, w) for w in (x_cm.shape[1], 2 * I, I))
        cb = [weighting_grad(0, plan[0])] if plan else []
        db, gb, jobs = [], [], []
        for c, p in enumerate(plan):
            if c + 1 < n:
                cb.append(weighting_grad(c + 1, plan[c + 1]))
            g_RD, ev = cb[c]
            sched.wait(ev)
            r0, r1 = p["rows"]
            dest, src = dest_R[r0:r1], src_R[r0:r1]
            tpe = TokensPerExpert(counts_CL[c], p["tpe"], offs_CL[c])
            g_e = torch.index_select(g_RD, 0, src, out=g_cm[r0:r1]) if gather else g_RD.index_select(0, src)
            saved = (None if gather else xs[c], hs[c], tpe, ctx.grouped)
            outs = dict(dh_out=dh_cm[r0:r1], a_out=a_cm[r0:r1]) if gather else {}
            with sm_carveout(ctx.cfg, overlap, g_ND.device, ctx.EP):
                if ctx.fused:
                    dx_e, gw_e, job = expert_dgrad_weighted(g_e, saved, w1, w2, ws[c],
                                                            swiglu_grads_weighted=ctx.swiglu[2], **outs)
                else:
                    dx_e, job = expert_dgrad(g_e, saved, w1, w2, swiglu_grads=ctx.swiglu[1], **outs)
            if not gather:
                jobs.append(job)
            db.append(sched.all_to_all(dx_e.index_select(0, dest), p["in_splits"], p["out_splits"]))
            if ctx.fused:  # every rank exchanges gw, needed or not: the collectives stay in step
                gb.append(sched.all_to_all(gw_e.index_select(0, dest), p["in_splits"], p["out_splits"]))
        # W: the wgrad of every chunk after the last dgrad, while the tail dispatch-backward runs
        if gather:  # regroup the chunk-major buffers by expert (gathers), one GEMM per weight
            tpe = TokensPerExpert(counts_CL.sum(0), [sum(col) for col in zip(*(p["tpe"] for p in plan))])
            src2_R = expert_major_rows(counts_CL, R)
            jobs = [WgradJob(*(t.index_select(0, src2_R) for t in (x_cm, dh_cm, a_cm, g_cm)), tpe, ctx.grouped, L)]
            del g_cm, dh_cm, a_cm
        dw1 = dw2 = None
        for job in jobs:
            with sm_carveout(ctx.cfg, overlap, g_ND.device, ctx.EP):  # next to the tail dispatch-backward
                a1, a2 = expert_wgrad(job)
            dw1, dw2 = (a1, a2) if dw1 is None else (dw1.add_(a1), dw2.add_(a2))
        if dw1 is None:
            dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
        gx_ND = torch.empty_like(g_ND)
        for c, p in enumerate(plan):  # S: sum each token's input-gradient copies as each dispatch-backward lands
            dx_MD, ev = db[c]
            sched.wait(ev)
            (t0, t1), (a, b) = p["tokens"], p["copies"]
            sum_copies_fn(dx_MD, _chunk_positions(inv_M, a, b), K, out=gx_ND[t0:t1])
            if ctx.fused and need_w:
                gw_R, ev = gb[c]
                sched.wait(ev)
                gws.append(gw_R)
        sched.finish()
        gw_NK = None
        if need_w:
            gw_M = gws[0] if len(gws) == 1 else torch.cat(gws) if gws else g_ND.new_empty(
                0, dtype=torch.promote_types(weights_NK.dtype, torch.float32))
            gw_NK = gw_M.index_select(0, inv_M).view_as(weights_NK).to(weights_NK.dtype)
        return gx_ND, gw_NK, dw1, dw2, None, None, None, None, None, None, None


@register("moe_dispatch", "chunked", kind="primitive", twin="all_to_all", default=True, config=ChunkedDispatch,
          falls_back=needs_triton(*TRITON_KERNELS))
def chunked_dispatch_with(config: ChunkedDispatch, x_ND, weights_NK, indices_NK, experts, num_experts, *, chunks=None):
    """Expert parallel over experts.ep_group in C chunks: all_to_all overlapped with expert GEMMs
    (`chunks` overrides config.chunks)."""
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
        raise TypeError("chunked dispatch computes the SwiGLU experts itself: `experts` must hold "
                        "gate_up_proj [L, 2I, D] and down_proj [L, D, I] (GroupedExperts does)")
    group = getattr(experts, "ep_group", None)
    EP = dist.get_world_size(group) if group is not None else 1
    group = group if EP > 1 else None
    spec, auto = chunk_spec(config.chunks if chunks is None else chunks)
    K = indices_NK.shape[1] if indices_NK.dim() == 2 else -1
    agree_once(experts, group, x_ND.device, {
        "impl (all_to_all=1, chunked=2)": 2, "num_experts": num_experts, "ep size": EP, "top_k": K,
        "model width": x_ND.shape[-1] if x_ND.dim() == 2 else -1, "chunk count": len(spec),
        "chunk sizes": spec_word(spec, auto)}, _AGREED)
    if num_experts % EP:
        raise ValueError(f"num_experts={num_experts} is not divisible by the ep group size {EP}")
    if indices_NK.dim() != 2:
        raise ValueError(f"indices must be [N, K], got shape {tuple(indices_NK.shape)}")
    L = experts.gate_up_proj.shape[0]
    if L != num_experts // EP or experts.down_proj.shape[0] != num_experts // EP:
        raise ValueError(f"experts hold {L} experts; expected num_experts / ep size = {num_experts // EP}")
    mode = getattr(experts, "grouped_mm", "auto")

    phase = fused_recompute_phase(config)

    def run(w1, w2):  # inside the experts' forward: FSDP2 has unsharded w1, w2 here
        w1, w2 = w1.to(x_ND.dtype), w2.to(x_ND.dtype)
        if group is None and phase is not None:  # one rank under recompute: grouped, nothing saved
            return LocalGroupedExperts.apply(x_ND, weights_NK, w1, w2, indices_NK, num_experts, phase, mode,
                                             config.group_rows, config.forward_group_rows, permute_fns(config, x_ND),
                                             swiglu_fns(config, x_ND))
        return _ChunkedEP.apply(x_ND, weights_NK, w1, w2, indices_NK, num_experts, spec, group, mode, auto, config)
    if getattr(experts, "accepts_with_weights", False):  # GroupedExperts: run inside its forward (FSDP2 hooks)
        return experts(x_ND, with_weights=run)
    return run(experts.gate_up_proj, experts.down_proj)


chunked_dispatch = Bound(chunked_dispatch_with, ChunkedDispatch())
