"""megatron-core's MLA as an outside anchor of the MLA benchmark: `MLASelfAttention` from its local
(non-transformer-engine) layer spec, its forward in our [B, T, D] layout, the CPU shims that let it
run in the `--smoke` mode, and a parity check against our primitive with copied weights."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from siblings import load  # noqa: E402

run = load("mla", "run_config")
CFG, cuda = run.CFG, run.cuda


def init_megatron():
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
        if cuda():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if cuda():
            tensor_parallel.model_parallel_cuda_manual_seed(0)


@contextlib.contextmanager
def megatron_device_shims():
    """On the CPU only: megatron's RotaryEmbedding, global memory buffer and dropout RNG fork name
    the CUDA device (and its RNG) directly; point them at the CPU (fp32 runs only). Without transformer-engine,
    megatron-core 0.16's MLA tests isinstance(linear_proj, TELinear) with TELinear a placeholder
    that is not a type (0.19 skips that test); give it a type that matches nothing."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import multi_latent_attention as mla_mod

    with contextlib.ExitStack() as stack:
        if not isinstance(getattr(mla_mod, "TELinear", type), type):
            stack.enter_context(mock.patch.object(mla_mod, "TELinear", type("NoTELinear", (), {})))
        if not cuda():
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

    init_megatron()
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
        use_cpu_initialization=not cuda(), **recompute)
    with megatron_device_shims():
        m = build_module(attn, config=cfg, layer_number=1)
    return m.to(CFG["device"], dtype)


def megatron_forward(m, x_BTD):
    """[B, T, D] in and out (megatron runs [T, B, D]); explicit causal mask (True = masked)."""
    T = x_BTD.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).triu(1)[None, None]
    with megatron_device_shims():
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
    for run in (lambda x: ours(x, cos, sin), lambda x: megatron_forward(theirs, x)):
        xi = x.clone().requires_grad_(True)
        y = run(xi)
        with megatron_device_shims():
            g = torch.autograd.grad(y.square().sum(), xi)[0]
        outs.append((y.detach(), g))
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    rec["out_rel_err"] = rel(outs[0][0], outs[1][0])
    rec["dx_rel_err"] = rel(outs[0][1], outs[1][1])
    return rec
