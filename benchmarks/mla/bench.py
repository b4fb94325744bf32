"""MLA on one GPU at DeepSeek-V3 sizes: the primitive (lean backward on and off; its core on FA4 where
flash-attn-4 is installed, else SDPA), the twin, megatron-core's MLA, and a sweep of the attention core.

    python benchmarks/mla/bench.py --out DIR     # writes DIR/mla.json (default benchmarks/mla/results/)
    python benchmarks/mla/bench.py --smoke       # CPU, fp32, toy sizes: every code path, no timing claims
    python -m pytest benchmarks/mla/bench.py -q --benchmark-json bench.json

One attention layer (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64,
v 128), bf16, batch 1, causal, forward + backward, at 4K / 16K / 32K tokens:
- `flash_lean`, `flash_plain`: `primitives.mla.FlashMLA` with the lean backward on / off, as it
  runs by default (core on FA4 where installed; `mla_core_backend` in the results says which);
- `flash_lean_sdpa`, `flash_plain_sdpa`: the same with option `fa4="off"` (core on SDPA/cuDNN);
- `flash_lean_pad_v` (16K): the same with option `pad_v` (v zero-padded to 192 inside SDPA);
- `flash_lean_packed`, `flash_lean_packed_sdpa`, `flash_lean_packed_per_sequence` (16K): the lean layer
  on a packed batch of 32 sequences of 512 tokens (`cu_seqlens`; an RL-style batch): FA4 (one varlen
  launch), FA4 off (PyTorch's FlashAttention 2 varlen kernel, v padded to 192, one launch), FA4 and
  varlen off (one SDPA call per sequence); each `flash_*` record holds its `FlashMLAConfig` (`mla_config`);
- `naive`: `baselines.mla.NaiveMLA` (explicit scores: 4K only, it needs [128, T, T] fp32 scores);
- `megatron`, `megatron_up_proj_recompute`: megatron-core's `MLASelfAttention` built from its local
  (non-transformer-engine) layer spec, plain and with `recompute_modules=["mla_up_proj"]` (its
  counterpart of our lean backward). One adapter: the local spec's `DotProductAttention` does not
  accept the `k_channels`/`v_channels` that MLA passes it, so a subclass drops them (its unfused
  [b*h, s, s] scores path then runs as is). Tried at every length; an OOM is recorded as the reason;
- `core_*`: the attention core alone, forward + backward on random q/k/v (sweep below); `core_cudnn`,
  `core_bshd` and `core_fa4` also time the forward alone (`fwd_median_ms`, `fwd_useful_TFLOPs`,
  useful forward FLOPs H * T^2 * (d_qk + d_v)).
Useful FLOPs of the core, counted the same for every variant (also padded ones): causal forward +
backward = 3 * H * T^2 * (d_qk + d_v) with d_qk = 192, d_v = 128 (2 matmuls forward, 4 backward,
half of each under the causal mask; the backward's recomputed q.k is not counted). Every core
record also carries the rate in FlashAttention's own convention (`fa_convention_TFLOPs`: its
benchmarks count causal forward + backward as 3.5x the causal forward, i.e. the backward's recompute
included, 3.5 * H * T^2 * (d_qk + d_v)), the count published attention-kernel rates use. The rate is
compared with a bf16 8192^3 matmul measured in the same process. Padded variants also report the
executed rate, counting d_v = 192.
Layout sweep (`CORE_VARIANTS`): `core_cudnn` q/k/v contiguous [B, H, T, d]; `core_bshd` transposed
views of contiguous [B, T, H, d]; `core_primitive` exactly what `FlashMLA._core` hands SDPA (q a
concatenation of nope and RoPE'd rope parts, k a concatenation with the shared rope key broadcast,
v a strided slice of the kv_b_proj output, assembly included in the timing); `core_primitive_fused`
the same with the assembly as one Triton kernel each way (`kernels/mla_rope.py`, what `_core` runs
with option `fused_rope`, the default of the `flash_*` layers too); `core_prealloc` the
same with q and k written into preallocated [B, T, H, 192] buffers; `core_cudnn_pad_v` v zero-padded
to 192 ([B, H, T, d] as core_cudnn); `core_flash_pad_v` the flash backend (it refuses 192/128) with
v padded to 192, BSHD views; `core_fa4` FlashAttention 4 (`kernels/attention_fa4.py`) on
contiguous [B, T, H, d] (its native layout). The padded variants slice the output back to 128 before
the backward.
Saved activations: device memory held between forward and backward, less the output. Targets: core
>= 60% of the matmul rate at 16K; lean saved <= 1/3 of plain at <= 15% extra time. megatron
parity: our primitive's weights copied into megatron's module (same names up to a fixed map), fp32,
plain RoPE (base 10000, DeepSeek's interleaved pairs on both sides); output and input-gradient
relative errors recorded. Every case times a fixed number of iterations (median ms) after warm-up.
"""
from __future__ import annotations

