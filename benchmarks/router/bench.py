"""Routers and MoE experts on one GPU: fused router kernels vs their torch twins and megatron-core.

    python -m pytest benchmarks/router/bench.py -q --benchmark-json bench.json
    python benchmarks/router/bench.py          # writes $BENCH_OUT/router.json (default benchmarks/router/results/)

Routing cases, forward only, at 16K and 64K tokens:
- DeepSeek-V3 (256 experts, top-8, 8 groups, 4 kept, fp32 logits as its gate computes them):
  `aux_free` (fused Triton), `aux_free_ref` (torch twin), megatron-core's
  `topk_routing_with_score_function` (sigmoid, expert bias, groups), and the twin under torch.compile.
- Qwen3.5 (256 experts, top-8 softmax, bf16 logits): `softmax_fused` (fused Triton), `softmax_topk`
  (torch twin) and megatron-core's softmax.
Target: the fused kernel >= 5x faster than the twin at 64K tokens, identical indices.
Experts case: Qwen3-30B-A3B's experts (128 x SwiGLU 2048 -> 768, top-8) on 8K tokens, bf16 forward +
backward: grouped GEMMs (torch._grouped_mm) vs a per-expert loop.
Every case times a fixed number of iterations with CUDA events (median ms) after warm-up.
"""
from __future__ import annotations

import sys
import json
import os
from pathlib import Path

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from timing import check_measured, median_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (16384, 65536)
DSV3 = dict(E=256, top_k=8, n_group=8, topk_group=4)
QWEN35 = dict(E=256, top_k=8)
ROUTING_IMPLS = {"dsv3": ("aux_free", "aux_free_ref", "megatron", "compiled_ref"),
                 "qwen35": ("softmax_fused", "softmax_topk", "megatron")}
EXPERTS = dict(E=128, D=2048, I=768, top_k=8, tokens=8192)
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"cases": []}


def _time_ms(fn, iters=20, warmup=5):
    return median_ms(fn, iters, warmup, cuda=True)


def _routing_fn(family, impl, T):
    g = torch.Generator(device="cuda").manual_seed(T)
    if family == "dsv3":
        logits = torch.randn(T, DSV3["E"], device="cuda", generator=g)
        bias = torch.randn(DSV3["E"], device="cuda", generator=g) * 0.1
        kw = dict(top_k=8, n_group=8, topk_group=4, scaling_factor=2.5)
        if impl == "aux_free":
            from bumblebee.primitives.router import aux_free_topk
            return lambda: aux_free_topk(logits, bias, **kw)
        if impl in ("aux_free_ref", "compiled_ref"):
            from bumblebee.baselines.router import aux_free_topk
            f = torch.compile(aux_free_topk) if impl == "compiled_ref" else aux_free_topk
            return lambda: f(logits, bias, **kw)
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
        return lambda: topk_routing_with_score_function(logits, 8, num_groups=8, group_topk=4, scaling_factor=2.5,
                                                        score_function="sigmoid", expert_bias=bias)
    logits = torch.randn(T, QWEN35["E"], device="cuda", generator=g).to(torch.bfloat16)
    if impl == "softmax_fused":
        from bumblebee.primitives.router import softmax_topk_fused
        return lambda: softmax_topk_fused(logits, top_k=8, norm_topk_prob=True)
    if impl == "softmax_topk":
        from bumblebee.baselines.router import softmax_topk
        return lambda: softmax_topk(logits, top_k=8, norm_topk_prob=True)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    return lambda: topk_routing_with_score_function(logits, 8, use_pre_softmax=True, score_function="softmax")


def routing_case(family, impl, T):
    try:
        fn = _routing_fn(family, impl, T)
    except ImportError as e:
        pytest.skip(f"{impl} unavailable: {e}")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = _time_ms(fn)
    peak = torch.cuda.max_memory_allocated() - base
    E = 256
    read_bytes = T * E * (4 if family == "dsv3" else 2)
    rec = {"case": f"{family}-{T // 1024}K", "impl": impl, "tokens": T, "experts": E, "top_k": 8,
           "median_ms": ms, "peak_workspace_bytes": peak, "logits_read_GBps": read_bytes / ms / 1e6}
    RESULTS["cases"].append(rec)
    return fn, rec


