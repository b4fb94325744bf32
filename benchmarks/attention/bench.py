"""The `attention` slot on one GPU at Qwen3's shape (32 query heads, 8 key/value heads, head dim 128) and
Qwen3.5's full-attention shape (16 query heads, 2 key/value heads, head dim 256), bf16, causal,
forward + backward, dense (batch 1) and packed (`cu_seqlens`).

    python benchmarks/attention/bench.py --out DIR   # writes DIR/attention.json (default benchmarks/attention/results/)
    python benchmarks/attention/bench.py --smoke     # CPU, fp32, toy sizes: every code path, no timing claims

Implementations, all through the same [B, H, T, D] interface:
- `sdpa`: the primitive as it runs by default (FlashAttention 4 where flash-attn-4 is installed and
  the head dim is <= 128; `attention_core` in the results says which);
- `sdpa_no_fa4`: the primitive as `sdpa:fa4=off` (SDPA, cuDNN first; packed: PyTorch's FlashAttention 2
  varlen kernel while sequences average under `kernels/varlen_attention.MAX_MEAN_LENGTH` tokens, else one
  SDPA call per sequence);
- `sdpa_per_sequence`: `sdpa:fa4=off,varlen=off` (packed: one SDPA call per sequence, cuDNN first);
- `eager`: the twin (explicit [B, H, N, N] fp32 scores; up to 8K tokens);
- anchors: `flash_backend` (SDPA's flash backend, FlashAttention 2; dense only), `varlen_direct`
  (aten._flash_attention_forward with cu_seqlens through kernels/attention_varlen.py, no slot, no
  length rule; packed only) and `fa4_direct` (flash_attn.cute.flash_attn_func / flash_attn_varlen_func
  called on [B, T, H, D] tensors, no slot).
Cases (`CASES`): Qwen3 dense 8K / 32K / 64K tokens and packed 32K tokens as 8 x 4K, 16 x 2K, 32 x 1K,
64 x 512 and 256 x 128 sequences (RL-style batches; 2K and 1K place the varlen crossover); Qwen3.5 dense
32K and packed 64 x 512 and 8 x 4K. Useful causal FLOPs: 6 * Hq * d * sum over sequences of L^2 (forward two matmuls,
backward four, half under the mask). Rates are read against a bf16 8192^3 matmul measured in the same
process. Every case times a fixed number of iterations with CUDA events (median ms) after warm-up.
Each record of a slot entry holds its resolved config (`impl_config`).
"""
from __future__ import annotations

import sys
import argparse
import json
import os
from pathlib import Path

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from stamp import stamp
from timing import check_measured, matmul_tflops, median_ms, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"qwen3": dict(q_heads=32, kv_heads=8, head_dim=128), "qwen3.5": dict(q_heads=16, kv_heads=2, head_dim=256)}
SMOKE_SHAPE = dict(q_heads=4, kv_heads=2, head_dim=8)
CASES = ([("qwen3", (t,)) for t in (8192, 32768, 65536)]
         + [("qwen3", (n,) * c) for c, n in ((8, 4096), (16, 2048), (32, 1024), (64, 512), (256, 128))]  # 32K tokens
         + [("qwen3.5", (32768,)), ("qwen3.5", (512,) * 64), ("qwen3.5", (4096,) * 8)])
IMPLS = ("sdpa", "sdpa_no_fa4", "sdpa_per_sequence", "eager", "flash_backend", "varlen_direct", "fa4_direct")
SLOT_CHOICES = {"sdpa": "sdpa", "sdpa_no_fa4": "sdpa:fa4=off", "sdpa_per_sequence": "sdpa:fa4=off,varlen=off",
                "eager": "eager"}  # the entries that run through the slot, as `impl` choices
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"cases": []}
CFG = {"shape": SHAPES["qwen3"], "device": "cuda", "dtype": torch.bfloat16}  # shape: set per case


