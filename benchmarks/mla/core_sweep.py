"""The attention core of the MLA benchmark alone: forward + backward of each layout variant in
`CORE_VARIANTS` on random q/k/v at the run's head sizes (bench.py's docstring describes each), with
useful and FlashAttention-convention rates; `core_cudnn`, `core_bshd` and `core_fa4` also time the
forward alone."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from siblings import load  # noqa: E402

run = load("mla", "run_config")
CFG, RESULTS, cuda = run.CFG, run.RESULTS, run.cuda

CORE_VARIANTS = ("core_cudnn", "core_bshd", "core_fa4", "core_primitive", "core_primitive_fused", "core_prealloc",
                 "core_cudnn_pad_v", "core_flash_pad_v")
FORWARD_TIMED = ("core_cudnn", "core_bshd", "core_fa4")


def core_fn(variant, T, backward=True):
    """(fn) running forward + backward (or the forward alone, without autograd) of one core variant at
    DeepSeek-V3 head sizes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bumblebee.kernels.mla_rope import assemble_qk
    from bumblebee.primitives.mla import rope_pairs

    s = CFG["sizes"]
    H, nope, R, dv = s["n_heads"], s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    dqk, dev, dt = nope + R, CFG["device"], CFG["dtype"]
    backend = SDPBackend.FLASH_ATTENTION if variant == "core_flash_pad_v" else SDPBackend.CUDNN_ATTENTION
    ctx = (lambda: sdpa_kernel([backend])) if cuda() else contextlib.nullcontext
    pad = dqk - dv if variant.endswith("pad_v") else 0

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=backward)

    if variant == "core_fa4":
        from bumblebee.kernels import attention_fa4 as fa4
        q0, k0, v0 = leaf(1, T, H, dqk), leaf(1, T, H, dqk), leaf(1, T, H, dv)
        if not fa4.available(q0, v0):
            raise RuntimeError("flash-attn-4 is not installed, or this device/dtype is not one it runs")
        grad = torch.randn(1, T, H, dv, device=dev, dtype=dt)

        def fa4_fn():
            o = fa4.causal_attention(q0, k0, v0, dqk ** -0.5)
            if backward:
                o.backward(grad)
        return fa4_fn

    if variant in ("core_primitive", "core_primitive_fused", "core_prealloc"):
        q_full, kv_full, k_pe = leaf(1, T, H, dqk), leaf(1, T, H, nope + dv), leaf(1, T, 1, R)
        cos, sin = run.rope(T, R)
        grad = torch.randn(1, T, H, dv, device=dev, dtype=dt).transpose(1, 2)  # as o_proj's input gives it

        def qkv():
            q_nope, q_pe = q_full.split([nope, R], dim=-1)
            k_nope, v = kv_full.split([nope, dv], dim=-1)
            if variant == "core_primitive_fused":  # as _core with FUSED_ROPE = "on"
                q, k = assemble_qk(q_full, k_nope, k_pe[:, :, 0], cos, sin, True)
            elif variant == "core_primitive":
                q = torch.cat((q_nope, rope_pairs(q_pe, cos, sin, True)), dim=-1)
                k = torch.cat((k_nope, rope_pairs(k_pe, cos, sin, True).expand(1, T, H, R)), dim=-1)
            else:
                q, k = q_full.new_empty(1, T, H, dqk), q_full.new_empty(1, T, H, dqk)
                q[..., :nope] = q_nope
                q[..., nope:] = rope_pairs(q_pe, cos, sin, True)
                k[..., :nope] = k_nope
                k[..., nope:] = rope_pairs(k_pe, cos, sin, True)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    else:
        bshd = variant != "core_cudnn" and not variant.startswith("core_cudnn_pad")
        shape = (lambda d: (1, T, H, d)) if bshd else (lambda d: (1, H, T, d))
        q0, k0, v0 = leaf(*shape(dqk)), leaf(*shape(dqk)), leaf(*shape(dv))
        grad = torch.randn(*shape(dv), device=dev, dtype=dt)
        if bshd:
            grad = grad.transpose(1, 2)

        def qkv():
            return (q0.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2)) if bshd else (q0, k0, v0)

    def fn():
        q, k, v = qkv()
        if pad:
            v = F.pad(v, (0, pad))
        with ctx():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            (o[..., :dv] if pad else o).backward(grad)
    return fn


def core_case(variant, T):
    rec = {"case": run.case_name(T), "impl": variant, "tokens": T}
    if cuda():
        torch.cuda.empty_cache()
    fn = core_fn(variant, T)
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    base = run.mem()
    rec["median_ms"] = run.time_ms(fn)
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda() else None
    H = CFG["sizes"]["n_heads"]
    dqk = CFG["sizes"]["qk_nope_head_dim"] + CFG["sizes"]["qk_rope_head_dim"]
    dv = CFG["sizes"]["v_head_dim"]
    rec["useful_TFLOPs"] = run.core_flops(T, H, dqk, dv) / rec["median_ms"] / 1e9
    rec["fa_convention_TFLOPs"] = run.core_flops_fa_convention(T, H, dqk, dv) / rec["median_ms"] / 1e9
    if variant.endswith("pad_v"):
        rec["executed_TFLOPs"] = run.core_flops(T, H, dqk, dqk) / rec["median_ms"] / 1e9
    if variant in FORWARD_TIMED:
        rec["fwd_median_ms"] = run.time_ms(core_fn(variant, T, backward=False))
        rec["fwd_useful_TFLOPs"] = run.core_flops(T, H, dqk, dv) / 3 / rec["fwd_median_ms"] / 1e9
    RESULTS["cases"].append(rec)
    return fn, rec
