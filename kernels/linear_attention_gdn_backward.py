"""The q/k/w/gate gradients of one chunk of the gated delta rule (chunked form), as a Triton kernel.

Why this exists: flash-linear-attention 0.6's `chunk_bwd_dqkwg` refuses the gated case on Hopper
with Triton in [3.4, 3.7.1) ("produces incorrect results ... see #640"). Its kernel accumulates
`ds = do @ v^T` with `tl.dot`, then feeds `tl.trans(ds)` to another `tl.dot` (the attention part of
dk); on sm90 those Triton versions miscompile a transposed MMA result used as a dot operand, while
the forward is fine. This kernel never transposes a dot result: it accumulates `ds^T = v @ do^T`
from the loaded tiles beside `ds`, masks each with its own (transposed) causal mask and gate
factor, and uses each as the left operand of one dot. `chunk_bwd_dqkwg` below has the signature
and return contract of fla's for the gated calls its gated delta rule makes, so fla's backward can
call it in place of its own (see `primitives/linear_attention.py`).

The math, per value head (key head `hv // (HV // H)`), per chunk of BT tokens (chunks restart at
each sequence start), with Q, K [L, K] and V (the corrected values v_new), dO, dV [L, V] the chunk's
rows, S, dS [K, V] the state entering the chunk and the gradient of the state leaving it (`h`, `dh`;
stored [V, K] when `state_v_first`), G [L] the chunk-local cumulative gate in log2 units (exp2(G)
is the decay from the chunk start), g_l = G[L-1], M the causal mask (i >= j):

    dq  = scale * exp2(G)[:, None] * (dO @ S^T) + Ds @ K
    dk  = exp2(g_l - G)[:, None] * (V @ dS^T)   + Ds^T @ Q
    dw  = -(dV @ S^T)
    dg  = rowsum(dq * Q) - rowsum(dk * K),   plus  exp2(g_l) * sum(S * dS) + sum(exp2(g_l - G) * (V @ dS^T) * K)
          on the chunk's last row
    Ds  = scale * M * exp2(G_i - G_j) * (dO @ V^T)

These are the gradients of sum(dO * o) + sum(dS * S_end) - sum(dV * (W @ S)) with o the chunk's
output and S_end = exp2(g_l) S + (K * exp2(g_l - G))^T V, S and V held fixed; dg is taken with
respect to the gate in natural-log units (d exp2(G) / d(G ln 2) = exp2(G)), which is what fla's
backward feeds its reverse cumsum. dq and dk come out per value head and are summed over the value
heads that share a key head. Shapes: q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K];
g [B, T, HV] fp32; h, dh [B, NT, HV, K, V] (packed sequences: B = 1, NT counts every sequence's
chunks). On CUDA (or under TRITON_INTERPRET=1) the Triton kernel runs; elsewhere `dqkwg_torch`, the
same per-chunk algorithm in torch.
"""
from __future__ import annotations

