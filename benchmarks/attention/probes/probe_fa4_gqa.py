"""Probe: FlashAttention 4 against SDPA's cuDNN backend on causal GQA at the shapes of the Qwen3 attention
layers (32 query heads, 8 or 4 key/value heads, head dim 128) and Qwen3.5's full-attention layers
(16 query heads, 2 key/value heads, head dim 256), bf16, batch 1, BSHD.

Checks first (T = 2048): output and q/k/v gradients of both against an fp32 reference (k/v repeated
per query head). Then times forward alone and forward + backward at 8K, 32K and 64K tokens. Useful
causal FLOPs: forward 2 * Hq * T^2 * d, forward + backward 3x that. One JSON line per case.
Shapes: (query heads, key/value heads, head dim).

    python benchmarks/attention/probes/probe_fa4_gqa.py
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
from timing import matmul_tflops, median_ms

SHAPES = ((32, 8, 128), (32, 4, 128), (16, 2, 256))


def inputs(T, shape, seed=0):
    HQ, hk, D = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, T, hk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    do = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


def fa4(q, k, v):
    from flash_attn.cute import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)
    return o[0] if isinstance(o, tuple) else o


def reference(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).transpose(1, 2)


def grads(fn, q, k, v, do):
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(o.dtype))
    return [o.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float()]


def check(shape, T=2048):
    q, k, v, do = inputs(T, shape, seed=1)
    ref = grads(reference, q, k, v, do)
    for name, fn in (("cudnn", cudnn), ("fa4", fa4)):
        got = grads(fn, q, k, v, do)
        errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
        print(json.dumps({"check": name, "tokens": T, "shape": shape, "rel_err_vs_fp32": errs}), flush=True)


def timed(name, fn, T, shape, rate):
    q, k, v, do = inputs(T, shape)
    HQ, _, D = shape

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward(do)

    useful = 2 * HQ * T * T * D  # causal forward: two matmuls of 2 * T^2 * d each, halved
    out = {"impl": name, "tokens": T, "shape": shape}
    for label, f, flops in (("fwd", fwd, useful), ("fwd_bwd", step, 3 * useful)):
        ms = median_ms(f, iters=10, warmup=3)
        out[label + "_ms"] = ms
        out[label + "_useful_TFLOPs"] = flops / ms / 1e9
        out[label + "_pct_matmul"] = 100 * flops / ms / 1e9 / rate
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    rate = matmul_tflops()
    print(json.dumps({"matmul_TFLOPs": rate, "device": torch.cuda.get_device_name(),
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    for shape in SHAPES:
        check(shape)
        for T in (8192, 32768, 65536):
            for name, fn in (("cudnn", cudnn), ("fa4", fa4)):
                timed(name, fn, T, shape, rate)
