"""The chunked dispatch's row bookkeeping in torch, its own algorithms (the twins sort: common/).

- `copy_order`: where each routed copy goes when the copies are grouped by key (chunk * E + expert,
  or expert * C + chunk), stable in token order. Off CUDA a counting sort: the counts per key, their
  exclusive prefix sums (each key's first row), and each copy's rank among the earlier copies of its
  key (a one-hot prefix sum, block by block), so row = first[key] + rank, and the order is that row
  index scattered. On CUDA it stays the radix sort of `common/moe_dispatch_permute.py:copy_order`
  (one `torch.sort`, what the GPU benchmarks measured; a counting sort there costs O(M x keys)).
- `regroup_rows`: the regroup kernel's algorithm (`kernels/moe_dispatch_regroup.py`) in torch. Per
  block b = (chunk c, source s, expert l) of counts_CSL: s0, its first row in arrival order (the
  blocks before it, source order); r0, the first row of its chunk; d0, the rows of its chunk before
  it in (expert, source) order. Row s0 + j of the block goes to d0 + j of its chunk (dest), and
  the chunk's row d0 + j comes from s0 - r0 + j (src). Integer arithmetic: the kernel's bits.
- `expert_major_rows`: for the delayed wgrad's one GEMM per weight, the chunk-major row that fills
  each row of the expert-major buffer (blocks (expert, chunk)), as one gather index: no inverse.

Shape legend as in `primitives/moe_dispatch.py`; M copies, R rows.
"""
from __future__ import annotations

import torch

from bumblebee.common.moe_dispatch_permute import copy_order as _radix_copy_order

RANK_BLOCK_ELEMENTS = 1 << 22  # one-hot [block, keys] int64 tile of the counting sort: 32 MiB


def _exclusive_cumsum(t, dim=-1):
    return t.cumsum(dim) - t


def _stable_ranks(key_M: torch.Tensor, num_keys: int) -> torch.Tensor:
    """For each copy, how many copies before it (token-major) have its key."""
    M = key_M.numel()
    block = max(1, RANK_BLOCK_ELEMENTS // max(1, num_keys))
    seen_K = torch.zeros(num_keys, dtype=torch.int64, device=key_M.device)
    rank_M = torch.empty(M, dtype=torch.int64, device=key_M.device)
    for a in range(0, M, block):
        k = key_M[a:a + block]
        onehot = torch.nn.functional.one_hot(k, num_keys)  # [b, keys]
        rank_M[a:a + block] = onehot.cumsum(0).gather(1, k[:, None])[:, 0] - 1 + seen_K[k]
        seen_K += onehot.sum(0)
    return rank_M


def copy_order(flat_M: torch.Tensor, num_keys: int, copy_bounds=None, chunk_major: bool = True):
    """(order_M, inv_M, counts [C, num_keys]): the copies grouped by key = chunk * num_keys + expert
    (chunk_major) or expert * C + chunk, stable in token order; chunk c holds the copies
    [copy_bounds[c], copy_bounds[c + 1]). order_M: row -> token-major copy id; inv_M its inverse.
    flat_M must lie in [0, num_keys)."""
    if flat_M.is_cuda:
        return _radix_copy_order(flat_M, num_keys, copy_bounds, chunk_major)
    M, dev = flat_M.numel(), flat_M.device
    bounds = torch.tensor([0, M] if copy_bounds is None else list(copy_bounds), device=dev)
    C = bounds.numel() - 1
    chunk_M = torch.searchsorted(bounds[1:-1], torch.arange(M, device=dev), right=True)
    expert_M = flat_M.reshape(-1).long()
    key_M = chunk_M * num_keys + expert_M if chunk_major else expert_M * C + chunk_M
    counts = torch.bincount(key_M, minlength=C * num_keys)
    inv_M = _exclusive_cumsum(counts)[key_M] + _stable_ranks(key_M, C * num_keys)  # copy -> its row
    order_M = torch.empty_like(inv_M).scatter_(0, inv_M, torch.arange(M, device=dev))
    counts = counts.view(C, num_keys) if chunk_major else counts.view(num_keys, C).t().contiguous()
    return order_M, inv_M, counts


def regroup_rows(counts_CSL: torch.Tensor, chunk_rows: list):
    """(dest_R, src_R, counts_CL, offs_CL int32) of rows received in (chunk, source, expert) blocks of
    counts_CSL [C, S, L]; chunk_rows[c] = counts_CSL[c].sum(), known on the host. The same outputs
    as `kernels/moe_dispatch_regroup.py:regroup`, by its per-block arithmetic."""
    C, S, L = counts_CSL.shape
    dev, rows = counts_CSL.device, sum(chunk_rows)
    n_B = counts_CSL.reshape(-1)  # blocks in arrival (chunk, source, expert) order
    s0_B = _exclusive_cumsum(n_B)
    r0_B = _exclusive_cumsum(counts_CSL.sum((1, 2))).repeat_interleave(S * L)
    d0_B = _exclusive_cumsum(counts_CSL.transpose(1, 2).reshape(C, L * S)).view(C, L, S).transpose(1, 2).reshape(-1)
    block_R = torch.repeat_interleave(torch.arange(C * S * L, device=dev), n_B, output_size=rows)
    j_R = torch.arange(rows, device=dev) - s0_B[block_R]
    dest_R = d0_B[block_R] + j_R
    src_R = torch.empty_like(dest_R).scatter_(0, r0_B[block_R] + dest_R, s0_B[block_R] - r0_B[block_R] + j_R)
    counts_CL = counts_CSL.sum(1)
    return dest_R, src_R, counts_CL, torch.cumsum(counts_CL, 1, dtype=torch.int32)


def expert_major_rows(counts_CL: torch.Tensor, rows: int) -> torch.Tensor:
    """src_R: row i of one buffer grouped by expert (chunks in order inside each expert) is row src_R[i]
    of the C chunks concatenated, each chunk grouped by expert (counts_CL[c, e] rows)."""
    C, L = counts_CL.shape
    chunk_first = _exclusive_cumsum(counts_CL.reshape(-1)).view(C, L).t().reshape(-1)  # blocks (e, c)
    n_B = counts_CL.t().reshape(-1)
    shift_B = chunk_first - _exclusive_cumsum(n_B)
    return torch.arange(rows, device=counts_CL.device) + torch.repeat_interleave(shift_B, n_B, output_size=rows)
