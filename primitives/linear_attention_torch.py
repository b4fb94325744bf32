"""flash-linear-attention's gated DeltaNet algorithm written in torch: the `fla` primitive's path where
fla's Triton kernels do not run (a CPU, fla not installed, fla's gated backward unusable).

`chunk_gated_delta_rule_torch` follows the steps of fla's `chunk_gated_delta_rule` forward, in its
order, with its chunk of 64 tokens (fp32, or float64 for float64 inputs):

  1. l2-normalize q and k inside the rule (`use_qk_l2norm_in_kernel`): x / sqrt(sum(x^2) + 1e-6);
  2. `chunk_local_cumsum`: G, the cumulative log decay from each chunk's start;
  3. `chunk_scaled_dot_kkt`: A = strictly lower part of beta_i k_i.k_j exp(G_i - G_j);
  4. `solve_tril`: (I + A)^-1, each 16 x 16 diagonal block by forward substitution, then the
     off-diagonal blocks block row by block row (`merge_16x16_to_64x64_inverse`);
  5. `recompute_w_u`: w = (I + A)^-1 (beta exp(G) k), u = (I + A)^-1 (beta v);
  6. `chunk_gated_delta_rule_fwd_h`: the state entering every chunk, h_c, by a scan over chunks:
     v_new = u - w h_c, h_{c+1} = exp(G_last) h_c + (exp(G_last - G) k)^T v_new;
  7. `chunk_fwd_o`: o = scale (exp(G) q h_c + tril(q k^T exp(G_i - G_j)) v_new), all chunks at once.

Value head hv reads key head hv // (HV / H) through a broadcast view (no repeated copy of q, k), and
the scale multiplies the output, as in fla. Packed sequences restart the chunks at every sequence
start. The backward is autograd's through these steps. `causal_conv1d_silu_taps` is fla's
`causal_conv1d` with SiLU: a loop over the W taps, each masked where it would reach before its
sequence's first token.

Shape legend: B batch, T tokens, H key heads, R = HV / H value heads per key head, N chunks, C chunk
length (64), Dk / Dv head dims, W conv width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.checks import check_cu_seqlens

CHUNK = 64  # fla's BT for the gated delta rule
BLOCK = 16  # solve_tril's diagonal blocks


def _acc(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _positions(B: int, T: int, cu_seqlens, device):
    """[B*T] each token's position inside its sequence (rows, or the packed stream's sequences)."""
    if cu_seqlens is None:
        return torch.arange(T, device=device).repeat(B)
    cu = check_cu_seqlens(cu_seqlens, B * T)
    starts = torch.tensor(cu[:-1], device=device)
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
    return torch.arange(B * T, device=device) - torch.repeat_interleave(starts, lengths)


def causal_conv1d_silu_taps(x_BTC, weight_CW, cu_seqlens=None):
    """SiLU(depthwise causal conv) in fp32, returned in x's dtype; tap s reads the token s steps back
    when that token is in the same sequence."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    x = _acc(x_BTC.reshape(B * T, C))
    w = _acc(weight_CW)
    pos = _positions(B, T, cu_seqlens, x.device)[:, None]
    y = x * w[:, W - 1]
    for s in range(1, W):
        y = y + torch.where(pos >= s, x.roll(s, dims=0), 0.0) * w[:, W - 1 - s]
    return F.silu(y).reshape(B, T, C).to(x_BTC.dtype)


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _forward_substitution(L):
    """(I + L)^-1 for strictly lower L [..., n, n], row by row: X_i = e_i - L_i[:i] X[:i]."""
    n = L.shape[-1]
    eye = torch.eye(n, dtype=L.dtype, device=L.device)
    rows = [eye[0].expand(L.shape[:-2] + (n,))]
    for i in range(1, n):
        done = torch.stack(rows, dim=-2)  # [..., i, n]
        rows.append(eye[i] - (L[..., i:i + 1, :i] @ done)[..., 0, :])
    return torch.stack(rows, dim=-2)


