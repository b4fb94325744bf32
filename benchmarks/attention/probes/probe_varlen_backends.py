"""Probe: PyTorch's own varlen attention kernels on packed causal batches, against one SDPA call per
sequence (the attention slot's and MLA's packed path where FA4 is not installed).

Backends: `loop` (SDPA per sequence, cuDNN first), `cudnn` (aten._cudnn_attention_forward with
cu_seqlens: cuDNN's ragged SDPA, one launch), `flash` (aten._flash_attention_forward with cu_seqlens:
FlashAttention 2 varlen, one launch; equal q/k and v head dims only), `flash_pad_v` (the same through
kernels/attention_varlen.py, v zero-padded to the q/k head dim: how MLA runs it). Shapes (query heads, key/value
heads, d_qk, d_v): Qwen3 (32, 8, 128, 128), Qwen3.5 (16, 2, 256, 256), the MLA core
(128, 128, 192, 128). Checks first (uneven lengths, 2048 tokens): output and q/k/v gradients against an
fp32 per-sequence reference. Then forward + backward times on 32K tokens packed as 64 x 512, 32 x 1K,
16 x 2K and 8 x 4K (the crossover against one call per sequence).
A backend that raises is reported with its error. One JSON line per case.

    python benchmarks/attention/probes/probe_varlen_backends.py
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

SHAPES = {"qwen3": (32, 8, 128, 128), "qwen3.5": (16, 2, 256, 256), "mla": (128, 128, 192, 128)}
CHECK_LENGTHS = (37, 300, 1, 1024, 686)
PACKINGS = ((512,) * 64, (1024,) * 32, (2048,) * 16, (4096,) * 8)
ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def inputs(lengths, shape, dtype=torch.bfloat16, seed=0):
    hq, hk, d, e = shape
    N = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, c: torch.randn(N, h, c, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return make(hq, d), make(hk, d), make(hk, e), make(hq, e), cu


def loop(q, k, v, cu, max_len, scale, reference=False):
    rep = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        if reference:
            qs, ks, vs = qs.float(), ks.float().repeat_interleave(rep, 1), vs.float().repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            with sdpa_kernel(ORDER, set_priority=True):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=rep > 1)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def cudnn(q, k, v, cu, max_len, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False,
                                                   scale=scale)[0]


def flash(q, k, v, cu, max_len, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0]


def flash_pad_v(q, k, v, cu, max_len, scale):
    from bumblebee.kernels import attention_varlen as varlen_attention
    return varlen_attention.causal_attention(q, k, v, scale, cu, max_len)


IMPLS = {"loop": loop, "cudnn": cudnn, "flash": flash, "flash_pad_v": flash_pad_v}


def grads(fn, q, k, v, do, cu, max_len, scale, **kw):
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv, cu, max_len, scale, **kw)
    o.backward(do.to(o.dtype))
    return [o.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float()]


def check(name, shape):
    q, k, v, do, cu = inputs(CHECK_LENGTHS, shape, seed=1)
    scale, max_len = shape[2] ** -0.5, max(CHECK_LENGTHS)
    ref = grads(loop, q, k, v, do, cu, max_len, scale, reference=True)
    for impl, fn in IMPLS.items():
        rec = {"check": name, "impl": impl, "lengths": CHECK_LENGTHS}
        try:
            got = grads(fn, q, k, v, do, cu, max_len, scale)
            rec["rel_err_vs_fp32"] = {n: ((a - b).norm() / b.norm()).item()
                                      for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
        except Exception as exc:  # noqa: BLE001 - a probe reports what fails
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)


def timed(name, shape, lengths, rate):
    q, k, v, do, cu = inputs(lengths, shape)
    hq, _, d, e = shape
    scale, max_len = d ** -0.5, max(lengths)
    useful = 3 * hq * (d + e) * sum(n * n for n in lengths)  # causal forward H L^2 (d + e), backward 2x
    for impl, fn in IMPLS.items():
        rec = {"case": name, "impl": impl, "packing": f"{len(lengths)}x{lengths[0]}"}

        def step():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            fn(qq, kk, vv, cu, max_len, scale).backward(do)
        try:
            ms = median_ms(step, iters=10, warmup=3)
            rec.update(fwd_bwd_ms=ms, pct_matmul=100 * useful / ms / 1e9 / rate)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    rate = matmul_tflops()
    print(json.dumps({"matmul_TFLOPs": rate, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    for name, shape in SHAPES.items():
        check(name, shape)
        for lengths in PACKINGS:
            timed(name, shape, lengths, rate)