import sys
import argparse
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from stamp import stamp
from timing import matmul_tflops, median_ms
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (4096, 16384, 32768)
DSV3 = dict(dim=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128)
SMOKE = dict(dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8)
IMPLS = ("flash_lean", "flash_plain", "flash_lean_sdpa", "flash_plain_sdpa", "naive", "megatron",
         "megatron_up_proj_recompute")
CORE_VARIANTS = ("core_cudnn", "core_bshd", "core_fa4", "core_primitive", "core_primitive_fused", "core_prealloc",
                 "core_cudnn_pad_v", "core_flash_pad_v")
FORWARD_TIMED = ("core_cudnn", "core_bshd", "core_fa4")
FLOP_FORMULA = ("useful causal fwd+bwd FLOPs = 3 * H * T^2 * (d_qk + d_v), d_qk 192, d_v 128, H 128; "
                "FlashAttention convention (backward recompute counted) = 3.5 * H * T^2 * (d_qk + d_v)")
OUT = Path(os.environ.get("BENCH_OUT", Path(__file__).parent / "results"))
RESULTS: dict = {"cases": []}
# --smoke switches to SMOKE / cpu / fp32 / 16; packed_len: tokens per sequence in the packed cases
CFG = {"sizes": DSV3, "device": "cuda", "dtype": torch.bfloat16, "packed_len": 512}


def _cuda():
    return CFG["device"] == "cuda"


def _time_ms(fn, iters=10, warmup=3):
    return median_ms(fn, iters, warmup, cuda=_cuda())


def core_flops(T, H=128, dqk=192, dv=128):
    return 3 * H * T * T * (dqk + dv)


def core_flops_fa_convention(T, H=128, dqk=192, dv=128):
    """FlashAttention's benchmark count: backward = 2.5x the forward (recompute included)."""
    return 3.5 * H * T * T * (dqk + dv)


def _rope(T, R=None):
    R = R or CFG["sizes"]["qk_rope_head_dim"]
    dev = CFG["device"]
    pos = torch.arange(T, device=dev).float()
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=dev).float() / R))
    f = pos[:, None] * inv
    emb = torch.cat([f, f], -1)[None]
    return emb.cos().to(CFG["dtype"]), emb.sin().to(CFG["dtype"])


def _mem():
    return torch.cuda.memory_allocated() if _cuda() else 0


def _options(impl):
    """The FlashMLAConfig a `flash_*` case runs: lean or plain backward; FA4 off for `_sdpa`, FA4 and
    varlen off for `_per_sequence`; pad_v for `_pad_v`."""
    from bumblebee.primitives.mla import FlashMLAConfig
    return FlashMLAConfig(lean_backward=impl.startswith("flash_lean"), pad_v=impl.endswith("pad_v"),
                          fa4="off" if impl.endswith(("_sdpa", "_per_sequence")) else "auto",
                          varlen=not impl.endswith("_per_sequence"))


def _core_backend(impl):
    """Which attention core a FlashMLA case runs: "fa4" or "sdpa" (the twin: "explicit scores")."""
    if not impl.startswith("flash"):
        return "explicit scores"
    from bumblebee.kernels import attention_fa4 as fa4
    s, config = CFG["sizes"], _options(impl)
    dqk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    if config.fa4 == "auto" and fa4.supports(torch.device(CFG["device"]), CFG["dtype"], dqk, s["v_head_dim"]):
        return "fa4"
    varlen = ("_packed" in impl and config.varlen and CFG["device"] == "cuda"
              and CFG["dtype"] in (torch.bfloat16, torch.float16))
    return "flash varlen" if varlen else "sdpa"


