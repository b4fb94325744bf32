"""Probe: the q/k RMSNorm + RoPE chain of a Qwen3 attention layer, by layout, compiled as the model runs it.

At 32K tokens the profiled step spent ~10 ms in the compiled RoPE kernels on q ([1, 32, 32768, 128]
bf16: 256 MB read + 256 MB written per call, ~0.13 ms at 4 TB/s, 12 calls a step), 5x the bytes' time.
The model applies RoPE on the [B, H, T, D] view of [B, T, H, D] memory, so the compiled kernel writes
[B, H, T, D] and reads q strided, head-major: each head sweeps all T rows of q and of cos/sin.
Cases, forward + backward (one upstream gradient), q then k:
- `bhtd`: as the model runs it (norm, then RoPE on the transposed view);
- `bthd`: RoPE on [B, T, H, D] (cos/sin broadcast over heads), transposed after;
- `bthd_fused_norm`: the per-head RMSNorm and RoPE in one compiled function on [B, T, H, D].
Outputs are checked equal across cases (bitwise: the same fp32 math per element). One JSON line per case.

    python benchmarks/training_step/probes/probe_rope_layout.py --tokens 32768
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import stamp  # noqa: E402
from timing import median_ms  # noqa: E402

from bumblebee.models.components import RotaryEmbedding, apply_rope, rotate_half  # noqa: E402
from bumblebee.norms import rms_norm  # noqa: E402


def rope_bthd(x, cos, sin):
    cos, sin = cos[:, :, None], sin[:, :, None]
    return x * cos + rotate_half(x) * sin


def norm_rope_bthd(x, weight, eps: float, cos, sin):
    dtype = x.dtype
    h = x.float()
    h = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype))
    return rope_bthd(h, cos, sin)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    T, eps = args.tokens, 1e-6
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"q": 32, "k": 4}
    xs = {n: torch.randn(1, T, h, 128, device=dev, dtype=dt, generator=g) for n, h in shapes.items()}
    ws = {n: (1 + 0.1 * torch.randn(128, device=dev, generator=g)).to(dt) for n in shapes}
    dys = {n: torch.randn(1, h, T, 128, device=dev, dtype=dt, generator=g) for n, h in shapes.items()}
    cos, sin = RotaryEmbedding(128, {"rope_theta": 1e6})(torch.arange(T, device=dev)[None], dt)
    c_rope_bthd = torch.compile(rope_bthd, dynamic=True)
    c_norm_rope = torch.compile(norm_rope_bthd, dynamic=True)

    cases = {
        "bhtd": lambda x, w: apply_rope(rms_norm(x, w, eps).transpose(1, 2), cos, sin),
        "bthd": lambda x, w: c_rope_bthd(rms_norm(x, w, eps), cos, sin).transpose(1, 2),
        "bthd_fused_norm": lambda x, w: c_norm_rope(x, w, eps, cos, sin).transpose(1, 2),
    }
    outs, rows = {}, []
    for name, fn in cases.items():
        leaves = {n: (xs[n].clone().requires_grad_(), ws[n].clone().requires_grad_()) for n in shapes}

        def step():
            for n, (x, w) in leaves.items():
                x.grad = w.grad = None
                fn(x, w).backward(dys[n])

        step()
        outs[name] = [fn(*leaves[n]).detach() for n in shapes] + [leaves[n][0].grad for n in shapes]
        fwd = median_ms(lambda: [fn(*leaves[n]) for n in shapes], iters=20, warmup=3)
        both = median_ms(step, iters=20, warmup=3)
        row = {"case": name, "tokens": T, "fwd_ms": fwd, "fwd_bwd_ms": both,
               "out_strides": list(fn(*leaves["q"]).stride()),
               "equal_to_bhtd": all(torch.equal(a, b) for a, b in zip(outs[name], outs["bhtd"])),
               "max_abs_diff_to_bhtd": max((a.float() - b.float()).abs().max().item()
                                           for a, b in zip(outs[name], outs["bhtd"]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({**stamp(), "probe": "rope_layout", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
