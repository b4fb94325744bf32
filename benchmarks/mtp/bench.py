"""MTP depth 1 on one GPU: the lean primitive (through `linear_ce`) vs the materialized twin.

    python -m pytest benchmarks/mtp/bench.py -q --benchmark-json bench.json
    python benchmarks/mtp/bench.py             # writes $BENCH_OUT/mtp.json (default benchmarks/mtp/results/)

A one-layer DeepSeek-V3-shaped model (hidden 2048, 16 MLA heads of 192/128, 16 experts top-4,
DeepSeek-V3's 129280-token vocabulary) with one MTP depth, bf16, batch 1, at 4K and 16K tokens,
forward + backward of the full loss. The main loss goes through `linear_ce` in both cases, so the
peak-memory difference is the MTP depth's: the twin holds [T, V] fp32 logits and their gradient.
Every case times a fixed number of iterations with CUDA events (median ms) after warm-up.
"""
from __future__ import annotations

import sys
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from timing import check_measured, median_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (4096, 16384)
IMPLS = ("lean", "materialized")
CONFIG = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 2048, "intermediate_size": 5632,
          "moe_intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 16,
          "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 16, "n_shared_experts": 1,
          "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
          "num_nextn_predict_layers": 1, "dtype": "bfloat16", "max_position_embeddings": 32768,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"cases": []}


def _time_ms(fn, iters=5, warmup=2):
    return median_ms(fn, iters, warmup, cuda=True)


def mtp_case(impl, T):
    import bumblebee as bb

    rec = {"case": f"{T // 1024}K", "impl": impl, "tokens": T}
    torch.cuda.empty_cache()
    model = bb.models.build(CONFIG, impl={"mtp": impl, "cross_entropy": "linear_ce"}, device="cuda")
    ids = torch.randint(0, CONFIG["vocab_size"], (1, T), device="cuda")

    def fn():
        model(ids, labels=ids).loss.backward()

    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    rec["median_ms"] = _time_ms(fn)
    RESULTS["cases"].append(rec)
    return fn, rec


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_mtp(benchmark, impl, T):
    benchmark.group = f"mtp-{T // 1024}K"
    fn, rec = mtp_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=3, warmup_rounds=1)
    check_measured(benchmark, rec, nonnegative=("peak_MB",))


def write_results(path=None):
    path = Path(path or OUT / "mtp.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    by = {(c["case"], c["impl"]): c for c in RESULTS["cases"] if "peak_MB" in c}
    RESULTS["peak_saving_MB"] = {f"{T // 1024}K": by[(f"{T // 1024}K", "materialized")]["peak_MB"]
                                 - by[(f"{T // 1024}K", "lean")]["peak_MB"]
                                 for T in TOKENS if (f"{T // 1024}K", "lean") in by
                                 and (f"{T // 1024}K", "materialized") in by}
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   date=datetime.date.today().isoformat(), config=CONFIG)
    path.write_text(json.dumps(RESULTS, indent=2))
    return path


def main():
    for T in TOKENS:
        for impl in IMPLS:
            try:
                mtp_case(impl, T)
            except Exception as e:  # out of memory, or linear_ce missing
                RESULTS["cases"].append({"case": f"{T // 1024}K", "impl": impl, "error": str(e)[:300]})
                torch.cuda.empty_cache()
    for c in RESULTS["cases"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    print("written", write_results())


if __name__ == "__main__":
    main()
