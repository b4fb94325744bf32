"""Token dispatch for an MoE block: the `moe_dispatch` slot's references.

`local` (one rank): permute the token copies by expert (stable, so each expert sees its tokens in
order), run every expert on its contiguous rows in one grouped call, scale by the routing weights
and add the copies back to their tokens. Dropless: every routed copy is computed.

`all_to_all` (expert parallel, no chunking; the twin of `primitives/moe_dispatch.py`): the experts
are sharded over the `ep` process group held by `experts.ep_group` (rank r holds global experts
[r*E/EP, (r+1)*E/EP)); `None` or a group of one rank means all experts are local. Steps:
  1. permute the copies by global expert (so also by destination rank), count them per expert;
  2. exchange the counts (one small all_to_all), read them on the host: the ONE host sync;
  3. all_to_all the rows with uneven splits; regroup what arrived from (source, expert) order to
     (expert, source) order; one grouped expert call on the local experts;
  4. undo the regroup, the reverse all_to_all, weight and sum each token's K copies.
Autograd runs through both all_to_alls (their backward is the opposite all_to_all). The permutation
steps (sort, counts, regroup index, gather / weighted sum over K and their gradients) come from
`common/moe_dispatch_permute.py` (the chunked primitive has its own): gathers and sums, no atomics.

Both accept `chunks=` for signature parity with the chunked primitive and ignore it.

Shape legend: N tokens, K experts per token, M = N*K routed copies, D model width, E experts,
EP ranks in the ep group, L = E/EP local experts, R rows received by this rank.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from bumblebee.distributed import agree_once
from bumblebee.common.moe_dispatch_permute import Permute, RowPermutation, Unpermute, copy_order, inverse_index, regroup_index
from bumblebee.registry import register

_AGREED = weakref.WeakKeyDictionary()  # experts -> the config its first-call agreement check passed


def _check_shapes(x_ND, weights_NK, indices_NK):
    N, K = indices_NK.shape
    if x_ND.dim() != 2 or x_ND.shape[0] != N or weights_NK.shape != (N, K):
        return (f"x [N, D], weights [N, K] and indices [N, K] disagree: {tuple(x_ND.shape)}, "
                f"{tuple(weights_NK.shape)}, {tuple(indices_NK.shape)}")
    return None


@register("moe_dispatch", "local", kind="baseline")
def local_dispatch(x_ND, weights_NK, indices_NK, experts, num_experts, *, chunks=None):
    """Permute tokens by expert on one rank, grouped expert call, weighted un-permute."""
    group = getattr(experts, "ep_group", None)
    if group is not None and dist.get_world_size(group) > 1:
        raise ValueError("local dispatch needs all experts on this rank; the experts are sharded over an ep "
                         "group: use moe_dispatch='all_to_all' or 'chunked'")
    if indices_NK.dim() != 2:
        raise ValueError(f"indices must be [N, K], got shape {tuple(indices_NK.shape)}")
    N, K = indices_NK.shape
    err = _check_shapes(x_ND, weights_NK, indices_NK)
    if err:
        raise ValueError(err)
    bad = (indices_NK < 0) | (indices_NK >= num_experts)
    if bool(bad.any()):  # one host sync: wrong ids would otherwise fail deep in a split (or not at all)
        ids = sorted(set(indices_NK[bad].tolist()))
        raise ValueError(f"moe_dispatch: expert indices {ids[:8]} are outside [0, num_experts={num_experts})")
    order_M, inv_M, counts_1E = copy_order(indices_NK.reshape(-1), num_experts)
    x_MD = Permute.apply(x_ND, order_M // K, inv_M, K)
    y_MD = experts(x_MD, counts_1E[0])
    return Unpermute.apply(y_MD, weights_NK, order_M, inv_M, x_ND.dtype)


# ---- expert parallel, no chunking -------------------------------------------------------------------

def ep_size_rank(group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# agree_once (bumblebee.distributed) checks the config on the first call only. A later change of the
# expert count or of the number of chunks on one rank alone changes the size of the count exchange
# and is not caught: change them on every rank together.


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven row splits; the backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _a2a(g, in_splits, out_splits, ctx.group), None, None, None


def _a2a(x, out_splits, in_splits, group):
    if group is None:
        return x
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


@register("moe_dispatch", "all_to_all", kind="baseline")
def all_to_all_dispatch(x_ND, weights_NK, indices_NK, experts, num_experts, *, chunks=None):
    """Expert parallel over experts.ep_group: one all_to_all each way, no chunking (dropless)."""
    group = getattr(experts, "ep_group", None)
    EP, _ = ep_size_rank(group)
    group = group if EP > 1 else None
    N, K = indices_NK.shape
    E = num_experts
    agree_once(experts, group, x_ND.device, {  # same fields, same length as the chunked primitive's check
        "impl (all_to_all=1, chunked=2)": 1, "num_experts": E, "ep size": EP, "top_k": K,
        "model width": x_ND.shape[-1] if x_ND.dim() == 2 else -1, "chunk count": 1, "chunk sizes": 0}, _AGREED)
    if E % EP:
        raise ValueError(f"num_experts={E} is not divisible by the ep group size {EP}")
    L = E // EP

    # Local problems travel in the header of the count exchange: every rank raises, none hangs.
    shape_err = _check_shapes(x_ND, weights_NK, indices_NK)
    flat_M = indices_NK.reshape(-1)
    bad_idx = ((flat_M < 0) | (flat_M >= E)).any()  # False when empty
    order_M, inv_M, counts_1E = copy_order(flat_M.clamp(0, E - 1), E)
    counts_RL = counts_1E.view(EP, L)  # copies for each destination's experts
    head = torch.stack([torch.full((), 1 if shape_err else 0, device=counts_RL.device),
                        bad_idx.to(counts_RL.device, torch.int64), torch.full((), E, device=counts_RL.device)])
    msg = torch.cat([head.expand(EP, 3), counts_RL], dim=1)
    recv = _a2a(msg, [1] * EP, [1] * EP, group)  # recv[s] = header of s + its copies for my experts
    host = torch.cat([msg.reshape(-1), recv.reshape(-1)]).tolist()  # the one host sync
    sent, got = host[:msg.numel()], host[msg.numel():]
    heads = [got[s * (L + 3):s * (L + 3) + 3] for s in range(EP)]
    for s, (bad_shape, bad_index, their_E) in enumerate(heads):
        if their_E != E:
            raise ValueError(f"ranks of the ep group disagree on num_experts: rank {s} has {their_E}, this rank {E}")
        if bad_shape or bad_index:
            what = shape_err if bad_shape and shape_err else ("inputs of mismatched shapes" if bad_shape else
                                                               f"expert indices outside [0, {E})")
            raise ValueError(f"moe_dispatch: rank {s} of the ep group passed {what}")
    in_splits = [sum(sent[r * (L + 3) + 3:(r + 1) * (L + 3)]) for r in range(EP)]
    out_splits = [sum(got[s * (L + 3) + 3:(s + 1) * (L + 3)]) for s in range(EP)]
    recv_SL = recv[:, 3:]

    x_RD = _AllToAll.apply(Permute.apply(x_ND, order_M // K, inv_M, K), out_splits, in_splits, group)
    # regroup (source, expert) -> (expert, source): row i goes to dest_R[i]
    R = sum(out_splits)
    dest_R = regroup_index(recv_SL.unsqueeze(0), R)
    src_R = inverse_index(dest_R)
    y_RD = experts(RowPermutation.apply(x_RD, src_R, dest_R), recv_SL.sum(0))
    if R == 0:  # no rows here: keep x_RD in the graph so this rank joins the backward all_to_all too
        y_RD = y_RD + x_RD
    y_RD = RowPermutation.apply(y_RD, dest_R, src_R)  # back to (source, expert) order
    y_MD = _AllToAll.apply(y_RD, in_splits, out_splits, group)
    return Unpermute.apply(y_MD, weights_NK, order_M, inv_M, x_ND.dtype)
