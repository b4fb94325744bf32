"""The routers' closed-form backwards (primitives/router.py: `_aux_free_grad`, `_softmax_grad`): float64
gradcheck of the primitives themselves (selection and replay, with and without the normalization),
fp32 gradients against a float64 reference within a few times plain PyTorch's fp32 error, and what
sets them apart from autograd through the twins' expressions (exact zeros off the selected experts,
no autograd graph inside the backward)."""
import pytest
import torch

from bumblebee.baselines import router as base
from bumblebee.primitives import router as prim

# (T, E, top_k, n_group, topk_group)
AUX_SHAPES = [(9, 16, 4, 4, 2), (5, 12, 3, 1, 1), (6, 7, 7, 1, 1), (4, 8, 1, 2, 1)]
SOFTMAX_SHAPES = [(9, 16, 5), (6, 7, 7), (5, 12, 1), (3, 60, 8)]


def gradcheck(fn, x):
    """float64 finite differences of fn at x; fast mode (random projections of the Jacobian): a few
    forward calls instead of one per logit, each a selection in Python."""
    return torch.autograd.gradcheck(fn, (x,), fast_mode=True)


def _logits(T, E, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * 2).to(dtype), (torch.randn(E, generator=g) * 0.5).to(dtype)


def _aux(x, bias, shape, norm, **kw):
    _, _, k, G, TG = shape
    return prim.aux_free_topk(x, bias, top_k=k, n_group=G, topk_group=TG, scaling_factor=2.5, norm_topk_prob=norm,
                              **kw)


@pytest.mark.parametrize("shape", AUX_SHAPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
def test_aux_free_backward_gradcheck_float64(shape, norm):
    x, bias = _logits(*shape[:2], seed=sum(shape))
    x.requires_grad_(True)
    assert gradcheck(lambda y: _aux(y, bias, shape, norm)[0], x)
    routes = _aux(x.detach(), bias, shape, norm)[1].flip(1)  # replay, the experts in another order
    assert gradcheck(lambda y: _aux(y, bias, shape, norm, routed_experts=routes)[0], x)


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_backward_gradcheck_float64(shape, norm):
    T, E, k = shape
    x = _logits(T, E, seed=T + E + k)[0].requires_grad_(True)
    assert gradcheck(lambda y: prim.softmax_topk_fused(y, top_k=k, norm_topk_prob=norm)[0], x)
    routes = prim.softmax_topk_fused(x.detach(), top_k=k)[1].flip(1)
    assert gradcheck(lambda y: prim.softmax_topk_fused(y, top_k=k, norm_topk_prob=norm, routed_experts=routes)[0], x)


def _softmax_ref64(x, top_k, norm_topk_prob, routed_experts):
    """The softmax weights written in float64 (the twin's own softmax runs in fp32 even for fp64 logits)."""
    w = torch.softmax(x.double(), dim=-1).gather(1, routed_experts)
    return w / w.sum(-1, keepdim=True) if norm_topk_prob else w


def _grads(fn, x, up_TE, dtype):
    x = x.detach().to(dtype).clone().requires_grad_(True)
    w, idx = fn(x)
    (w * up_TE.to(w.dtype).gather(1, idx)).sum().backward()
    return x.grad.double()


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("which", ["aux_free", "softmax"])
def test_backward_within_fp32_error_of_float64(which, norm):
    """ours (fp32) within 4x the fp32 error plain PyTorch makes through the twin's expression, both
    against float64, on the same selection; and not the twin's bits."""
    T, E = 97, 64
    x, bias = _logits(T, E, seed=31, dtype=torch.float32)
    up_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(32))
    if which == "aux_free":
        kw = dict(top_k=8, n_group=8, topk_group=4, scaling_factor=2.5, norm_topk_prob=norm)
        routes = prim.aux_free_topk(x, bias, **kw)[1]
        ours = _grads(lambda y: prim.aux_free_topk(y, bias, **kw), x, up_TE, torch.float32)
        twin = _grads(lambda y: base.aux_free_topk(y, bias, routed_experts=routes, **kw), x, up_TE, torch.float32)
        ref = _grads(lambda y: base.aux_free_topk(y, bias.double(), routed_experts=routes, **kw), x, up_TE,
                     torch.float64)
    else:
        routes = prim.softmax_topk_fused(x, top_k=8)[1]
        ours = _grads(lambda y: prim.softmax_topk_fused(y, top_k=8, norm_topk_prob=norm), x, up_TE, torch.float32)
        twin = _grads(lambda y: base.softmax_topk(y, top_k=8, norm_topk_prob=norm, routed_experts=routes), x, up_TE,
                      torch.float32)
        ref = _grads(lambda y: (_softmax_ref64(y, 8, norm, routes), routes), x, up_TE, torch.float64)
    e_twin, e_ours = ((t - ref).norm().item() / ref.norm().item() for t in (twin, ours))
    assert 0 < e_twin < 1e-5 and e_ours <= 4 * e_twin, (e_ours, e_twin)
    assert not torch.equal(ours, twin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_softmax_normalized_backward_is_zero_off_the_selected_experts(dtype):
    """With norm_topk_prob the weights are the softmax of the k selected logits: an exact zero for the
    other experts (autograd through the row's softmax leaves rounding residue there), and each row's
    gradient sums to zero within rounding; in the logits' dtype."""
    x = _logits(41, 60, seed=3, dtype=dtype)[0].requires_grad_(True)
    w, idx = prim.softmax_topk_fused(x, top_k=8)
    (w.double() * torch.randn(41, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)).sum().backward()
    grad = x.grad
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    off = torch.ones_like(grad, dtype=torch.bool).scatter_(1, idx, False)
    assert grad[off].eq(0).all() and grad.gather(1, idx).ne(0).all()
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert grad.double().sum(1).abs().max() <= tol * grad.double().abs().sum(1).max()


def test_backward_builds_no_autograd_graph(monkeypatch):
    """The backwards are closed forms: neither calls autograd on an expression of its own."""
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: 1 / 0)
    x, bias = _logits(13, 16, seed=5, dtype=torch.float32)
    for route in (lambda y: prim.aux_free_topk(y, bias, top_k=4, n_group=4, topk_group=2),
                  lambda y: prim.softmax_topk_fused(y, top_k=4, norm_topk_prob=False)):
        y = x.clone().requires_grad_(True)
        route(y)[0].pow(2).sum().backward()
        assert y.grad.abs().sum() > 0


