"""Fused auxiliary-loss-free top-k routing (DeepSeek-V3) as one Triton kernel.

One pass over the router logits [T, E] computes, per token: sigmoid scores in fp32, the biased
scores (bias for the selection only), the group scores (sum of the top-2 biased scores of each
group), the `topk_group` best groups (the others masked to -inf), the top-k experts of the kept
groups, their weights from the unbiased scores (renormalized with a 1e-20 guard, times the scaling
factor), and the per-expert token counts. The grid is persistent: each program walks blocks of
BLOCK_T tokens and adds its counts to the output with one vector atomic at the end.

`aux_free_topk_torch` is the same algorithm in torch, block by block (the primitive's path where
Triton does not run): the same reductions in the same order, not the reference's topk calls.

Shape legend: T tokens, E experts, K experts per token, G groups.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the primitive runs the torch path below, never the kernel
    triton = None


def _jit(fn):
    """The kernel compiled by Triton; without Triton the plain function, which is never launched."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _aux_free_topk_kernel(logits_ptr, bias_ptr, weights_ptr, indices_ptr, counts_ptr,
                          T, E, stride_t, scaling_factor,
                          TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS_3D: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    bias_E = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    group_E = e // (E // N_GROUP)  # padded experts fall in groups >= N_GROUP
    g_ar = tl.arange(0, BLOCK_G)
    k_ar = tl.arange(0, BLOCK_K)
    hist_E = tl.zeros([BLOCK_E], dtype=tl.int32)
    n_blocks = tl.cdiv(T, BLOCK_T)
    for blk in range(pid, n_blocks, nprog):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        r_ok = rows < T
        x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + e[None, :],
                    mask=r_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        s_TE = tl.sigmoid(x)
        b_TE = tl.where(e_ok[None, :], s_TE + bias_E[None, :], float("-inf"))
        if GROUPS_3D:  # E and the groups are powers of two: all groups in three [T, G, E/G] reductions
            GS: tl.constexpr = BLOCK_E // N_GROUP
            gs_ar = tl.arange(0, GS)
            b3 = tl.reshape(b_TE, (BLOCK_T, N_GROUP, GS))
            m1 = tl.max(b3, axis=2)
            i1 = tl.min(tl.where(b3 == m1[:, :, None], gs_ar[None, None, :], GS), axis=2)
            m2 = tl.max(tl.where(gs_ar[None, None, :] == i1[:, :, None], float("-inf"), b3), axis=2)
            gscore_TG = m1 + m2
            keep_TG = tl.zeros([BLOCK_T, N_GROUP], dtype=tl.int1)
            for _ in range(TOPK_GROUP):
                gm = tl.max(gscore_TG, axis=1)
                gi = tl.min(tl.where(gscore_TG == gm[:, None], g_ar[None, :], BLOCK_G), axis=1)
                keep_TG = keep_TG | (g_ar[None, :] == gi[:, None])
                gscore_TG = tl.where(g_ar[None, :] == gi[:, None], float("-inf"), gscore_TG)
            keep3 = tl.broadcast_to(keep_TG[:, :, None], (BLOCK_T, N_GROUP, GS))
            b_TE = tl.where(tl.reshape(keep3, (BLOCK_T, BLOCK_E)), b_TE, float("-inf"))
        elif N_GROUP > 1:
            gscore_TG = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
            for g in range(N_GROUP):
                bg = tl.where((group_E == g)[None, :], b_TE, float("-inf"))
                m1 = tl.max(bg, axis=1)
                i1 = tl.min(tl.where(bg == m1[:, None], e[None, :], BLOCK_E), axis=1)
                m2 = tl.max(tl.where(e[None, :] == i1[:, None], float("-inf"), bg), axis=1)
                gscore_TG = tl.where(g_ar[None, :] == g, (m1 + m2)[:, None], gscore_TG)
            keep_TE = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
            for _ in range(TOPK_GROUP):
                gm = tl.max(gscore_TG, axis=1)
                gi = tl.min(tl.where(gscore_TG == gm[:, None], g_ar[None, :], BLOCK_G), axis=1)
                keep_TE = keep_TE | (group_E[None, :] == gi[:, None])
                gscore_TG = tl.where(g_ar[None, :] == gi[:, None], float("-inf"), gscore_TG)
            b_TE = tl.where(keep_TE, b_TE, float("-inf"))
        w_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        i_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
        sel_TE = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for j in range(TOP_K):
            m = tl.max(b_TE, axis=1)
            idx = tl.min(tl.where(b_TE == m[:, None], e[None, :], BLOCK_E), axis=1)
            hit = e[None, :] == idx[:, None]
            w = tl.sum(tl.where(hit, s_TE, 0.0), axis=1)
            b_TE = tl.where(hit, float("-inf"), b_TE)
            w_TK = tl.where(k_ar[None, :] == j, w[:, None], w_TK)
            i_TK = tl.where(k_ar[None, :] == j, idx[:, None], i_TK)
            sel_TE = sel_TE | hit
        hist_E += tl.sum(tl.where(sel_TE & r_ok[:, None], 1, 0), axis=0).to(tl.int32)  # once per block
        if NORM:
            w_TK = w_TK / (tl.sum(w_TK, axis=1)[:, None] + 1e-20)
        w_TK = w_TK * scaling_factor
        out = rows[:, None].to(tl.int64) * TOP_K + k_ar[None, :]
        o_ok = r_ok[:, None] & (k_ar[None, :] < TOP_K)
        tl.store(weights_ptr + out, w_TK, mask=o_ok)
        tl.store(indices_ptr + out, i_TK.to(tl.int64), mask=o_ok)
    tl.atomic_add(counts_ptr + e, hist_E, mask=e_ok)


