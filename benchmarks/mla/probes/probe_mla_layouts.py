"""Probe: which operand layout slows cuDNN's MLA attention (q/k head dim 192, v 128, 128 heads, causal,
bf16, 16K tokens)? Each case runs SDPA forward + backward on leaves of one layout: `BHSD` = contiguous
[B, H, T, d], `BSHD` = transposed view of contiguous [B, T, H, d], `slice` = v as the last 128 columns
of a contiguous [B, T, H, 256] (the primitive's kv_b_proj output). Reports the median wall time
(CUDA events) and, from one profiled step, the cuDNN forward / backward kernel times.

    python benchmarks/mla/probes/probe_mla_layouts.py
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

H, DQK, DV, T = 128, 192, 128, 16384
CASES = {  # name: (q/k layout, v layout, grad-output layout)
    "all_BHSD": ("BHSD", "BHSD", "BHSD"),
    "all_BSHD": ("BSHD", "BSHD", "BSHD"),
    "qk_BHSD_v_slice_do_BSHD": ("BHSD", "slice", "BSHD"),
    "qk_BSHD_v_slice_do_BSHD": ("BSHD", "slice", "BSHD"),
    "qk_BSHD_v_slice_do_BHSD": ("BSHD", "slice", "BHSD"),
    "qk_BHSD_v_BHSD_do_BSHD": ("BHSD", "BHSD", "BSHD"),
    "qk_BSHD_v_BHSD_do_BHSD": ("BSHD", "BHSD", "BHSD"),
}


def leaf(layout, d, g):
    if layout == "BHSD":
        return torch.randn(1, H, T, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    if layout == "BSHD":
        return torch.randn(1, T, H, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    return torch.randn(1, T, H, 128 + d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()


def view(t, layout, d):
    if layout == "BHSD":
        return t
    if layout == "BSHD":
        return t.transpose(1, 2)
    return t[..., 128:].transpose(1, 2)


def case(name):
    qk_l, v_l, do_l = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = leaf(qk_l, DQK, g), leaf(qk_l, DQK, g), leaf(v_l, DV, g)
    do = leaf(do_l, DV, g).detach()
    do = view(do, do_l, DV)

    def step():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(view(q, qk_l, DQK), view(k, qk_l, DQK), view(v, v_l, DV),
                                               is_causal=True)
        o.backward(do)
        q.grad = k.grad = v.grad = None

    ms = median_ms(step, iters=10, warmup=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kern = {"fprop": 0.0, "bprop": 0.0, "other": 0.0}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = "fprop" if "fprop" in e.name else "bprop" if "bprop" in e.name else "other"
            kern[key] += e.device_time_total / 1e3
    return {"case": name, "tokens": T, "median_ms": round(ms, 3), **{f"{k}_ms": round(v, 3) for k, v in kern.items()}}


def main():
    for name in CASES:
        print(json.dumps(case(name)), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
