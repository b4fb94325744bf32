"""Multi-head latent attention (DeepSeek-V2/V3) on PyTorch SDPA, with a memory-lean backward.

Same parameters, names and math as the twin `bumblebee.baselines.mla.NaiveMLA`; what differs, each
an option of `FlashMLAConfig` (the constructor's first argument; `impl={"mla": "flash:fa4=off"}`):

- `fa4`: the attention core is FlashAttention 4 (`kernels/attention_fa4.py`) where flash-attn-4 is
  installed and runs the shapes (Hopper/Blackwell, 16-bit); otherwise (or "off")
  `F.scaled_dot_product_attention` with the backend picked explicitly: on CUDA cuDNN first (it runs
  q/k head dim 192 with v head dim 128; the flash backend refuses those dims), then flash,
  memory-efficient, math. The CPU uses SDPA's own choice;
- `lean_backward` (default on): the up-projections (`q_b_proj` or `q_proj`, `kv_b_proj`), the RoPE
  and the per-head K/V assembly run under a selective activation checkpoint that saves only the
  latents and the attention op's own outputs (output and log-sum-exp). The backward recomputes
  per-head Q/K/V from the latents (matmuls) but never reruns the attention itself. Saved per layer:
  latents + output instead of Q, K, V, output; inside the models' full recompute only the layer's
  input (`FlashMLA._lean_context`);
- `cu_seqlens` (packed sequences): one FA4 varlen call for the whole stream; without FA4, while
  sequences are short on average, one call of PyTorch's FlashAttention 2 varlen kernel with v
  zero-padded to 192 (`kernels/attention_varlen.py`; option `varlen`); else one SDPA call per
  sequence, so every call stays on a fast backend (a block-diagonal mask would push SDPA off
  cuDNN/flash).
- `pad_v` (default off): v zero-padded to the q/k head dim inside SDPA, the extra output columns
  dropped; same result, for a backend whose equal-head-dim kernel outruns its 192/128 one (measured
  in benchmarks/mla/bench.py, benchmarks/mla/NOTES.md). SDPA path only.
- `fused_rope` (default on): the Q/K assembly (split, RoPE, concatenations, rope-key broadcast) as one
  Triton kernel each way (`kernels/mla_rope.py`), on CUDA (or under TRITON_INTERPRET=1) when cos/sin
  need no gradient; q and k keep the projections' dtype.

Shape legend: B batch, T tokens, D model width, H heads, R rope dim, N = B*T.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from bumblebee import packing, recompute
from bumblebee.checks import check_mla_inputs
from bumblebee.kernels import mla_rope as _fused_rope
from bumblebee.common.mla_projections import MLAProjections
from bumblebee.options import check_bool, check_choice, option
from bumblebee.registry import needs_triton, register
from bumblebee.kernels import attention_fa4 as _fa4
from bumblebee.kernels import attention_sdpa_cudnn_first as _sdpa_cudnn
from bumblebee.kernels import attention_varlen as _varlen

FA4_CHOICES = ("auto", "off")


@dataclass(frozen=True)
class FlashMLAConfig:
    """Options of flash: `impl={"mla": FlashMLAConfig(lean_backward=False)}`, or the string
    "flash:lean_backward=off,fa4=off" (CLI: `--a flash:fa4=off`)."""

    impl_name = "flash"  # not a field: the implementation these options configure
    lean_backward: bool = option(True, "recompute per-head Q/K/V from the latents in the backward, keeping "
                                 "only the latents and the attention outputs (0.24x the activations for "
                                 "2-9% more time); never reruns the attention")
    fa4: str = option("auto", "the attention core on FlashAttention 4 (flash-attn-4) where installed and it "
                      "runs the shapes (forward 1.19-1.24x, forward + backward 1.05x cuDNN at 16K-32K on "
                      "an H100); off: SDPA, cuDNN first")
    varlen: bool = option(True, "packed batches without FA4: one launch of PyTorch's FlashAttention 2 varlen "
                          "kernel (v padded to 192) while sequences are short on average; False: one SDPA "
                          "call per sequence")
    fused_rope: bool = option(True, "the Q/K assembly (RoPE, concatenations) as one Triton kernel each way, "
                              "on CUDA when cos/sin need no gradient (the core step 18% faster at 4K, 5% at "
                              "16K on an H200); False: the torch path")
    pad_v: bool = option(False, "SDPA path: v zero-padded to the q/k head dim, the extra output columns "
                         "dropped (same result; measured 1.39x slower with cuDNN at 16K, mla/NOTES.md)")

    def __post_init__(self):
        check_choice(self, "fa4", FA4_CHOICES)
        for name in ("lean_backward", "varlen", "fused_rope", "pad_v"):
            check_bool(self, name)


def _use_fa4(config: FlashMLAConfig, x: torch.Tensor, qk_dim: int, v_dim: int) -> bool:
    """True when fa4 is "auto" and FA4 runs this layer's core for input x: its device, head dims, and
    the dtype the projections will produce (autocast's where it is on)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return config.fa4 == "auto" and _fa4.supports(x.device, dtype, qk_dim, v_dim)


def _use_fused_rope(config: FlashMLAConfig, t: torch.Tensor, cos=None, sin=None) -> bool:
    """True when fused_rope is on, Triton runs on t (CUDA, or TRITON_INTERPRET=1) and cos/sin need
    no gradient (the kernels give them none; the torch path does)."""
    if not config.fused_rope or any(c is not None and c.requires_grad for c in (cos, sin)):
        return False
    return _fused_rope.use_triton(t)


def rope_pairs(x_BThR, cos_BTR, sin_BTR, interleave: bool):
    """RoPE without a de-interleave copy: evens/odds are rotated as strided views and written once
    (de-interleaved, as transformers writes them; q.k is unchanged)."""
    c, s = cos_BTR[:, :, None], sin_BTR[:, :, None]
    half = x_BThR.shape[-1] // 2
    if interleave:
        x1, x2 = x_BThR[..., 0::2], x_BThR[..., 1::2]
    else:
        x1, x2 = x_BThR[..., :half], x_BThR[..., half:]
    c, s = c[..., :half], s[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def sdpa_causal(q_BhTd, k_BhTd, v_BhTe, scale, pad_v=False):
    """Causal SDPA; on CUDA the cuDNN backend first (MLA's 192/128 head dims), with fallbacks.
    pad_v: zero-pad v to the q/k head dim and drop the padded output columns (the same result; a
    kernel for equal head dims may outrun the 192/128 one despite 1.2x the FLOPs: mla/bench.py)."""
    e = v_BhTe.shape[-1]
    if pad_v and e < q_BhTd.shape[-1]:
        v_BhTe = F.pad(v_BhTe, (0, q_BhTd.shape[-1] - e))
    o = _sdpa_cudnn.causal_sdpa(q_BhTd, k_BhTd, v_BhTe, scale)
    return o[..., :e] if o.shape[-1] != e else o


def _keep_attention_outputs(ctx, op, *args, **kwargs):
    # SDPA's backend ops (cudnn/flash/efficient/flash_for_cpu), the varlen and FA4 forward ops keep their outputs
    # (o, logsumexp...); everything else in the region (up-projections, RoPE, concatenations) is recomputed.
    name = str(op)
    attention = "_scaled_dot_product" in name or "fa4_causal_fwd" in name or "varlen_causal_fwd" in name
    return CheckpointPolicy.MUST_SAVE if attention else CheckpointPolicy.PREFER_RECOMPUTE


_LEAN_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _keep_attention_outputs)


class _HandedOver:
    """The recompute context of a lean region run in the first forward of a full-recompute layer:
    it reads the attention outputs that the layer's recompute cached (`FlashMLA._lean_context`).
    Without them (none handed over) the region reruns the attention: slower, same result."""

    def __init__(self, module):
        self.module, self.ctx = module, None

    def __enter__(self):
        self.ctx, self.module._handover = self.module._handover or contextlib.nullcontext(), None
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


@register("mla", "flash", kind="primitive", twin="naive", default=True, config=FlashMLAConfig,
          falls_back=needs_triton(_fused_rope))
class FlashMLA(MLAProjections):
    """SDPA (cuDNN first) MLA; lean backward recomputes per-head Q/K/V from the latents."""

    _handover = None  # per instance, set and cleared by _lean_context

    def __init__(self, config: FlashMLAConfig, dim, n_heads, *, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                 qk_rope_head_dim, v_head_dim, softmax_scale=None, rope_interleave=True, bias=False):
        """`config` first (what `registry.resolve("mla", choice)` binds), then the twin's arguments."""
        if not isinstance(config, FlashMLAConfig):
            raise TypeError(f"FlashMLA's first argument must be a FlashMLAConfig, got {config!r}")
        super().__init__(dim, n_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                         qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                         v_head_dim=v_head_dim, softmax_scale=softmax_scale, rope_interleave=rope_interleave,
                         bias=bias)
        self.options = config

    def forward(self, x_BTD, cos, sin, cu_seqlens=None):
        """x [B, T, D], cos/sin [B, T, R] (per-token positions) -> [B, T, D]."""
        check_mla_inputs(x_BTD, cos, sin, self.dim, self.rope_dim)
        B, T, _ = x_BTD.shape
        segments = None if cu_seqlens is None else tuple(packing.segments(cu_seqlens, B * T))  # one host sync
        # the latents: all that the lean backward keeps of the input side
        q_src = x_BTD if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x_BTD))
        c_kv, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        # decided once: the lean backward's recompute takes the same paths
        fused = _use_fused_rope(self.options, x_BTD, cos, sin)
        fa4 = _use_fa4(self.options, x_BTD, self.qk_dim, self.v_dim)
        if self.options.lean_backward and torch.is_grad_enabled():
            o = checkpoint(self._core, q_src, c_kv, k_rope, cos, sin, segments, fused, fa4, cu_seqlens,
                           use_reentrant=False, context_fn=self._lean_context())
        else:
            o = self._core(q_src, c_kv, k_rope, cos, sin, segments, fused, fa4, cu_seqlens)
        return self.o_proj(o)

    def _lean_context(self):
        """The lean region's checkpoint contexts. Inside a model's full recompute
        (`bumblebee.recompute`) the layer's first forward must keep nothing until its backward, but
        the backward still runs on the first forward's graph: so the first forward caches nothing,
        the layer's recompute (just before its backward) caches the attention outputs, and the
        first forward's region reads them when its backward recomputes Q/K/V (`_HandedOver`).
        Attention runs once per pass, and only the layer's input is held across the forward."""
        phase = recompute.phase()
        if phase is None:
            return _LEAN_CONTEXT
        if phase == "forward":
            return lambda: (contextlib.nullcontext(), _HandedOver(self))
        caching, cached = _LEAN_CONTEXT()
        self._handover = cached
        return lambda: (caching, contextlib.nullcontext())

    def _core(self, q_src, c_kv, k_rope, cos, sin, segments, fused=False, fa4=False, cu_seqlens=None):
        """Up-projections, RoPE, attention: latents -> [B, T, H*v]."""
        B, T, _ = c_kv.shape
        H = self.n_heads
        q = (self.q_proj if self.q_lora_rank is None else self.q_b_proj)(q_src).view(B, T, H, self.qk_dim)
        k_nope, v = self.kv_b_proj(c_kv).view(B, T, H, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        if fused:
            q, k = _fused_rope.assemble_qk(q, k_nope, k_rope, cos, sin, self.rope_interleave)
        else:
            q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
            q = torch.cat((q_nope, rope_pairs(q_rope, cos, sin, self.rope_interleave)), dim=-1)
            k_rope = rope_pairs(k_rope[:, :, None], cos, sin, self.rope_interleave)
            k = torch.cat((k_nope, k_rope.expand(B, T, H, self.rope_dim)), dim=-1)
        if fa4 and q.dtype == k.dtype == v.dtype and _fa4.available(q, v):  # e.g. autocast with the torch RoPE: SDPA
            return self._core_fa4(q, k, v, segments, cu_seqlens).reshape(B, T, H * self.v_dim)
        if segments is not None and self.options.varlen and _varlen.serves(q, k, v, segments):
            flat = (t.reshape(B * T, H, t.shape[-1]) for t in (q, k, v))
            o = _varlen.causal_attention(*flat, self.softmax_scale, cu_seqlens, max(b - a for a, b in segments))
            return o.reshape(B, T, H * self.v_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, d]
        if segments is None:
            o = sdpa_causal(q, k, v, self.softmax_scale, self.options.pad_v)
        else:  # packed: one causal call per sequence
            o = packing.per_sequence(lambda *qkv: sdpa_causal(*qkv, self.softmax_scale, self.options.pad_v),
                                     q, k, v, segments)
        return o.transpose(1, 2).reshape(B, T, H * self.v_dim)

    def _core_fa4(self, q, k, v, segments, cu_seqlens):
        """FA4 on [B, T, H, d] (BSHD, as the projections write it); packed: one varlen call."""
        if segments is None:
            return _fa4.causal_attention(q, k, v, self.softmax_scale)
        B, T, H, _ = q.shape
        flat = (t.reshape(B * T, H, t.shape[-1]) for t in (q, k, v))
        return _fa4.causal_attention(*flat, self.softmax_scale, cu_seqlens=cu_seqlens,
                                     max_seqlen=max(b - a for a, b in segments))
