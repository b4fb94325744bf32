"""MLA on one GPU at DeepSeek-V3 sizes: the primitive (lean backward on and off; its core on FA4 where
flash-attn-4 is installed, else SDPA), the twin, megatron-core's MLA, and a sweep of the attention core.

    python benchmarks/mla/bench.py --out DIR     # writes DIR/mla.json (default benchmarks/mla/results/)
    python benchmarks/mla/bench.py --smoke       # CPU, fp32, toy sizes: every code path, no timing claims
    python -m pytest benchmarks/mla/bench.py -q --benchmark-json bench.json

One attention layer (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64,
v 128), bf16, batch 1, causal, forward + backward, at 4K / 16K / 32K tokens:
- `flash_lean`, `flash_plain`: `primitives.mla.FlashMLA` with the lean backward on / off, as it
  runs by default (core on FA4 where installed; `mla_core_backend` in the results says which);
- `flash_lean_sdpa`, `flash_plain_sdpa`: the same with option `fa4="off"` (core on SDPA/cuDNN);
- `flash_lean_pad_v` (16K): the same with option `pad_v` (v zero-padded to 192 inside SDPA);
- `flash_lean_packed`, `flash_lean_packed_sdpa`, `flash_lean_packed_per_sequence` (16K): the lean layer
  on a packed batch of 32 sequences of 512 tokens (`cu_seqlens`; an RL-style batch): FA4 (one varlen
  launch), FA4 off (PyTorch's FlashAttention 2 varlen kernel, v padded to 192, one launch), FA4 and
  varlen off (one SDPA call per sequence); each `flash_*` record holds its `FlashMLAConfig` (`mla_config`);
- `naive`: `baselines.mla.NaiveMLA` (explicit scores: 4K only, it needs [128, T, T] fp32 scores);
- `megatron`, `megatron_up_proj_recompute`: megatron-core's `MLASelfAttention` built from its local
  (non-transformer-engine) layer spec, plain and with `recompute_modules=["mla_up_proj"]` (its
  counterpart of our lean backward). One adapter: the local spec's `DotProductAttention` does not
  accept the `k_channels`/`v_channels` that MLA passes it, so a subclass drops them (its unfused
  [b*h, s, s] scores path then runs as is). Tried at every length; an OOM is recorded as the reason;
- `core_*`: the attention core alone, forward + backward on random q/k/v (sweep below); `core_cudnn`,
  `core_bshd` and `core_fa4` also time the forward alone (`fwd_median_ms`, `fwd_useful_TFLOPs`,
  useful forward FLOPs H * T^2 * (d_qk + d_v)).
Useful FLOPs of the core, counted the same for every variant (also padded ones): causal forward +
backward = 3 * H * T^2 * (d_qk + d_v) with d_qk = 192, d_v = 128 (2 matmuls forward, 4 backward,
half of each under the causal mask; the backward's recomputed q.k is not counted). Every core
record also carries the rate in FlashAttention's own convention (`fa_convention_TFLOPs`: its
benchmarks count causal forward + backward as 3.5x the causal forward, i.e. the backward's recompute
included, 3.5 * H * T^2 * (d_qk + d_v)), the count published attention-kernel rates use. The rate is
compared with a bf16 8192^3 matmul measured in the same process. Padded variants also report the
executed rate, counting d_v = 192.
Layout sweep (`CORE_VARIANTS`): `core_cudnn` q/k/v contiguous [B, H, T, d]; `core_bshd` transposed
views of contiguous [B, T, H, d]; `core_primitive` exactly what `FlashMLA._core` hands SDPA (q a
concatenation of nope and RoPE'd rope parts, k a concatenation with the shared rope key broadcast,
v a strided slice of the kv_b_proj output, assembly included in the timing); `core_primitive_fused`
the same with the assembly as one Triton kernel each way (`kernels/mla_rope.py`, what `_core` runs
with option `fused_rope`, the default of the `flash_*` layers too); `core_prealloc` the
same with q and k written into preallocated [B, T, H, 192] buffers; `core_cudnn_pad_v` v zero-padded
to 192 ([B, H, T, d] as core_cudnn); `core_flash_pad_v` the flash backend (it refuses 192/128) with
v padded to 192, BSHD views; `core_fa4` FlashAttention 4 (`kernels/attention_fa4.py`) on
contiguous [B, T, H, d] (its native layout). The padded variants slice the output back to 128 before
the backward.
Saved activations: device memory held between forward and backward, less the output. Targets: core
>= 60% of the matmul rate at 16K; lean saved <= 1/3 of plain at <= 15% extra time. megatron
parity: our primitive's weights copied into megatron's module (same names up to a fixed map), fp32,
plain RoPE (base 10000, DeepSeek's interleaved pairs on both sides); output and input-gradient
relative errors recorded. Every case times a fixed number of iterations (median ms) after warm-up.
Parts beside this file: `run_config.py` (sizes, device, dtype, the gathered records, FLOP counts),
`core_sweep.py` (the attention core alone), `megatron_anchor.py` (megatron-core's MLA and the parity).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from siblings import load  # noqa: E402
from stamp import stamp  # noqa: E402
from timing import check_measured, matmul_tflops, synced  # noqa: E402

# the parts: run settings and records, the core sweep, megatron-core's MLA
run = load("mla", "run_config")
sweep = load("mla", "core_sweep")
megatron = load("mla", "megatron_anchor")
CFG, RESULTS, SMOKE, cuda, case_name = run.CFG, run.RESULTS, run.SMOKE, run.cuda, run.case_name
CORE_VARIANTS = sweep.CORE_VARIANTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (4096, 16384, 32768)
IMPLS = ("flash_lean", "flash_plain", "flash_lean_sdpa", "flash_plain_sdpa", "naive", "megatron",
         "megatron_up_proj_recompute")
FLOP_FORMULA = ("useful causal fwd+bwd FLOPs = 3 * H * T^2 * (d_qk + d_v), d_qk 192, d_v 128, H 128; "
                "FlashAttention convention (backward recompute counted) = 3.5 * H * T^2 * (d_qk + d_v)")
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))


# ---- whole layers ---------------------------------------------------------------------------------

def _options(impl):
    """The FlashMLAConfig a `flash_*` case runs: lean or plain backward; FA4 off for `_sdpa`, FA4 and
    varlen off for `_per_sequence`; pad_v for `_pad_v`."""
    from bumblebee.primitives.mla import FlashMLAConfig
    return FlashMLAConfig(lean_backward=impl.startswith("flash_lean"), pad_v=impl.endswith("pad_v"),
                          fa4="off" if impl.endswith(("_sdpa", "_per_sequence")) else "auto",
                          varlen=not impl.endswith("_per_sequence"))


def _core_backend(impl):
    """Which attention core a FlashMLA case runs: "fa4" or "sdpa" (the twin: "explicit scores")."""
    if not impl.startswith("flash"):
        return "explicit scores"
    from bumblebee.kernels import attention_fa4 as fa4
    s, config = CFG["sizes"], _options(impl)
    dqk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    if config.fa4 == "auto" and fa4.supports(torch.device(CFG["device"]), CFG["dtype"], dqk, s["v_head_dim"]):
        return "fa4"
    varlen = ("_packed" in impl and config.varlen and CFG["device"] == "cuda"
              and CFG["dtype"] in (torch.bfloat16, torch.float16))
    return "flash varlen" if varlen else "sdpa"


def _layer(impl):
    from bumblebee.baselines.mla import NaiveMLA
    from bumblebee.primitives.mla import FlashMLA

    torch.manual_seed(0)
    with torch.device(CFG["device"]):  # initialized where it runs (the CPU takes seconds at these sizes)
        m = NaiveMLA(**CFG["sizes"]) if impl == "naive" else FlashMLA(_options(impl), **CFG["sizes"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    return m.to(CFG["device"], CFG["dtype"])


def mla_case(impl, T):
    """(timed fn, record) for one implementation and length; the record gains ms and memory."""
    if impl.startswith("core_"):
        return sweep.core_case(impl, T)
    rec = {"case": case_name(T), "impl": impl, "tokens": T}
    if cuda():
        torch.cuda.empty_cache()
    dev, dt, D = CFG["device"], CFG["dtype"], CFG["sizes"]["dim"]
    x = torch.randn(1, T, D, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn_like(x)
    if impl.startswith("megatron"):
        from megatron.core import parallel_state

        m = megatron.megatron_mla(CFG["sizes"], dt, up_proj_recompute=impl == "megatron_up_proj_recompute")
        parallel_state.destroy_global_memory_buffer()  # its [b*h, s, s] score buffer: counted per case
        parallel_state._set_global_memory_buffer()
        rec["note"] = ("local spec; unfused DotProductAttention ([b*h, s, s] scores in a persistent global "
                       "buffer, softmax in fp32); adapter drops k_channels/v_channels")

        def call():
            return megatron.megatron_forward(m, x)
        shims = megatron.megatron_device_shims  # its up-projection recompute runs inside the backward
    else:
        m = _layer(impl)
        cos, sin = run.rope(T)
        n = CFG["packed_len"] if "_packed" in impl else T
        cu = torch.arange(0, T + 1, n, device=dev, dtype=torch.int32) if "_packed" in impl else None
        rec["sequences"] = T // n
        shims = contextlib.nullcontext
        rec["core_backend"] = _core_backend(impl)
        if impl != "naive":
            rec["mla_config"] = dataclasses.asdict(m.options)

        def call():
            with shims():
                return m(x, cos, sin, cu)
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = run.mem()
    y = call()
    if cuda():
        rec["saved_activation_MB"] = (run.mem() - before - y.numel() * y.element_size()) / 2**20
    with shims():
        y.backward(grad)
    del y
    if cuda():
        rec["first_step_peak_MB"] = (torch.cuda.max_memory_allocated() - before) / 2**20

    def fn():
        with shims():
            call().backward(grad)
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    base = run.mem()
    rec["median_ms"] = run.time_ms(fn)
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda() else None
    RESULTS["cases"].append(rec)
    return fn, rec


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS + CORE_VARIANTS)
def test_mla(benchmark, impl, T):
    if impl == "naive" and T > 4096:
        pytest.skip("the twin's [128, T, T] fp32 scores do not fit")
    if impl.startswith("megatron") and T > 4096:
        pytest.skip("megatron's unfused core attention holds [128, T, T] scores (OOM from 16K)")
    benchmark.group = f"mla-{T // 1024}K"
    fn, rec = mla_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(synced(fn), rounds=5, warmup_rounds=1)
    check_measured(benchmark, rec, nonnegative=("peak_MB", "first_step_peak_MB"))


def summarize():
    by = {(c["case"], c["impl"]): c for c in RESULTS["cases"] if "median_ms" in c}
    rate = RESULTS.get("matmul_bf16_TFLOPs")
    out = {}
    for T in sorted({c["tokens"] for c in RESULTS["cases"]}):
        key = case_name(T)
        s = {}
        if rate:
            s["core_fraction_of_matmul"] = {v: by[(key, v)]["useful_TFLOPs"] / rate
                                            for v in CORE_VARIANTS if (key, v) in by}
            s["core_fraction_of_matmul_fa_convention"] = {v: by[(key, v)]["fa_convention_TFLOPs"] / rate
                                                          for v in CORE_VARIANTS if (key, v) in by}
            s["core_floor_ms"] = run.core_flops(T) / rate / 1e9
        if (key, "flash_lean") in by and (key, "flash_plain") in by:
            lean, plain = by[(key, "flash_lean")], by[(key, "flash_plain")]
            if "saved_activation_MB" in plain:
                s["lean_saved_over_plain"] = lean["saved_activation_MB"] / plain["saved_activation_MB"]
            s["lean_extra_time"] = lean["median_ms"] / plain["median_ms"] - 1
        if (key, "core_primitive_fused") in by and (key, "core_primitive") in by:
            s["fused_rope_time_ratio_core"] = (by[(key, "core_primitive_fused")]["median_ms"]
                                               / by[(key, "core_primitive")]["median_ms"])
        if (key, "flash_lean_packed") in by and (key, "flash_lean_packed_sdpa") in by:
            s["packed_fa4_speedup_lean"] = (by[(key, "flash_lean_packed_sdpa")]["median_ms"]
                                            / by[(key, "flash_lean_packed")]["median_ms"])
        if (key, "flash_lean_packed_sdpa") in by and (key, "flash_lean_packed_per_sequence") in by:
            s["packed_varlen_speedup_lean"] = (by[(key, "flash_lean_packed_per_sequence")]["median_ms"]
                                               / by[(key, "flash_lean_packed_sdpa")]["median_ms"])
        if (key, "flash_lean_pad_v") in by and (key, "flash_lean") in by:
            s["pad_v_time_ratio_lean"] = by[(key, "flash_lean_pad_v")]["median_ms"] / by[(key, "flash_lean")]["median_ms"]
        for ref in ("naive", "megatron", "megatron_up_proj_recompute"):
            if (key, ref) in by and (key, "flash_plain") in by:
                s[f"speedup_flash_plain_vs_{ref}"] = by[(key, ref)]["median_ms"] / by[(key, "flash_plain")]["median_ms"]
        out[key] = s
    RESULTS["summary"] = out
    RESULTS["targets"] = {"core_fraction_of_matmul_16K": ">= 0.60", "lean_saved_over_plain": "<= 0.333",
                          "lean_extra_time": "<= 0.15"}


def write_results(path=None):
    try:
        import megatron.core
        megatron_version = megatron.core.__version__
    except Exception:  # not installed, or fails to import
        megatron_version = None
    from bumblebee.primitives.mla import FlashMLAConfig
    try:
        from importlib.metadata import version
        fa4_version = version("flash-attn-4")
    except Exception:  # not installed
        fa4_version = None
    path = Path(path or OUT / "mla.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.update(stamp(), device=torch.cuda.get_device_name() if cuda() else "cpu (smoke)",
                   megatron_core=megatron_version,
                   cudnn=torch.backends.cudnn.version() if cuda() else None,
                   mla_fused_rope=FlashMLAConfig().fused_rope, mla_default_config=dataclasses.asdict(FlashMLAConfig()),
                   flash_attn_4=fa4_version, mla_core_backend=_core_backend("flash_lean"),
                   shapes=CFG["sizes"], dtype=str(CFG["dtype"]),
                   flop_formula=FLOP_FORMULA)
    summarize()
    path.write_text(json.dumps(RESULTS, indent=2, default=str))
    return path


def _attempt(fn, *args, impl, T):
    try:
        return fn(*args)
    except Exception as e:  # out of memory, a backend that refuses, megatron failing to build
        RESULTS["cases"].append({"case": case_name(T), "impl": impl, "tokens": T,
                                 "error": f"{type(e).__name__}: {str(e)[:400]}"})
    if cuda():  # after the except block, so that the failed frames' tensors are gone
        torch.cuda.empty_cache()
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="folder for mla.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, toy sizes: runs every code path")
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="sequence lengths to run")
    args = ap.parse_args(argv)
    tokens, parity_T = tuple(args.tokens), 512
    if args.smoke:
        CFG.update(sizes=SMOKE, device="cpu", dtype=torch.float32, packed_len=16)
        tokens, parity_T = (32, 48), 24
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    if cuda():
        RESULTS["matmul_bf16_TFLOPs"] = matmul_tflops()
    for T in tokens:
        layer_impls = [i for i in IMPLS if not i.startswith("megatron") and (i != "naive" or T <= 4096)]
        if T == 16384 or args.smoke and T == tokens[0]:
            layer_impls += ["flash_lean_pad_v", "flash_lean_packed", "flash_lean_packed_sdpa",
                            "flash_lean_packed_per_sequence"]
        for impl in layer_impls + list(CORE_VARIANTS):
            _attempt(mla_case, impl, T, impl=impl, T=T)
    if not args.no_megatron:  # last: its persistent score buffer and any OOM come after everything else
        rec = _attempt(megatron.megatron_parity, CFG["sizes"], parity_T, impl="megatron_parity", T=parity_T)
        if rec is not None:
            RESULTS["megatron_parity"] = rec
        for T in tokens:
            for impl in ("megatron", "megatron_up_proj_recompute"):
                if impl == "megatron_up_proj_recompute" and T > 4096 and not args.smoke:
                    continue  # the plain megatron case already shows whether its scores fit
                _attempt(mla_case, impl, T, impl=impl, T=T)
    for c in RESULTS["cases"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    out = Path(args.out)
    print("written", write_results(out / "mla.json" if out.suffix != ".json" else out))
    print(json.dumps({"summary": RESULTS["summary"], "megatron_parity": RESULTS.get("megatron_parity")}, indent=2,
                     default=str))


if __name__ == "__main__":
    main()
