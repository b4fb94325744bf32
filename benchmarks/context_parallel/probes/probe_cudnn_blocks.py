"""Probe: can the cp ring's attention blocks run on SDPA's cuDNN kernel instead of its flash kernel?
(They now do: `primitives/context_parallel/kernels.py`, whose block functions this probe calls under
each SDPA backend; its result at 6330dda, measured before that move with the same calls, is a line of
`results/history.jsonl`.)

The ring (`primitives/context_parallel/flash.py`) ran each (query piece, key chunk) block on
`aten._scaled_dot_product_flash_attention` for its output and log-sum-exp, merges the blocks in fp32,
and runs each block's backward from the merged output and log-sum-exp. On an H200 at the bench's
shapes (16 heads of 256) the flash kernel is ~1.7x slower than cuDNN, which a single GPU's plain SDPA
call takes. This probe checks, for one rank's chunk at CP = 1 (its causal diagonal block and one
earlier full block), that `aten._scaled_dot_product_cudnn_attention[_backward]` used the same way
gives the float64 result (output, dq, dk, dv), with flash's error as the scale; and times both
against one causal SDPA call over the same keys. One JSON line per case.

    python benchmarks/context_parallel/probes/probe_cudnn_blocks.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing
from stamp import stamp  # noqa: E402
from timing import median_ms  # noqa: E402

from bumblebee.primitives.context_parallel.kernels import block_backward, block_forward  # noqa: E402

aten = torch.ops.aten


def _on(backend, fn):
    """fn under one SDPA backend: the library's block functions pick cuDNN or flash from that setting."""
    def call(*args):
        with sdpa_kernel([backend]):
            return fn(*args)
    return call


def cudnn_bwd_empty_bias(do, q, k, v, o, lse, causal, scale, aux):
    """cuDNN's backward given an empty bias tensor where the library passes None (does it take either?)."""
    _, _, shape, cq, ck, mq, mk, seed, off = aux  # (kernel, repeat factor, ...): block_forward's
    return aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.reshape(shape).contiguous(), seed, off, q.new_empty(0), cq, ck, mq, mk, 0.0, causal,
        scale=scale)


KERNELS = {"flash": (_on(SDPBackend.FLASH_ATTENTION, block_forward), block_backward),
           "cudnn_bias_none": (_on(SDPBackend.CUDNN_ATTENTION, block_forward), block_backward),
           "cudnn_bias_empty": (_on(SDPBackend.CUDNN_ATTENTION, block_forward), cudnn_bwd_empty_bias)}


def two_blocks(kernel, q, k, v, do, scale):
    """The chunk's queries against an earlier full chunk (k[:, :, :L]) and their own chunk (causal):
    merged output, then each block's backward from the merged output and log-sum-exp."""
    fwd, bwd = KERNELS[kernel]
    L = q.shape[2]
    parts = [(k[:, :, :L].contiguous(), v[:, :, :L].contiguous(), False),
             (k[:, :, L:].contiguous(), v[:, :, L:].contiguous(), True)]
    outs = [fwd(q, kb, vb, c, scale) for kb, vb, c in parts]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    o = sum(ob.float() * (lb - lse).exp()[..., None] for ob, lb, _ in outs).to(q.dtype)
    grads = [bwd(do, q, kb, vb, o, lse, c, scale, aux) for (kb, vb, c), (_, _, aux) in zip(parts, outs)]
    dq = grads[0][0].float() + grads[1][0].float()
    dk = torch.cat([grads[0][1], grads[1][1]], dim=2)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=2)
    return o, dq, dk, dv


def reference(q, k, v, do, scale):
    """Float64: the chunk's queries see the earlier chunk and their own causally (lower-right)."""
    L = q.shape[2]
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    mask = torch.ones(L, 2 * L, dtype=torch.bool, device=q.device).tril(L)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do.double())
    return o.detach(), dq, dk, dv


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def inputs(L, H, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, L, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, H, 2 * L, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    do = torch.randn(1, H, L, D, device="cuda", generator=g).bfloat16()
    return q, k, v, do


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check-len", type=int, default=1024)
    ap.add_argument("--time-len", type=int, default=16384, help="chunk length (64K tokens at CP = 2: 16K)")
    args = ap.parse_args()
    H, D = 16, 256
    scale = D ** -0.5
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "probe_cudnn_blocks.json").write_text(json.dumps({**stamp(), "rows": rows}, indent=1))

    q, k, v, do = inputs(args.check_len, H, D, 0)
    ref = reference(q, k, v, do, scale)
    for name in KERNELS:
        try:
            got = two_blocks(name, q, k, v, do, scale)
            emit({"check": name, "L": args.check_len,
                  **{n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}})
        except Exception as e:  # a kernel that refuses these arguments is a result, not a crash
            emit({"check": name, "error": f"{type(e).__name__}: {e}"[:400]})

    q, k, v, do = inputs(args.time_len, H, D, 1)
    L = args.time_len
    for name in KERNELS:
        try:
            ms = median_ms(lambda: two_blocks(name, q, k, v, do, scale), iters=5, warmup=2)
            emit({"time": name, "L": L, "median_ms": ms, "tflops": tflops(1.5 * L * L, ms)})
        except Exception as e:
            emit({"time": name, "error": f"{type(e).__name__}: {e}"[:400]})
    mask = torch.ones(L, 2 * L, dtype=torch.bool, device="cuda").tril(L)
    cases = {"sdpa_causal_2L": (lambda: _sdpa_fb(q, k, v, do, None, True, scale, full=True), 2.0 * L * L),
             "sdpa_mask_lower_right": (lambda: _sdpa_fb(q, k, v, do, mask, False, scale), 1.5 * L * L)}
    for label, (fn, pairs) in cases.items():
        try:
            ms = median_ms(fn, iters=5, warmup=2)
            emit({"time": label, "L": L, "median_ms": ms, "tflops": tflops(pairs, ms)})
        except Exception as e:
            emit({"time": label, "error": f"{type(e).__name__}: {e}"[:400]})


def tflops(pairs, ms, H=16, D=256):
    """Useful TFLOP/s of forward + backward (2.5x the forward's 4 H D flops per visible pair)."""
    return 4 * H * D * pairs * 3.5 / ms / 1e9


def _sdpa_fb(q, k, v, do, mask, causal, scale, full=False):
    """One plain SDPA forward + backward (its backend as a user gets it): the chunk's queries against
    [earlier | own] keys with a mask, or (full) one causal call over 2L queries, what one GPU runs."""
    qq = torch.cat([q, q], dim=2) if full else q
    qq, kk, vv = (t.detach().requires_grad_() for t in (qq, k, v))
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal, scale=scale)
    o.backward(torch.cat([do, do], dim=2) if full else do)


if __name__ == "__main__":
    main()
