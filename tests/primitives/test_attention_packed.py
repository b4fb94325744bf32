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


@pytest.mark.gpu
def test_per_sequence_gradients_across_packings(monkeypatch):
    """One SDPA call per sequence (FA4 and varlen off) on two packings that share sequence lengths, the
    case where torch's cuDNN backward graph cache returned non-finite MLA gradients
    (`packing.per_sequence`; test_mla.py reproduces it without the fix, this GQA shape did not):
    both packings within 3x the bf16 error of the eager twin against float64."""
    from bumblebee.primitives import attention
    monkeypatch.setattr(attention, "FA4", "off")
    monkeypatch.setattr(attention, "VARLEN", "off")
    for lengths in ((37, 300, 1, 1024, 686), (300, 1, 399)):
        N = sum(lengths)
        g = torch.Generator(device="cuda").manual_seed(N)
        q = torch.randn(1, 8, N, 128, device="cuda", generator=g)
        k, v = (torch.randn(1, 2, N, 128, device="cuda", generator=g) for _ in "kv")
        do = torch.randn(1, 8, N, 128, device="cuda", generator=g)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)

        def run(impl, dtype):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            o = resolve("attention", impl)(*leaves, cu_seqlens=cu)
            o.backward(do.to(dtype))
            return [o.detach().double()] + [t.grad.double() for t in leaves]

        exact, ours, twin = run("sdpa", torch.float64), run("sdpa", torch.bfloat16), run("eager", torch.bfloat16)
        for a, t, r in zip(ours, twin, exact):
            err, bound = ((a - r).norm() / r.norm()).item(), ((t - r).norm() / r.norm()).item()
            assert err <= 3 * bound + 1e-3, (lengths, err, bound)