def solve_tril(A):
    """(I + A)^-1 for strictly lower A [..., C, C] as fla's solve_tril: the diagonal 16 x 16 blocks
    inverted on their own, then X_rc = -X_rr sum_{m=c}^{r-1} A_rm X_mc for the blocks below them."""
    n = A.shape[-1] // BLOCK
    blk = lambda t, r, c: t[..., r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK]  # noqa: E731
    diag = _forward_substitution(torch.stack([blk(A, r, r) for r in range(n)], dim=-3))
    X = {(r, r): diag[..., r, :, :] for r in range(n)}
    for r in range(1, n):
        for c in range(r - 1, -1, -1):
            X[r, c] = -X[r, r] @ sum(blk(A, r, m) @ X[m, c] for m in range(c, r))
    zero = torch.zeros_like(diag[..., 0, :, :])
    return torch.cat([torch.cat([X.get((r, c), zero) for c in range(n)], dim=-1) for r in range(n)], dim=-2)


def _rule_rows(q, k, v, g, beta, scale):
    """Whole sequences, one per row. q, k [B, L, H, Dk]; v [B, L, H, R, Dv]; g, beta [B, L, H, R] (all
    in the accumulation dtype) -> o [B, L, H, R, Dv]."""
    B, L, H, R, Dv = v.shape
    pad = (-L) % CHUNK  # zero keys and beta: padded tokens leave the state alone
    q, k = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k))
    v = F.pad(v, (0, 0, 0, 0, 0, 0, 0, pad))
    g, beta = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (g, beta))
    N = (L + pad) // CHUNK
    # [B, H, 1, N, C, Dk] keys and queries (shared by the R value heads), [B, H, R, N, C, *] the rest
    q, k = (t.reshape(B, N, CHUNK, H, -1).permute(0, 3, 1, 2, 4)[:, :, None] for t in (q, k))
    v = v.reshape(B, N, CHUNK, H, R, Dv).permute(0, 3, 4, 1, 2, 5)
    g, beta = (t.reshape(B, N, CHUNK, H, R).permute(0, 3, 4, 1, 2) for t in (g, beta))
    G = g.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # j -> i, i >= j
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    Ai = solve_tril(A)
    w = Ai @ (k * (beta * G.exp())[..., None])
    u = Ai @ (v * beta[..., None])
    h = q.new_zeros(B, H, R, k.shape[-1], Dv)
    states, v_new = [], []
    for c in range(N):
        states.append(h)
        vn = u[..., c, :, :] - w[..., c, :, :] @ h
        v_new.append(vn)
        G_c = G[..., c, :]
        k_dec = k[..., c, :, :] * (G_c[..., -1:] - G_c).exp()[..., None]
        h = h * G_c[..., -1, None, None].exp() + k_dec.transpose(-1, -2) @ vn
    h_c, v_new = torch.stack(states, dim=-3), torch.stack(v_new, dim=-3)  # [B, H, R, N, Dk|C, Dv]
    o = (q * G.exp()[..., None]) @ h_c + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    o = (o * scale).permute(0, 3, 4, 1, 2, 5).reshape(B, N * CHUNK, H, R, Dv)
    return o[:, :L]


def chunk_gated_delta_rule_torch(q, k, v, g, beta, *, scale: float, cu_seqlens=None):
    """q, k [B, T, H, Dk], v [B, T, HV, Dv], g (log decays) and beta [B, T, HV] -> o [B, T, HV, Dv] in v's
    dtype; q and k are l2-normalized here; cu_seqlens [S+1]: the B*T tokens are packed sequences."""
    B, T, H, Dk = k.shape
    HV, Dv = v.shape[2:]
    if q.shape != k.shape or v.shape[:2] != (B, T) or g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"gated delta rule: q, k [B, T, H, Dk], v [B, T, HV, Dv], g and beta [B, T, HV] disagree: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    if HV % H:
        raise ValueError(f"gated delta rule: key heads ({H}) must divide value heads ({HV})")
    R, dtype = HV // H, v.dtype
    q, k = _l2norm(_acc(q)), _l2norm(_acc(k))
    v, g, beta = _acc(v).reshape(B, T, H, R, Dv), _acc(g).reshape(B, T, H, R), _acc(beta).reshape(B, T, H, R)
    if cu_seqlens is None:
        o = _rule_rows(q, k, v, g, beta, scale)
    else:  # one sequence at a time: the chunks restart at every sequence start
        cu = check_cu_seqlens(cu_seqlens, B * T)
        flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o = torch.cat([_rule_rows(*(t[a:b][None] for t in flat), scale)[0] for a, b in zip(cu, cu[1:])])
    return o.reshape(B, T, HV, Dv).to(dtype)
