"""`gdn_fla.conv_entering_states` on gloo ranks (CPU; fla's context stood in by the fields it reads): the
entering conv states of a rank's local sequences hold, for each part's first sequence, the W - 1 tokens
before the part in the whole sequence, cut at the document start, in fla's CP conv layout (history in the
last columns); every other row zero; and the gradients of those states reach the ranks and positions that
hold the tokens (the all-gather's reduce-scatter backward), as autograd on the whole sequence says.
Unpacked and packed (a document starting 1 token before a part, one inside a part), CP = 2 and 4."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bumblebee.primitives.context_parallel import layout
from bumblebee.primitives.context_parallel.gdn_fla import conv_entering_states
from tests.primitives.context_parallel_ranks import spawn

T, W, WIDTHS = 64, 4, (3, 3, 5)  # q, k, v channels
DOCS = {"unpacked": None, "packed": (0, 7, 23, 40, 64)}  # CP 4: parts of 8; 23 is 1 token before part 3's 24


def _context(group, cu):
    """The fields of fla's zigzag FLACPContext that conv_entering_states reads, from the layout."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    L = T // (2 * cp)
    bounds = list(cu) if cu is not None else [0, T]
    chunks = (rank, 2 * cp - 1 - rank)
    local, counts, pre = [0], [], []
    for c in chunks:
        lo, hi = c * L, (c + 1) * L
        cuts = sorted({lo, hi, *[b for b in bounds if lo < b < hi]})
        counts.append(len(cuts) - 1)
        local += [local[-1] + (b - a) for a, b in zip(cuts[:-1], cuts[1:])]
        pre.append(lo - max(b for b in bounds if b <= lo))  # tokens of the part's first document before it
    return SimpleNamespace(group=group, part_len=L, cu_seqlens=torch.tensor(local), front_num_seqs=counts[0],
                           is_first_by_part=tuple(c == 0 for c in chunks), pre_num_conv_tokens_by_part=tuple(pre))


def _expected(full, ctx, chunks, bounds):
    """The states from the whole sequence: row of each part's first sequence, column W - 1 - j the token
    j + 1 before the part, where it lies in the same document."""
    N, C = len(ctx.cu_seqlens) - 1, full.shape[-1]
    rows = []
    for part, c in enumerate(chunks):
        start = c * ctx.part_len
        doc = max(b for b in bounds if b <= start)
        cols = [full[0, start - 1 - j] if start - 1 - j >= doc else full.new_zeros(C) for j in range(W - 1)]
        rows.append(torch.stack([full.new_zeros(C)] + cols[::-1], dim=1))  # [C, W]
    out = [torch.zeros(C, W, dtype=full.dtype)] * N
    out[0], out[ctx.front_num_seqs] = rows[0], rows[1]
    return torch.stack(out)


def halo(group):
    results = {}
    for name, cu in DOCS.items():
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        batch = layout.make_batch(group, T, None if cu is None else torch.tensor(cu))
        ctx = _context(group, cu)
        torch.manual_seed(0)  # the same whole sequence on every rank
        full = [torch.randn(1, T, c, dtype=torch.float64) for c in WIDTHS]
        rows = len(ctx.cu_seqlens) - 1  # each rank's own loss weights over its states
        weight = torch.randn(rows, sum(WIDTHS), W, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        mine = [f[:, batch.index].clone().requires_grad_() for f in full]
        got = conv_entering_states(mine, context=ctx, width=W)
        (got * weight).sum().backward()
        leaves = [f.clone().requires_grad_() for f in full]
        want = _expected(torch.cat(leaves, dim=-1), ctx, (rank, 2 * cp - 1 - rank), list(cu or (0, T)))
        (want * weight).sum().backward()
        grads = [leaf.grad.clone() for leaf in leaves]
        for g in grads:  # every rank's loss reads some rank's tokens: the whole gradient is the sum
            dist.all_reduce(g)
        results[name] = {"states": (got.detach(), want.detach()),
                         "grads": [(m.grad, g[:, batch.index]) for m, g in zip(mine, grads)]}
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_entering_states_and_their_gradients_equal_the_whole_sequence(world, tmp_path):
    for rank, res in enumerate(spawn(world, __name__, "halo", tmp_path)):
        for name, case in res.items():
            got, want = case["states"]
            assert got.shape == want.shape and torch.equal(got, want), (world, rank, name)
            for got_g, want_g in case["grads"]:
                torch.testing.assert_close(got_g, want_g, rtol=0, atol=1e-12, msg=f"{world} {rank} {name}")
