"""The attention slot on packed sequences (`cu_seqlens`): primitive and twin equal each sequence run
alone (float64, GQA), in [1, H, N, D] and [B, H, T, D] layouts of the same stream; bad boundaries
raise ValueError naming cu_seqlens."""
import pytest
import torch

from bumblebee import packing
from bumblebee.registry import resolve


def _inputs(B, T, H=4, K=2, D=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, T, D, dtype=torch.float64, generator=g) for h in (H, K, K)]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("B", [1, 2])
def test_packed_equals_separate(impl, B):
    attend = resolve("attention", impl)
    q, k, v = _inputs(B, 48 // B)  # one stream of 48 tokens either way
    cu = torch.tensor([0, 5, 6, 30, 48])
    got = packing.to_stream(attend(q, k, v, scale=0.3, cu_seqlens=cu))
    stream = [packing.to_stream(t) for t in (q, k, v)]
    want = torch.cat([attend(*(t[:, :, a:b] for t in stream), scale=0.3) for a, b in zip(cu[:-1], cu[1:])], dim=2)
    assert (got - want).abs().max() < 1e-6  # the twin's softmax runs in fp32


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bad_cu_seqlens(impl):
    q, k, v = _inputs(1, 10)
    for cu in ([0, 5, 9], [0, 6, 4, 10], [1, 10], [0, 10.0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            resolve("attention", impl)(q, k, v, cu_seqlens=torch.tensor(cu))


def test_stream_round_trip():
    t = torch.randn(3, 2, 5, 4)
    s = packing.to_stream(t)
    assert s.shape == (1, 2, 15, 4) and torch.equal(s[0, :, 5:10], t[1])
    assert torch.equal(packing.from_stream(s, 3, 5), t)
