"""Routers: fused aux-free kernel vs torch twin vs a float64 reference; softmax top-k (the torch twin
and the fused primitive) vs transformers' math and a float64 reference; megatron-core's routing
function; bias update (1 and 2 gloo ranks); replay; bad input.

The Triton kernels run on the CPU under TRITON_INTERPRET=1 in a subprocess (this file run as a
script with --interpret); bf16 and large shapes run in the GPU tests.
"""
import json
import os
import sys

import pytest
import torch

from bumblebee import registry
from bumblebee.baselines import router as base
from bumblebee.primitives import router as prim
from tests.interpreter import run_under_interpreter
from tests.ranks import leave_group

# (T, E, top_k, n_group, topk_group)
SHAPES = [(37, 16, 4, 4, 2), (1, 12, 3, 1, 1), (29, 8, 1, 2, 1), (33, 64, 8, 8, 4), (20, 6, 2, 3, 2),
          (19, 40, 6, 5, 3), (7, 10, 10, 1, 1)]


def make_inputs(T, E, seed, bias_shift=-0.3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * 2, torch.randn(E, generator=g) * 0.5 + bias_shift


def ref_aux_free(logits, bias, top_k, n_group, topk_group, scaling_factor=1.0, norm=True):
    """float64, token by token, as the DeepSeek-V3 reference reads: sorted sets of indices + weights."""
    s = torch.sigmoid(logits.double())
    b = s + bias.double()
    T, E = s.shape
    gs = E // n_group
    idx, w = [], []
    for t in range(T):
        group_score = [sorted(b[t, g * gs:(g + 1) * gs].tolist(), reverse=True)[:2] for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group] if n_group > 1 else [0]
        cand = [e for g in kept for e in range(g * gs, (g + 1) * gs)]
        chosen = sorted(sorted(cand, key=lambda e: -b[t, e].item())[:top_k])
        wt = s[t, chosen]
        if norm:
            wt = wt / (wt.sum() + 1e-20)
        idx.append(chosen)
        w.append((wt * scaling_factor).tolist())
    return torch.tensor(w, dtype=torch.float64).view(T, top_k), torch.tensor(idx, dtype=torch.int64).view(T, top_k)


def by_index(w, idx):
    order = idx.argsort(dim=1)
    return w.gather(1, order), idx.gather(1, order)


def check_against_ref(fn, T, E, k, G, TG, seed, scaling=2.5, norm=True, bias_shift=-0.3):
    logits, bias = make_inputs(T, E, seed, bias_shift)
    w, idx, counts = fn(logits, bias, top_k=k, n_group=G, topk_group=TG, scaling_factor=scaling,
                        norm_topk_prob=norm, return_counts=True)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (T, k)
    w_ref, idx_ref = ref_aux_free(logits, bias, k, G, TG, scaling, norm)
    assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=E))  # the counts of its own choice
    w, idx = by_index(w, idx)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
def test_aux_free_twin_matches_float64_reference(shape, norm):
    check_against_ref(base.aux_free_topk, *shape, seed=sum(shape), norm=norm)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_aux_free_primitive_cpu_path_matches_reference(shape):
    check_against_ref(prim.aux_free_topk, *shape, seed=1 + sum(shape))


