"""The chunked dispatch at one rank under the models' full recompute: experts in groups, nothing saved.

With no exchange to overlap, the memory of a MoE layer's backward is what decides how long a sequence
trains. Holding every routed copy at once (the gathered input x, fc1's h, the output gradient g,
SwiGLU's a and dh, the input gradient dx: about 6 [M, D]-sized tensors for M = N K copies, 220 KiB per
token at Qwen3-30B-A3B's sizes) puts the backward's peak far above the parameters. Here:

- the recompute saves no expert activation: only the layer input x_ND, the routing weights, the
  sorted order and the counts (the first forward saves the same set: checkpoint compares them), and
  its output is discarded (zeros);
- the backward walks the experts in G contiguous groups of about `group_rows` routed rows each
  (rows are sorted by expert, so a group is one row range): gather x and g for the group, fc1
  (the recompute's work, moved here), the fc2 dgrad, the weighted SwiGLU gradient, both weight
  gradients of the group's experts, and its dx rows, added into the [N, D] fp32 input gradient by
  `add_group_copies` (`kernels/moe_dispatch_fused_permute.py`, where `fused_permute` is on; else its torch
  twin: each token's copies in the group summed in fp32 in k order, then one add to its row; no
  atomics, so deterministic); then every group's buffers are free;
- the first forward, which keeps nothing per row, runs groups of about `forward_group_rows` rows (16x by
  default): one group at up to 128K tokens at top-8, whose fc2 output is itself the [M, D] buffer that
  the un-permute reads; several groups are copied into one (at 128K tokens of Qwen3.5-35B-A3B, 4 groups
  of 2^18 rows copied ~4.3 GB a layer). Its transient, ~12.8 KiB per routed row at Qwen3-30B-A3B's sizes
  (13.4 GB for 2^20 rows), comes while the forward holds only the layer inputs, below the backward's peak.

The backward's working set is then the [N, D] fp32 input gradient plus one group's tensors: about
8 + 168 / G KiB per token at those sizes (an [M, D] dx buffer summed over K at the end would add 24).
FLOPs are those of the saved-activation path (fc1 runs once in the backward instead of once in the
recompute); the identity row gathers of one rank disappear. The forward's un-permute is the fused
kernel's (`kernels/moe_dispatch_fused_permute.py`) where the config enables it, as in
`primitives/moe_dispatch.py`. Shape legend as there.
"""
from __future__ import annotations

import math

import torch

from bumblebee.kernels.moe_dispatch_expert_gemm import (TokensPerExpert, expert_dgrad_weighted, expert_forward,
                                                        expert_wgrad)
from bumblebee.primitives.moe_dispatch_plan import exchange_counts


def expert_groups(tpe: list, group_rows: int) -> list:
    """[(e0, e1, r0, r1)]: contiguous expert ranges of about `group_rows` routed rows each (an expert
    is never split; empty ranges are dropped)."""
    M = sum(tpe)
    G = max(1, math.ceil(M / group_rows))
    out, e0, r0, acc = [], 0, 0, 0
    for e, n in enumerate(tpe):
        acc += n
        if acc * G >= (len(out) + 1) * M and e + 1 < len(tpe):  # crossed the next 1/G of the rows
            if acc > r0:
                out.append((e0, e + 1, r0, acc))
            e0, r0 = e + 1, acc
    if acc > r0:
        out.append((e0, len(tpe), r0, acc))
    return out


def _group_tpe(counts_E, tpe, e0, e1):
    return TokensPerExpert(counts_E[e0:e1], tpe[e0:e1])


