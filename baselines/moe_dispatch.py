"""Local (single-rank) token dispatch for an MoE block: the `moe_dispatch` slot's reference.

Permute the token copies by expert (stable, so each expert sees its tokens in order), run every
expert on its contiguous rows in one grouped call, scale by the routing weights and add the copies
back to their tokens. Dropless: every routed copy is computed. Expert parallelism (all-to-all over
the ep group) is another implementation of this slot with the same signature.

Shape legend: N tokens, K experts per token, M = N*K routed copies, D model width, E experts.
"""
from __future__ import annotations

import torch

from bumblebee.registry import register


@register("moe_dispatch", "local", kind="baseline", default=True)
def local_dispatch(x_ND, weights_NK, indices_NK, experts, num_experts):
    """Permute tokens by expert on one rank, grouped expert call, weighted un-permute."""
    N, K = indices_NK.shape
    if x_ND.shape[0] != N or weights_NK.shape != (N, K):
        raise ValueError(f"x [N, D], weights [N, K] and indices [N, K] disagree: {tuple(x_ND.shape)}, "
                         f"{tuple(weights_NK.shape)}, {tuple(indices_NK.shape)}")
    flat_M = indices_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    token_M = order_M // K
    tokens_per_expert_E = torch.bincount(flat_M, minlength=num_experts)
    y_MD = experts(x_ND[token_M], tokens_per_expert_E)
    y_MD = y_MD * weights_NK.reshape(-1)[order_M].unsqueeze(-1)
    return torch.zeros_like(x_ND).index_add_(0, token_M, y_MD.to(x_ND.dtype))