def test_dropped_groups_never_selected_when_biased_scores_are_negative():
    # Biased scores all < 0: masking dropped groups with 0.0 (transformers) would pick them.
    T, E, G, TG, k = 16, 16, 4, 1, 4
    logits, _ = make_inputs(T, E, 3)
    bias = torch.full((E,), -3.0)
    for fn in (base.aux_free_topk, prim.aux_free_topk):
        w, idx = fn(logits, bias, top_k=k, n_group=G, topk_group=TG)
        assert ((idx // (E // G)) == (idx[:, :1] // (E // G))).all()  # all k experts from the one kept group
    check_against_ref(base.aux_free_topk, T, E, k, G, TG, seed=3, bias_shift=-3.0)


@pytest.mark.parametrize("shape", [(41, 16, 4, 4, 2), (23, 32, 8, 8, 4), (17, 12, 3, 1, 1), (9, 64, 6, 8, 3)], ids=str)
def test_aux_free_twin_matches_megatron_core(shape):
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    T, E, k, G, TG = shape
    if G > 1 and k // TG != 2:
        pytest.skip("megatron-core scores a group by its top-(k // topk_group) experts, DeepSeek-V3 by the top-2")
    logits, bias = make_inputs(T, E, 5)
    probs, rmap = mu.topk_routing_with_score_function(
        logits, k, num_groups=G if G > 1 else None, group_topk=TG if G > 1 else None, scaling_factor=2.5,
        score_function="sigmoid", expert_bias=bias)
    w, idx = base.aux_free_topk(logits, bias, top_k=k, n_group=G, topk_group=TG, scaling_factor=2.5)
    dense = torch.zeros(T, E).scatter_(1, idx, w)
    assert torch.equal(rmap.bool(), dense != 0)
    torch.testing.assert_close(dense, probs.float(), rtol=1e-6, atol=1e-7)


def test_aux_free_gradients_flow_through_unbiased_scores():
    logits, bias = make_inputs(13, 16, 8)
    x = logits.double().requires_grad_()
    w, idx = base.aux_free_topk(x, bias, top_k=4, n_group=4, topk_group=2, scaling_factor=1.5)
    g = torch.randn_like(w)
    (grad,) = torch.autograd.grad(w, x, g)
    assert (grad != 0).sum(dim=1).eq(4).all()  # only the selected experts get a gradient
    assert torch.autograd.gradcheck(
        lambda y: base.aux_free_topk(y, bias, top_k=4, n_group=4, topk_group=2, routed_experts=idx)[0], (x,))


def ref_softmax(logits, top_k, norm):
    p = torch.softmax(logits.double(), dim=-1)
    w, idx = p.topk(top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if norm else w), idx


@pytest.mark.parametrize("T,E,k", [(31, 8, 2), (1, 5, 1), (17, 128, 8), (6, 7, 7)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_matches_float64_and_transformers(T, E, k, norm, dtype):
    logits = (torch.randn(T, E) * 2).to(dtype)
    w, idx, counts = base.softmax_topk(logits, top_k=k, norm_topk_prob=norm, return_counts=True)
    assert w.dtype == dtype and idx.dtype == torch.int64
    # transformers' Qwen3MoeTopKRouter, its order of operations
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    tw, tidx = torch.topk(p, k, dim=-1)
    if norm:
        tw /= tw.sum(dim=-1, keepdim=True)
    assert torch.equal(idx, tidx) and torch.equal(w, tw.to(dtype))
    w64, idx64 = ref_softmax(logits.float(), k, norm)
    assert torch.equal(idx, idx64)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(w.double(), w64, rtol=tol, atol=tol)
    assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=E))


def tied_at_k(logits, k):
    """Rows whose k-th and (k+1)-th largest logits are equal: either expert is a right choice."""
    if k == logits.shape[1]:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    top = logits.double().topk(k + 1, dim=-1).values
    return top[:, k - 1] == top[:, k]


def check_softmax_fused(fn, T, E, k, norm, dtype, seed):
    """The fused router (kernel, or its algorithm in torch) against the float64 reference, transformers'
    Qwen3MoeTopKRouter math and the twin: indices in descending probability, lowest index first on
    ties; weights within the output dtype's rounding; counts exact."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    w, idx, counts = fn(logits, top_k=k, norm_topk_prob=norm, return_counts=True)
    assert w.dtype == dtype and idx.dtype == torch.int64 and w.shape == idx.shape == (T, k)
    assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=E))
    order = torch.sort(-logits.double(), dim=-1, stable=True).indices[:, :k]  # ties: lowest index first
    assert torch.equal(idx, order)
    untied = ~tied_at_k(logits, k)
    p = torch.softmax(logits, dtype=torch.float, dim=-1)  # transformers' order of operations
    tw, tidx = torch.topk(p, k, dim=-1)
    if norm:
        tw /= tw.sum(dim=-1, keepdim=True)
    w_base, idx_base = base.softmax_topk(logits, top_k=k, norm_topk_prob=norm)
    for other in (tidx, idx_base, ref_softmax(logits, k, norm)[1]):
        assert torch.equal(idx.sort(dim=1).values[untied], other.sort(dim=1).values[untied])
    rtol, atol = {torch.float32: (2e-6, 1e-8), torch.float16: (1e-3, 1e-7), torch.bfloat16: (8e-3, 1e-6)}[dtype]
    w64 = ref_softmax(logits, k, norm)[0]  # sorted values: tie-blind
    torch.testing.assert_close(w.double(), w64, rtol=rtol, atol=atol)
    torch.testing.assert_close(w.float(), tw.to(dtype).float(), rtol=2 * rtol, atol=atol)
    torch.testing.assert_close(w.float(), w_base.float(), rtol=2 * rtol, atol=atol)


def check_softmax_fused_grad(fn, T, E, k, norm, dtype, seed):
    """d(sum of weights x an upstream gradient per (token, expert))/d logits equals the twin's."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    up_TE = torch.randn(T, E, generator=g).to(dtype)
    grads = []
    for f in (fn, base.softmax_topk):
        x = logits.clone().requires_grad_()
        w, idx = f(x, top_k=k, norm_topk_prob=norm)
        (w * up_TE.gather(1, idx)).sum().backward()
        grads.append(x.grad.float())
    untied = ~tied_at_k(logits, k)
    ours, twin = grads[0][untied], grads[1][untied]
    assert (ours - twin).norm() <= (1e-6 if dtype == torch.float32 else 1e-2) * twin.norm()


SOFTMAX_CASES = [(T, E, k) for E, T in ((8, 31), (60, 23), (128, 17), (256, 9)) for k in (1, 2, 8)]


@pytest.mark.parametrize("T,E,k", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_fused_matches_float64_transformers_and_twin(T, E, k, norm, dtype):
    check_softmax_fused(prim.softmax_topk_fused, T, E, k, norm, dtype, seed=T * E + k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_fused_matches_transformers_qwen3_moe_router(dtype, norm):
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    torch.manual_seed(6)
    router = hf.Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=24, num_experts=60, num_experts_per_tok=8,
                                                  norm_topk_prob=norm)).to(dtype)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    logits, w_hf, idx_hf = router(torch.randn(3, 11, 24).to(dtype))
    w, idx = prim.softmax_topk_fused(logits, top_k=8, norm_topk_prob=norm)
    untied = ~tied_at_k(logits, 8)
    assert untied.float().mean() > 0.5 and w.dtype == w_hf.dtype
    assert torch.equal(idx.sort(1).values[untied], idx_hf.sort(1).values[untied])
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(w.float(), w_hf.float(), rtol=tol, atol=1e-6)  # both in descending order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_fused_gradients_match_twin(dtype, norm):
    check_softmax_fused_grad(prim.softmax_topk_fused, 29, 60, 8, norm, dtype, seed=4)
    x = (torch.randn(7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda y: prim.softmax_topk_fused(y, top_k=3, norm_topk_prob=norm)[0], (x,))


def test_softmax_fused_torch_path_is_its_own_algorithm(monkeypatch):
    """Off CUDA the primitive runs kernels/router_softmax.py's blocked torch algorithm, not torch.topk;
    block sizes agree, and float64 stays float64."""
    from bumblebee.kernels import router_softmax as ks

    logits = torch.randn(45, 60, generator=torch.Generator().manual_seed(13)) * 2
    w64, idx64 = ref_softmax(logits, 8, True)
    calls = []
    real = ks.softmax_topk_torch
    monkeypatch.setattr(prim, "softmax_topk_torch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(torch, "topk", lambda *a, **k: 1 / 0)  # the twin's selection
    w, idx = prim.softmax_topk_fused(logits, top_k=8)
    assert calls and torch.equal(idx, idx64)
    torch.testing.assert_close(w.double(), w64, rtol=2e-6, atol=1e-8)
    w2, idx2, c2 = real(logits, 8, True, block_t=7)
    w3, idx3, c3 = real(logits, 8, True, block_t=64)
    assert torch.equal(idx2, idx) and torch.equal(idx3, idx) and torch.equal(w2, w3) and torch.equal(c2, c3)
    w_d, idx_d, _ = real(logits.double(), 8, True)
    assert w_d.dtype == torch.float64 and torch.equal(idx_d, idx)
    torch.testing.assert_close(w_d, w64, rtol=1e-12, atol=1e-15)


def test_softmax_is_the_default_for_softmax_scoring():
    from bumblebee.models.moe import DEFAULT_ROUTER, TopKRouter

    assert registry.get("router").name == DEFAULT_ROUTER["softmax"] == "softmax_fused"
    impl = registry.get("router", "softmax_fused")
    assert impl.kind == "primitive" and impl.twin == "softmax_topk" and impl.obj.scoring == "softmax"
    assert registry.get("router", "softmax_topk").twin == "softmax_fused"
    assert TopKRouter(8, 16, 2).route is prim.softmax_topk_fused
    assert TopKRouter(8, 16, 2, router="softmax_topk").route is base.softmax_topk
    fits = r"accepted here: \['softmax_fused', 'softmax_topk'\]"
    with pytest.raises(ValueError, match=r"does not compute softmax routing; " + fits):
        TopKRouter(8, 16, 2, router="aux_free")


@pytest.mark.parametrize("which", ["softmax", "softmax_fused", "aux_free_ref", "aux_free"])
def test_replay_reproduces_routes_and_recomputes_weights(which):
    logits, bias = make_inputs(21, 16, 9)

    def route(x, **kw):
        if which in ("softmax", "softmax_fused"):
            fn = base.softmax_topk if which == "softmax" else prim.softmax_topk_fused
            return fn(x, top_k=3, norm_topk_prob=True, **kw)
        fn = base.aux_free_topk if which == "aux_free_ref" else prim.aux_free_topk
        return fn(x, bias, top_k=3, n_group=4, topk_group=2, scaling_factor=2.0, **kw)

    w, idx = route(logits)
    w2, idx2 = route(logits, routed_experts=idx)
    assert torch.equal(idx2, idx) and torch.equal(w2, w)
    x = (logits + torch.randn_like(logits)).requires_grad_()  # other scores: same experts, new weights
    w3, idx3 = route(x, routed_experts=idx)
    assert torch.equal(idx3, idx) and not torch.allclose(w3, w)
    w3.sum().backward() if "softmax" not in which else (w3 * torch.randn_like(w3)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


BAD = [
    (dict(top_k=17), r"top_k must be in \[1, E=16\], got top_k=17"),
    (dict(top_k=0), r"got top_k=0"),
    (dict(n_group=3), r"E=16 must be a multiple of n_group=3"),
    (dict(topk_group=5), r"topk_group must be in \[1, n_group=4\], got topk_group=5"),
    (dict(n_group=16, topk_group=2, top_k=2), r">= 2 experts per group, got E=16, n_group=16"),
    (dict(top_k=9), r"top_k=9 exceeds the experts of the kept groups"),
    (dict(routed_experts=torch.zeros(5, 4, dtype=torch.long)), r"routed_experts must be \[T=7, k=4\], got shape \(5, 4\)"),
    (dict(routed_experts=torch.full((7, 4), 16)), r"routed_experts hold 16, outside the experts \[0, 16\)"),
    (dict(routed_experts=torch.full((7, 4), -1)), r"routed_experts hold -1"),
    (dict(routed_experts=torch.tensor([[0, 1, 2, 3]] * 6 + [[5, 9, 5, 1]])),
     r"routed_experts repeat an expert within a token: token 6 has \[5, 9, 5, 1\]"),
    (dict(bias=torch.zeros(15)), r"bias must be \[E=16\]"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[m[:30] for _, m in BAD])
@pytest.mark.parametrize("fn", [base.aux_free_topk, prim.aux_free_topk], ids=["twin", "primitive"])
def test_bad_input_raises_value_error(fn, kw, msg):
    args = dict(top_k=4, n_group=4, topk_group=2, bias=torch.zeros(16))
    args.update(kw)
    bias = args.pop("bias")
    with pytest.raises(ValueError, match=msg):
        fn(torch.randn(7, 16), bias, **args)


@pytest.mark.parametrize("fn", [base.softmax_topk, prim.softmax_topk_fused], ids=["twin", "primitive"])
def test_softmax_bad_input_raises_value_error(fn):
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=4\], got top_k=5"):
        fn(torch.randn(3, 4), top_k=5)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=4\], got top_k=0"):
        fn(torch.randn(3, 4), top_k=0)
    with pytest.raises(ValueError, match=r"logits must be a \[T, E\] tensor, got shape \(3,\)"):
        fn(torch.randn(3), top_k=1)
    with pytest.raises(ValueError, match=r"logits must be floating point, got torch.int64"):
        fn(torch.ones(3, 4, dtype=torch.long), top_k=1)
    with pytest.raises(ValueError, match=r"routed_experts hold 4"):
        fn(torch.randn(3, 4), top_k=2, routed_experts=torch.full((3, 2), 4))
    with pytest.raises(ValueError, match=r"routed_experts must be \[T=3, k=2\], got shape \(3, 3\)"):
        fn(torch.randn(3, 4), top_k=2, routed_experts=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"repeat an expert within a token: token 0 has \[1, 1\]"):
        fn(torch.randn(3, 4), top_k=2, routed_experts=torch.tensor([[1, 1], [0, 1], [2, 3]]))


# ---- bias update -------------------------------------------------------------------------------

def _router(seed=0):
    from bumblebee.models.moe import TopKRouter

    torch.manual_seed(seed)
    r = TopKRouter(12, 16, 4, scoring="sigmoid", n_group=4, topk_group=2, scaling_factor=2.5, router="aux_free_ref")
    with torch.no_grad():
        r.weight.normal_(0, 0.5)
        r.e_score_correction_bias.normal_(0, 0.01)
    return r


def _batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(10, 12, generator=g) for _ in range(4)]  # 4 micro-batches


def test_bias_update_single_rank():
    from bumblebee.models.moe import router_load_stats, update_router_bias

    r = _router()
    model = torch.nn.ModuleDict({"gate": r})
    bias0 = r.e_score_correction_bias.clone()
    counts = torch.zeros(16, dtype=torch.int64)
    for x in _batches():
        _, _, idx = r(x)
        counts += torch.bincount(idx.view(-1), minlength=16)
    loads = update_router_bias(model, rate=1e-3)
    assert torch.equal(loads["gate"], counts)
    want = bias0 + 1e-3 * torch.sign(counts.float().mean() - counts.float())
    assert torch.equal(r.e_score_correction_bias, want) and r.e_score_correction_bias.dtype == torch.float32
    assert r.tokens_per_expert is None  # reset for the next step
    stats = router_load_stats(model)["gate"]
    assert stats["max_over_mean"] == pytest.approx(counts.max().item() / counts.float().mean().item())
    for x in _batches(2):
        r(x)
    update_router_bias(model, rate=1e-2, recenter=True)
    assert abs(r.e_score_correction_bias.mean().item()) < 1e-6


def test_bias_stays_fp32_when_the_model_is_cast():
    r = _router().to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16 and r.e_score_correction_bias.dtype == torch.float32


def _bias_update_rank(rank, world, init_file, out):
    import torch.distributed as dist

    from bumblebee.models.moe import update_router_bias

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    r = _router()
    model = torch.nn.ModuleDict({"gate": r})
    for x in _batches():
        r(x.chunk(world)[rank])  # each rank sees its shard of every micro-batch
    loads = update_router_bias(model, rate=1e-3, group=dist.group.WORLD, recenter=True)
    if rank == 0:
        torch.save({"bias": r.e_score_correction_bias, "load": loads["gate"]}, out)
    leave_group()


def test_bias_update_two_gloo_ranks_equals_single_rank_on_both_shards(tmp_path):
    from bumblebee.models.moe import update_router_bias

    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_bias_update_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2)
    got = torch.load(out)
    r = _router()
    model = torch.nn.ModuleDict({"gate": r})
    for x in _batches():
        for shard in x.chunk(2):  # each rank's rows as the ranks routed them: the same shapes, so the
            r(shard)              # same float math (a whole batch may break a near-tie the other way)
    loads = update_router_bias(model, rate=1e-3, recenter=True)
    assert torch.equal(got["load"], loads["gate"])
    assert torch.equal(got["bias"], r.e_score_correction_bias)


# ---- the fused kernel under the Triton interpreter ------------------------------------------------

def _interpret_main():
    """Run with TRITON_INTERPRET=1: the kernel itself (fp32, fp16), forward and backward."""
    assert prim._INTERPRET
    results = []
    for i, (T, E, k, G, TG) in enumerate(SHAPES):
        check_against_ref(prim.aux_free_topk, T, E, k, G, TG, seed=100 + i, norm=i % 2 == 0)
        results.append([T, E, k, G, TG])
    check_against_ref(prim.aux_free_topk, 16, 16, 4, 4, 1, seed=7, bias_shift=-3.0)  # negative biased scores
    from bumblebee.kernels.router_aux_free import aux_free_topk_fwd

    logits, bias = make_inputs(45, 32, 11)  # several blocks per program (persistent loop), fp16 logits
    for dtype in (torch.float32, torch.float16):
        x = logits.to(dtype)
        w, idx, counts = aux_free_topk_fwd(x, bias, 4, 4, 2, 1.0, True, block_t=8, max_programs=2)
        w_ref, idx_ref = ref_aux_free(x.float(), bias, 4, 4, 2)
        assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=32))
        w, idx = by_index(w, idx)
        assert torch.equal(idx, idx_ref), dtype
        torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=2e-7)
    x = logits[::2, :].t().contiguous().t()  # a non-contiguous view
    w, idx = prim.aux_free_topk(x, bias, top_k=4, n_group=4, topk_group=2)
    w2, idx2 = base.aux_free_topk(x, bias, top_k=4, n_group=4, topk_group=2)
    assert torch.equal(by_index(w, idx)[1], by_index(w2, idx2)[1])
    # backward of the fused path equals the twin's autograd
    xa = logits.clone().requires_grad_()
    xb = logits.clone().requires_grad_()
    wa, ia = prim.aux_free_topk(xa, bias, top_k=4, n_group=4, topk_group=2, scaling_factor=2.5)
    wb, ib = base.aux_free_topk(xb, bias, top_k=4, n_group=4, topk_group=2, scaling_factor=2.5)
    ga = torch.randn_like(wa)
    (wa * ga).sum().backward()
    oa, ob = ia.argsort(1), ib.argsort(1)
    gb = torch.zeros_like(ga).scatter_(1, ob, ga.gather(1, oa))  # the same upstream gradient per expert
    (wb * gb).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-7)
    empty = prim.aux_free_topk(torch.randn(0, 16), torch.zeros(16), top_k=2, n_group=4, topk_group=2)
    assert empty[0].shape == (0, 2)
    results.append(_interpret_softmax())
    print(json.dumps({"ok": True, "shapes": results}))


