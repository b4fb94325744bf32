"""Probe: FlashAttention 4's SM90 backward under other tile configurations, at the Qwen3-30B-A3B attention
shape (32 query heads, 4 key/value heads, head dim 128, causal, bf16, batch 1, BSHD).

Why: in the training step attention is FA4 in both stacks and its backward is the largest kernel (137 of
545 kernel ms at 32K; attention is ~3/4 of the step at 128K). FA4 picks its SM90 backward tiles from one
table (`interface._tile_size_bwd_sm90`, written from FA3's H100 table: 64 x 128 for causal head dim 128)
and ignores the tile arguments of `_flash_attn_bwd` there. Floor: the backward's FLOPs (2.5x the causal
forward's 2 Hq T^2 d: five matmuls, the scores recomputed, as FlashAttention counts them) at the measured
bf16 matmul rate; at bcd08dd it ran ~635 TFLOP/s against the forward's ~740. Prediction: a configuration
that beats the default does so by under ~10%; at 128K each 1% of the backward is ~25 ms of a step 198 ms
short of 1.3x the peer.

Each configuration replaces that table's answer while its calls run (restored after each; this process
only), first checks dq, dk, dv at 2048 tokens against the default's (relative norm error, bf16's scale),
then times the backward alone (forward once, outside the clock) at each length. A configuration FA4
cannot build is reported with its error. One JSON line per case.

    python benchmarks/attention/probes/probe_fa4_bwd_tiles.py [--tokens 32768 131072]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from timing import matmul_tflops, median_ms  # noqa: E402

SHAPE = (32, 4, 128)  # query heads, key/value heads, head dim
# BwdConfig fields beside the default (64 x 128, stages 2/2/2, SdP_swapAB, AtomLayout 1/2/1). Not
# num_stages_PdS alone: FA4's compile cache key leaves it out, so such a config would reuse (or poison)
# the default's compiled kernel.
CANDIDATES = {
    "default": None,
    "m80_n128_dQswap": dict(m_block_size=80, dQ_swapAB=True),
    "m64_n112": dict(n_block_size=112),
    "m64_n96": dict(n_block_size=96),
    "m64_n128_dO1": dict(num_stages_dO=1),
    "m64_n128_noSdPswap_AtomM2": dict(SdP_swapAB=False, AtomLayoutMSdP=2),
    "m128_n128_AtomdQ2": dict(m_block_size=128, AtomLayoutMdQ=2, num_stages_Q=1, num_stages_dO=1, num_stages_PdS=1),
    "m64_n128_3wg": dict(num_wg=3, AtomLayoutNdKV=3),
}


def interface():
    from flash_attn.cute import interface as fa
    return fa


def run_with(config, fn):
    """fn() with FA4's SM90 backward table answering `config` (None: its own answer)."""
    fa = interface()
    table = fa._tile_size_bwd_sm90
    if config is not None:
        base = table(SHAPE[2], SHAPE[2], True, False)
        fa._tile_size_bwd_sm90 = lambda *a, **k: fa.BwdConfig(**{**base.__dict__, **config})
    try:
        return fn()
    finally:
        fa._tile_size_bwd_sm90 = table


def inputs(T, seed=0):
    hq, hk, d = SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, T, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    do = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    fa = interface()
    scale = d ** -0.5
    out, lse, *_ = fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return q, k, v, out, do, lse, scale


def backward(args):
    q, k, v, out, do, lse, scale = args
    return interface()._flash_attn_bwd(q, k, v, out, do, lse, scale, True)[:3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--only", nargs="*", default=None, help="candidate names (default: all)")
    args = ap.parse_args()
    print_stamp(probe=Path(__file__).stem)
    rate = matmul_tflops()
    print(json.dumps({"matmul_TFLOPs": rate, "device": torch.cuda.get_device_name(), "shape": SHAPE}), flush=True)
    small = inputs(2048, seed=1)
    want = [t.float() for t in backward(small)]
    hq, _, d = SHAPE
    for name, config in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        rec = {"config": name, "changes": config}
        try:
            got = run_with(config, lambda: [t.float() for t in backward(small)])
            rec["rel_err_vs_default"] = {n: ((a - b).norm() / b.norm()).item()
                                         for n, a, b in zip(("dq", "dk", "dv"), got, want)}
            for T in args.tokens:
                big = inputs(T)
                ms = run_with(config, lambda: median_ms(lambda: backward(big), iters=5, warmup=2))
                useful = 2.5 * (2 * hq * T * T * d)  # five matmuls against the causal forward's two
                rec[f"bwd_ms_{T}"] = ms
                rec[f"bwd_TFLOPs_{T}"] = useful / ms / 1e9
                rec[f"bwd_pct_matmul_{T}"] = 100 * useful / ms / 1e9 / rate
                del big
        except Exception as e:  # noqa: BLE001 - a tile FA4 cannot build is a result, not a crash
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
