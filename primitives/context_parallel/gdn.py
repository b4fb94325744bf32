"""Gated DeltaNet over a context-parallel shard: conv halo and exact fp32 state passing.

The recurrence runs over the chunks in global order 0 .. 2 CP - 1, while rank r holds chunks r and
2 CP - 1 - r (the attention layers' layout, `layout.py`). Per chunk c the state leaving it is an
affine map of the state entering it, S_out = A_c S_in + B_c (A_c [Dk, Dk], B_c [Dk, Dv] per value
head; A_c = 0 when a document starts inside the chunk), and the chunk's output is o_0 + X S_in, linear
in the entering state too. One call of the chunked rule per rank computes all of them at once
(`gated_delta_rule`: values widened by Dk zero columns, entering state [0 | I]); one differentiable
all-gather brings every chunk's (A, B); every rank composes them in chunk order in fp32 for the states
entering its chunks and adds X S_in. No rank waits for another's chunk, no chunk runs twice, and no
layer needs another layout. Gradients flow back through the composition and the all-gather's
reduce-scatter to the ranks that made each map, and through the rule's final-state gradient. The
causal conv takes its W - 1 halo tokens of chunk c from the tail of chunk c - 1 (another all-gather
of 2 CP x (W - 1) tokens); taps stop at the token's document start.

The rule: fla's `chunk_gated_delta_rule` (with `initial_state` and `output_final_state`) on CUDA where
fla serves (`fla_rule`), else `torch_rule`: the chunked rule in torch, fp32, with a triangular solve
per 64-token block (not fla's 16 x 16 blocks), same interface.
Shape legend: B batch, L chunk length, HV value heads, Dk / Dv head dims, C conv channels, W width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.norms import to_acc
from bumblebee.primitives.context_parallel.attention import check_batch
from bumblebee.primitives.context_parallel.comm import gather
from bumblebee.primitives.context_parallel.layout import CPBatch, gather_slot, rank_chunks
from bumblebee.primitives.linear_attention import fla_falls_back, fla_ops

BLOCK = 64
# ContextParallel.deltanet: fla's CP kernels where they serve, else the maps (auto); this file's maps; fla's
DELTANET = ("auto", "maps", "fla")
FLA_TRANSITIONS = ("fla", "fp32", "bf16x2", "bf16")  # ContextParallel.fla_transition


def _halos(x_BTC, W: int, batch: CPBatch):
    """The W - 1 tokens before each of this rank's two chunks, [B, 2, W-1, C] in x's dtype: the tail
    of the previous chunk (another rank's, by one all-gather of every chunk's tail), zeros before chunk 0."""
    B, _, C = x_BTC.shape
    L = batch.chunk
    if W - 1 > L:
        raise ValueError(f"conv width {W} needs chunks of at least {W - 1} tokens, got {L} "
                         f"(T={batch.T}, CP={batch.cp})")
    tails = torch.stack([x_BTC[:, (i + 1) * L - (W - 1):(i + 1) * L] for i in range(2)], dim=1)
    tails = gather(tails, batch.group, dim=1)  # [B, 2 CP, W-1, C]
    return torch.stack([tails[:, gather_slot(c - 1, batch.cp)] if c > 0 else x_BTC.new_zeros(B, W - 1, C)
                        for c in rank_chunks(batch.rank, batch.cp)], dim=1)


def halo_conv_rows(x_BTC, weight_CW, batch: CPBatch, conv):
    """SiLU(depthwise causal conv) of an unpacked shard's two chunks through `conv(rows [R, n, C],
    weight [C, W]) -> [R, n, C]`, the single layer's own causal conv (fla's `causal_conv1d` on CUDA,
    in the input dtype): each chunk becomes a row prefixed by its halo, whose W - 1 outputs are
    dropped. No fp32 copy of the [T, C] activations (the fp32 path cost ~3x fla's conv at 32K tokens)."""
    B, _, C = x_BTC.shape
    W, L = weight_CW.shape[-1], batch.chunk
    rows = torch.cat([_halos(x_BTC, W, batch), x_BTC.reshape(B, 2, L, C)], dim=2)  # [B, 2, W-1+L, C]
    y = conv(rows.reshape(2 * B, W - 1 + L, C), weight_CW)
    return y[:, W - 1:].reshape(B, 2 * L, C)


def halo_conv_silu(x_BTC, weight_CW, batch: CPBatch):
    """SiLU(depthwise causal conv) of this rank's two chunks, fp32 inside, in x's dtype; tap s reads
    the token s steps back (on the previous chunk's rank for the first W - 1 tokens) within the
    token's document."""
    B, _, C = x_BTC.shape
    W, L = weight_CW.shape[-1], batch.chunk
    x, w = to_acc(x_BTC), to_acc(weight_CW)
    halos = _halos(x, W, batch)
    out = []
    for i, c in enumerate(rank_chunks(batch.rank, batch.cp)):
        ext = torch.cat([halos[:, i], x[:, i * L:(i + 1) * L]], dim=1)
        if not batch.packed:  # no document start to stop at: one depthwise conv (saves only its input)
            out.append(F.conv1d(ext.transpose(1, 2), w[:, None], groups=C).transpose(1, 2))
            continue
        in_doc = batch.chunk_index(i) - batch.starts[i * L:(i + 1) * L]  # position inside the document
        y = 0
        for s in range(W):
            y = y + ext[:, W - 1 - s:W - 1 - s + L] * (in_doc >= s)[:, None].to(x.dtype) * w[:, W - 1 - s]
        out.append(y)
    return F.silu(torch.cat(out, dim=1)).to(x_BTC.dtype)


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _run(q, k, v, g, beta, h0):
    """The chunked rule on one piece of a sequence: [B, HV, n, *] fp32 (q scaled), entering state h0
    [B, HV, Dk, Dv] -> (o [B, HV, n, Dv], leaving state)."""
    n = q.shape[2]
    pad = (-n) % BLOCK  # zero keys and beta, zero log decay: padding leaves the state alone
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    Bn, HV, N, Dk = k.shape
    nb = N // BLOCK
    q, k, v = (t.reshape(Bn, HV, nb, BLOCK, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(Bn, HV, nb, BLOCK), beta.reshape(Bn, HV, nb, BLOCK)
    G = g.cumsum(-1)
    lower = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # unit diagonal: beta k.k is replaced by 1 below
    A = A.tril(-1) + torch.eye(BLOCK, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec, k_dec = q * G.exp()[..., None], k * (G[..., -1:] - G).exp()[..., None]
    h, outs = h0, []
    for b in range(nb):
        v_new = u[:, :, b] - w[:, :, b] @ h
        outs.append(q_dec[:, :, b] @ h + attn[:, :, b] @ v_new)
        h = h * G[:, :, b, -1].exp()[..., None, None] + k_dec[:, :, b].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2)[:, :, :n], h


def torch_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens=None):
    """fla's `chunk_gated_delta_rule(..., initial_state, output_final_state=True,
    use_qk_l2norm_in_kernel=True)` in torch, fp32: q, k [B, n, H, Dk], v [B, n, HV, Dv], g, beta
    [B, n, HV], initial_state [N, HV, Dk, Dv] (N rows, or N sequences of cu_seqlens with B = 1) ->
    (o [B, n, HV, Dv] in v's dtype, final states [N, HV, Dk, Dv] fp32)."""
    rep = v.shape[2] // k.shape[2]
    q, k = (l2norm(to_acc(t)).repeat_interleave(rep, dim=2).transpose(1, 2) for t in (q, k))
    q = q * scale
    v, g, beta = (to_acc(t).transpose(1, 2) for t in (v, g, beta))
    h0 = to_acc(initial_state)
    if cu_seqlens is None:
        o, h = _run(q, k, v, g, beta, h0)
    else:
        cu = cu_seqlens.tolist()
        runs = [_run(*(t[:, :, a:b] for t in (q, k, v, g, beta)), h0[n:n + 1]) for n, (a, b) in
                enumerate(zip(cu, cu[1:]))]
        o, h = torch.cat([r[0] for r in runs], dim=2), torch.cat([r[1] for r in runs])
    return o.transpose(1, 2).to(v.dtype), h


def fla_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens=None):
    """fla's chunked kernel, its backward inside the `linear_attention` primitive's scope (the Hopper
    dq/dk/dw/dg replacement serves it); same interface as `torch_rule`."""
    from bumblebee.primitives.linear_attention import scoped
    rule = fla_ops()[1]
    final = []

    def run(q, k, v, g, beta):
        o, h = rule(*(t.contiguous() for t in (q, k, v)), g.float().contiguous(), beta.contiguous(), scale=scale,
                    initial_state=initial_state.float().contiguous(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        final.append(h)
        return o
    o = scoped(run, q, k, v, g, beta.to(q.dtype))
    return o, final[0]


def gated_delta_rule(q, k, v, g, beta, *, scale: float, batch: CPBatch, rule=torch_rule):
    """q, k [B, 2L, H, Dk], v [B, 2L, HV, Dv], g (log decays), beta [B, 2L, HV] of this rank's chunks
    -> o [B, 2L, HV, Dv] in v's dtype; q and k are l2-normalized in `rule` (`torch_rule`, `fla_rule`).

    One call of `rule` over both chunks with the values widened by Dk zero columns and the entering
    state [0 | I]: the state leaving the chunk is then [B_c | A_c] (its affine map: S_out = A_c S_in +
    B_c), and the output [o_0 | X] where o_0 is the output from a zero entering state and X S_in the
    entering state's contribution (the rule is linear in its state). A segment after a document start
    inside a chunk enters [0 | 0]: it sees no earlier state (so A_c = 0 when the chunk's last segment
    is one of those)."""
    B, T2, H, Dk = k.shape
    HV, Dv = v.shape[2:]
    L, cp, dtype, dev = batch.chunk, batch.cp, v.dtype, v.device
    wide = torch.cat([v, v.new_zeros(B, T2, HV, Dk)], dim=-1)
    acc = torch.promote_types(dtype, torch.float32)  # the state's dtype
    eye = torch.cat([torch.zeros(Dk, Dv, device=dev, dtype=acc), torch.eye(Dk, device=dev, dtype=acc)], -1)  # [0 | I]
    if not batch.packed:  # every chunk one sequence: rows [B, 2L] -> [2B, L]
        o, fin = rule(*(t.reshape(2 * B, L, *t.shape[2:]) for t in (q, k, wide, g, beta)), scale=scale,
                      initial_state=eye.expand(2 * B, HV, Dk, Dv + Dk), cu_seqlens=None)
        o, maps = o.reshape(B, T2, HV, Dv + Dk), fin.reshape(B, 2, HV, Dk, Dv + Dk)
    else:  # B = 1: the rank's 2L tokens as sequences cut at chunk ends and document starts
        cu, h0, last = [0], [], []
        for i in range(2):
            bounds = sorted({0, L, *batch.cuts[i]})
            for n, b in enumerate(bounds[1:]):
                h0.append(eye if n == 0 and 0 not in batch.cuts[i] else torch.zeros_like(eye))
                cu.append(i * L + b)
            last.append(len(cu) - 2)
        o, fin = rule(q, k, wide, g, beta, scale=scale, initial_state=torch.stack(h0)[:, None].expand(-1, HV, -1, -1),
                      cu_seqlens=torch.tensor(cu, device=dev))
        maps = fin[last][None]
    AB = gather(maps, batch.group, dim=1)  # [B, 2 CP, HV, Dk, Dv + Dk]: (B | A) of every chunk
    chunks = rank_chunks(batch.rank, cp)
    entering, S = {}, AB.new_zeros(B, HV, Dk, Dv)
    for c in range(max(chunks)):  # the scan in chunk order, fp32
        S = AB[:, gather_slot(c, cp), ..., Dv:] @ S + AB[:, gather_slot(c, cp), ..., :Dv]
        entering[c + 1] = S
    outs = []
    for i, c in enumerate(chunks):
        piece = o[:, i * L:(i + 1) * L]
        out = to_acc(piece[..., :Dv])
        if c > 0:
            out = out + torch.einsum("bnhk,bhkv->bnhv", to_acc(piece[..., Dv:]), entering[c])
        outs.append(out)
    return torch.cat(outs, dim=1).to(dtype)


def _fla_conv_silu(x_RnC, weight_CW):
    return fla_ops()[0](x_RnC, weight=weight_CW.to(x_RnC.dtype), activation="silu")[0]


def gdn_forward(layer, x_BTD, cu_seqlens, *, row_conv=None, deltanet: str = "auto",
                fla_concurrent_parts: bool = False, fla_transition: str = "fla"):
    """A gated DeltaNet layer (the `linear_attention` slot's parameters) on this rank's chunks.
    deltanet="maps": this file's affine maps (any device); "fla": fla's own CP kernels
    (`gdn_fla.py`, CUDA; `fla_concurrent_parts`, `fla_transition`: `ContextParallel`'s options, here defaulting to
    fla's own path, while `ContextParallel` defaults to the measured faster one); "auto": fla's where
    they serve x and the layer (`why_not_fla_cp`) and no `row_conv` (an option of the maps) is given,
    else the maps. `row_conv` (rows [R, n, C], weight [C, W]) -> SiLU(causal conv): the maps'
    conv of unpacked shards (`halo_conv_rows`); default fla's where fla serves, else the fp32 halo
    path (`halo_conv_silu`)."""
    batch = check_batch(cu_seqlens, x_BTD.transpose(1, 2))  # tokens on dim 2, as attention's q
    if deltanet == "auto":
        from bumblebee.primitives.context_parallel.gdn_fla import why_not_fla_cp
        # row_conv is an option of the maps: a caller who gives it runs them
        deltanet = "fla" if why_not_fla_cp(x_BTD, layer.head_k_dim) is None and row_conv is None else "maps"
    if deltanet == "fla":
        from bumblebee.primitives.context_parallel.gdn_fla import fla_cp_forward
        return fla_cp_forward(layer, x_BTD, batch, fla_concurrent_parts, fla_transition)
    if deltanet != "maps":
        raise ValueError(f"deltanet must be one of {DELTANET}, got {deltanet!r}")
    B, T, _ = x_BTD.shape
    fla = fla_falls_back(x_BTD.device, x_BTD.dtype, training=torch.is_grad_enabled()) is None
    row_conv = row_conv or (_fla_conv_silu if fla else None)
    if row_conv is not None and not batch.packed:
        qkv = halo_conv_rows(layer.in_proj_qkv(x_BTD), layer.conv1d.weight[:, 0], batch, row_conv)
    else:
        qkv = halo_conv_silu(layer.in_proj_qkv(x_BTD), layer.conv1d.weight[:, 0], batch)
    heads = ((layer.num_k_heads, layer.head_k_dim),) * 2 + ((layer.num_v_heads, layer.head_v_dim),)
    q, k, v = (t.reshape(B, T, *hd) for t, hd in
               zip(qkv.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1), heads))
    beta = layer.in_proj_b(x_BTD).sigmoid()
    g = -to_acc(layer.A_log).exp() * F.softplus(to_acc(layer.in_proj_a(x_BTD)) + layer.dt_bias)
    o = gated_delta_rule(q, k, v, g, beta, scale=layer.head_k_dim ** -0.5, batch=batch,
                         rule=fla_rule if fla else torch_rule)
    z = layer.in_proj_z(x_BTD).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
    return layer.out_proj(layer.norm(o, z).reshape(B, T, layer.value_dim))