def _interpret_softmax():
    """The fused softmax kernel under the interpreter (fp32, fp16): reference, twin, tie rule, persistent
    loop, a non-contiguous view, the backward, an empty batch."""
    from bumblebee.kernels.router_softmax import softmax_topk_fwd, softmax_topk_torch

    cases = 0
    for T, E, k in SOFTMAX_CASES:
        for norm in (True, False):
            for dtype in (torch.float32, torch.float16):
                check_softmax_fused(prim.softmax_topk_fused, T, E, k, norm, dtype, seed=T + E + k)
                cases += 1
    ties = torch.tensor([[1.0, 3.0, -0.0, 0.5, 3.0, 0.0, 3.0, -2.0, 1.0]] * 3)  # equal: lowest index first
    masked = torch.randn(5, 12, generator=torch.Generator().manual_seed(14))
    masked[:, 3:] = float("-inf")  # experts a token may not take: selected last, by index, weight 0
    for dtype in (torch.float32, torch.float16):
        for fn in (softmax_topk_fwd, softmax_topk_torch):
            w, idx, _ = fn(ties.to(dtype), 7, False)
            assert idx.tolist() == [[1, 4, 6, 0, 8, 3, 2]] * 3 and w[:, 0].eq(w[:, 2]).all(), (fn, dtype)
            w, idx, counts = fn(masked.to(dtype), 6, True)
            assert idx[:, 3:].tolist() == [[3, 4, 5]] * 5 and w[:, 3:].eq(0).all() and counts[3:6].eq(5).all()
    x = torch.randn(45, 60, generator=torch.Generator().manual_seed(12)) * 2  # several blocks per program
    for dtype in (torch.float32, torch.float16):
        w, idx, counts = softmax_topk_fwd(x.to(dtype), 6, True, block_t=4, max_programs=3)
        assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=60))
        w2, idx2 = base.softmax_topk(x.to(dtype), top_k=6)
        untied = ~tied_at_k(x.to(dtype), 6)  # fp16 ties: either expert is right
        assert torch.equal(idx.sort(1).values[untied], idx2.sort(1).values[untied]), dtype
        torch.testing.assert_close(w.float(), w2.float(), rtol=2e-3 if dtype == torch.float16 else 2e-6, atol=1e-7)
        for routes in (idx, idx.int()):  # replay: the selection's arithmetic, bit for bit
            w3, idx3, counts3 = softmax_topk_fwd(x.to(dtype), 6, True, routes, block_t=4, max_programs=3)
            assert torch.equal(w3, w) and torch.equal(idx3, idx) and torch.equal(counts3, counts)
        xg = x.to(dtype).clone().requires_grad_()
        w4, _ = prim.softmax_topk_fused(xg, top_k=6, routed_experts=idx)
        w4.float().pow(2).sum().backward()
        assert torch.equal(w4, w) and xg.grad.abs().sum() > 0
    view = x[::2].t().contiguous().t()
    assert torch.equal(prim.softmax_topk_fused(view, top_k=5)[1],
                       prim.softmax_topk_fused(view.contiguous(), top_k=5)[1])
    for norm in (True, False):
        check_softmax_fused_grad(prim.softmax_topk_fused, 29, 60, 8, norm, torch.float32, seed=5)
    empty = prim.softmax_topk_fused(torch.randn(0, 16), top_k=2, return_counts=True)
    assert empty[0].shape == (0, 2) and empty[2].eq(0).all()
    return {"softmax_cases": cases}


