"""Gated DeltaNet on one GPU: flash-linear-attention (primitive) vs the torch chunked twin.

    python benchmarks/linear_attention/bench.py --out DIR     # DIR/linear_attention.json, about 2-3 GPU minutes
    python benchmarks/linear_attention/bench.py --smoke --out DIR  # CPU, tiny shapes: checks the script runs
    python -m pytest benchmarks/linear_attention/bench.py -q --benchmark-json bench.json

1. The layer at Qwen3.5-35B-A3B sizes (hidden 2048; 16 key and 32 value heads of 128; conv width 4),
   bf16, batch 1, forward + backward, at 4K to 64K tokens: median ms, peak memory over the inputs,
   and the useful TFLOP/s of the chunked algorithm.
2. One Qwen3.5-MoE decoder-layer group (3 DeltaNet layers + 1 gated-attention layer, 256 experts
   top-8 + shared expert, the 248,320-token vocabulary through `linear_ce`), a full training step
   at 8K and 32K tokens with either linear-attention implementation, plus the time of each layer
   kind alone (DeltaNet layer, attention layer, MoE block) to see where the step goes.
Every case times a fixed number of iterations with CUDA events (median ms) after one warm-up call,
and reads the peak memory over those same calls. Cases run shortest first; the twin up to
--twin-max-tokens (default 32K: its per-chunk scan is slow and its fp32 per-chunk tensors large at
64K), and no case starts after --budget-s (default 150 s); what was not run is listed under
"skipped" in the JSON with the reason. The JSON also says which gated backward fla ran
("fla_backward": on Hopper with Triton < 3.7.1 fla refuses its own chunk_bwd_dqkwg and the
primitive installs kernels/linear_attention_gdn_backward.py in its place).
"""
from __future__ import annotations

import sys
import argparse
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from timing import Stopwatch, check_measured, median_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYER_TOKENS = (4096, 8192, 16384, 32768, 65536)
STEP_TOKENS = (8192, 32768)
IMPLS = ("fla", "torch_chunked")
D, H, HV, DK, DV, W = 2048, 16, 32, 128, 128, 4
MODEL = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": D, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": W,
         "linear_key_head_dim": DK, "linear_value_head_dim": DV, "linear_num_key_heads": H,
         "linear_num_value_heads": HV, "full_attention_interval": 4, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
         "mtp_num_hidden_layers": 0, "dtype": "bfloat16", "max_position_embeddings": 65536,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"layer": [], "step": [], "parts": [], "skipped": []}
DEVICE, DTYPE = "cuda", torch.bfloat16  # --smoke: cpu, float32


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, iters=3, warmup=1, peak=None):
    """Median ms over `iters` calls after `warmup`; with `peak` (a dict) also the peak MB above the start."""
    return median_ms(fn, iters, warmup, peak=peak, cuda=DEVICE == "cuda")


def _rule_flops(T):
    """Useful FLOPs of the chunked rule, forward + backward (3x forward), chunk 64: per chunk and
    value head, the KK^T and QK^T products, the UT solves, the state read/write and the outputs."""
    C, n = 64, T // 64
    per_chunk = 2 * C * C * DK * 2 + 2 * C * C * (DK + DV) + 2 * C * DK * DV * 4 + 2 * C * C * DV
    return 3 * n * HV * per_chunk


def _layer(impl):
    from bumblebee import registry

    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = registry.resolve("linear_attention", impl)(D, H, HV, DK, DV, conv_kernel_size=W)
    return layer.to(DTYPE)


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def layer_case(impl, T):
    rec = {"part": "deltanet_layer", "impl": impl, "tokens": T}
    _empty_cache()
    layer = _layer(impl)
    x = (torch.randn(1, T, D, device=DEVICE, dtype=DTYPE)).requires_grad_()
    grad = torch.randn_like(x)

    def fn():
        layer(x).backward(grad)

    rec["median_ms"] = _time_ms(fn, peak=rec)
    rec["rule_TFLOPs"] = _rule_flops(T) / rec["median_ms"] / 1e9
    RESULTS["layer"].append(rec)
    return fn, rec


def _model(impl):
    import bumblebee as bb

    cls = bb.models.MODEL_TYPES[MODEL["model_type"]]
    config = cls.config_class.from_hf(MODEL)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = cls(config, {"linear_attention": impl, "cross_entropy": "linear_ce"})
    with torch.no_grad():  # initialized on the GPU (the CPU init of 256 experts x 4 layers is slow)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(1, 16).log_()
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model.to(DTYPE)


