"""Linear cross-entropy vs its twin and outside anchors: bf16 forward+backward, mean reduction.

    python3 -m pytest benchmarks/cross_entropy/bench.py -q --benchmark-json bench.json
    python3 benchmarks/cross_entropy/bench.py --plot benchmarks/cross_entropy/results/cross_entropy.json

One case per (implementation, shape), grouped by shape. Shapes: A (N 16384, H 4096, V 151936),
B (N 16384, H 2048, V 248320) and a token sweep 4K..64K at H 2048, V 248320. Implementations:
linear_ce (the primitive's default: the 6NHV path when its workspace fits the budget), linear_ce_lean
(the 8NHV vocabulary-chunk path forced), linear_ce_fwdgrad (the 6NHV gradients-in-forward path
forced), the materialized twin, Liger's fused linear CE, Cut Cross-Entropy with its gradient
filtering (cce) and without it (cce_exact: the exact peer), and a torch.compile'd 8-chunk loss
(each chunk checkpointed). Memory: peak allocated during the step minus the memory held before it
(inputs) minus the gradients every implementation must return (dH, dW in bf16): the workspace.
The floor is 6NHV FLOPs at the bf16 matmul rate measured in the same process (8192^3);
10% of labels are ignored, and valid_floor_ms counts only the non-ignored tokens (implementations
that skip ignored rows, as linear_ce and CCE do, can go below floor_ms).
Results go to $BENCH_OUT/cross_entropy.json (default benchmarks/cross_entropy/results/); `--plot` draws the PNG
(matplotlib: `pip install -e '.[plot]'`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing, siblings
from timing import check_measured, do_bench_ms, matmul_tflops, synced  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"A": (16384, 4096, 151936), "B": (16384, 2048, 248320)}
SWEEP = {f"sweep-{n // 1024}K": (n, 2048, 248320) for n in (4096, 8192, 32768, 65536)}
SWEEP_IMPLS = ("linear_ce", "linear_ce_lean", "linear_ce_fwdgrad", "materialized_ce", "liger", "cce")  # B is the 16K point of the sweep
IMPLS = ("linear_ce", "linear_ce_lean", "linear_ce_fwdgrad", "materialized_ce", "liger", "cce", "cce_exact",
         "compiled_chunks")
OUT = Path(os.environ.get("BENCH_OUT", HERE / "results"))
GiB = 1024 ** 3
RESULTS: dict = {"cases": []}


def _compiled_chunks():
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    @torch.compile(dynamic=False)
    def chunk(h, w, y):
        return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")

    def loss(h, w, y):
        total = sum(checkpoint(chunk, hc, w, yc, use_reentrant=False)
                    for hc, yc in zip(h.chunk(8), y.chunk(8)))
        return total / (y != -100).sum().clamp(min=1)
    return loss


def _impl(name):
    if name in ("linear_ce", "linear_ce_lean", "linear_ce_fwdgrad"):
        from bumblebee import registry
        path = {"linear_ce": "auto", "linear_ce_lean": "lean", "linear_ce_fwdgrad": "grad_in_forward"}[name]
        return registry.resolve("cross_entropy", f"linear_ce:path={path}")
    if name == "materialized_ce":
        from bumblebee.baselines.cross_entropy import materialized_cross_entropy
        return materialized_cross_entropy
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
    if name in ("cce", "cce_exact"):  # Cut CE with its gradient filtering (default), and without it
        from cut_cross_entropy import linear_cross_entropy
        eps = {} if name == "cce" else {"filter_eps": None}
        return lambda h, w, y: linear_cross_entropy(h, w, y, **eps)
    if name == "compiled_chunks":
        return _compiled_chunks()
    raise ValueError(name)


def _matmul_tflops():
    if "matmul_tflops" not in RESULTS:  # triton's do_bench, as the committed floors were measured
        RESULTS["matmul_tflops"] = matmul_tflops(8192, timer=lambda f: do_bench_ms(f, warmup_ms=100, rep_ms=500))
    return RESULTS["matmul_tflops"]


def _cases():
    for shape, dims in {**SHAPES, **SWEEP}.items():
        for impl in (IMPLS if shape in SHAPES else SWEEP_IMPLS):
            yield pytest.param(impl, shape, dims, id=f"{shape}-{impl}")


def _save():
    from stamp import stamp
    RESULTS.update(stamp(), memory_definition="peak during fwd+bwd - memory before it - bytes of dH and dW",
                   flop_definition="useful FLOPs = 6NHV; floor = 6NHV / matmul_tflops")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cross_entropy.json").write_text(json.dumps(RESULTS, indent=1))


@pytest.fixture(scope="module", autouse=True)
def write_results():
    yield
    _save()
    print("\n" + table(RESULTS))


@pytest.mark.parametrize("impl,shape,dims", list(_cases()))
def test_cross_entropy(benchmark, impl, shape, dims):
    n, h, v = dims
    benchmark.group = shape
    rate = _matmul_tflops()
    case = dict(impl=impl, shape=shape, N=n, H=h, V=v, floor_ms=6 * n * h * v / rate / 1e9)
    RESULTS["cases"].append(case)
    fn = _impl(impl)
    if hasattr(fn, "config"):  # ours: the options it ran with go into the result
        from bumblebee.options import record
        case["config"] = record(fn.config)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * h ** -0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    case["valid_floor_ms"] = case["floor_ms"] * float((labels != -100).float().mean())

    def setup():
        hidden.grad = weight.grad = None

    step = synced(lambda: fn(hidden, weight, labels).backward())

    oom = False
    try:
        setup(), step(), setup()  # warm-up: compilation, autotuning, handles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        grads = hidden.grad.numel() * 2 + weight.grad.numel() * 2
        case["workspace_gib"] = (torch.cuda.max_memory_allocated() - before - grads) / GiB
        benchmark.pedantic(step, setup=setup, rounds=10 if shape in SHAPES else 5, warmup_rounds=1)
    except torch.cuda.OutOfMemoryError:
        oom = True  # handled outside the except block, so the traceback frees its tensors
    if oom:
        case["oom"] = True
        hidden.grad = weight.grad = None
        del hidden, weight
        torch.cuda.empty_cache()
        _save()
        pytest.skip(f"{impl} runs out of memory at {shape}")
    case["median_ms"] = benchmark.stats.stats.median * 1e3
    case["useful_tflops"] = 6 * n * h * v / case["median_ms"] / 1e9
    case["x_floor"] = case["median_ms"] / case["floor_ms"]
    check_measured(benchmark, case, positive=("median_ms", "useful_tflops", "x_floor", "floor_ms", "valid_floor_ms"))
    benchmark.extra_info.update({k: case[k] for k in ("workspace_gib", "useful_tflops", "x_floor", "floor_ms",
                                                      "valid_floor_ms")})
    del hidden, weight
    torch.cuda.empty_cache()
    _save()


def table(res):
    rows = [f"{res.get('device')}  bf16 matmul {res.get('matmul_tflops', 0):.0f} TFLOP/s",
            f"{'shape':<11}{'impl':<19}{'ms':>8}{'x floor':>9}{'x valid':>9}{'TFLOP/s':>9}{'work GiB':>10}"]
    for c in res["cases"]:
        if c.get("oom"):
            rows.append(f"{c['shape']:<11}{c['impl']:<19}{'OOM':>8}")
        elif "median_ms" in c:
            rows.append(f"{c['shape']:<11}{c['impl']:<19}{c['median_ms']:8.1f}{c['x_floor']:9.2f}"
                        f"{c['median_ms'] / c['valid_floor_ms']:9.2f}"
                        f"{c['useful_tflops']:9.0f}{c['workspace_gib']:10.2f}")
    return "\n".join(rows)


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(path).read_text())
    pts = [c for c in res["cases"] if c["H"] == 2048 and c["V"] == 248320]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in SWEEP_IMPLS:
        ok = sorted((c["N"], c) for c in pts if c["impl"] == impl and "median_ms" in c)
        if ok:
            ax_t.plot([n for n, _ in ok], [c["median_ms"] for _, c in ok], "o-", label=impl)
            ax_m.plot([n for n, _ in ok], [c["workspace_gib"] for _, c in ok], "o-", label=impl)
        for c in pts:
            if c["impl"] == impl and c.get("oom"):
                ax_m.axvline(c["N"], color="red", ls=":", lw=1)
                ax_m.annotate(f"{impl}: OOM", (c["N"], 0), rotation=90, fontsize=7, color="red")
    floor = sorted((c["N"], c["floor_ms"]) for c in pts if c["impl"] == "linear_ce")
    ax_t.plot([n for n, _ in floor], [f for _, f in floor], "k--", label="floor (6NHV)")
    for ax, lab in ((ax_t, "median ms (fwd+bwd)"), (ax_m, "workspace GiB (peak - inputs - grads)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens N (H 2048, V 248320, bf16)")
        ax.set_ylabel(lab)
        ax.legend(fontsize=7)
    ax_m.set_yscale("symlog", linthresh=0.1)
    ax_m.set_ylim(bottom=0)
    fig.suptitle(f"cross-entropy on {res['device']} ({res['date']})")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        print(plot(sys.argv[2]))
    else:
        print(__doc__)