def test_fused_kernel_under_triton_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(__file__)


# ---- GPU: bf16 and large shapes ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,G,TG", [(16384, 256, 8, 8, 4), (4097, 64, 6, 8, 3), (1, 256, 8, 8, 4),
                                        (3000, 72, 4, 1, 1)])
def test_fused_kernel_on_gpu_matches_twin(dtype, T, E, k, G, TG):
    logits, bias = make_inputs(T, E, T + E)
    logits, bias = logits.cuda().to(dtype), bias.cuda()
    w, idx, c = prim.aux_free_topk(logits, bias, top_k=k, n_group=G, topk_group=TG, scaling_factor=2.5,
                                   return_counts=True)
    w2, idx2, c2 = base.aux_free_topk(logits, bias, top_k=k, n_group=G, topk_group=TG, scaling_factor=2.5,
                                      return_counts=True)
    w, idx = by_index(w, idx)
    w2, idx2 = by_index(w2, idx2)
    assert torch.equal(idx, idx2) and torch.equal(c, c2)
    torch.testing.assert_close(w, w2, rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,k", [(131072, 256, 8), (4096, 128, 8), (3001, 60, 2)])
def test_fused_softmax_on_gpu_matches_twin(dtype, T, E, k):
    g = torch.Generator(device="cuda").manual_seed(T + E)
    logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(dtype)
    w, idx, c = prim.softmax_topk_fused(logits, top_k=k, return_counts=True)
    w2, idx2, c2 = base.softmax_topk(logits, top_k=k, return_counts=True)
    assert w.dtype == dtype and torch.equal(idx, torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k])
    untied = ~tied_at_k(logits, k)
    assert torch.equal(idx.sort(1).values[untied], idx2.sort(1).values[untied])
    assert torch.equal(c, torch.bincount(idx.view(-1), minlength=E))
    assert torch.equal(c, c2) or not untied.all()
    rtol = 1.6e-2 if dtype == torch.bfloat16 else 2e-6  # one bf16 ulp: the kernel's exp is not torch's
    torch.testing.assert_close(w.float(), w2.float(), rtol=rtol, atol=1e-6)
    w_replay, _, c_replay = prim.softmax_topk_fused(logits, top_k=k, routed_experts=idx, return_counts=True)
    assert torch.equal(w_replay, w) and torch.equal(c_replay, c)
    x, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    up = torch.randn(T, E, device="cuda", generator=g).to(dtype)
    for fn, xi in ((prim.softmax_topk_fused, x), (base.softmax_topk, x2)):
        wi, ii = fn(xi, top_k=k)
        (wi * up.gather(1, ii)).sum().backward()
    ours, twin = x.grad.float()[untied], x2.grad.float()[untied]
    assert (ours - twin).norm() <= (1e-2 if dtype == torch.bfloat16 else 1e-6) * twin.norm()


