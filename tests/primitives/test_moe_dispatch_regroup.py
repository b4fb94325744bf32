"""kernels/moe_dispatch_regroup.py (the chunked dispatch's row indices from the received counts, one launch),
its algorithm in torch (primitives/moe_dispatch_rows.py:regroup_rows, the primitive's path where the
kernel does not run) and the twins' torch path (common/moe_dispatch_permute.py:regroup_rows) against a
plain-Python reference built block by block.

The Triton kernel runs under TRITON_INTERPRET=1 (this file run as a script in a subprocess,
`--interpret`): several chunks, sources and experts, zero counts (empty experts, a source that
sends nothing, an empty chunk), a non-contiguous counts view (as the primitive passes it), no
chunk at all. The compiled kernel runs on the GPU at layer sizes (`-m gpu`).
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from bumblebee.kernels import moe_dispatch_regroup as rg
from bumblebee.common import moe_dispatch_permute as twins
from bumblebee.primitives import moe_dispatch_rows as rows
from tests.interpreter import interpreted_fixture


def reference(counts_CSL):
    """dest, src, counts_CL, offs_CL by walking the blocks: chunk rows arrive (source, expert)-major,
    the GEMMs want them (expert, source)-major inside each chunk."""
    C, S, L = counts_CSL.shape
    cnt = counts_CSL.tolist()
    dest, src, counts, offs = [], [], [], []
    for c in range(C):
        start, pos = {}, 0
        for l in range(L):
            for s in range(S):
                start[s, l] = pos
                pos += cnt[c][s][l]
        chunk_dest = [start[s, l] + j for s in range(S) for l in range(L) for j in range(cnt[c][s][l])]
        inv = [0] * len(chunk_dest)
        for r, d in enumerate(chunk_dest):
            inv[d] = r
        dest += chunk_dest
        src += inv
        per_l = [sum(cnt[c][s][l] for s in range(S)) for l in range(L)]
        counts.append(per_l)
        offs.append([sum(per_l[:l + 1]) for l in range(L)])
    t = torch.tensor
    return (t(dest, dtype=torch.int64), t(src, dtype=torch.int64), t(counts, dtype=torch.int64).view(C, L),
            t(offs, dtype=torch.int32).view(C, L))


def cases(device="cpu", big=False):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 2, 128), (4, 8, 32)] if big else [(1, 2, 5), (3, 2, 4), (2, 3, 1), (1, 1, 1)]
    for C, S, L in shapes:
        cnt = torch.randint(0, 6, (C, S, L), generator=g)
        yield f"{C}x{S}x{L}", cnt
        sparse = cnt.clone()
        sparse[torch.rand(C, S, L, generator=g) < 0.5] = 0
        sparse[:, 0] = 0  # a source that sends nothing
        if C > 1:
            sparse[1] = 0  # an empty chunk
        yield f"{C}x{S}x{L} sparse", sparse
        # the primitive's layout: a transposed view of the received [S, C, L] message
        yield f"{C}x{S}x{L} view", torch.randint(0, 6, (S, C, L), generator=g).transpose(0, 1)
    yield "no chunk", torch.zeros(0, 2, 3, dtype=torch.int64)


def compare(fn, device, big=False):
    fails = []
    for name, cnt in cases(big=big):
        want = reference(cnt)
        rows = cnt.sum((1, 2)).tolist()
        got = fn(cnt.to(device), rows)
        for what, a, b in zip(("dest", "src", "counts", "offs"), got, want):
            if a.dtype != b.dtype or not torch.equal(a.cpu(), b):
                fails.append(f"{name}: {what}")
    return fails


def _interpret_main():
    assert rg.triton is not None and rg.use_triton(torch.zeros(1))
    print(json.dumps({"ok": True, "fails": compare(rg.regroup, "cpu")}))


interpreted = interpreted_fixture(__file__)


def test_kernel_under_triton_interpreter(interpreted):
    assert not interpreted["fails"], interpreted["fails"]


@pytest.mark.parametrize("fn", [rows.regroup_rows, twins.regroup_rows], ids=["primitive", "twins"])
def test_torch_path_matches_reference(fn):
    assert not compare(fn, "cpu")


def test_bad_input():
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="counts_CSL must be int64"):
        rg.regroup(torch.zeros(1, 2, 3, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="C = len"):
        rg.regroup(torch.zeros(2, 2, 3, dtype=torch.int64), [0])
    if not rg.use_triton(torch.zeros(1)):  # CPU tensors without the interpreter: the torch path's job
        with pytest.raises(ValueError, match="regroup_rows is the torch path"):
            rg.regroup(torch.zeros(2, 2, 3, dtype=torch.int64), [0, 0])


@pytest.mark.gpu
def test_cuda_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert not compare(rg.regroup, "cuda", big=True)


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()