def step_case(impl, T):
    rec = {"part": "model_step_3deltanet_1attn_moe", "impl": impl, "tokens": T}
    _empty_cache()
    model = _model(impl)
    ids = torch.randint(0, MODEL["vocab_size"], (1, T), device=DEVICE)

    def fn():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    rec["median_ms"] = _time_ms(fn, peak=rec)
    RESULTS["step"].append(rec)
    if impl == "fla":  # where the step goes: each layer kind alone, forward + backward
        x = torch.randn(1, T, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
        pos = torch.arange(T, device=DEVICE)[None]
        cos, sin = model.model.rotary_emb(pos, DTYPE)
        parts = {"deltanet_layer_block": lambda: model.model.layers[0](x, cos, sin)[0],
                 "attention_layer_block": lambda: model.model.layers[3](x, cos, sin)[0],
                 "deltanet_mixer": lambda: model.model.layers[0].linear_attn(x),
                 "attention_mixer": lambda: model.model.layers[3].self_attn(x, cos, sin),
                 "moe_block": lambda: model.model.layers[0].mlp(x)[0]}
        for name, f in parts.items():
            ms = _time_ms(lambda f=f: f().sum().backward())
            RESULTS["parts"].append({"part": name, "impl": impl, "tokens": T, "median_ms": ms})
    return fn, rec  # the model lives as long as fn (main drops it; pytest-benchmark times it)


def _synced(fn):
    def run():
        fn()
        _sync()
    return run


@pytest.mark.parametrize("T", LAYER_TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_deltanet_layer(benchmark, impl, T):
    benchmark.group = f"deltanet-layer-{T // 1024}K"
    fn, rec = layer_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_synced(fn), rounds=3, warmup_rounds=1)
    check_measured(benchmark, rec, positive=("median_ms", "rule_TFLOPs"), nonnegative=("peak_MB",))


@pytest.mark.parametrize("T", STEP_TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_decoder_group_step(benchmark, impl, T):
    benchmark.group = f"qwen3.5-moe-4-layers-{T // 1024}K"
    fn, rec = step_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_synced(fn), rounds=3, warmup_rounds=1)
    check_measured(benchmark, rec, nonnegative=("peak_MB",))


def fla_backward_info():
    """Which gated backward the primitive runs here (fla's own, ours inside fla's, or fla's algorithm in torch)."""
    from bumblebee.primitives import linear_attention as la

    ops = la.fla_ops()
    try:
        import fla
        version = getattr(fla, "__version__", None)
    except ImportError:
        version = None
    return {"fla_version": version, "fla_imports": ops is not None,
            "fla_refuses_its_gated_dqkwg": la.fla_refuses_gated_backward(),
            "our_dqkwg_installed": la.DQKWG_HOOK, "fla_backward_ok": la.fla_backward_ok()}


def write_results(path=None):
    import triton

    path = Path(path or OUT / "linear_attention.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    by = {(c["tokens"], c["impl"]): c for c in RESULTS["layer"] if "median_ms" in c}
    RESULTS["layer_speedup"] = {f"{T // 1024}K": by[(T, "torch_chunked")]["median_ms"] / by[(T, "fla")]["median_ms"]
                                for T in sorted({t for t, _ in by}) if (T, "fla") in by and (T, "torch_chunked") in by}
    RESULTS.update(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
                   torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
                   dtype=str(DTYPE), layer_shape=dict(hidden=D, key_heads=H, value_heads=HV, head_k_dim=DK,
                                                      head_v_dim=DV, conv=W),
                   model=MODEL, fla_backward=fla_backward_info())
    path.write_text(json.dumps(RESULTS, indent=2))
    return path


def _smoke_shapes():
    """Tiny CPU shapes (float32): the same code paths, seconds to run."""
    global D, H, HV, DK, DV, MODEL, DEVICE, DTYPE
    D, H, HV, DK, DV = 64, 2, 4, 16, 16
    DEVICE, DTYPE = "cpu", torch.float32
    MODEL = {**MODEL, "vocab_size": 512, "hidden_size": D, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "linear_key_head_dim": DK, "linear_value_head_dim": DV, "linear_num_key_heads": H,
             "linear_num_value_heads": HV, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
             "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "dtype": "float32"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="folder for linear_attention.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, float32: checks the script runs")
    ap.add_argument("--layer-tokens", default=",".join(map(str, LAYER_TOKENS)))
    ap.add_argument("--step-tokens", default=",".join(map(str, STEP_TOKENS)))
    ap.add_argument("--twin-max-tokens", type=int, default=32768, help="longest sequence the twin runs")
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no new case after this many seconds")
    args = ap.parse_args(argv)
    layer_tokens = [int(t) for t in args.layer_tokens.split(",")]
    step_tokens = [int(t) for t in args.step_tokens.split(",")]
    if args.smoke:
        _smoke_shapes()
        layer_tokens, step_tokens = [100, 200], [150]
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    RESULTS["twin_max_tokens"] = args.twin_max_tokens
    clock = Stopwatch()

    def run(kind, case, impl, T):
        why = None
        if impl == "torch_chunked" and T > args.twin_max_tokens:
            why = f"twin not run past --twin-max-tokens {args.twin_max_tokens} (time and memory)"
        elif clock.seconds() > args.budget_s:
            why = f"time budget --budget-s {args.budget_s:.0f} spent"
        if why:
            RESULTS["skipped"].append({"part": kind, "impl": impl, "tokens": T, "why": why})
            return
        try:
            case(impl, T)
        except Exception as e:  # out of memory, or fla missing
            RESULTS[kind].append({"part": kind, "impl": impl, "tokens": T, "error": str(e)[:300]})
        _empty_cache()

    # shortest first (layers before the step at equal length): a spent budget drops the longest cases
    cases = sorted([(T, 0, "layer", layer_case) for T in layer_tokens]
                   + [(T, 1, "step", step_case) for T in step_tokens], key=lambda c: c[:2])
    for T, _, kind, case in cases:
        for impl in IMPLS:
            run(kind, case, impl, T)
    RESULTS["wall_s"] = clock.seconds()
    for c in RESULTS["layer"] + RESULTS["step"] + RESULTS["parts"] + RESULTS["skipped"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    print("written", write_results(Path(args.out) / "linear_attention.json"))


if __name__ == "__main__":
    main()
