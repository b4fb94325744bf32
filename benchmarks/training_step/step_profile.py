"""What one training step launched, read from a torch profiler trace: kernel time by category, the
attention kernel family and the optimizer path (`training_step/bench.py` records both in every row).

A row's `attention_kernel` and `optimizer` come from the kernels and operators the profiled step ran,
never from a stack's configuration: a flag that a library ignores, or a fallback it takes silently
(FA4 refusing a head dim, AdamW's fused path refused for a parameter type), shows here.
"""
from __future__ import annotations

import torch

from timing import Stopwatch, sync

CATEGORIES = [  # first match wins; kernel names lower-cased
    ("attention", ("fmha", "flash", "attention", "sdpa", "fa4", "cudnn")),
    ("nccl", ("nccl",)),
    ("optimizer", ("multi_tensor_apply", "adam", "fused_adamw")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "grouped_mm", "wgmma", "splitk", "cublas")),
    ("copies_and_casts", ("copy", "cast", "catarray", "cat_", "index", "gather", "scatter", "convert", "fill",
                          "permute", "transpose", "contiguous")),
    ("reductions", ("reduce", "norm", "sum", "softmax", "topk", "sort", "radix", "cumsum", "bincount")),
    ("elementwise", ("elementwise", "silu", "mul", "add", "exp", "foreach")),
]
# softmax-attention kernel families by kernel name (lower-cased), first match wins: FA4 is the CuTe DSL
# FlashAttention (flash_attn.cute); cuDNN's SDPA kernels; FA3 (flash::...Sm90); FlashAttention 2 (PyTorch's
# flash backend, pytorch_flash::, or the flash-attn 2 package); the memory-efficient (cutlass fmha) backend
ATTENTION_FAMILIES = [
    ("fa4", ("flash_attncute", "flashattentionforwardsm", "flashattentionbackwardsm")),
    ("cudnn", ("cudnn_generated", "cudnn_sdpa", "sdpa_sm90", "sdpa_sm100")),
    ("flash3", ("flashattnfwdsm90", "flashattnbwdsm90", "flash::flashattn")),
    ("flash2", ("pytorch_flash::", "flash_fwd_kernel", "flash_bwd_", "flash_fwd_splitkv")),
    ("mem_efficient", ("fmha_cutlass", "attention_kernel_batched", "efficient_attention")),
]
LINEAR_ATTENTION = ("chunk_gated_delta", "chunk_fwd_kernel", "chunk_bwd_kernel", "chunk_scaled_dot_kkt",
                    "recompute_w_u", "chunk_local_cumsum", "solve_tril", "chunk_bwd_dqkwg")


def classify(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def attention_family(name: str) -> str | None:
    """The softmax-attention family of one kernel, or None when it is no attention kernel."""
    low = name.lower()
    for fam, keys in ATTENTION_FAMILIES:
        if any(k in low for k in keys):
            return fam
    return None


def launched(kernels: dict, ops: set) -> dict:
    """`attention_kernel` (the family with the most kernel time; "unfused" when none ran, e.g. eager
    attention's matmuls and softmax), its ms by family, fla's linear-attention kernels' ms, and `optimizer`:
    "fused" when AdamW's fused kernel ran (ATen's FusedOptimizerTensorListMetadata, op _fused_adamw_),
    "foreach" when its multi-tensor ops ran (_foreach_addcdiv_ / _foreach_lerp_), else "single_tensor"
    when per-parameter addcdiv_ ran, else None (no optimizer step in the trace)."""
    fams: dict = {}
    linear = 0.0
    for name, ms in kernels.items():
        fam = attention_family(name)
        if fam:
            fams[fam] = fams.get(fam, 0.0) + ms
        elif any(k in name.lower() for k in LINEAR_ATTENTION):
            linear += ms
    attention = max(fams, key=fams.get) if fams else "unfused"
    names = " ".join(kernels).lower()
    if "fusedoptimizertensorlistmetadata" in names or any(o.startswith("aten::_fused_adam") for o in ops):
        optimizer = "fused"
    elif ops & {"aten::_foreach_addcdiv_", "aten::_foreach_lerp_", "aten::_foreach_addcdiv"}:
        optimizer = "foreach"
    elif "aten::addcdiv_" in ops:
        optimizer = "single_tensor"
    else:
        optimizer = None
    return {"attention_kernel": attention, "attention_kernel_ms": fams, "linear_attention_kernel_ms": linear,
            "optimizer": optimizer}


def _trace(stack, ids, detail: bool):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    sync(ids.device)
    clock = Stopwatch()
    with profile(activities=acts, record_shapes=detail) as prof:
        stack.step(ids)
        sync(ids.device)
    wall = clock.seconds() * 1e3
    kernels, ops = {}, set()
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        if dev is not None and dev != torch.autograd.DeviceType.CPU:
            t = getattr(e, "device_time", None)
            t = e.cuda_time if t is None else t
            kernels[e.name] = kernels.get(e.name, 0.0) + t / 1e3
        else:
            ops.add(e.name)
    return prof, wall, kernels, ops


def kernels_launched(stack, ids) -> dict:
    """One step traced for what it launched (no shapes, no breakdown): `launched`'s fields."""
    _, _, kernels, ops = _trace(stack, ids, detail=False)
    return launched(kernels, ops)


def profile_step(stack, ids) -> dict:
    """One step traced in full: kernel ms by category, top kernels, the attention ops and the operators
    behind the kernel time with their input shapes, and `launched`'s fields."""
    prof, wall, kernels, ops = _trace(stack, ids, detail=True)
    attention_ops: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU and any(
                k in e.name for k in ("scaled_dot_product", "fa4", "varlen", "chunk_gated_delta", "flash_attn")):
            attention_ops[e.name] = attention_ops.get(e.name, 0) + 1
    cats: dict = {}
    for name, ms in kernels.items():
        c = classify(name)
        cats[c] = cats.get(c, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    top_ops = []  # the operators behind the kernel time, with their input shapes
    for e in prof.key_averages(group_by_input_shape=True):
        ms = getattr(e, "self_device_time_total", 0) / 1e3
        if ms > 0 and getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU:
            top_ops.append({"op": e.key, "shapes": str(e.input_shapes)[:200], "ms": ms, "count": e.count})
    top_ops.sort(key=lambda o: -o["ms"])
    return {"wall_ms": wall, "kernel_ms_total": sum(kernels.values()),
            "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "ms": ms, "category": classify(n)} for n, ms in top],
            "attention_ops": attention_ops, "top_ops": top_ops[:60], **launched(kernels, ops)}
