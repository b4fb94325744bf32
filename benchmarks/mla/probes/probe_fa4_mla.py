"""Probe: FlashAttention 4 (`flash_attn.cute`, CuTe DSL, has an SM90 path) against SDPA's cuDNN backend on
the MLA attention core: 128 heads, q/k head dim 192, v head dim 128, causal, bf16, batch 1, BSHD.

Checks first (T = 2048): output, dq, dk, dv of both against an fp32 reference built from the same bf16
inputs; packed (varlen, two sequences) FA4 against FA4 on each sequence alone. Then times forward and
forward + backward at 4K, 16K and 32K tokens. Useful causal FLOPs as in `mla/run_config.py`:
3 * H * T^2 * (d_qk + d_v) for forward + backward, H * T^2 * (d_qk + d_v) for the forward alone.
Prints one JSON line per case.

    python benchmarks/mla/probes/probe_fa4_mla.py
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

H, DQK, DV = 128, 192, 128
SCALE = DQK ** -0.5


def inputs(T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, T, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qk")
    kv = torch.randn(1, T, H, DQK + DV, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, T, H, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, kv, do


def cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=SCALE)
    return o.transpose(1, 2)


def fa4(q, k, v):
    from flash_attn.cute import flash_attn_func
    o = flash_attn_func(q, k, v, softmax_scale=SCALE, causal=True)
    return o[0] if isinstance(o, tuple) else o


def reference(q, k, v):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * SCALE
    T = s.shape[-1]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).transpose(1, 2)


def grads(fn, q, k, kv, do):
    qq, kk, kvv = (t.detach().requires_grad_() for t in (q, k, kv))
    o = fn(qq, kk, kvv[..., DQK:])
    o.backward(do.to(o.dtype))
    return [o.detach().float(), qq.grad.float(), kk.grad.float(), kvv.grad[..., DQK:].float()]


def check(T=2048):
    q, k, kv, do = inputs(T, seed=1)
    ref = grads(reference, q, k, kv, do)
    for name, fn in (("cudnn", cudnn), ("fa4", fa4)):
        got = grads(fn, q, k, kv, do)
        errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
        print(json.dumps({"check": name, "tokens": T, "rel_err_vs_fp32": errs}), flush=True)
    from flash_attn.cute import flash_attn_varlen_func
    half = T // 2
    qs, ks, vs = q[0], k[0], kv[0, ..., DQK:]
    cu = torch.tensor([0, half, T], dtype=torch.int32, device="cuda")
    o = flash_attn_varlen_func(qs, ks, vs, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=half,
                               max_seqlen_k=half, softmax_scale=SCALE, causal=True)
    o = o[0] if isinstance(o, tuple) else o
    sep = torch.cat([fa4(q[:, a:b], k[:, a:b], kv[:, a:b, :, DQK:])[0] for a, b in ((0, half), (half, T))])
    print(json.dumps({"check": "fa4_varlen_vs_separate", "tokens": T,
                      "max_abs_diff": (o.float() - sep.float()).abs().max().item()}), flush=True)


def timed(name, fn, T, rate):
    q, k, kv, do = inputs(T)
    v = kv[..., DQK:]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        qq, kk, kvv = (t.detach().requires_grad_() for t in (q, k, kv))
        fn(qq, kk, kvv[..., DQK:]).backward(do)

    useful = H * T * T * (DQK + DV)
    out = {"impl": name, "tokens": T}
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
    check()
    for T in (4096, 16384, 32768):
        for name, fn in (("cudnn", cudnn), ("fa4", fa4)):
            timed(name, fn, T, rate)
