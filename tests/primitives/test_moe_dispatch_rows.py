"""primitives/moe_dispatch_rows.py (the chunked dispatch's own row bookkeeping: a counting sort of the
copies, the expert-major gather index) against stable sorts, and the chunked primitive on the CPU
running none of the twins' permutation code (common/moe_dispatch_permute.py). The regroup index:
tests/primitives/test_moe_dispatch_regroup.py."""
import sys

import pytest
import torch

from bumblebee.baselines.moe_dispatch import all_to_all_dispatch
from bumblebee.primitives import moe_dispatch_rows as rows
from bumblebee.primitives.moe_dispatch import chunked_dispatch_with
from bumblebee.primitives.moe_dispatch_options import ChunkedDispatch
from tests.contract_cases import moe_dispatch_case

COMMON = "common/moe_dispatch_permute.py"


def _routes(N, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    if not N:
        return torch.zeros(0, K, dtype=torch.int64)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])


@pytest.mark.parametrize("N,K,E,bounds", [(37, 3, 7, [0, 10, 10, 30, 37]), (50, 2, 5, None), (1, 1, 1, [0, 1]),
                                          (0, 2, 4, None), (23, 8, 8, [0, 7, 23])], ids=str)
@pytest.mark.parametrize("block", [rows.RANK_BLOCK_ELEMENTS, 9])  # one tile, or several blocks of ranks
def test_copy_order_is_a_stable_sort_by_key(N, K, E, bounds, block, monkeypatch):
    monkeypatch.setattr(rows, "RANK_BLOCK_ELEMENTS", block)
    flat = _routes(N, K, E, seed=N + E).reshape(-1)
    b = [0, N] if bounds is None else bounds
    C = len(b) - 1
    chunk = torch.repeat_interleave(torch.arange(C), torch.tensor([b[c + 1] - b[c] for c in range(C)]) * K)
    for chunk_major, key in ((True, chunk * E + flat), (False, flat * C + chunk)):
        order, inv, counts = rows.copy_order(flat.int(), E, None if bounds is None else [x * K for x in b],
                                             chunk_major=chunk_major)
        assert torch.equal(order, torch.argsort(key, stable=True))
        assert torch.equal(order[inv], torch.arange(N * K)) and inv.dtype == order.dtype == torch.int64
        want = torch.bincount(chunk * E + flat, minlength=C * E).view(C, E)  # per chunk, per expert
        assert torch.equal(counts, want)


def test_expert_major_rows_gather_chunk_major_rows_by_expert():
    g = torch.Generator().manual_seed(2)
    cl = torch.randint(0, 4, (3, 5), generator=g)
    cl[1] = 0
    R = int(cl.sum())
    expert_of_row = torch.repeat_interleave(torch.arange(5).repeat(3), cl.reshape(-1))  # chunk-major rows
    src = rows.expert_major_rows(cl, R)
    assert torch.equal(src, torch.argsort(expert_of_row, stable=True))


def _calls_into(path, fn):
    """The names of the functions defined in `path` that fn() calls (this thread: CPU autograd runs here)."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(path):
            seen.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("wgrad", ["gather", "add"])
def test_chunked_on_cpu_runs_none_of_the_twins_permutation(wgrad):
    (x, w, idx), kw, _ = moe_dispatch_case(torch.Generator().manual_seed(5))

    def run(fn):
        def step():
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(xs, ws, idx, **kw)
            out.pow(2).sum().backward()
            return out.detach(), xs.grad, ws.grad
        return step

    prim = run(lambda *a, **k: chunked_dispatch_with(ChunkedDispatch(wgrad=wgrad), *a, **k))
    assert not _calls_into(COMMON, prim)
    assert {"copy_order", "unpermute", "sum_copies"} <= _calls_into(COMMON, run(all_to_all_dispatch))  # it detects
    for ours, twin in zip(prim(), run(all_to_all_dispatch)()):
        assert (ours - twin).norm() <= 1e-6 * twin.norm()
