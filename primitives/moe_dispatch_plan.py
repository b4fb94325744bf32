"""The chunked dispatch's plan: the one count exchange (the host sync) and what every rank derives
from it alike.

Each rank sorts its routed copies by chunk and expert and sends every other rank one message: a
header (`HEAD` words: local token count, bad-shape flag, bad-index flag, E, a word for the chunking)
and its per-chunk counts per destination expert. From the messages every rank builds the same plan:
whether "auto" merges the chunks into one (every rank below `min_tokens`), which chunks hold any
token on any rank (the others are dropped), and per active chunk its token range, its range of the
sorted copies, the split sizes of its exchanges and the received rows per local expert. Bad local
inputs travel in the header, so every rank raises the same error and none hangs.
Shape legend as in `primitives/moe_dispatch.py`.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from bumblebee.primitives.moe_dispatch_rows import copy_order

HEAD = 5  # header words per message: local token count, bad-shape flag, bad-index flag, E, chunking


def chunk_bounds(n: int, spec: tuple) -> list:
    """Token boundaries [0, b1, ..., n] of the chunks: floor(n * cumulative share)."""
    total, acc, out = sum(spec), 0, [0]
    for s in spec:
        acc += s
        out.append(n * acc // total)
    return out


def spec_word(spec: tuple, auto: bool = False) -> int:
    return hash(spec + ((0,) if auto else ())) & 0xFFFFFFFF  # (.., 0) is no explicit spec: sizes are >= 1


@functools.lru_cache(maxsize=16)
def _header(N, shape_bad, E, word, device):
    """The count message's header on the device, cached (read only): a copy from the host per layer
    call costs host time in a step that is bound by it."""
    return torch.tensor([N, shape_bad, 0, E, word], dtype=torch.int64).to(device)


def exchange_counts(x_ND, weights_NK, indices_NK, E, spec, group, EP, min_tokens, early=None, auto=False):
    """Sorted copy order, the host view of every chunk's splits (the one host sync) and the received
    counts [C, S, L] of the active chunks, on the device (`kernels/moe_dispatch_regroup.py` turns them into
    the row indices). `early(order_M, copy_bounds)` is issued before the host sync (device work
    that needs no host counts keeps the GPU busy while the host waits); its result is returned.
    `auto`: below `min_tokens` on every rank the chunks merge into one (counts summed on the device
    before the sync), a decision every rank takes alike from the exchanged token counts."""
    N, K = indices_NK.shape
    L, C = E // EP, len(spec)
    shape_bad = x_ND.dim() != 2 or x_ND.shape[0] != N or weights_NK.shape != (N, K)
    flat_M = indices_NK.reshape(-1)
    # bad ids travel in the header, every rank raises after the exchange; int32 keys: half the radix
    # passes of the sort (C * E < 2^31), each pass a host launch in a host-bound small step
    keys_M = flat_M.clamp(0, E - 1).to(torch.int32)
    bad_idx = (keys_M != flat_M).any()
    bounds = chunk_bounds(N, spec)
    split = [b * K for b in bounds]
    may_merge = auto and C > 1 and N < min_tokens  # this rank's guess; merging needs every rank below
    # chunks are contiguous in token order: sorting by chunk * E + expert keeps them apart; a rank that
    # expects one chunk sorts by expert * C + chunk: the order of one chunk, counted per chunk for the message
    order_M, inv_M, counts_CE = copy_order(keys_M, E, split, chunk_major=not may_merge)
    dev = order_M.device
    word = spec_word(spec, auto)
    head = _header(N, int(shape_bad), E, word, dev)
    msg = torch.cat([head.expand(EP, HEAD), counts_CE.view(C, EP, L).transpose(0, 1).reshape(EP, C * L)], dim=1)
    msg[:, 2] = bad_idx
    if group is None:
        recv = msg
    else:
        recv = torch.empty_like(msg)
        dist.all_to_all_single(recv, msg, group=group)
    head_start = early(order_M, [0, N * K] if may_merge else split) if early is not None else None
    # a rank that guessed one chunk also reads its counts summed over the chunks, summed on the device
    merged = [t[:, HEAD:].unflatten(1, (C, L)).sum(1) for t in (msg, recv)] if may_merge else []
    host = torch.cat([t.reshape(-1) for t in [msg, recv] + merged]).tolist()  # the one host sync
    W = HEAD + C * L
    sent = [host[r * W:(r + 1) * W] for r in range(EP)]
    got = [host[EP * W + s * W:EP * W + (s + 1) * W] for s in range(EP)]
    for s, row in enumerate(got):
        if row[3] != E or row[4] != word:  # changed after the first-call check, same message size
            raise ValueError(f"ranks of the ep group disagree on num_experts or chunks: rank {s} has "
                             f"E={row[3]}, chunking {row[4]:#x}; this rank E={E}, chunking {word:#x}")
        if row[1] or row[2]:
            what = "inputs of mismatched shapes" if row[1] else f"expert indices outside [0, {E})"
            if s == (dist.get_rank(group) if group is not None else 0) and row[1]:
                what += (f": x {tuple(x_ND.shape)}, weights {tuple(weights_NK.shape)}, "
                         f"indices {tuple(indices_NK.shape)}")
            raise ValueError(f"moe_dispatch: rank {s} of the ep group passed {what}")
    # per chunk of the plan, per rank: the counts per local expert sent to it / received from it
    if auto and C > 1 and max(row[0] for row in got) < min_tokens:  # one chunk on every rank
        sums = host[2 * EP * W:]
        sent_CRL = [[sums[r * L:(r + 1) * L] for r in range(EP)]]
        got_CRL = [[sums[(EP + s) * L:(EP + s + 1) * L] for s in range(EP)]]
        recv_CSL = merged[1].unsqueeze(0)
        spec, C, bounds = (1,), 1, [0, N]
    else:
        sent_CRL = [[row[HEAD + c * L:HEAD + (c + 1) * L] for row in sent] for c in range(C)]
        got_CRL = [[row[HEAD + c * L:HEAD + (c + 1) * L] for row in got] for c in range(C)]
        recv_CSL = recv[:, HEAD:].view(EP, C, L).transpose(0, 1)
        if may_merge:  # another rank holds more tokens: chunks after all, sorted chunk-major
            order_M, inv_M, _ = copy_order(keys_M, E, split)
            head_start = None

    # A chunk that is empty on every rank is dropped by every rank alike (clamps C to the tokens).
    active = [c for c in range(C) if any(b[c + 1] > b[c] for b in (chunk_bounds(row[0], spec) for row in got))]
    plan, rows = [], 0
    for c in active:
        recv_SL = got_CRL[c]
        R = sum(map(sum, recv_SL))
        plan.append(dict(
            chunk=c,
            tokens=(bounds[c], bounds[c + 1]),
            copies=(bounds[c] * K, bounds[c + 1] * K),  # the chunk's range in sorted order and in token order
            in_splits=[sum(r) for r in sent_CRL[c]],
            out_splits=[sum(r) for r in recv_SL],
            tpe=list(map(sum, zip(*recv_SL))),  # zip/map: this host time is exposed
            rows=(rows, rows + R),  # the chunk's slice of dest_R
        ))
        rows += R
    if len(active) < C:
        recv_CSL = recv_CSL[active]
    return order_M, inv_M, plan, recv_CSL, head_start
