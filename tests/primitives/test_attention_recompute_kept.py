"""The attention slot's kept output under a model's full recompute (`kernels/attention_recompute_kept.py`).

Inside a recompute region the first forward keeps attention's output and log-sum-exp and the recompute
skips the kernel: the gradients must equal those of the same computation without recompute (float64 on
the CPU, where the CPU flash kernel plays cuDNN's part; bitwise in bf16 on a GPU against the plain
recompute, which runs the same cuDNN kernels on the same inputs).
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import bumblebee as bb
from bumblebee import recompute
from bumblebee.kernels import attention_recompute_kept as kept
from bumblebee.primitives.attention import SDPA, sdpa_attention_with


def _layer(config, x, wq, wk, wv, wo, heads=4, kv_heads=2):
    B, T, _ = x.shape
    q = (x @ wq).view(B, T, heads, -1).transpose(1, 2)
    k = (x @ wk).view(B, T, kv_heads, -1).transpose(1, 2)
    v = (x @ wv).view(B, T, kv_heads, -1).transpose(1, 2)
    o = sdpa_attention_with(config, q, k, v)
    return o.transpose(1, 2).reshape(B, T, -1) @ wo


def _weights(dtype, device="cpu", D=32, d=8, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(D, heads * d), (D, kv_heads * d), (D, kv_heads * d), (heads * d, D)]
    return [(torch.randn(s, generator=g, dtype=torch.float64) / s[0] ** 0.5).to(device, dtype).requires_grad_()
            for s in shapes]


def _grads(config, x, ws, region: bool, kept=None):
    """kept: the budgets the region counts in (a model's `recompute.Kept`), None: the region's own."""
    x = x.detach().requires_grad_()
    if region:
        y = checkpoint(_layer, config, x, *ws, use_reentrant=False, context_fn=lambda: recompute.contexts(kept))
    else:
        y = _layer(config, x, *ws)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    out = [x.grad] + [w.grad for w in ws]
    for w in ws:
        w.grad = None
    return out


def _count_forwards(monkeypatch, owner=kept, names=("CUDNN", "CPU_FLASH")):
    """Counts the kept kernels' forwards (the kernels `owner.<name>` that the primitive picks)."""
    calls = []
    for name in names:
        real = getattr(owner, name)

        def counted(*a, real=real):
            calls.append(1)
            return real.forward(*a)

        monkeypatch.setattr(owner, name, kept.Kernel(real.name, counted, real.backward))
    return calls


def test_kept_output_gives_the_gradients_of_no_recompute_and_runs_attention_once(monkeypatch):
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    ws = _weights(torch.float64)
    want = _grads(SDPA(recompute_keep_bytes=0), x, ws, region=False)
    calls = _count_forwards(monkeypatch)
    budgets = recompute.Kept()
    got = _grads(SDPA(), x, ws, region=True, kept=budgets)
    assert len(calls) == 1  # the first forward only: the recompute took the kept output
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert list(budgets.slots) == ["attention"] and budgets.live() == 0  # released with the backward


def test_over_the_budget_both_passes_recompute_attention(monkeypatch):
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    ws = _weights(torch.float64, seed=1)
    want = _grads(SDPA(recompute_keep_bytes=0), x, ws, region=False)
    calls = _count_forwards(monkeypatch)
    budgets = recompute.Kept()
    got = _grads(SDPA(recompute_keep_bytes=1), x, ws, region=True, kept=budgets)  # one byte: nothing fits
    assert calls == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert budgets.live() == 0


def test_budget_counts_every_layer_kept_at_once():
    q = torch.empty(2, 4, 24, 8, dtype=torch.float64)
    one = kept.kept_bytes(q, q)
    assert one == 2 * 4 * 24 * (8 * 8 + 4)
    budget = recompute.KeptBudget()
    assert budget.reserve(one, 2 * one) and budget.reserve(one, 2 * one)
    assert not budget.reserve(one, 2 * one)  # a third layer would pass the budget: it recomputes
    budget.release(one)
    assert budget.reserve(one, 2 * one)


def test_outside_a_recompute_region_it_is_plain_sdpa(monkeypatch):
    calls = _count_forwards(monkeypatch)
    q, k = torch.randn(1, 4, 16, 8, dtype=torch.float64), torch.randn(1, 2, 16, 8, dtype=torch.float64)
    out = sdpa_attention_with(SDPA(), q, k, k)
    ref = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert calls == []


def test_a_second_backward_through_a_retained_graph_says_why():
    x = torch.randn(1, 16, 32, dtype=torch.float64, requires_grad=True)
    ws = _weights(torch.float64, seed=2)
    y = checkpoint(_layer, SDPA(), x, *ws, use_reentrant=False, context_fn=recompute.contexts)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retained graph"):
        y.sum().backward()


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_model_recompute_with_kept_attention_matches_the_plain_recompute(model_name, monkeypatch):
    """Against the same model recomputing attention (the MoE path's own fp32 accumulation differs from
    no recompute by ~1e-8 relative, so the plain recompute is the exact reference)."""
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(3))
    grads = {}
    calls = _count_forwards(monkeypatch)
    for name, keep, rec in (("plain", 0, True), ("kept", 6 << 30, True)):
        model = bb.models.build(model_name, {"attention": SDPA(recompute_keep_bytes=keep)}, seed=0,
                                dtype=torch.float64).set_recompute(rec)
        model(ids, labels=ids).loss.backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == model.config.num_hidden_layers  # once per layer: none in the recompute
    assert grads["plain"].keys() == grads["kept"].keys()
    for n, g in grads["plain"].items():
        torch.testing.assert_close(grads["kept"][n], g, rtol=1e-12, atol=1e-14, msg=n)