def _cuda():
    return CFG["device"] == "cuda"


def _case_fn(impl, lengths):
    """fn running forward + backward of `impl` on one packed stream of sequences `lengths` (a single
    length is a dense batch of 1)."""
    from bumblebee.registry import resolve

    s, dev, dt = CFG["shape"], CFG["device"], CFG["dtype"]
    N, packed = sum(lengths), len(lengths) > 1
    if impl == "eager" and N > 8192:
        raise RuntimeError("the twin holds [B, H, N, N] fp32 scores: run up to 8K tokens")
    if impl == "flash_backend" and packed:
        raise RuntimeError("dense only (SDPA has no varlen entry)")
    if impl == "varlen_direct" and not packed:
        raise RuntimeError("packed only")
    g = torch.Generator(device=dev).manual_seed(N)
    q, k, v = (torch.randn(1, N, h, s["head_dim"], device=dev, dtype=dt, generator=g).requires_grad_()
               for h in (s["q_heads"], s["kv_heads"], s["kv_heads"]))
    grad = torch.randn(1, N, s["q_heads"], s["head_dim"], device=dev, dtype=dt, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=dev, dtype=torch.int32)
    kw = {"cu_seqlens": cu} if packed else {}
    if impl == "fa4_direct":
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        def call():
            if packed:
                o = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                           max_seqlen_k=max(lengths), causal=True)
                return (o[0] if isinstance(o, tuple) else o)[None]
            o = flash_attn_func(q, k, v, causal=True)
            return o[0] if isinstance(o, tuple) else o
    elif impl == "varlen_direct":
        from bumblebee.kernels import attention_varlen as varlen_attention

        def call():
            return varlen_attention.causal_attention(q[0], k[0], v[0], s["head_dim"] ** -0.5, cu, max(lengths))[None]
    elif impl == "flash_backend":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)
    else:
        fn = resolve("attention", SLOT_CHOICES[impl])

        def call():
            return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)

    def step():
        call().backward(grad)
    return step


def _core(impl, packed):
    from bumblebee.kernels import attention_fa4 as fa4
    from bumblebee.kernels import attention_varlen as varlen_attention
    from bumblebee.primitives import attention
    from bumblebee.registry import choose
    if impl in ("eager", "flash_backend", "varlen_direct"):
        return {"eager": "explicit scores", "flash_backend": "sdpa flash", "varlen_direct": "flash varlen"}[impl]
    if impl == "fa4_direct":
        return "fa4"
    s, config = CFG["shape"], choose("attention", SLOT_CHOICES[impl])[1]
    on = config.fa4 == "on" or config.fa4 == "auto" and (packed or s["head_dim"] <= attention.FA4_MAX_HEAD_DIM)
    if on and fa4.supports(torch.device(CFG["device"]), CFG["dtype"], s["head_dim"], s["head_dim"]):
        return "fa4"
    lengths = CFG["lengths"]
    cuda16 = CFG["device"] == "cuda" and CFG["dtype"] in (torch.bfloat16, torch.float16)
    if (packed and config.varlen and cuda16
            and varlen_attention.worthwhile(sum(lengths), len(lengths))):
        return "flash varlen"
    return "sdpa per sequence" if packed else "sdpa"


def _name(shape, lengths):
    kind = f"dense-{lengths[0] // 1024}K" if len(lengths) == 1 else f"packed-{len(lengths)}x{lengths[0]}"
    return f"{shape}-{kind}"


