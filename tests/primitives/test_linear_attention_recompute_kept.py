"""The linear_attention slot's rule kept under a model's full recompute
(`kernels/linear_attention_recompute_kept.py`, `FLAConfig.recompute_keep_bytes`).

Inside a recompute region the first forward keeps the chunked rule's output and the recompute skips
the rule: the gradients must equal those of the same layer without recompute (float64 on the CPU,
where fla's algorithm in torch is the kernel), and on a GPU in bf16 those of fla's plain recompute
(the same fla kernels on the same inputs), with fla's public rule never run in the recompute.
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import bumblebee as bb
from bumblebee import recompute, registry
from bumblebee.kernels import linear_attention_recompute_kept as kept
from bumblebee.primitives import linear_attention as la
from bumblebee.primitives.linear_attention import FLAConfig, FLAGatedDeltaNet

SHAPE = dict(hidden_size=24, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel_size=3)


def _layer(config, dtype=torch.float64, device="cpu", shape=SHAPE, seed=0):
    torch.manual_seed(seed)
    layer = FLAGatedDeltaNet(config, *(shape[k] for k in ("hidden_size", "num_k_heads", "num_v_heads",
                                                          "head_k_dim", "head_v_dim")),
                             conv_kernel_size=shape["conv_kernel_size"])
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer.to(device, dtype)


def _grads(layer, x, region: bool, cu=None, kept=None):
    """kept: the budgets the region counts in (a model's `recompute.Kept`), None: the region's own."""
    x = x.detach().requires_grad_()
    if region:
        y = checkpoint(layer, x, cu, use_reentrant=False, context_fn=lambda: recompute.contexts(kept))
    else:
        y = layer(x, cu)
    (y.double() * torch.linspace(-1, 1, y.numel(), device=y.device, dtype=torch.float64).view_as(y)).sum().backward()
    out = [x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out


def _phases(monkeypatch):
    """The recompute phase of every run of the torch rule (the kept kernel's backward runs it outside
    any region: autograd through fla's algorithm in torch)."""
    seen, real = [], la._torch_rule

    def counted(*a):
        seen.append(recompute.phase())
        return real(*a)

    monkeypatch.setattr(la, "_torch_rule", counted)
    return seen


@pytest.mark.parametrize("packed", [False, True])
def test_kept_rule_gives_the_gradients_of_no_recompute_and_skips_the_rule_in_the_recompute(monkeypatch, packed):
    x = torch.randn(2, 20, 24, dtype=torch.float64)
    cu = torch.tensor([0, 7, 30, 40]) if packed else None
    want = _grads(_layer(FLAConfig()), x, region=False, cu=cu)
    seen = _phases(monkeypatch)
    budgets = recompute.Kept()
    got = _grads(_layer(FLAConfig(recompute_keep_bytes=1 << 30)), x, region=True, cu=cu, kept=budgets)
    assert "recompute" not in seen and seen.count("forward") == 1, seen
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert list(budgets.slots) == ["linear_attention"] and budgets.live() == 0  # released with the backward


def test_over_the_budget_or_off_both_passes_run_the_rule(monkeypatch):
    x = torch.randn(1, 16, 24, dtype=torch.float64)
    want = _grads(_layer(FLAConfig(), seed=1), x, region=False)
    for config in (FLAConfig(recompute_keep_bytes=8), FLAConfig(recompute_keep_bytes=0)):  # 8 bytes: less than one output
        seen = _phases(monkeypatch)
        budgets = recompute.Kept()
        got = _grads(_layer(config, seed=1), x, region=True, kept=budgets)
        assert seen == ["forward", "recompute"], seen
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert budgets.live() == 0


def test_a_graph_freed_without_backward_returns_its_bytes():
    layer = _layer(FLAConfig(recompute_keep_bytes=1 << 30))
    x = torch.randn(1, 16, 24, dtype=torch.float64, requires_grad=True)
    budgets = recompute.Kept()
    y = checkpoint(layer, x, None, use_reentrant=False, context_fn=lambda: recompute.contexts(budgets))
    assert budgets.live() > 0
    del y
    assert budgets.live() == 0


def test_a_second_backward_through_a_retained_graph_is_refused():
    layer = _layer(FLAConfig(recompute_keep_bytes=1 << 30))
    x = torch.randn(1, 16, 24, dtype=torch.float64, requires_grad=True)
    y = checkpoint(layer, x, None, use_reentrant=False, context_fn=recompute.contexts).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute"):
        y.backward()


def test_model_with_the_default_kept_rule_trains_like_the_plain_recompute(monkeypatch):
    config = bb.models.NAMED["qwen3.5-moe-tiny"]
    ids = torch.randint(0, config["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(0))
    out, phases = {}, {}
    for name, impl in (("plain", FLAConfig(recompute_keep_bytes=0)), ("kept", "fla")):
        phases[name] = _phases(monkeypatch)
        model = bb.models.build(config, impl={"linear_attention": impl}, seed=0, dtype=torch.float64)
        model.set_recompute(True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert model.model.kept.live() == 0  # the model's own budgets, released with the backward
        out[name] = [loss.detach()] + [p.grad for p in model.parameters()]
    for a, b in zip(out["kept"], out["plain"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert "recompute" in phases["plain"] and "recompute" not in phases["kept"], phases


def test_config_is_typed_and_reported():
    assert registry.spec("linear_attention", "fla:recompute_keep_bytes=4096") == "fla:recompute_keep_bytes=4096"
    assert registry.record("linear_attention", "fla")["recompute_keep_bytes"] == 4 << 30
    with pytest.raises(ValueError, match="recompute_keep_bytes"):
        FLAConfig(recompute_keep_bytes=-1)
    with pytest.raises(TypeError, match="FLAConfig"):
        FLAGatedDeltaNet("fla", 24, 2, 4, 8, 6)


# ---- GPU: fla's kernels kept, bf16 --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_fla_kept_rule_equals_fla_plain_recompute_bf16_gpu(monkeypatch, packed):
    assert la.fla_ops() is not None and la.fla_backward_ok(), "fla and its backward must run on the GPU machine"
    assert kept.fla_available(), "fla's internal forward / backward moved: the kept rule would never run"
    shape = dict(hidden_size=1024, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                 conv_kernel_size=4)  # Qwen3.5-35B-A3B's DeltaNet heads
    x = torch.randn(1, 8192, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) * 0.5
    cu = torch.tensor([0, 1000, 1001, 5000, 8192], device="cuda") if packed else None
    want = _grads(_layer(FLAConfig(recompute_keep_bytes=0), torch.bfloat16, "cuda", shape), x.bfloat16(), region=True, cu=cu)
    conv, rule = la.fla_ops()
    phases = []

    def counted(*a, **k):
        phases.append(recompute.phase())
        return rule(*a, **k)

    monkeypatch.setattr(la, "fla_ops", lambda: (conv, counted))
    got = _grads(_layer(FLAConfig(recompute_keep_bytes=1 << 34), torch.bfloat16, "cuda", shape), x.bfloat16(),
                 region=True, cu=cu)
    assert phases == [], phases  # fla's public rule never ran: the kept kernel's forward did, once
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
        assert err < 1e-2, (i, float(err))  # the same kernels on the same inputs (a wrong A or gate: O(1))