def test_each_model_keeps_within_its_own_budget(monkeypatch):
    """Two models in one process: the second keeps every layer's output within its own budget while the
    first still holds its kept outputs (a process-wide count would leave the second nothing)."""
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(5))
    first = bb.models.build("qwen3-tiny", seed=0, dtype=torch.float64).set_recompute(True)
    loss_first = first(ids, labels=ids).loss
    held = first.model.kept.live()
    assert held > 0
    calls = _count_forwards(monkeypatch)
    second = bb.models.build("qwen3-tiny", {"attention": SDPA(recompute_keep_bytes=held)}, seed=0,
                             dtype=torch.float64).set_recompute(True)
    loss_second = second(ids, labels=ids).loss
    assert second.model.kept.live() == held and len(calls) == second.config.num_hidden_layers
    (loss_first + loss_second).backward()
    assert first.model.kept.live() == 0 and second.model.kept.live() == 0


def test_config_checks_and_parses_the_budget():
    with pytest.raises(ValueError, match="recompute_keep_bytes"):
        SDPA(recompute_keep_bytes=-1)
    with pytest.raises(ValueError, match="recompute_keep_bytes"):
        SDPA(recompute_keep_bytes=1.5)
    from bumblebee.options import parse
    assert parse(SDPA, "recompute_keep_bytes=1GiB").recompute_keep_bytes == 1 << 30


def _bitwise_on_gpu(config, monkeypatch, owner, names):
    x = torch.randn(1, 2048, 512, device="cuda", dtype=torch.bfloat16)
    ws = _weights(torch.bfloat16, "cuda", D=512, d=128, heads=4, kv_heads=2, seed=4)
    plain = dataclasses.replace(config, recompute_keep_bytes=0)
    want = _grads(plain, x, ws, region=True)  # the same kernel, attention recomputed
    calls = _count_forwards(monkeypatch, owner, names)
    got = _grads(config, x, ws, region=True)
    assert len(calls) == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_kept_output_is_bitwise_the_plain_recompute(monkeypatch):
    _bitwise_on_gpu(SDPA(fa4="off"), monkeypatch, kept, ("CUDNN",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_kept_output_is_bitwise_the_plain_recompute(monkeypatch):
    from bumblebee.kernels import attention_fa4
    from bumblebee.primitives import attention
    if not attention_fa4.supports(torch.device("cuda"), torch.bfloat16, 128, 128):
        pytest.skip("flash-attn-4 is not installed or does not run on this GPU")
    _bitwise_on_gpu(SDPA(fa4="on"), monkeypatch, attention, ("_FA4_KEPT",))


def test_where_fa4_serves_its_kernel_is_the_kept_one(monkeypatch):
    """The FA4 branch keeps FA4's output (a CPU stand-in plays FA4 here; the GPU test runs FA4 itself)."""
    from bumblebee.primitives import attention
    monkeypatch.setattr(attention._fa4, "available", lambda q, v: True)
    stand_in = kept.Kernel("fa4", kept.CPU_FLASH.forward, kept.CPU_FLASH.backward)
    monkeypatch.setattr(attention, "_FA4_KEPT", stand_in)
    monkeypatch.setattr(attention, "_fa4_dense", attention._sdpa)
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    ws = _weights(torch.float64, seed=5)
    want = _grads(SDPA(recompute_keep_bytes=0), x, ws, region=False)
    sdpa_calls = _count_forwards(monkeypatch)
    fa4_calls = _count_forwards(monkeypatch, attention, ("_FA4_KEPT",))
    budgets = recompute.Kept()
    got = _grads(SDPA(fa4="on"), x, ws, region=True, kept=budgets)
    assert len(fa4_calls) == 1 and sdpa_calls == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert budgets.live() == 0
