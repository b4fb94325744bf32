"""MLA on one GPU at DeepSeek-V3 sizes: the SDPA primitive (lean backward on and off) vs the twin.

    python -m pytest benchmarks/bench_mla.py -q --benchmark-json bench.json
    python benchmarks/bench_mla.py             # writes $BENCH_OUT/mla.json (default benchmarks/results/)

One attention layer (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64,
v 128), bf16, batch 1, causal, forward + backward, at 4K / 16K / 32K tokens:
- `flash_lean`, `flash_plain`: `primitives.mla.FlashMLA` with the lean backward on / off;
- `naive`: `baselines.mla.NaiveMLA` (explicit scores: 4K only, it needs [128, T, T] fp32 scores);
- `core_cudnn`: the attention core alone (SDPA, cuDNN backend, q/k 192 and v 128 per head), for the
  useful rate: causal FLOPs = 3 * H * T^2 * (192 + 128) per forward + backward (2 matmuls forward,
  4 backward, half of each under the causal mask), against a measured bf16 8192^3 matmul rate.
Saved activations: device memory held between forward and backward, less the output.
Targets: core >= 60% of the matmul rate at 16K; lean saved <= 1/3 of plain at <= 15% extra time.
megatron-core's MLA is not run: its local (non-transformer-engine) layer spec cannot build MLA
(megatron-core 0.16: `DotProductAttention` rejects MLA's `k_channels`), and transformer-engine
does not fit on the GPU machine (../shared/gpu/README.md).
Every case times a fixed number of iterations with CUDA events (median ms) after warm-up.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (4096, 16384, 32768)
DSV3 = dict(dim=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128)
IMPLS = ("flash_lean", "flash_plain", "naive", "core_cudnn")
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"cases": []}


def _time_ms(fn, iters=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, iters=20)
    return 2 * n ** 3 / ms / 1e9


def core_flops(T, H=128, dqk=192, dv=128):
    return 3 * H * T * T * (dqk + dv)


def _rope(T):
    pos = torch.arange(T, device="cuda").float()
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    f = pos[:, None] * inv
    emb = torch.cat([f, f], -1)[None]
    return emb.cos().bfloat16(), emb.sin().bfloat16()


def _layer(impl):
    from bumblebee.baselines.mla import NaiveMLA
    from bumblebee.primitives.mla import FlashMLA

    torch.manual_seed(0)
    cls = NaiveMLA if impl == "naive" else FlashMLA
    m = cls(**DSV3, lean_backward=impl == "flash_lean")
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    return m.cuda().bfloat16()


def mla_case(impl, T):
    """(timed fn, record) for one implementation and length; the record gains ms and memory."""
    rec = {"case": f"{T // 1024}K", "impl": impl, "tokens": T}
    torch.cuda.empty_cache()
    if impl == "core_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k = (torch.randn(1, 128, T, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(1, 128, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, 128, T, 128, device="cuda", dtype=torch.bfloat16)

        def fn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(grad)
    else:
        m = _layer(impl)
        x = torch.randn(1, T, DSV3["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cos, sin = _rope(T)
        grad = torch.randn_like(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = m(x, cos, sin)
        rec["saved_activation_MB"] = (torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / 2**20
        y.backward(grad)
        del y

        def fn():
            m(x, cos, sin).backward(grad)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rec["median_ms"] = _time_ms(fn)
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if impl == "core_cudnn":
        rec["useful_TFLOPs"] = core_flops(T) / rec["median_ms"] / 1e9
    RESULTS["cases"].append(rec)
    return fn, rec


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_mla(benchmark, impl, T):
    if impl == "naive" and T > 4096:
        pytest.skip("the twin's [128, T, T] fp32 scores do not fit")
    benchmark.group = f"mla-{T // 1024}K"
    fn, rec = mla_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=5, warmup_rounds=1)


def summarize():
    by = {(c["case"], c["impl"]): c for c in RESULTS["cases"] if "median_ms" in c}
    rate = RESULTS.get("matmul_bf16_TFLOPs")
    out = {}
    for T in TOKENS:
        key = f"{T // 1024}K"
        s = {}
        if (key, "core_cudnn") in by and rate:
            s["core_fraction_of_matmul"] = by[(key, "core_cudnn")]["useful_TFLOPs"] / rate
        if (key, "flash_lean") in by and (key, "flash_plain") in by:
            lean, plain = by[(key, "flash_lean")], by[(key, "flash_plain")]
            s["lean_saved_over_plain"] = lean["saved_activation_MB"] / plain["saved_activation_MB"]
            s["lean_extra_time"] = lean["median_ms"] / plain["median_ms"] - 1
        if (key, "naive") in by and (key, "flash_plain") in by:
            s["speedup_flash_vs_naive"] = by[(key, "naive")]["median_ms"] / by[(key, "flash_plain")]["median_ms"]
        out[key] = s
    RESULTS["summary"] = out
    RESULTS["targets"] = {"core_fraction_of_matmul_16K": ">= 0.60", "lean_saved_over_plain": "<= 0.333",
                          "lean_extra_time": "<= 0.15"}


def write_results(path=None):
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    path = Path(path or OUT / "mla.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton_version,
                   cudnn=torch.backends.cudnn.version(), date=datetime.date.today().isoformat(), shapes=DSV3)
    summarize()
    path.write_text(json.dumps(RESULTS, indent=2))
    return path


def main():
    RESULTS["matmul_bf16_TFLOPs"] = matmul_tflops()
    for T in TOKENS:
        for impl in IMPLS:
            if impl == "naive" and T > 4096:
                continue
            try:
                mla_case(impl, T)
            except Exception as e:  # out of memory, or a backend that refuses
                RESULTS["cases"].append({"case": f"{T // 1024}K", "impl": impl, "error": str(e)[:300]})
                torch.cuda.empty_cache()
    for c in RESULTS["cases"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    print("written", write_results())
    print(json.dumps(RESULTS["summary"], indent=2))


if __name__ == "__main__":
    main()
