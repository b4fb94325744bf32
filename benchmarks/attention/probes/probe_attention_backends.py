"""Probe: SDPA backends for causal GQA at the composed step's attention shape (Qwen3.5: 16 query
heads, 2 key/value heads, head dim 256) and at head dim 128, bf16, batch 1: forward alone and
forward + backward per backend (cuDNN, flash, memory-efficient), with the useful causal TFLOP/s
(forward 2 H S^2 d, backward twice that); for cuDNN also with K/V expanded to every query head
before the call (`cudnn_expand_kv`, the backward then sums the heads' dK/dV) and with q/k/v as
transposed views of [B, S, H, d] (`cudnn_bshd`). Prints one JSON line per case.

    python benchmarks/attention/probes/probe_attention_backends.py
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

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn_expand_kv": SDPBackend.CUDNN_ATTENTION,
            "cudnn_bshd": SDPBackend.CUDNN_ATTENTION}


def case(S, d, H=16, HKV=2, backend="cudnn"):
    g = torch.Generator(device="cuda").manual_seed(S + d)
    bshd = backend == "cudnn_bshd"
    shape = (lambda h: (1, S, h, d)) if bshd else (lambda h: (1, h, S, d))
    q = torch.randn(*shape(H), device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(*shape(HKV), device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(*shape(HKV), device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, H, S, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def fwd(grad):
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
        if bshd:
            qq, kk, vv = (t.transpose(1, 2) for t in (qq, kk, vv))
        if backend == "cudnn_expand_kv":
            kk, vv = (t.repeat_interleave(H // HKV, dim=1) for t in (kk, vv))
        with sdpa_kernel([BACKENDS[backend]]):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=kk.shape[1] != H)
        if grad:
            o.backward(do)

    rec = {"S": S, "head_dim": d, "heads": H, "kv_heads": HKV, "backend": backend}
    try:
        f_ms = median_ms(lambda: fwd(False), iters=5, warmup=2)
        fb_ms = median_ms(lambda: fwd(True), iters=5, warmup=2)
    except RuntimeError as e:
        rec["error"] = str(e).splitlines()[0][:200]
        return rec
    flops_f = 2 * H * S * S * d
    rec.update(fwd_ms=round(f_ms, 3), fwd_bwd_ms=round(fb_ms, 3), bwd_ms=round(fb_ms - f_ms, 3),
               fwd_TFLOPs=round(flops_f / f_ms / 1e9), bwd_TFLOPs=round(2 * flops_f / (fb_ms - f_ms) / 1e9),
               fwd_bwd_TFLOPs=round(3 * flops_f / fb_ms / 1e9))
    return rec


def main():
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version(), "matmul_bf16_TFLOPs": round(matmul_tflops())}),
          flush=True)
    for d in (256, 128):
        for S in (8192, 32768):
            for b in BACKENDS if d == 256 else ("cudnn", "cudnn_expand_kv", "cudnn_bshd"):
                print(json.dumps(case(S, d, backend=b)), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
