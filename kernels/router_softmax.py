"""Fused softmax top-k routing (Qwen3-MoE, Qwen3.5-MoE) as one Triton kernel.

One pass over the router logits [T, E] computes, per token: the fp32 softmax (max, exp, sum), the
top-k experts by probability (descending, the lowest index first on ties), their weights (the
probabilities, renormalized over the k when asked) and the per-expert token counts.

Each expert's score and index are packed into one integer key whose order is (score, -index), so
each of the k selections is one max reduction and one compare (not a max, a min-index and two
compares). 16-bit logits: the score is the logit's own 16 bits made signed-monotone (the
probability's order, exact ties included), an int32 key. fp32 logits: the score is the fp32 bits
of the probability (>= 0, so they order as integers), an int64 key. Counts accumulate per program
in a [BLOCK_T, E] register tile (a reduction over rows per block costs about as much as the k
selections) and go out with one vector atomic. The grid is persistent. Weights come from the k
logits loaded again, so a replay (experts given, no selection) weighs them by the same
arithmetic, bit for bit.

`softmax_topk_torch` is the same algorithm in torch (where Triton does not run, and float64):
k arg-max passes, lowest index on ties, not `torch.topk`.

Shape legend: T tokens, E experts, K experts per token.
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

MAX_EXPERTS = 1 << 16  # the index field of a key


@_jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, indices_ptr, counts_ptr, T, E, stride_t,
                         TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, KEY16: tl.constexpr,
                         REPLAY: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    low_E = 0xFFFF - e
    k_ar = tl.arange(0, BLOCK_K)
    NONE: tl.constexpr = -2147483648 if KEY16 else -1  # below every real key
    hist_TE = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)  # summed over rows once, at the end
    for blk in range(pid, tl.cdiv(T, BLOCK_T), nprog):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        r_ok = rows < T
        row_ptr = logits_ptr + rows[:, None].to(tl.int64) * stride_t
        raw = tl.load(row_ptr + e[None, :], mask=r_ok[:, None] & e_ok[None, :], other=0.0)
        x = tl.where(e_ok[None, :], raw.to(tl.float32), float("-inf"))  # rows past T stay finite
        m = tl.max(x, axis=1)
        ex = tl.exp(x - m[:, None])
        s = tl.sum(ex, axis=1)
        out = rows[:, None].to(tl.int64) * TOP_K + k_ar[None, :]
        o_ok = r_ok[:, None] & (k_ar[None, :] < TOP_K)
        if REPLAY:
            idx = tl.load(indices_ptr + out, mask=o_ok, other=0)
        else:
            if KEY16:  # the logit's 16 bits made signed-monotone (-0 as +0): the probabilities' order
                b = raw.to(tl.int16, bitcast=True).to(tl.int32)
                b = tl.where(b == -32768, 0, b)
                key = (tl.where(b < 0, b ^ 0x7FFF, b) << 16) | low_E[None, :]
            else:  # fp32 bits of a probability >= 0 order as the probability
                p = ex / s[:, None]
                key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | low_E.to(tl.int64)[None, :]
            key = tl.where(e_ok[None, :], key, NONE)
            top = tl.full([BLOCK_T, BLOCK_K], NONE, key.dtype)
            for j in tl.static_range(TOP_K):
                best = tl.max(key, axis=1)
                key = tl.where(key == best[:, None], NONE, key)  # keys are unique within a row
                top = tl.where(k_ar[None, :] == j, best[:, None], top)
            hist_TE += ((key == NONE) & e_ok[None, :] & r_ok[:, None]).to(tl.int32)
            idx = 0xFFFF - (top & 0xFFFF).to(tl.int32)
            tl.store(indices_ptr + out, idx.to(tl.int64), mask=o_ok)
        # the k logits again (cached): a selection and a replay weigh experts by the same arithmetic
        xv = tl.load(row_ptr + idx, mask=o_ok, other=0.0).to(tl.float32)
        w = tl.where(k_ar[None, :] < TOP_K, tl.exp(xv - m[:, None]) / s[:, None], 0.0)
        if NORM:
            w = w / tl.sum(w, axis=1)[:, None]
        tl.store(weights_ptr + out, w.to(weights_ptr.dtype.element_ty), mask=o_ok)
    if not REPLAY:
        tl.atomic_add(counts_ptr + e, tl.sum(hist_TE, axis=0), mask=e_ok)


def softmax_topk_fwd(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                     routed_experts: torch.Tensor | None = None, block_t: int | None = None,
                     num_warps: int = 4, max_programs: int | None = None):
    """(weights [T, K] in the logits' dtype, indices [T, K] int64, counts [E] int64); inputs assumed
    validated (1 <= top_k <= E < 65536). routed_experts [T, K]: no selection, those experts weighed.
    block_t None: a [block_t, next_pow2(E)] tile of 2048."""
    if triton is None:
        raise RuntimeError("Triton is not installed: run the kernel's algorithm in torch (softmax_topk_torch)")
    T, E = logits_TE.shape
    if E >= MAX_EXPERTS:
        raise ValueError(f"the fused softmax router packs expert indices in 16 bits: E={E} >= {MAX_EXPERTS}")
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    dev = logits_TE.device
    weights = torch.full((T, top_k), float("nan"), dtype=logits_TE.dtype, device=dev)  # poisoned
    if routed_experts is None:
        indices = torch.full((T, top_k), -1, dtype=torch.int64, device=dev)
        counts = torch.zeros(E, dtype=torch.int32, device=dev)
    else:
        indices = routed_experts.to(torch.int64).contiguous()
        counts = torch.bincount(indices.reshape(-1), minlength=E)
    if T == 0:
        return weights, indices, counts.long()
    block_e = triton.next_power_of_2(E)
    if block_t is None:
        block_t = max(1, min(64, 2048 // block_e))
    n_blocks = triton.cdiv(T, block_t)
    if max_programs is None:
        max_programs = (torch.cuda.get_device_properties(dev).multi_processor_count * 8
                        if dev.type == "cuda" else 4)
    grid = (min(n_blocks, max_programs),)
    _softmax_topk_kernel[grid](logits_TE, weights, indices, counts, T, E, logits_TE.stride(0),
                               TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_T=block_t, BLOCK_E=block_e,
                               BLOCK_K=triton.next_power_of_2(top_k), KEY16=logits_TE.element_size() == 2,
                               REPLAY=routed_experts is not None, num_warps=num_warps)
    return weights, indices, counts.long()


def softmax_topk_torch(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                       routed_experts: torch.Tensor | None = None, block_t: int = 1024):
    """The kernel's algorithm in torch, block by block of `block_t` tokens: softmax as max, exp, sum
    (fp32; fp64 stays fp64), k arg-max passes over the kernel's scores (lowest index on ties), counts
    summed per block. The same outputs as `softmax_topk_fwd` (routed_experts too). No autograd: the
    caller recomputes the weights' gradient."""
    T, E = logits_TE.shape
    acc = torch.promote_types(logits_TE.dtype, torch.float32)
    dev = logits_TE.device
    weights = torch.empty(T, top_k, dtype=logits_TE.dtype, device=dev)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    with torch.no_grad():
        for a in range(0, T, block_t):
            x = logits_TE[a:a + block_t].detach().to(acc)
            p = torch.exp(x - x.max(dim=1, keepdim=True).values)
            p = p / p.sum(dim=1, keepdim=True)
            if routed_experts is None:
                i_TK = _select(x if logits_TE.element_size() == 2 else p, top_k)  # the kernel's key order
            else:
                i_TK = routed_experts[a:a + block_t].long()
            w_TK = p.gather(1, i_TK)
            if norm_topk_prob:
                w_TK = w_TK / w_TK.sum(dim=1, keepdim=True)
            weights[a:a + block_t] = w_TK.to(logits_TE.dtype)
            indices[a:a + block_t] = i_TK
            counts += torch.bincount(i_TK.reshape(-1), minlength=E)
    return weights, indices, counts


def _select(score_TE, top_k):
    """k arg-max passes, the lowest index on ties (not a -inf fill: logits may be -inf)."""
    cols = torch.arange(score_TE.shape[1], device=score_TE.device)
    taken = torch.zeros_like(score_TE, dtype=torch.bool)
    i_TK = torch.empty(score_TE.shape[0], top_k, dtype=torch.int64, device=score_TE.device)
    for j in range(top_k):
        left = score_TE.masked_fill(taken, float("-inf"))
        best = left.max(dim=1, keepdim=True).values
        idx = torch.where((left == best) & ~taken, cols, score_TE.shape[1]).min(dim=1, keepdim=True).values
        i_TK[:, j:j + 1] = idx
        taken.scatter_(1, idx, True)
    return i_TK