import inspect
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is absent on some CPU-only installs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:
    # Tiles: fla's BK = BV = 128 (three [64, 128] fp32 accumulators plus ds and ds^T spill registers at
    # 4 warps, as fla's kernel does) or BK = 64 (two programs per chunk and head, each recomputing the
    # scores; at 8 warps ptxas reports almost no spills for sm90). The autotuner picks; dg gets one
    # row per key block (rows a wider block leaves unwritten stay zero). One config under the interpreter.
    MIN_BK = 64
    _CONFIGS = ([triton.Config({"BK": 64, "BV": 32}, num_warps=4)] if INTERPRET else
                [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=2)
                 for bk, bv, w in ((128, 128, 4), (128, 128, 8), (64, 128, 8), (64, 64, 8), (64, 128, 4))])

    @triton.autotune(configs=_CONFIGS, key=["H", "HV", "K", "V", "BT", "USE_DW", "STATE_V_FIRST", "IS_VARLEN"],
                     reset_to_zero=["dg"])
    @triton.jit(do_not_specialize=["T", "G_NUMEL"])
    def _dqkwg_kernel(q, k, v, g, h, do, dh, dv, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, T, G_NUMEL,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, USE_DW: tl.constexpr, STATE_V_FIRST: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
        i_t = tl.program_id(0).to(tl.int64)   # chunk (global over packed sequences when IS_VARLEN)
        i_bh = tl.program_id(1).to(tl.int64)  # batch row x value head
        i_k = tl.program_id(2)                # block of key dims
        i_b = i_bh // HV
        i_h = i_bh % HV
        i_hk = i_h // (HV // H)               # the key head this value head reads
        if IS_VARLEN:
            i_c = i_t  # the chunk's row in h / dh
            i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
            i_t = tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        else:
            i_c = i_b * tl.cdiv(T, BT) + i_t
            bos = i_b * T

        o_t = i_t * BT + tl.arange(0, BT)  # token positions within the sequence
        m_t = o_t < T
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        row_qk = (bos + o_t) * H + i_hk    # rows of q, k [*, H, K]
        row_v = (bos + o_t) * HV + i_h     # rows of v, do, dv [*, HV, V], dq, dk, dw [*, HV, K], g [*, HV]
        h += (i_c * HV + i_h) * K * V
        dh += (i_c * HV + i_h) * K * V

        b_ds = tl.zeros([BT, BT], dtype=tl.float32)   # do @ v^T
        b_dsT = tl.zeros([BT, BT], dtype=tl.float32)  # v @ do^T, accumulated itself: never a transposed dot result
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_sds = tl.zeros([BK], dtype=tl.float32)      # sum over v of S * dS, per key dim
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_tv = row_v[:, None] * V + o_v[None, :]
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
            if STATE_V_FIRST:
                p_s = o_v[:, None] * K + o_k[None, :]
            else:
                p_s = o_v[:, None] + o_k[None, :] * V
            m_vk = m_v[:, None] & m_k[None, :]
            b_hT = tl.load(h + p_s, mask=m_vk, other=0.0)    # [BV, BK] = S^T
            b_dhT = tl.load(dh + p_s, mask=m_vk, other=0.0)  # [BV, BK] = dS^T
            b_sds += tl.sum(b_hT.to(tl.float32) * b_dhT.to(tl.float32), axis=0)
            b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
            b_dsT = tl.dot(b_v, tl.trans(b_do), b_dsT)
            b_dq = tl.dot(b_do, b_hT.to(b_do.dtype), b_dq)
            b_dk = tl.dot(b_v, b_dhT.to(b_v.dtype), b_dk)
            if USE_DW:
                b_dv = tl.load(dv + p_tv, mask=m_tv, other=0.0)
                b_dw = tl.dot(b_dv.to(b_v.dtype), b_hT.to(b_v.dtype), b_dw)

        m_tk = m_t[:, None] & m_k[None, :]
        p_out = row_v[:, None] * K + o_k[None, :]
        if USE_DW:
            tl.store(dw + p_out, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
        p_qk = row_qk[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0.0)
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.0)

        last = tl.minimum(i_t * BT + BT, T) - 1  # the chunk's last row
        b_g = tl.load(g + row_v, mask=m_t, other=0.0).to(tl.float32)
        b_g_last = tl.load(g + (bos + last) * HV + i_h).to(tl.float32)
        b_dq = b_dq * (tl.exp2(b_g) * scale)[:, None]
        b_dk = b_dk * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        b_dk_k = tl.sum(b_dk * b_k.to(tl.float32), axis=1)  # the state path's part of dg, per row
        b_dg_last = tl.sum(b_sds, axis=0) * tl.exp2(b_g_last) + tl.sum(b_dk_k, axis=0)

        m_c = m_t[:, None] & m_t[None, :]
        m_A = (o_t[:, None] >= o_t[None, :]) & m_c   # i >= j
        m_AT = (o_t[:, None] <= o_t[None, :]) & m_c  # its transpose
        b_ds = tl.where(m_A, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
        b_dsT = tl.where(m_AT, b_dsT * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
        b_dk = tl.dot(b_dsT.to(b_q.dtype), b_q, b_dk)

        b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
        b_dg = tl.where(o_t == last, b_dg + b_dg_last, b_dg)
        tl.store(dq + p_out, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + p_out, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dg + i_k * G_NUMEL + row_v, b_dg, mask=m_t)


def chunk_indices_for(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[NT, 2] (sequence, chunk within it) for every chunk of the packed sequences, in order."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(len(counts), device=cu_seqlens.device), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.stack([seq, torch.arange(len(seq), device=cu_seqlens.device) - first], 1).to(cu_seqlens)


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """(dq [B, T, H, K], dk [B, T, H, K], dw like w or None, dg [B, T, HV] fp32) for the gated rule;
    fla's `chunk_bwd_dqkwg` contract for `g` given and `g_gamma` None (v is v_new, dv its gradient)."""
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg here covers the gated rule only: g given, g_gamma None")
    if (w is None) != (dv is None):
        raise ValueError("w and dv come together")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"key heads ({H}) must divide value heads ({HV})")
    scale = K ** -0.5 if scale is None else scale
    BT = chunk_size
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = chunk_indices_for(cu_seqlens, BT)
    if not use_triton(q):
        return dqkwg_torch(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    q, k, v, do, h, dh, g = (t.contiguous() for t in (q, k, v, do, h, dh, g))
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.zeros(triton.cdiv(K, MIN_BK), B, T, HV, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w) if w is not None else None
    dv = dv.contiguous() if dv is not None else None
    _dqkwg_kernel[lambda meta: (NT, B * HV, triton.cdiv(K, meta["BK"]))](
        q, k, v, g, h, do, dh, dv, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, T, B * T * HV,
        H=H, HV=HV, K=K, V=V, BT=BT, USE_DW=w is not None, STATE_V_FIRST=bool(state_v_first),
        IS_VARLEN=cu_seqlens is not None)
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg.sum(0)


SIGNATURE = inspect.signature(chunk_bwd_dqkwg)


def dqkwg_torch(q, k, v, do, h, dh, w, g, dv, scale, state_v_first=False, cu_seqlens=None, chunk_size=64):
    """The kernel's algorithm in torch, all chunks at once (fp32, or float64 for float64 inputs)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    B, T, H, K = k.shape
    HV = v.shape[2]
    BT = chunk_size
    cu = (torch.arange(B + 1, device=q.device) * T if cu_seqlens is None else cu_seqlens).tolist()
    chunks = [(c, min(c + BT, b)) for a, b in zip(cu[:-1], cu[1:]) for c in range(a, b, BT)]  # packed rows
    starts, ends = (torch.tensor(x, device=q.device, dtype=torch.long) for x in zip(*chunks))
    pos = starts[:, None] + torch.arange(BT, device=q.device)
    valid = pos < ends[:, None]                                                  # [N, BT]
    last = ends - 1 - starts                                                     # row of each chunk's last token
    idx = torch.where(valid, pos, 0)

    def rows(x):  # [B, T, heads, d] -> [N, BT, heads, d], zeros outside the sequence
        x = x.to(acc).reshape(B * T, *x.shape[2:])[idx]
        return x * valid.view(*valid.shape, *([1] * (x.dim() - 2)))

    rep = HV // H
    Q, Kc = (rows(t).repeat_interleave(rep, 2) for t in (q, k))                 # [N, BT, HV, K]
    Vn, dO = rows(v), rows(do)                                                   # [N, BT, HV, V]
    G = rows(g[..., None])[..., 0]                                               # [N, BT, HV]
    S, dS = (t.to(acc).reshape(-1, HV, *t.shape[-2:]) for t in (h, dh))
    if state_v_first:
        S, dS = S.transpose(-1, -2), dS.transpose(-1, -2)                       # [N, HV, K, V]
    g_last = G.gather(1, last.view(-1, 1, 1).expand(-1, 1, HV))                  # [N, 1, HV]
    decay_q = torch.exp2(G) * valid[..., None]
    decay_k = torch.exp2(g_last - G) * valid[..., None]
    dq = scale * decay_q[..., None] * torch.einsum("nthv,nhkv->nthk", dO, S)
    dk = decay_k[..., None] * torch.einsum("nthv,nhkv->nthk", Vn, dS)
    dg_last = torch.exp2(g_last[:, 0]) * (S * dS).sum((-1, -2)) + (dk * Kc).sum((1, 3))   # [N, HV]
    causal = torch.tril(torch.ones(BT, BT, dtype=torch.bool, device=q.device))
    mask = causal[None, :, :, None] & valid[:, :, None, None] & valid[:, None, :, None]   # [N, i, j, HV]
    gap = torch.where(mask, G[:, :, None] - G[:, None, :], 0.0)
    ds = torch.where(mask, torch.einsum("nihv,njhv->nijh", dO, Vn) * torch.exp2(gap), 0.0) * scale
    dq = dq + torch.einsum("nijh,njhk->nihk", ds, Kc)
    dk = dk + torch.einsum("nijh,nihk->njhk", ds, Q)
    dgc = (dq * Q).sum(-1) - (dk * Kc).sum(-1)                                   # [N, BT, HV]
    dgc[torch.arange(len(last), device=q.device), last] += dg_last

    def scatter(x, like_shape, dtype):
        out = torch.zeros(B * T, *x.shape[2:], dtype=x.dtype, device=x.device)
        out[pos[valid]] = x[valid]
        return out.view(*like_shape).to(dtype)

    dq = scatter(dq, (B, T, HV, K), q.dtype)
    dk = scatter(dk, (B, T, HV, K), k.dtype)
    dg = scatter(dgc[..., None], (B, T, HV), acc)
    dw = None
    if w is not None:
        dw = scatter(-torch.einsum("nthv,nhkv->nthk", rows(dv), S), tuple(w.shape), w.dtype)
    if H != HV:
        dq = dq.view(B, T, H, rep, K).sum(3)
        dk = dk.view(B, T, H, rep, K).sum(3)
    return dq, dk, dw, dg
