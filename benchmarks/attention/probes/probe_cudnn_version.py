"""Probe: SDPA's cuDNN backend at the attention shapes of the models, for comparing cuDNN releases.

Run it once per cuDNN build (torch's own, then a newer one preloaded) and compare the lines; the cuDNN
version is the first field of every line. Shapes (query heads, key/value heads, d_qk, d_v): the MLA core
(128, 128, 192, 128), Qwen3's attention (32, 8, 128, 128), Qwen3.5's full attention (16, 2, 256, 256).
Causal, bf16, batch 1. Checks first (T = 2048): output and q/k/v gradients against an fp32 reference.
Then forward and forward + backward times. Useful causal FLOPs: forward Hq * T^2 * (d_qk + d_v),
forward + backward 3x that.

    python benchmarks/attention/probes/probe_cudnn_version.py
    LD_PRELOAD=<newer>/libcudnn.so.9 python benchmarks/attention/probes/probe_cudnn_version.py
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

CASES = (((128, 128, 192, 128), (4096, 16384, 32768)),
         ((32, 8, 128, 128), (32768,)),
         ((16, 2, 256, 256), (32768,)))
VERSION = torch.backends.cudnn.version()


def inputs(T, shape, seed=0):
    hq, hk, dqk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, d: torch.randn(1, h, T, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return make(hq, dqk), make(hk, dqk), make(hk, dv), make(hq, dv)


def cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def reference(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                          v.float().repeat_interleave(rep, 1), is_causal=True)


def grads(fn, q, k, v, do):
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(o.dtype))
    return [o.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float()]


def check(shape, T=2048):
    q, k, v, do = inputs(T, shape, seed=1)
    ref, got = grads(reference, q, k, v, do), grads(cudnn, q, k, v, do)
    errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
    print(json.dumps({"cudnn": VERSION, "check": shape, "tokens": T, "rel_err_vs_fp32": errs}), flush=True)


def timed(shape, T, rate):
    q, k, v, do = inputs(T, shape)
    hq, _, dqk, dv = shape

    def fwd():
        with torch.no_grad():
            cudnn(q, k, v)

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        cudnn(qq, kk, vv).backward(do)

    useful = hq * T * T * (dqk + dv)
    out = {"cudnn": VERSION, "shape": shape, "tokens": T}
    for label, f, flops in (("fwd", fwd, useful), ("fwd_bwd", step, 3 * useful)):
        ms = median_ms(f, iters=10, warmup=3)
        out[label + "_ms"] = ms
        out[label + "_pct_matmul"] = 100 * flops / ms / 1e9 / rate
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    rate = matmul_tflops()
    print(json.dumps({"cudnn": VERSION, "matmul_TFLOPs": rate, "device": torch.cuda.get_device_name()}), flush=True)
    for shape, lengths in CASES:
        check(shape)
        for T in lengths:
            timed(shape, T, rate)