# ---- GPU: bf16, layer sizes, and the time of the backward ---------------------------------------

def _autograd_backward(logits, idx, g, which, norm):
    """The backward these primitives had: autograd through the k weights recomputed in torch."""
    with torch.enable_grad():
        x = logits.detach().requires_grad_(True)
        acc = x.to(torch.promote_types(x.dtype, torch.float32))
        if which == "aux_free":
            w = torch.sigmoid(acc.gather(1, idx))
            w = (w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w) * 2.5
        else:
            w = torch.softmax(acc, dim=-1).gather(1, idx)
            w = (w / w.sum(-1, keepdim=True) if norm else w).to(x.dtype)
        return torch.autograd.grad(w, x, g)[0]


def _closed_form(logits, idx, g, which, norm):
    if which == "aux_free":
        return prim._aux_free_grad(logits, idx, g, 2.5, norm)
    return prim._softmax_grad(logits, idx, g, norm)


def _gpu_case(which, dtype, T=65536, E=256, k=8):
    logits, bias = (t.cuda() for t in _logits(T, E, seed=T + E, dtype=torch.float32))
    logits = logits.to(dtype)
    if which == "aux_free":
        w, idx = prim.aux_free_topk(logits, bias, top_k=k, n_group=8, topk_group=4, scaling_factor=2.5)
    else:
        w, idx = prim.softmax_topk_fused(logits, top_k=k)
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(w.device, w.dtype)
    return logits, idx, g


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["aux_free", "softmax"])
def test_backwards_on_gpu_within_the_dtypes_error(which, dtype, norm):
    """At layer sizes: the closed form against float64 within 4x the error of autograd through the
    weights' expression in the same dtype."""
    logits, idx, g = _gpu_case(which, dtype)
    ref = _autograd_backward(logits.double(), idx, g.double(), which, norm)
    e_ours, e_autograd = ((_closed_form(logits, idx, g, which, norm).double() - ref).norm().item() / ref.norm().item(),
                          (_autograd_backward(logits, idx, g, which, norm).double() - ref).norm().item()
                          / ref.norm().item())
    assert e_ours <= 4 * e_autograd + 1e-6, (e_ours, e_autograd)
