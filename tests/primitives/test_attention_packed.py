"""The attention slot on packed sequences (`cu_seqlens`): primitive and twin equal each sequence run
alone (float64, GQA), in [1, H, N, D] and [B, H, T, D] layouts of the same stream; bad boundaries
raise ValueError naming cu_seqlens; the primitive's options (`SDPA`) pick its kernel (FA4, the varlen
kernel, SDPA), shown on the CPU with recording stand-ins for the GPU kernels."""
import pytest
import torch

from bumblebee import packing
from bumblebee.primitives import attention
from bumblebee.primitives.attention import SDPA
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


def fake_kernel(name, calls):
    """A stand-in for FA4's or the varlen kernel's entry point on the CPU: records `name` in `calls` and
    computes the result with the eager twin. Takes [B, T, H, D] (dense) or [N, H, D] with cu_seqlens."""
    eager = resolve("attention", "eager")

    def kernel(q, k, v, scale, cu_seqlens=None, max_seqlen=None):
        calls.append(name)
        if q.dim() == 3:
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
            return eager(q, k, v, scale=scale, cu_seqlens=cu_seqlens)[0].transpose(0, 1)
        return eager(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale).transpose(1, 2)
    return kernel


@pytest.mark.parametrize("choice,head_dim,packed,want", [
    ("sdpa", 8, False, "fa4"), ("sdpa", 8, True, "fa4"),
    ("sdpa", 160, False, None),  # dense beyond FA4_MAX_HEAD_DIM: SDPA
    ("sdpa", 160, True, "fa4"),  # packed: FA4 at every head dim
    ("sdpa:fa4=on", 160, False, "fa4"),
    (SDPA(fa4="off"), 8, True, "varlen"), ("sdpa:fa4=off", 8, False, None),
    ("sdpa:fa4=off,varlen=off", 8, True, None)])
def test_options_pick_the_kernel(monkeypatch, choice, head_dim, packed, want):
    calls = []
    monkeypatch.setattr(attention._fa4, "available", lambda q, v: True)
    monkeypatch.setattr(attention._fa4, "causal_attention", fake_kernel("fa4", calls))
    monkeypatch.setattr(attention._varlen, "serves", lambda *a: True)
    monkeypatch.setattr(attention._varlen, "causal_attention", fake_kernel("varlen", calls))
    q, k, v = _inputs(2, 12, D=head_dim)
    kw = {"scale": 0.3, "cu_seqlens": torch.tensor([0, 5, 6, 24])} if packed else {"scale": 0.3}
    got = resolve("attention", choice)(q, k, v, **kw)
    assert calls == ([want] if want else [])
    assert (got - resolve("attention", "eager")(q, k, v, **kw)).abs().max() < 1e-6


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"SDPA.fa4 must be one of 'auto', 'on', 'off'; got 'cudnn'"):
        SDPA(fa4="cudnn")
    with pytest.raises(ValueError, match=r"SDPA.varlen must be True or False; got 'off'"):
        SDPA(varlen="off")  # a string here would read as True
    assert resolve("attention", "sdpa:varlen=off").config == SDPA(varlen=False)
    assert attention.sdpa_attention.config == SDPA()  # a direct call runs the defaults


def test_stream_round_trip():
    t = torch.randn(3, 2, 5, 4)
    s = packing.to_stream(t)
    assert s.shape == (1, 2, 15, 4) and torch.equal(s[0, :, 5:10], t[1])
    assert torch.equal(packing.from_stream(s, 3, 5), t)


@pytest.mark.gpu
def test_per_sequence_gradients_across_packings():
    """One SDPA call per sequence (FA4 and varlen off) on two packings that share sequence lengths, the
    case where torch's cuDNN backward graph cache returned non-finite MLA gradients
    (`packing.per_sequence`; test_mla.py reproduces it without the fix, this GQA shape did not):
    both packings within 3x the bf16 error of the eager twin against float64."""
    per_sequence = SDPA(fa4="off", varlen=False)
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

        exact, ours = run(per_sequence, torch.float64), run(per_sequence, torch.bfloat16)
        twin = run("eager", torch.bfloat16)
        for a, t, r in zip(ours, twin, exact):
            err, bound = ((a - r).norm() / r.norm()).item(), ((t - r).norm() / r.norm()).item()
            assert err <= 3 * bound + 1e-3, (lengths, err, bound)
