"""Gated DeltaNet (Qwen3.5's linear attention) on flash-linear-attention's Triton kernels.

Same layer, parameters and function as the twin `bumblebee.baselines.linear_attention.
ChunkedGatedDeltaNet` (see there for the formulation). On CUDA: fla's causal conv (`causal_conv1d`,
Triton, SiLU fused, packed sequences through `cu_seqlens`) and its chunked gated delta rule
(`chunk_gated_delta_rule`: WY/UT representation, q/k l2-norm in the kernel, key heads shared by
value heads without a repeated copy, fp32 state, packed sequences). fla is imported on first use;
its kernels cannot run on a CPU (they ask for a GPU driver even under the Triton interpreter), so
off CUDA, or where fla is not installed, the layer runs fla's algorithm written in torch
(`bumblebee.primitives.linear_attention_torch`: the same chunking, triangular solve by 16 x 16
blocks, state scan and output pass), never the twin's code.

fla 0.6 refuses its gated backward on Hopper with Triton in [3.4, 3.7.1): one of its kernels
(`chunk_bwd_dqkwg`) is miscompiled there. On first use the primitive then installs
`bumblebee.kernels.linear_attention_gdn_backward.chunk_bwd_dqkwg` (the same function, written so that the miscompiled
pattern never appears) into fla's backend registry, so fla's backward runs unchanged otherwise. The
installed backend serves our layers' calls only (`ours()`: the running backward is between a layer's
rule output and its inputs, marked by two identity autograd nodes); any other fla user in the
process keeps fla's own kernel (and its refusal).

The rule's inputs keep their activation dtype (bf16 in training); the kernels accumulate in fp32.

Inside a model's full recompute, `FLAConfig.recompute_keep_bytes` > 0 keeps each layer's rule output
from its first forward (with fla's WY matrix and gate cumsum), so the recompute skips the rule and the
backward runs the rule's own backward (`bumblebee.kernels.linear_attention_recompute_kept`).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee import recompute
from bumblebee.checks import check_cu_seqlens, check_gdn_config
from bumblebee.kernels import linear_attention_recompute_kept as _kept
from bumblebee.norms import GatedRMSNorm, to_acc
from bumblebee.primitives.linear_attention_torch import causal_conv1d_silu_taps, chunk_gated_delta_rule_torch
from bumblebee.options import check_int, option
from bumblebee.registry import register


DQKWG_HOOK = None  # how fla's gated chunk_bwd_dqkwg reaches kernels/linear_attention_gdn_backward.py, once installed
_OURS: set[int] = set()  # the backward passes (autograd graph tasks) now inside one of our layers' rule


def ours() -> bool:
    """Whether the running backward is inside one of our layers' rule: the only calls the installed
    dq/dk/dw/dg kernel serves."""
    return torch._C._current_graph_task_id() in _OURS


class _Open(torch.autograd.Function):
    """Identity on the rule's output: the backward enters the rule here."""

    @staticmethod
    def forward(ctx, o):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        _OURS.add(torch._C._current_graph_task_id())
        return grad


class _Close(torch.autograd.Function):
    """Identity on the rule's inputs: the backward has left the rule here."""

    @staticmethod
    def forward(ctx, *inputs):
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        _OURS.discard(torch._C._current_graph_task_id())
        return grads


def scoped(rule, *inputs):
    """rule(*inputs) with its backward inside `ours()` (autograd runs the nodes made between the two
    marks after the output's and before the inputs'): fla's calls there are ours."""
    if not torch.is_grad_enabled():
        return rule(*inputs)
    return _Open.apply(rule(*_Close.apply(*inputs)))


