"""Probe: backward tile configurations of FlashAttention 4's SM90 kernel on the MLA core (128 heads,
q/k head dim 192, v head dim 128, causal, bf16, batch 1, 16K tokens). FA4 picks its SM90 backward
tiles in `flash_attn.cute.interface._tile_size_bwd_sm90`; each case here replaces that choice, times
forward + backward, and checks dq/dk/dv against the default configuration (a configuration that
does not compile or fit shared memory is reported as an error). One JSON line per case.

    python benchmarks/mla/probes/probe_fa4_bwd_tiles.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import dataclasses
import json

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from probe_fa4_mla import DQK, DV, H, SCALE, inputs
from timing import matmul_tflops, median_ms

T = 16384
# (m_block, n_block, stages Q, stages dO, stages PdS, SdP_swapAB, dKV_swapAB, dQ_swapAB,
#  AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, num_wg[, dQ_single_wg])
CASES = {
    "default": None,
    "n112": (64, 112, 2, 2, 1, False, True, False, 1, 2, 1, 2),
    "n128": (64, 128, 2, 2, 1, False, True, False, 1, 2, 1, 2),
    "n80": (64, 80, 2, 2, 1, False, True, False, 1, 2, 1, 2),
    "n128_dO1": (64, 128, 2, 1, 1, False, True, False, 1, 2, 1, 2),
    "m80_n96_dQswap": (80, 96, 2, 2, 1, False, True, True, 1, 2, 1, 2),
    "n96_noswapKV": (64, 96, 2, 2, 1, False, False, False, 1, 2, 1, 2),
    "n96_SdPswap": (64, 96, 2, 2, 1, True, True, False, 1, 2, 1, 2),
    "m128_n64_wg2": (128, 64, 2, 2, 1, False, True, False, 2, 1, 2, 2),
    "n96_PdS2": (64, 96, 2, 2, 2, False, True, False, 1, 2, 1, 2),
    "n112_Q1": (64, 112, 1, 2, 1, False, True, False, 1, 2, 1, 2),
    "n128_Q1": (64, 128, 1, 2, 1, False, True, False, 1, 2, 1, 2),
    "n96_dQatom2": (64, 96, 2, 2, 1, False, True, False, 1, 2, 2, 2),
    "n96_KVatom1": (64, 96, 2, 2, 1, False, True, False, 1, 1, 1, 2),
    # one warp group computes the whole dQ GEMM while the other moves on (FA4's choice for head dim 96)
    "n96_dQ1wg": (64, 96, 2, 2, 1, False, True, False, 1, 2, 1, 2, True),
    "n96_dQ1wg_PdS2": (64, 96, 2, 2, 2, False, True, False, 1, 2, 1, 2, True),
}
SKIP = ("n112", "n128", "n80", "n128_dO1", "m80_n96_dQswap", "n96_noswapKV", "n96_SdPswap", "m128_n64_wg2")
SKIP += ("n96_PdS2", "n112_Q1", "n128_Q1", "n96_dQatom2", "n96_KVatom1")
# ^ measured on an H100 (results/history/probe_fa4_bwd_tiles_h100.jsonl): over shared memory, wrong results
# (n80), slower, or no tiled-MMA partition; then on an H200 (results/history/probe_fa4_bwd_tiles_h200.jsonl);
# each later run tries only the new cases (dQ_single_wg: results/history/probe_fa4_bwd_tiles_h200_dq1wg.jsonl)


def run_case(name, cfg, ref, rate):
    from flash_attn.cute import flash_attn_func, interface
    default = interface._tile_size_bwd_sm90
    if cfg is not None:
        base = default(DQK, DV, True, False)
        fields = ("m_block_size", "n_block_size", "num_stages_Q", "num_stages_dO", "num_stages_PdS",
                  "SdP_swapAB", "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV",
                  "AtomLayoutMdQ", "num_wg", "dQ_single_wg")
        chosen = dataclasses.replace(base, **dict(zip(fields, cfg)))
        interface._tile_size_bwd_sm90 = lambda *a, **k: chosen
    q, k, kv, do = inputs(T)

    def step():
        qq, kk, kvv = (t.detach().requires_grad_() for t in (q, k, kv))
        o = flash_attn_func(qq, kk, kvv[..., DQK:], softmax_scale=SCALE, causal=True)
        (o[0] if isinstance(o, tuple) else o).backward(do)
        return qq.grad, kk.grad, kvv.grad

    try:
        grads = step()
        diff = None if ref is None else max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref))
        ms = median_ms(step, iters=8, warmup=2)
        useful = 3 * H * T * T * (DQK + DV)
        print(json.dumps({"case": name, "cfg": cfg, "fwd_bwd_ms": ms, "pct_matmul": 100 * useful / ms / 1e9 / rate,
                          "max_abs_diff_vs_default": diff}), flush=True)
        return grads
    except Exception as e:  # noqa: BLE001 - a configuration that does not build is a result here
        print(json.dumps({"case": name, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        return None
    finally:
        interface._tile_size_bwd_sm90 = default


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    rate = matmul_tflops()
    print(json.dumps({"matmul_TFLOPs": rate, "device": torch.cuda.get_device_name(), "tokens": T}), flush=True)
    ref = None
    for name, cfg in CASES.items():
        if name in SKIP:
            continue
        out = run_case(name, cfg, ref, rate)
        if name == "default":
            ref = out
