"""Gated DeltaNet on one GPU: flash-linear-attention (primitive) vs the torch chunked twin.

    python -m pytest benchmarks/bench_linear_attention.py -q --benchmark-json bench.json
    python benchmarks/bench_linear_attention.py   # writes $BENCH_OUT/linear_attention.json (default benchmarks/results/)

1. The layer at Qwen3.5-35B-A3B sizes (hidden 2048; 16 key and 32 value heads of 128; conv width 4),
   bf16, batch 1, forward + backward, at 4K to 64K tokens: median ms, peak memory over the inputs,
   and the useful TFLOP/s of the chunked algorithm.
2. One Qwen3.5-MoE decoder-layer group (3 DeltaNet layers + 1 gated-attention layer, 256 experts
   top-8 + shared expert, the 248,320-token vocabulary through `linear_ce`), a full training step
   at 8K and 32K tokens with either linear-attention implementation, plus the time of each layer
   kind alone (DeltaNet layer, attention layer, MoE block) to see where the step goes.
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
RESULTS: dict = {"layer": [], "step": [], "parts": []}


def _time_ms(fn, iters=3, warmup=1):
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


def _peak_mb(fn):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _rule_flops(T):
    """Useful FLOPs of the chunked rule, forward + backward (3x forward), chunk 64: per chunk and
    value head, the KK^T and QK^T products, the UT solves, the state read/write and the outputs."""
    C, n = 64, T // 64
    per_chunk = 2 * C * C * DK * 2 + 2 * C * C * (DK + DV) + 2 * C * DK * DV * 4 + 2 * C * C * DV
    return 3 * n * HV * per_chunk


def _layer(impl):
    from bumblebee import registry

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = registry.resolve("linear_attention", impl)(D, H, HV, DK, DV, conv_kernel_size=W)
    return layer.to(torch.bfloat16)


def layer_case(impl, T):
    rec = {"part": "deltanet_layer", "impl": impl, "tokens": T}
    torch.cuda.empty_cache()
    layer = _layer(impl)
    x = (torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    grad = torch.randn_like(x)

    def fn():
        layer(x).backward(grad)

    rec["peak_MB"] = _peak_mb(fn)
    rec["median_ms"] = _time_ms(fn)
    rec["rule_TFLOPs"] = _rule_flops(T) / rec["median_ms"] / 1e9
    RESULTS["layer"].append(rec)
    return fn, rec


def _model(impl):
    import bumblebee as bb

    cls = bb.models.MODEL_TYPES[MODEL["model_type"]]
    config = cls.config_class.from_hf(MODEL)
    torch.manual_seed(0)
    with torch.device("cuda"):
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
    return model.to(torch.bfloat16)


def step_case(impl, T):
    rec = {"part": "model_step_3deltanet_1attn_moe", "impl": impl, "tokens": T}
    torch.cuda.empty_cache()
    model = _model(impl)
    ids = torch.randint(0, MODEL["vocab_size"], (1, T), device="cuda")

    def fn():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    rec["peak_MB"] = _peak_mb(fn)
    rec["median_ms"] = _time_ms(fn)
    RESULTS["step"].append(rec)
    if impl == "fla":  # where the step goes: each layer kind alone, forward + backward
        x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(T, device="cuda")[None]
        cos, sin = model.model.rotary_emb(pos, torch.bfloat16)
        parts = {"deltanet_layer_block": lambda: model.model.layers[0](x, cos, sin)[0],
                 "attention_layer_block": lambda: model.model.layers[3](x, cos, sin)[0],
                 "deltanet_mixer": lambda: model.model.layers[0].linear_attn(x),
                 "attention_mixer": lambda: model.model.layers[3].self_attn(x, cos, sin),
                 "moe_block": lambda: model.model.layers[0].mlp(x)[0]}
        for name, f in parts.items():
            ms = _time_ms(lambda f=f: f().sum().backward())
            RESULTS["parts"].append({"part": name, "impl": impl, "tokens": T, "median_ms": ms})
    del model
    return fn, rec


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("T", LAYER_TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_deltanet_layer(benchmark, impl, T):
    benchmark.group = f"deltanet-layer-{T // 1024}K"
    fn, rec = layer_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("T", STEP_TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_decoder_group_step(benchmark, impl, T):
    benchmark.group = f"qwen3.5-moe-4-layers-{T // 1024}K"
    fn, rec = step_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=3, warmup_rounds=1)


def write_results(path=None):
    import triton

    path = Path(path or OUT / "linear_attention.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    by = {(c["tokens"], c["impl"]): c for c in RESULTS["layer"] if "median_ms" in c}
    RESULTS["layer_speedup"] = {f"{T // 1024}K": by[(T, "torch_chunked")]["median_ms"] / by[(T, "fla")]["median_ms"]
                                for T in LAYER_TOKENS if (T, "fla") in by and (T, "torch_chunked") in by}
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.date.today().isoformat(), layer_shape=dict(hidden=D, key_heads=H, value_heads=HV,
                                                                            head_k_dim=DK, head_v_dim=DV, conv=W),
                   model=MODEL)
    path.write_text(json.dumps(RESULTS, indent=2))
    return path


def main():
    for T in LAYER_TOKENS:
        for impl in IMPLS:
            try:
                layer_case(impl, T)
            except Exception as e:  # out of memory, or fla missing
                RESULTS["layer"].append({"part": "deltanet_layer", "impl": impl, "tokens": T, "error": str(e)[:300]})
            torch.cuda.empty_cache()
    for T in STEP_TOKENS:
        for impl in IMPLS:
            try:
                step_case(impl, T)
            except Exception as e:
                RESULTS["step"].append({"part": "model_step", "impl": impl, "tokens": T, "error": str(e)[:300]})
            torch.cuda.empty_cache()
    for c in RESULTS["layer"] + RESULTS["step"] + RESULTS["parts"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    print("written", write_results())


if __name__ == "__main__":
    main()
