"""Probe: does a strided v (a slice of the kv_b_proj output, as FlashMLA._core had it) slow SDPA's
cuDNN backend against a contiguous v? MLA head dims (q/k 192, v 128), 128 heads, causal, bf16,
forward + backward, BSHD views. Prints one JSON line per (tokens, layout).

    python benchmarks/mla/probes/probe_mla_v_layout.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from timing import median_ms

H, DQK, DV, NOPE = 128, 192, 128, 128


def case(T, layout):
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, T, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, T, H, NOPE + DV, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, T, H, DV, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    def step():
        qq, kk, kvv = (t.detach().requires_grad_() for t in (q, k, kv))
        v = kvv[..., NOPE:]
        if layout == "contiguous":
            v = v.contiguous()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
        o.backward(do)

    ms = median_ms(step, iters=10, warmup=3)
    flops = 3 * H * T * T * (DQK + DV)
    return {"tokens": T, "v": layout, "median_ms": ms, "useful_TFLOPs": flops / ms / 1e9}


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    for T in (4096, 16384):
        for layout in ("strided", "contiguous"):
            print(json.dumps(case(T, layout)), flush=True)