def aux_free_topk_fwd(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int,
                      topk_group: int, scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                      block_t: int = 16, num_warps: int = 4, max_programs: int | None = None):
    """(weights [T, K] fp32, indices [T, K] int64, counts [E] int64); inputs assumed validated."""
    if triton is None:
        raise RuntimeError("Triton is not installed: run the kernel's algorithm in torch (aux_free_topk_torch)")
    T, E = logits_TE.shape
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    bias_E = bias_E.contiguous()
    dev = logits_TE.device
    weights = torch.full((T, top_k), float("nan"), dtype=torch.float32, device=dev)  # poisoned
    indices = torch.full((T, top_k), -1, dtype=torch.int64, device=dev)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    if T == 0:
        return weights, indices, counts.long()
    n_blocks = triton.cdiv(T, block_t)
    if max_programs is None:
        max_programs = (torch.cuda.get_device_properties(dev).multi_processor_count * 4
                        if dev.type == "cuda" else 4)
    grid = (min(n_blocks, max_programs),)
    _aux_free_topk_kernel[grid](
        logits_TE, bias_E, weights, indices, counts, T, E, logits_TE.stride(0), float(scaling_factor),
        TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob),
        BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(E), BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_K=triton.next_power_of_2(top_k),
        GROUPS_3D=n_group > 1 and E == triton.next_power_of_2(E) and n_group == triton.next_power_of_2(n_group),
        num_warps=num_warps)
    return weights, indices, counts.long()


def _argmax_lowest(x_TN):
    """Index of each row's maximum, the lowest one on ties: the kernel's max-then-min-index reduction."""
    cols = torch.arange(x_TN.shape[1], device=x_TN.device)
    m = x_TN.max(dim=1, keepdim=True).values
    return torch.where(x_TN == m, cols, x_TN.shape[1]).min(dim=1).values


def _aux_free_topk_block(x_TE, bias_E, top_k, n_group, topk_group):
    """One block of tokens as `_aux_free_topk_kernel` walks it: (unbiased scores [T, E], indices [T, K])."""
    T, E = x_TE.shape
    rows = torch.arange(T, device=x_TE.device)[:, None]
    s_TE = torch.sigmoid(x_TE)
    b_TE = s_TE + bias_E
    if n_group > 1:  # group score: the top biased score plus the top one left once its argmax is dropped
        b3 = b_TE.reshape(T, n_group, E // n_group)
        i1 = _argmax_lowest(b3.reshape(T * n_group, -1)).reshape(T, n_group, 1)
        m1 = b3.gather(2, i1)
        m2 = b3.scatter(2, i1, float("-inf")).max(dim=2, keepdim=True).values
        gscore_TG = (m1 + m2)[..., 0]
        keep_TG = torch.zeros_like(gscore_TG, dtype=torch.bool)
        for _ in range(topk_group):  # the kept groups one at a time, as the kernel's loop
            gi = _argmax_lowest(gscore_TG)[:, None]
            keep_TG[rows, gi] = True
            gscore_TG[rows, gi] = float("-inf")
        b_TE = b_TE.masked_fill(~keep_TG.repeat_interleave(E // n_group, dim=1), float("-inf"))
    indices_TK = torch.empty(T, top_k, dtype=torch.int64, device=x_TE.device)
    for j in range(top_k):  # the experts one at a time, best biased score first
        idx = _argmax_lowest(b_TE)[:, None]
        indices_TK[:, j:j + 1] = idx
        b_TE[rows, idx] = float("-inf")
    return s_TE, indices_TK


def aux_free_topk_torch(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int,
                        topk_group: int, scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                        block_t: int = 16):
    """The kernel's algorithm in torch, block by block of `block_t` tokens (iterative arg-max selection,
    lowest index on ties, counts summed per block): the same outputs as `aux_free_topk_fwd`, fp32
    (fp64 logits stay fp64). No autograd: the caller recomputes the weights' gradient."""
    T, E = logits_TE.shape
    acc = torch.promote_types(logits_TE.dtype, torch.float32)
    weights = torch.empty(T, top_k, dtype=acc, device=logits_TE.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    counts = torch.zeros(E, dtype=torch.int64, device=logits_TE.device)
    bias_E = bias_E.detach().to(acc)
    with torch.no_grad():
        for a in range(0, T, block_t):
            s_TE, i_TK = _aux_free_topk_block(logits_TE[a:a + block_t].detach().to(acc), bias_E, top_k, n_group,
                                              topk_group)
            w_TK = s_TE.gather(1, i_TK)
            if norm_topk_prob:
                w_TK = w_TK / (w_TK.sum(dim=1, keepdim=True) + 1e-20)
            weights[a:a + block_t] = w_TK * scaling_factor
            indices[a:a + block_t] = i_TK
            counts += torch.bincount(i_TK.reshape(-1), minlength=E)
    return weights, indices, counts