def _layer(impl):
    from bumblebee.baselines.mla import NaiveMLA
    from bumblebee.primitives.mla import FlashMLA

    torch.manual_seed(0)
    with torch.device(CFG["device"]):  # initialized where it runs (the CPU takes seconds at these sizes)
        m = NaiveMLA(**CFG["sizes"]) if impl == "naive" else FlashMLA(_options(impl), **CFG["sizes"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    return m.to(CFG["device"], CFG["dtype"])


# ---- megatron-core's MLA (local spec) -------------------------------------------------------------

def _init_megatron():
    """torch.distributed (world 1) and megatron's parallel state (TP = PP = 1), once per process."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        if _cuda():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if _cuda() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if _cuda():
            tensor_parallel.model_parallel_cuda_manual_seed(0)


@contextlib.contextmanager
def _megatron_device_shims():
    """On the CPU only: megatron's RotaryEmbedding, global memory buffer and dropout RNG fork name
    the CUDA device (and its RNG) directly; point them at the CPU (fp32 runs only). Without transformer-engine,
    megatron-core 0.16's MLA tests isinstance(linear_proj, TELinear) with TELinear a placeholder
    that is not a type (0.19 skips that test); give it a type that matches nothing."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import multi_latent_attention as mla_mod

    with contextlib.ExitStack() as stack:
        if not isinstance(getattr(mla_mod, "TELinear", type), type):
            stack.enter_context(mock.patch.object(mla_mod, "TELinear", type("NoTELinear", (), {})))
        if not _cuda():
            stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
            stack.enter_context(mock.patch.object(tensor_parallel.get_cuda_rng_tracker(), "fork",
                                                  lambda *a, **k: contextlib.nullcontext()))
            for name, stub in (("_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
                               ("_set_cuda_rng_state", lambda *a, **k: None)):  # up-proj recompute's RNG
                stack.enter_context(mock.patch.object(tensor_parallel.random, name, stub))
        yield


def megatron_mla(sizes, dtype, up_proj_recompute=False):
    """megatron-core's MLASelfAttention from its local spec at `sizes`, RoPE type "rope"."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class MLADotProductAttention(DotProductAttention):  # the local core attention, minus MLA's head dims
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    _init_megatron()
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm", qk_layernorm=True)
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = MLADotProductAttention
    recompute = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]) if up_proj_recompute else {}
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=sizes["dim"], num_attention_heads=sizes["n_heads"],
        q_lora_rank=sizes["q_lora_rank"], kv_lora_rank=sizes["kv_lora_rank"], qk_head_dim=sizes["qk_nope_head_dim"],
        qk_pos_emb_head_dim=sizes["qk_rope_head_dim"], v_head_dim=sizes["v_head_dim"], kv_channels=sizes["v_head_dim"],
        rope_type="rope", rotary_base=10000, layernorm_epsilon=1e-6, normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not _cuda(), **recompute)
    with _megatron_device_shims():
        m = build_module(attn, config=cfg, layer_number=1)
    return m.to(CFG["device"], dtype)


def _megatron_forward(m, x_BTD):
    """[B, T, D] in and out (megatron runs [T, B, D]); explicit causal mask (True = masked)."""
    T = x_BTD.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).triu(1)[None, None]
    with _megatron_device_shims():
        out, bias = m(x_BTD.transpose(0, 1), mask)
    assert bias is None
    return out.transpose(0, 1)


MEGATRON_NAMES = {  # ours -> megatron's (both [out, in] Linear weights, same row order)
    "q_a_proj.weight": "linear_q_down_proj.weight", "q_a_layernorm.weight": "q_layernorm.weight",
    "q_b_proj.weight": "linear_q_up_proj.weight", "q_proj.weight": "linear_q_proj.weight",
    "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight", "kv_a_layernorm.weight": "kv_layernorm.weight",
    "kv_b_proj.weight": "linear_kv_up_proj.weight", "o_proj.weight": "linear_proj.weight"}


def megatron_parity(sizes, T):
    """Our FlashMLA and megatron's MLA with the same weights, fp32, one sequence of T tokens."""
    from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig

    rec = {"what": "FlashMLA (fp32) vs megatron-core MLASelfAttention (local spec, fp32) with copied weights, "
                   "rope_type 'rope' base 10000, interleaved-pair RoPE, softmax scale 1/sqrt(d_qk)",
           "tokens": T, "sizes": sizes}
    dev, dt = CFG["device"], torch.float32
    torch.manual_seed(1)
    with torch.device(dev):
        ours = FlashMLA(FlashMLAConfig(), **sizes).to(dt)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.02)
    theirs = megatron_mla(sizes, dt)
    mparams = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            mparams[MEGATRON_NAMES[name]].copy_(p)
    x = torch.randn(1, T, sizes["dim"], device=dev, dtype=dt)
    pos = torch.arange(T, device=dev, dtype=torch.float64)
    R = sizes["qk_rope_head_dim"]
    f = pos[:, None] / (10000 ** (torch.arange(0, R, 2, device=dev, dtype=torch.float64) / R))
    emb = torch.cat([f, f], -1)[None]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    outs = []
    for run in (lambda x: ours(x, cos, sin), lambda x: _megatron_forward(theirs, x)):
        xi = x.clone().requires_grad_(True)
        y = run(xi)
        with _megatron_device_shims():
            g = torch.autograd.grad(y.square().sum(), xi)[0]
        outs.append((y.detach(), g))
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    rec["out_rel_err"] = rel(outs[0][0], outs[1][0])
    rec["dx_rel_err"] = rel(outs[0][1], outs[1][1])
    return rec


# ---- the attention core alone -----------------------------------------------------------------------

def _core_fn(variant, T, backward=True):
    """(fn) running forward + backward (or the forward alone, without autograd) of one core variant at
    DeepSeek-V3 head sizes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bumblebee.kernels.mla_rope import assemble_qk
    from bumblebee.primitives.mla import rope_pairs

    s = CFG["sizes"]
    H, nope, R, dv = s["n_heads"], s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    dqk, dev, dt = nope + R, CFG["device"], CFG["dtype"]
    backend = SDPBackend.FLASH_ATTENTION if variant == "core_flash_pad_v" else SDPBackend.CUDNN_ATTENTION
    ctx = (lambda: sdpa_kernel([backend])) if _cuda() else contextlib.nullcontext
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
        cos, sin = _rope(T, R)
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
    rec = {"case": f"{T // 1024}K" if T >= 1024 else str(T), "impl": variant, "tokens": T}
    if _cuda():
        torch.cuda.empty_cache()
    fn = _core_fn(variant, T)
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    base = _mem()
    rec["median_ms"] = _time_ms(fn)
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if _cuda() else None
    H = CFG["sizes"]["n_heads"]
    dqk = CFG["sizes"]["qk_nope_head_dim"] + CFG["sizes"]["qk_rope_head_dim"]
    dv = CFG["sizes"]["v_head_dim"]
    rec["useful_TFLOPs"] = core_flops(T, H, dqk, dv) / rec["median_ms"] / 1e9
    rec["fa_convention_TFLOPs"] = core_flops_fa_convention(T, H, dqk, dv) / rec["median_ms"] / 1e9
    if variant.endswith("pad_v"):
        rec["executed_TFLOPs"] = core_flops(T, H, dqk, dqk) / rec["median_ms"] / 1e9
    if variant in FORWARD_TIMED:
        rec["fwd_median_ms"] = _time_ms(_core_fn(variant, T, backward=False))
        rec["fwd_useful_TFLOPs"] = core_flops(T, H, dqk, dv) / 3 / rec["fwd_median_ms"] / 1e9
    RESULTS["cases"].append(rec)
    return fn, rec


# ---- whole layers ---------------------------------------------------------------------------------

def mla_case(impl, T):
    """(timed fn, record) for one implementation and length; the record gains ms and memory."""
    if impl.startswith("core_"):
        return core_case(impl, T)
    rec = {"case": f"{T // 1024}K" if T >= 1024 else str(T), "impl": impl, "tokens": T}
    if _cuda():
        torch.cuda.empty_cache()
    dev, dt, D = CFG["device"], CFG["dtype"], CFG["sizes"]["dim"]
    x = torch.randn(1, T, D, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn_like(x)
    if impl.startswith("megatron"):
        from megatron.core import parallel_state

        m = megatron_mla(CFG["sizes"], dt, up_proj_recompute=impl == "megatron_up_proj_recompute")
        parallel_state.destroy_global_memory_buffer()  # its [b*h, s, s] score buffer: counted per case
        parallel_state._set_global_memory_buffer()
        rec["note"] = ("local spec; unfused DotProductAttention ([b*h, s, s] scores in a persistent global "
                       "buffer, softmax in fp32); adapter drops k_channels/v_channels")

        def call():
            return _megatron_forward(m, x)
        shims = _megatron_device_shims  # its up-projection recompute runs inside the backward
    else:
        m = _layer(impl)
        cos, sin = _rope(T)
        n = CFG["packed_len"] if "_packed" in impl else T
        cu = torch.arange(0, T + 1, n, device=dev, dtype=torch.int32) if "_packed" in impl else None
        rec["sequences"] = T // n
        shims = contextlib.nullcontext
        rec["core_backend"] = _core_backend(impl)
        if impl != "naive":
            rec["mla_config"] = dataclasses.asdict(m.options)

        def call():
            with shims():
                return m(x, cos, sin, cu)
    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _mem()
    y = call()
    if _cuda():
        rec["saved_activation_MB"] = (_mem() - before - y.numel() * y.element_size()) / 2**20
    with shims():
        y.backward(grad)
    del y
    if _cuda():
        rec["first_step_peak_MB"] = (torch.cuda.max_memory_allocated() - before) / 2**20

    def fn():
        with shims():
            call().backward(grad)
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    base = _mem()
    rec["median_ms"] = _time_ms(fn)
    rec["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if _cuda() else None
    RESULTS["cases"].append(rec)
    return fn, rec


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"{t // 1024}K")
@pytest.mark.parametrize("impl", IMPLS + CORE_VARIANTS)
def test_mla(benchmark, impl, T):
    if impl == "naive" and T > 4096:
        pytest.skip("the twin's [128, T, T] fp32 scores do not fit")
    if impl.startswith("megatron") and T > 4096:
        pytest.skip("megatron's unfused core attention holds [128, T, T] scores (OOM from 16K)")
    benchmark.group = f"mla-{T // 1024}K"
    fn, rec = mla_case(impl, T)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(_sync(fn), rounds=5, warmup_rounds=1)


def summarize():
    by = {(c["case"], c["impl"]): c for c in RESULTS["cases"] if "median_ms" in c}
    rate = RESULTS.get("matmul_bf16_TFLOPs")
    out = {}
    for T in sorted({c["tokens"] for c in RESULTS["cases"]}):
        key = f"{T // 1024}K" if T >= 1024 else str(T)
        s = {}
        if rate:
            s["core_fraction_of_matmul"] = {v: by[(key, v)]["useful_TFLOPs"] / rate
                                            for v in CORE_VARIANTS if (key, v) in by}
            s["core_fraction_of_matmul_fa_convention"] = {v: by[(key, v)]["fa_convention_TFLOPs"] / rate
                                                          for v in CORE_VARIANTS if (key, v) in by}
            s["core_floor_ms"] = core_flops(T) / rate / 1e9
        if (key, "flash_lean") in by and (key, "flash_plain") in by:
            lean, plain = by[(key, "flash_lean")], by[(key, "flash_plain")]
            if "saved_activation_MB" in plain:
                s["lean_saved_over_plain"] = lean["saved_activation_MB"] / plain["saved_activation_MB"]
            s["lean_extra_time"] = lean["median_ms"] / plain["median_ms"] - 1
        if (key, "core_primitive_fused") in by and (key, "core_primitive") in by:
            s["fused_rope_time_ratio_core"] = (by[(key, "core_primitive_fused")]["median_ms"]
                                               / by[(key, "core_primitive")]["median_ms"])
        if (key, "flash_lean_packed") in by and (key, "flash_lean_packed_sdpa") in by:
            s["packed_fa4_speedup_lean"] = (by[(key, "flash_lean_packed_sdpa")]["median_ms"]
                                            / by[(key, "flash_lean_packed")]["median_ms"])
        if (key, "flash_lean_packed_sdpa") in by and (key, "flash_lean_packed_per_sequence") in by:
            s["packed_varlen_speedup_lean"] = (by[(key, "flash_lean_packed_per_sequence")]["median_ms"]
                                               / by[(key, "flash_lean_packed_sdpa")]["median_ms"])
        if (key, "flash_lean_pad_v") in by and (key, "flash_lean") in by:
            s["pad_v_time_ratio_lean"] = by[(key, "flash_lean_pad_v")]["median_ms"] / by[(key, "flash_lean")]["median_ms"]
        for ref in ("naive", "megatron", "megatron_up_proj_recompute"):
            if (key, ref) in by and (key, "flash_plain") in by:
                s[f"speedup_flash_plain_vs_{ref}"] = by[(key, ref)]["median_ms"] / by[(key, "flash_plain")]["median_ms"]
        out[key] = s
    RESULTS["summary"] = out
    RESULTS["targets"] = {"core_fraction_of_matmul_16K": ">= 0.60", "lean_saved_over_plain": "<= 0.333",
                          "lean_extra_time": "<= 0.15"}


def write_results(path=None):
    try:
        import megatron.core
        megatron_version = megatron.core.__version__
    except Exception:  # not installed, or fails to import
        megatron_version = None
    from bumblebee.primitives.mla import FlashMLAConfig
    try:
        from importlib.metadata import version
        fa4_version = version("flash-attn-4")
    except Exception:  # not installed
        fa4_version = None
    path = Path(path or OUT / "mla.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.update(stamp(), device=torch.cuda.get_device_name() if _cuda() else "cpu (smoke)",
                   megatron_core=megatron_version,
                   cudnn=torch.backends.cudnn.version() if _cuda() else None,
                   mla_fused_rope=FlashMLAConfig().fused_rope, mla_default_config=dataclasses.asdict(FlashMLAConfig()),
                   flash_attn_4=fa4_version, mla_core_backend=_core_backend("flash_lean"),
                   shapes=CFG["sizes"], dtype=str(CFG["dtype"]),
                   flop_formula=FLOP_FORMULA)
    summarize()
    path.write_text(json.dumps(RESULTS, indent=2, default=str))
    return path


def _attempt(fn, *args, impl, T):
    try:
        return fn(*args)
    except Exception as e:  # out of memory, a backend that refuses, megatron failing to build
        RESULTS["cases"].append({"case": f"{T // 1024}K" if T >= 1024 else str(T), "impl": impl, "tokens": T,
                                 "error": f"{type(e).__name__}: {str(e)[:400]}"})
    if _cuda():  # after the except block, so that the failed frames' tensors are gone
        torch.cuda.empty_cache()
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="folder for mla.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, toy sizes: runs every code path")
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="sequence lengths to run")
    args = ap.parse_args(argv)
    tokens, parity_T = tuple(args.tokens), 512
    if args.smoke:
        CFG.update(sizes=SMOKE, device="cpu", dtype=torch.float32, packed_len=16)
        tokens, parity_T = (32, 48), 24
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    if _cuda():
        RESULTS["matmul_bf16_TFLOPs"] = matmul_tflops()
    for T in tokens:
        layer_impls = [i for i in IMPLS if not i.startswith("megatron") and (i != "naive" or T <= 4096)]
        if T == 16384 or args.smoke and T == tokens[0]:
            layer_impls += ["flash_lean_pad_v", "flash_lean_packed", "flash_lean_packed_sdpa",
                            "flash_lean_packed_per_sequence"]
        for impl in layer_impls + list(CORE_VARIANTS):
            _attempt(mla_case, impl, T, impl=impl, T=T)
    if not args.no_megatron:  # last: its persistent score buffer and any OOM come after everything else
        rec = _attempt(megatron_parity, CFG["sizes"], parity_T, impl="megatron_parity", T=parity_T)
        if rec is not None:
            RESULTS["megatron_parity"] = rec
        for T in tokens:
            for impl in ("megatron", "megatron_up_proj_recompute"):
                if impl == "megatron_up_proj_recompute" and T > 4096 and not args.smoke:
                    continue  # the plain megatron case already shows whether its scores fit
                _attempt(mla_case, impl, T, impl=impl, T=T)
    for c in RESULTS["cases"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})
    out = Path(args.out)
    print("written", write_results(out / "mla.json" if out.suffix != ".json" else out))
    print(json.dumps({"summary": RESULTS["summary"], "megatron_parity": RESULTS.get("megatron_parity")}, indent=2,
                     default=str))


if __name__ == "__main__":
    main()