class LocalGroupedExperts(torch.autograd.Function):
    """One rank, inside a recompute region (`phase` "forward" or "recompute"); see the module doc."""

    @staticmethod
    def forward(ctx, x_ND, weights_NK, w1_E2ID, w2_EDI, indices_NK, E, phase, mode, group_rows, forward_group_rows,
                permute, swiglu):
        K = indices_NK.shape[1]
        order_M, inv_M, plan, recv_CSL, _ = exchange_counts(x_ND, weights_NK, indices_NK, E, (1,), None, 1,
                                                            float("inf"))
        tpe = plan[0]["tpe"] if plan else [0] * E
        counts_E = recv_CSL[0, 0] if plan else torch.zeros(E, dtype=torch.int64, device=x_ND.device)
        groups = expert_groups(tpe, group_rows)
        out_ND = torch.zeros_like(x_ND)
        if phase != "recompute" and groups:  # the recompute's output is discarded: it computes nothing
            token_M = order_M // K
            forward_groups = expert_groups(tpe, forward_group_rows)
            y_MD = None if len(forward_groups) == 1 else x_ND.new_empty(order_M.shape[0], x_ND.shape[1])
            for e0, e1, r0, r1 in forward_groups:
                x_g = x_ND.index_select(0, token_M[r0:r1])
                y_g, _ = expert_forward(x_g, _group_tpe(counts_E, tpe, e0, e1), w1_E2ID[e0:e1], w2_EDI[e0:e1],
                                        mode, swiglu=swiglu[0])
                if y_MD is None:  # one group: fc2's output is the whole buffer
                    y_MD = y_g
                else:
                    y_MD[r0:r1] = y_g
                del x_g, y_g
            permute[0](y_MD, weights_NK, inv_M, out=out_ND)
        ctx.K, ctx.tpe, ctx.groups, ctx.mode, ctx.permute, ctx.swiglu = K, tpe, groups, mode, permute, swiglu
        ctx.save_for_backward(x_ND, weights_NK, w1_E2ID, w2_EDI, order_M, inv_M, counts_E)
        return out_ND

    @staticmethod
    def backward(ctx, g_ND):
        x_ND, weights_NK, w1, w2, order_M, inv_M, counts_E = ctx.saved_tensors
        K, tpe = ctx.K, ctx.tpe
        g_ND = g_ND.contiguous()
        M = order_M.shape[0]
        token_M = order_M // K
        acc = torch.promote_types(g_ND.dtype, torch.float32)  # fp32; float64 stays float64
        w_sorted_M = weights_NK.reshape(-1).to(torch.promote_types(weights_NK.dtype, torch.float32)).index_select(
            0, order_M)
        # the input gradient accumulates group by group into [N, D] fp32 (4 D bytes per token instead of
        # the 2 K D of an [M, D] buffer), one owner per row and group: the same sum order on every run
        gx_ND = torch.zeros(g_ND.shape, dtype=acc, device=g_ND.device)
        gw_M = torch.empty(M, dtype=torch.promote_types(acc, w_sorted_M.dtype), device=g_ND.device)
        dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)  # experts without rows get zeros
        for e0, e1, r0, r1 in ctx.groups:
            tok = token_M[r0:r1]
            g_tpe = _group_tpe(counts_E, tpe, e0, e1)
            w1_g, w2_g = w1[e0:e1], w2[e0:e1]
            x_g = x_ND.index_select(0, tok)
            _, saved = expert_forward(x_g, g_tpe, w1_g, w2_g, ctx.mode, fc2=False)  # fc1 only: h
            dx_g, gw_g, job = expert_dgrad_weighted(g_ND.index_select(0, tok), saved, w1_g, w2_g, w_sorted_M[r0:r1],
                                                    swiglu_grads_weighted=ctx.swiglu[2])
            del saved, x_g
            ctx.permute[4](gx_ND, dx_g, inv_M, r0, r1)  # add_group_copies, fused or torch
            gw_M[r0:r1] = gw_g
            del dx_g, gw_g
            a1, a2 = expert_wgrad(job)
            del job
            dw1[e0:e1], dw2[e0:e1] = a1, a2
        gw_NK = None
        if ctx.needs_input_grad[1]:
            gw_NK = gw_M.index_select(0, inv_M).view_as(weights_NK).to(weights_NK.dtype)
        return gx_ND.to(g_ND.dtype), gw_NK, dw1, dw2, None, None, None, None, None, None, None, None