def fla_refuses_gated_backward() -> bool:
    """fla 0.6's own guard: its Triton chunk_bwd_dqkwg is wrong for gated rules on Hopper with Triton in
    [3.4, 3.7.1) (a transposed MMA result fed to another dot is miscompiled), so it raises there."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _install_dqkwg():
    """Hand fla's gated chunk_bwd_dqkwg to kernels/linear_attention_gdn_backward.py. fla dispatches that function
    through its 'common' backend registry: our backend takes the gated calls of our layers' backward
    (`ours()`), after tilelang's when fla finds tilelang usable. With FLA_DISABLE_BACKEND_DISPATCH=1
    there is no registry to join, so the name fla's gated delta rule imported is rebound instead, to a
    function that sends our layers' calls to our kernel and every other to fla's. Returns how it was
    installed."""
    from bumblebee.kernels import linear_attention_gdn_backward as gdn_backward

    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        import fla.ops.gated_delta_rule.chunk as gdr

        real = gdr.chunk_bwd_dqkwg
        gdr.chunk_bwd_dqkwg = lambda *args, **kwargs: (gdn_backward.chunk_bwd_dqkwg if ours() else real)(*args, **kwargs)
        return "fla.ops.gated_delta_rule.chunk.chunk_bwd_dqkwg"
    from fla.backends import BaseBackend
    from fla.backends import register as fla_register

    @fla_register("common")
    class BumblebeeDqkwg(BaseBackend):
        backend_type = "bumblebee_gdn_backward"
        priority = 6  # after tilelang (5)

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs):
            if not ours():
                return False, "not a bumblebee layer's backward: fla's own kernel serves it"
            a = gdn_backward.SIGNATURE.bind(*args, **kwargs).arguments
            if a.get("g") is None or a.get("g_gamma") is not None:
                return False, "only the gated rule (g given, no g_gamma)"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return gdn_backward.chunk_bwd_dqkwg(*args, **kwargs)

    return "fla.backends registry 'common'"


@functools.lru_cache(maxsize=1)
def fla_ops():
    """(causal_conv1d, chunk_gated_delta_rule) from flash-linear-attention, or None when absent. Where
    fla refuses its gated backward, our chunk_bwd_dqkwg is installed for it on this first call."""
    global DQKWG_HOOK
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no usable Triton / GPU
        return None
    if fla_refuses_gated_backward() and DQKWG_HOOK is None:
        try:
            DQKWG_HOOK = _install_dqkwg()
        except Exception as e:  # an fla whose internals moved: train on the torch path (fla_backward_ok)
            warnings.warn(f"could not install the gated DeltaNet dq/dk/dw/dg kernel into fla: {e!r}")
    return causal_conv1d, chunk_gated_delta_rule


@functools.lru_cache(maxsize=1)
def fla_backward_ok() -> bool:
    """Whether fla's gated backward runs correctly here: everywhere fla does not refuse it, and where it
    does (Hopper, Triton in [3.4, 3.7.1)) once our kernel is installed or tilelang serves it."""
    if not fla_refuses_gated_backward():
        return True
    if fla_ops() is not None and DQKWG_HOOK is not None:
        return True
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
        return CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled()
    except Exception:
        return importlib.util.find_spec("tilelang") is not None


_NO_FLA_BACKWARD = ("flash-linear-attention refuses its gated backward with this Triton on Hopper and our "
                    "replacement kernel could not be installed: training runs fla's algorithm in torch")


def fla_falls_back(device, dtype=None, training=True):
    """Why the layer runs fla's algorithm in torch on `device`, or None (fla's kernels run)."""
    if device.type != "cuda":
        return "flash-linear-attention's kernels need CUDA: its algorithm runs in torch"
    if fla_ops() is None:
        return "flash-linear-attention is not installed (or cannot run here): its algorithm runs in torch"
    if training and not fla_backward_ok():
        return _NO_FLA_BACKWARD
    return None


@dataclass(frozen=True)
class FLAConfig:
    """Options of fla: `impl={"linear_attention": FLAConfig(recompute_keep_bytes=4 << 30)}`, or the string
    "fla:recompute_keep_bytes=4294967296" (CLI: `--a fla:recompute_keep_bytes=4294967296`)."""

    impl_name = "fla"  # not a field: the implementation these options configure
    recompute_keep_bytes: int = option(
        4 << 30, "inside a model's full recompute: keep each layer's rule output (16-bit [T, HV*V]) and, on fla, its "
        "WY matrix (16-bit [T, HV, 64]) and gate cumsum from the first forward, so the recompute skips the "
        "chunked rule (about a third of its forward + backward), while the bytes kept at once across layers "
        "stay within this budget; past it a layer recomputes the rule. 0: always recompute")

    def __post_init__(self):
        check_int(self, "recompute_keep_bytes", 0)


def fla_qkv(layer, x_BTD, entering=None, **conv_kw):
    """q, k, v [B, T, heads, dim] of a gated DeltaNet layer (the slot's parameters) through fla's causal
    conv with SiLU (`conv_kw`: its cu_seqlens, or a context-parallel cp_context). Each is projected and
    convolved on its own (the rows of in_proj_qkv and of the depthwise conv are per channel), so each
    comes out contiguous, as fla's rule takes it. Split from one [T, conv_dim] output they were strided
    views, copied on the way in and their gradients concatenated on the way out (~12 bytes per
    channel and token each pass). `entering`: (q, k, v projections) -> the conv's entering states
    [N, conv_dim, W] for all three at once (context parallelism's halo), sliced per part."""
    causal_conv1d = fla_ops()[0]
    w_qkv, w_conv = layer.in_proj_qkv.weight, layer.conv1d.weight[:, 0].to(x_BTD.dtype)
    pieces, lo = [], 0
    for n, heads, dim in ((layer.key_dim, layer.num_k_heads, layer.head_k_dim),
                          (layer.key_dim, layer.num_k_heads, layer.head_k_dim),
                          (layer.value_dim, layer.num_v_heads, layer.head_v_dim)):
        pieces.append((lo, n, heads, dim))
        lo += n
    projected = [F.linear(x_BTD, w_qkv[lo:lo + n]) for lo, n, _, _ in pieces]
    states = entering(projected) if entering is not None else None
    parts = []
    for x, (lo, n, heads, dim) in zip(projected, pieces):
        if states is not None:
            conv_kw["initial_state"] = states[:, lo:lo + n]
        y, _ = causal_conv1d(x, weight=w_conv[lo:lo + n], activation="silu", **conv_kw)
        parts.append(y.reshape(*y.shape[:2], heads, dim))
    return parts


def _torch_rule(q, k, v, g, beta, scale, cu_seqlens):
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)


def _torch_kept_forward(q, k, v, g, beta, scale, cu_seqlens):
    with torch.no_grad():
        return _torch_rule(q, k, v, g, beta, scale, cu_seqlens), ()


def _torch_kept_backward(do, q, k, v, g, beta, kept, scale, cu_seqlens):
    """fla's algorithm in torch has no backward of its own: autograd through it, run again here."""
    with torch.enable_grad():
        ins = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
        return torch.autograd.grad(_torch_rule(*ins, scale, cu_seqlens), ins, do)


_TORCH_KEPT = _kept.RuleKernel("torch", _torch_kept_forward, _torch_kept_backward,
                               lambda q, v: v.numel() * v.element_size())


@register("linear_attention", "fla", kind="primitive", twin="torch_chunked", default=True, falls_back=fla_falls_back,
          config=FLAConfig)
class FLAGatedDeltaNet(nn.Module):
    """Gated DeltaNet on flash-linear-attention's chunked kernels (CUDA); their algorithm in torch elsewhere."""

    def __init__(self, config: FLAConfig, hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, *,
                 conv_kernel_size=4, eps=1e-6):
        """`config` first (what `registry.resolve("linear_attention", choice)` binds), then the twin's
        arguments."""
        if not isinstance(config, FLAConfig):
            raise TypeError(f"FLAGatedDeltaNet's first argument must be an FLAConfig, got {config!r}")
        super().__init__()
        check_gdn_config(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size)
        self.options = config
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

    def _fast(self, x):
        why = fla_falls_back(x.device, x.dtype, training=torch.is_grad_enabled())
        if why == _NO_FLA_BACKWARD:  # a silent fallback on a GPU would pass for fla in every report
            warnings.warn(why, stacklevel=3)
        return why is None

    def forward(self, x_BTD, cu_seqlens=None):
        """x [B, T, D] -> [B, T, D]; cu_seqlens [S+1]: the B*T tokens are packed sequences."""
        B, T, _ = x_BTD.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B * T)
        beta = self.in_proj_b(x_BTD).sigmoid()
        g = -to_acc(self.A_log).exp() * F.softplus(to_acc(self.in_proj_a(x_BTD)) + self.dt_bias)
        if self._fast(x_BTD):
            o = self._fla(x_BTD, g, beta, cu_seqlens, B, T)
        else:  # fla's algorithm in torch (its kernels need a GPU)
            qkv = causal_conv1d_silu_taps(self.in_proj_qkv(x_BTD), self.conv1d.weight[:, 0], cu_seqlens)
            q, k, v = self._heads(qkv, B, T)
            o = self._rule(_torch_rule, _TORCH_KEPT, q, k, v, g, beta, cu_seqlens)
        z = self.in_proj_z(x_BTD).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))

    def _heads(self, qkv, B, T):
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_k_heads, self.head_k_dim), k.reshape(B, T, self.num_k_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _fla(self, x_BTD, g, beta, cu_seqlens, B, T):
        chunk_gated_delta_rule = fla_ops()[1]
        cu = None
        if cu_seqlens is not None:  # fla reads packed sequences as one row
            x_BTD, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (x_BTD, g, beta))
            cu = cu_seqlens.to(device=x_BTD.device, dtype=torch.long)
        q, k, v = fla_qkv(self, x_BTD, cu_seqlens=cu)

        def plain(q, k, v, g, beta, scale, cu_seqlens):
            return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu_seqlens)[0]

        kernel = _kept.FLA if _kept.fla_available() else None
        o = scoped(lambda *qkvgb: self._rule(plain, kernel, *qkvgb, cu), q, k, v, g.float(), beta.to(q.dtype))
        return o.reshape(B, T, self.num_v_heads, self.head_v_dim)

    def _rule(self, plain, kernel, q, k, v, g, beta, cu_seqlens):
        """The chunked rule; inside a full-recompute region its first forward keeps the output while
        `recompute_keep_bytes` allows, and the recompute takes it (both passes decide alike: the
        recompute follows what its first forward handed over)."""
        scale = self.head_k_dim ** -0.5
        limit = self.options.recompute_keep_bytes
        if not limit or recompute.phase() not in ("forward", "recompute"):
            return plain(q, k, v, g, beta, scale, cu_seqlens)
        nbytes = kernel.kept_bytes(q, v) if kernel is not None else 0
        budget = recompute.budget("linear_attention")  # the model's: another model's kept rules never count here
        return recompute.keep_through(
            lambda: plain(q, k, v, g, beta, scale, cu_seqlens),
            lambda: kernel if kernel is not None and budget.reserve(nbytes, limit) else None,
            lambda kern: _kept.KeptRule.apply(q, k, v, g, beta, scale, cu_seqlens, kern,
                                              lambda: budget.release(nbytes), None),
            lambda kern, out: _kept.KeptRule.apply(q, k, v, g, beta, scale, cu_seqlens, kern, None, out))
