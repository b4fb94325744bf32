"""The chunked dispatch's row indices after the count exchange, in one Triton launch.

Rows arrive from the dispatch all_to_all in (chunk, source rank, local expert) blocks, counts_CSL
[C, S, L] rows each; the grouped GEMMs want each chunk's rows in (expert, source) order. From the
counts alone (on the device, no host sync beyond the row total the caller already holds):

  dest_R [R]     row r -> its position inside its chunk in (expert, source) order
  src_R  [R]     the inverse within each chunk: chunk rows in expert order = x_chunk[src]
  counts_CL      rows per (chunk, local expert)
  offs_CL int32  their inclusive prefix sums per chunk (the grouped GEMMs' offsets)

The torch path (`common/moe_dispatch_permute.py:regroup_rows`: `regroup_index`, `inverse_index`, a sum
and a cumsum, what the twin runs) is about 17 small kernels, each a host launch; right after the count exchange's host sync the GPU
waits for every one of them, and in a small step (4K tokens per rank) that is most of the
forward's idle time. Here one program per (chunk, source, expert) block sums the counts before it
(in source order and in expert order; C * E blocks, so at most a few thousand loads each) and
writes the block's rows of dest and src. Integer arithmetic: the same result as the torch path,
bit for bit.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is absent on some CPU-only installs
    triton = None


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _regroup_kernel(cnt_ptr, dest_ptr, src_ptr, counts_ptr, offs_ptr, S, L, sc, ss, sl,
                        BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
        b = tl.program_id(0)  # this block, (c, s, l) in source order
        SL = S * L
        c = b // SL
        s = (b // L) % S
        l = b % L
        n = tl.load(cnt_ptr + c * sc + s * ss + l * sl)
        before = tl.zeros([BLOCK_E], dtype=tl.int64)  # blocks before b, source order (all chunks)
        chunk = tl.zeros([BLOCK_E], dtype=tl.int64)  # blocks of chunks before c
        for j0 in range(0, b, BLOCK_E):
            j = j0 + tl.arange(0, BLOCK_E)
            v = tl.load(cnt_ptr + (j // SL) * sc + ((j // L) % S) * ss + (j % L) * sl, mask=j < b, other=0)
            before += v
            chunk += tl.where(j < c * SL, v, 0)
        s0 = tl.sum(before, axis=0)
        r0 = tl.sum(chunk, axis=0)
        ahead = tl.zeros([BLOCK_E], dtype=tl.int64)  # chunk c's blocks before (l, s) in (expert, source) order
        same = tl.zeros([BLOCK_E], dtype=tl.int64)  # chunk c's rows of expert l (every source)
        for k0 in range(0, SL, BLOCK_E):
            k = k0 + tl.arange(0, BLOCK_E)
            s2, l2 = k // L, k % L
            v = tl.load(cnt_ptr + c * sc + s2 * ss + l2 * sl, mask=k < SL, other=0)
            ahead += tl.where((l2 < l) | ((l2 == l) & (s2 < s)), v, 0)
            same += tl.where(l2 == l, v, 0)
        d0 = tl.sum(ahead, axis=0)
        if s == 0:  # one program per (chunk, expert) writes its count and inclusive offset
            tot = tl.sum(same, axis=0)
            tl.store(counts_ptr + c * L + l, tot)
            tl.store(offs_ptr + c * L + l, (d0 + tot).to(tl.int32))
        for j0 in range(0, n, BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R)
            ok = j < n
            tl.store(dest_ptr + s0 + j, d0 + j, mask=ok)
            tl.store(src_ptr + r0 + d0 + j, s0 - r0 + j, mask=ok)


def regroup(counts_CSL: torch.Tensor, chunk_rows: list):
    """(dest_R, src_R, counts_CL, offs_CL) of rows received in (chunk, source, expert) blocks;
    `chunk_rows[c]` = counts_CSL[c].sum(), known on the host (the plan). One Triton launch; the tensors
    must be on CUDA (or TRITON_INTERPRET=1 set), see `use_triton`."""
    if counts_CSL.dim() != 3 or counts_CSL.dtype != torch.int64 or len(chunk_rows) != counts_CSL.shape[0]:
        raise ValueError(f"counts_CSL must be int64 [C, S, L] with C = len(chunk_rows) = {len(chunk_rows)}, "
                         f"got {counts_CSL.dtype} {tuple(counts_CSL.shape)}")
    if not use_triton(counts_CSL):
        raise ValueError("regroup runs the Triton kernel: counts_CSL must be on CUDA (or TRITON_INTERPRET=1); "
                         "bumblebee.primitives.moe_dispatch_rows.regroup_rows is the torch path")
    C, S, L = counts_CSL.shape
    rows = sum(chunk_rows)
    dev = counts_CSL.device
    dest = torch.empty(rows, dtype=torch.int64, device=dev)
    src = torch.empty(rows, dtype=torch.int64, device=dev)
    counts_CL = torch.empty(C, L, dtype=torch.int64, device=dev)
    offs_CL = torch.empty(C, L, dtype=torch.int32, device=dev)
    if C * S * L:
        _regroup_kernel[(C * S * L,)](counts_CSL, dest, src, counts_CL, offs_CL, S, L, *counts_CSL.stride(),
                                      BLOCK_E=256, BLOCK_R=256)
    return dest, src, counts_CL, offs_CL