def experts_case(mode):
    from bumblebee.models.moe import GroupedExperts

    c = EXPERTS
    torch.manual_seed(0)
    ex = GroupedExperts(c["E"], c["D"], c["I"], grouped_mm=mode).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.02)
    M = c["tokens"] * c["top_k"]
    counts = torch.bincount(torch.randint(0, c["E"], (M,), device="cuda"), minlength=c["E"])
    x = torch.randn(M, c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fn():
        ex(x, counts).sum().backward()
    torch.cuda.reset_peak_memory_stats()
    ms = _time_ms(fn, iters=10, warmup=3)
    flops = 3 * 2 * M * c["D"] * 3 * c["I"]  # forward + backward, gate/up/down
    rec = {"case": "experts-qwen3-30b-a3b", "impl": f"grouped_mm={mode}", "rows": M, "median_ms": ms,
           "peak_bytes": torch.cuda.max_memory_allocated(), "TFLOPs": flops / ms / 1e9}
    RESULTS["cases"].append(rec)
    return fn, rec


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", ROUTING_IMPLS["dsv3"])
def test_dsv3_routing(benchmark, impl, T):
    benchmark.group = f"dsv3-routing-{T // 1024}K"
    fn, rec = routing_case("dsv3", impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=20, warmup_rounds=3)
    check_measured(benchmark, rec, positive=("median_ms", "logits_read_GBps"), nonnegative=("peak_workspace_bytes",))


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", ROUTING_IMPLS["qwen35"])
def test_qwen35_routing(benchmark, impl, T):
    benchmark.group = f"qwen35-routing-{T // 1024}K"
    fn, rec = routing_case("qwen35", impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=20, warmup_rounds=3)
    check_measured(benchmark, rec, positive=("median_ms", "logits_read_GBps"), nonnegative=("peak_workspace_bytes",))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_experts(benchmark, mode):
    benchmark.group = "experts"
    fn, rec = experts_case(mode)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=5, warmup_rounds=1)
    check_measured(benchmark, rec, positive=("median_ms", "TFLOPs"), nonnegative=("peak_bytes",))


def check_identical_indices():
    """Fused vs twin at 64K tokens: identical expert sets, weights within fp32 rounding."""
    from bumblebee.baselines.router import aux_free_topk as twin
    from bumblebee.primitives.router import aux_free_topk as fused

    logits = torch.randn(65536, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    w, i = fused(logits, bias, top_k=8, n_group=8, topk_group=4)
    w2, i2 = twin(logits, bias, top_k=8, n_group=8, topk_group=4)
    o, o2 = i.argsort(1), i2.argsort(1)
    return {"indices_identical": bool(torch.equal(i.gather(1, o), i2.gather(1, o2))),
            "max_weight_abs_diff": float((w.gather(1, o) - w2.gather(1, o2)).abs().max())}


def write_results(path=None):
    path = Path(path or OUT / "router.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    from stamp import stamp  # the commit (BENCH_COMMIT where the launcher sets it), versions, device, date
    RESULTS.update(stamp(), shapes={"dsv3": DSV3, "qwen35": QWEN35, "experts": EXPERTS})
    by = {(c["case"], c["impl"]): c["median_ms"] for c in RESULTS["cases"] if "median_ms" in c}
    RESULTS["speedup_fused_vs_twin"] = {f"{T // 1024}K": by[(f"dsv3-{T // 1024}K", "aux_free_ref")]
                                        / by[(f"dsv3-{T // 1024}K", "aux_free")]
                                        for T in TOKENS if (f"dsv3-{T // 1024}K", "aux_free") in by}
    RESULTS["speedup_softmax_fused_vs_twin"] = {f"{T // 1024}K": by[(f"qwen35-{T // 1024}K", "softmax_topk")]
                                                / by[(f"qwen35-{T // 1024}K", "softmax_fused")]
                                                for T in TOKENS if (f"qwen35-{T // 1024}K", "softmax_fused") in by}
    path.write_text(json.dumps(RESULTS, indent=2))
    return path


def main():
    RESULTS["check_64K"] = check_identical_indices()
    for T in TOKENS:
        for family, impls in ROUTING_IMPLS.items():
            for impl in impls:
                try:
                    routing_case(family, impl, T)
                except (pytest.skip.Exception, Exception) as e:  # an anchor that is missing or fails
                    RESULTS["cases"].append({"case": f"{family}-{T // 1024}K", "impl": impl, "error": str(e)[:300]})
    for mode in ("always", "never"):
        experts_case(mode)
    for c in RESULTS["cases"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()})
    print("written", write_results())


if __name__ == "__main__":
    main()