def run_case(impl, shape, lengths):
    CFG["shape"] = SHAPES[shape] if CFG["device"] == "cuda" else SMOKE_SHAPE
    CFG["lengths"] = lengths
    from bumblebee.registry import record
    rec = {"case": _name(shape, lengths), "impl": impl, "tokens": sum(lengths), "sequences": len(lengths),
           "shape": CFG["shape"], "attention_core": _core(impl, len(lengths) > 1)}
    if impl in SLOT_CHOICES:
        rec["impl_config"] = record("attention", SLOT_CHOICES[impl])
    if _cuda():
        torch.cuda.empty_cache()
    fn = _case_fn(impl, lengths)
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if _cuda() else 0
    rec["median_ms"] = median_ms(fn, iters=10, warmup=3, cuda=_cuda())
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if _cuda() else None
    s = CFG["shape"]
    rec["useful_TFLOPs"] = 6 * s["q_heads"] * s["head_dim"] * sum(n * n for n in lengths) / rec["median_ms"] / 1e9
    RESULTS["cases"].append(rec)
    return fn, rec


@pytest.mark.parametrize("case", CASES, ids=lambda c: _name(*c))
@pytest.mark.parametrize("impl", IMPLS)
def test_attention(benchmark, impl, case):
    benchmark.group = f"attention-{_name(*case)}"
    try:
        fn, rec = run_case(impl, *case)
    except (RuntimeError, ImportError) as e:
        pytest.skip(str(e))
    benchmark.extra_info.update(rec)
    benchmark.pedantic(synced(fn), rounds=5, warmup_rounds=1)
    check_measured(benchmark, rec, positive=("median_ms", "useful_TFLOPs"), nonnegative=("peak_MB",))


def summarize():
    by = {(c["case"], c["impl"]): c for c in RESULTS["cases"] if "median_ms" in c}
    rate = RESULTS.get("matmul_bf16_TFLOPs")
    out = {}
    for case in dict.fromkeys(c["case"] for c in RESULTS["cases"]):
        s = {}
        if (case, "sdpa") in by and (case, "sdpa_no_fa4") in by:
            s["speedup_sdpa_vs_no_fa4"] = by[(case, "sdpa_no_fa4")]["median_ms"] / by[(case, "sdpa")]["median_ms"]
        if (case, "sdpa_no_fa4") in by and (case, "sdpa_per_sequence") in by:
            s["speedup_no_fa4_vs_per_sequence"] = (by[(case, "sdpa_per_sequence")]["median_ms"]
                                                   / by[(case, "sdpa_no_fa4")]["median_ms"])
        if rate:
            s["fraction_of_matmul"] = {i: by[(case, i)]["useful_TFLOPs"] / rate for i in IMPLS if (case, i) in by}
        out[case] = s
    RESULTS["summary"] = out


def write_results(path):
    try:
        from importlib.metadata import version
        fa4_version = version("flash-attn-4")
    except Exception:  # not installed
        fa4_version = None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.update(stamp(), device=torch.cuda.get_device_name() if _cuda() else "cpu (smoke)",
                   cudnn=torch.backends.cudnn.version() if _cuda() else None, flash_attn_4=fa4_version,
                   shapes=SHAPES, dtype=str(CFG["dtype"]))
    summarize()
    path.write_text(json.dumps(RESULTS, indent=2, default=str))
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="folder for attention.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, toy sizes: runs every code path")
    args = ap.parse_args(argv)
    cases = CASES
    if args.smoke:
        CFG.update(device="cpu", dtype=torch.float32)
        cases = [("qwen3", (64,)), ("qwen3", (16,) * 4)]
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    if _cuda():
        RESULTS["matmul_bf16_TFLOPs"] = matmul_tflops()
    for shape, lengths in cases:
        for impl in IMPLS:
            try:
                run_case(impl, shape, lengths)
            except Exception as e:  # a backend that refuses, a package not installed, out of memory
                RESULTS["cases"].append({"case": _name(shape, lengths), "impl": impl,
                                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            if _cuda():
                torch.cuda.empty_cache()
    for c in RESULTS["cases"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    out = Path(args.out)
    print("written", write_results(out / "attention.json" if out.suffix != ".json" else out))
    print(json.dumps(RESULTS["summary"], indent=2))


if __name__ == "__main__":
    main()