@pytest.mark.gpu
def test_grouped_mm_experts_on_gpu_match_loop():
    from bumblebee.models.moe import MoEBlock

    torch.manual_seed(0)
    b = MoEBlock(256, 128, 16, 4).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(3, 333, 256, device="cuda", dtype=torch.bfloat16)
    y, _ = b(x)
    assert b.experts._use_grouped_mm(x)
    b.experts.grouped_mm = "never"
    y_loop, _ = b(x)
    err = ((y.float() - y_loop.float()).norm() / y_loop.float().norm()).item()
    assert err < 2e-2



@pytest.mark.gpu
def test_grouped_mm_experts_backward_matches_loop_with_expanded_gradient():
    """`.sum().backward()` hands the experts a stride-0 gradient, which grouped_mm's backward rejects."""
    from bumblebee.models.moe import GroupedExperts

    torch.manual_seed(1)
    ex = GroupedExperts(8, 64, 32).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    counts = torch.tensor([0, 37, 5, 0, 64, 1, 20, 9], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    grads = []
    for mode in ("always", "never"):
        ex.grouped_mm = mode
        ex.zero_grad()
        ex(x, counts).sum().backward()
        grads.append([p.grad.float().clone() for p in ex.parameters()])
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < 2e-2

if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()


def test_aux_free_says_when_its_kernel_does_not_run():
    # what `bumblebee pair` reports: float64 always runs the kernel's algorithm in torch, and without
    # CUDA (outside the Triton interpreter) so does every dtype; the code is the primitive's own
    code, why = registry.code_on("router", "aux_free", "cuda", torch.float64)  # a description: no GPU needed
    assert code == "aux_free" and "float64" in why
    assert registry.code_on("router", "aux_free", "cuda", torch.bfloat16) == ("aux_free", None)
    code, why = registry.code_on("router", "aux_free", "cpu", torch.float32)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert (code, why) == ("aux_free", None)
    else:
        assert code == "aux_free" and "CUDA" in why
    assert registry.code_on("router", "aux_free_ref", "cpu", torch.float32) == ("aux_free_ref", None)


def test_torch_path_is_the_kernels_algorithm_not_the_twins(monkeypatch):
    """Off CUDA the primitive runs kernels/router_aux_free.py's blocked torch algorithm: it matches the float64
    reference over several blocks, and routing still works with the twin's selection broken."""
    from bumblebee.kernels import router_aux_free as kr

    calls = []
    real = kr.aux_free_topk_torch
    monkeypatch.setattr(prim, "aux_free_topk_torch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(base, "aux_free_select", lambda *a, **k: 1 / 0)
    check_against_ref(prim.aux_free_topk, 45, 32, 4, 4, 2, seed=21)  # 3 blocks of 16 tokens
    assert calls
    logits, bias = make_inputs(45, 32, 22)
    w, idx, counts = kr.aux_free_topk_torch(logits, bias, 4, 4, 2, block_t=7)  # other block sizes agree
    w2, idx2, counts2 = kr.aux_free_topk_torch(logits, bias, 4, 4, 2, block_t=64)
    assert torch.equal(idx, idx2) and torch.equal(w, w2) and torch.equal(counts, counts2)
