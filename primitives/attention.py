"""Causal GQA attention: FlashAttention 4 where installed and measured faster, else PyTorch SDPA with the
backend picked explicitly.

On CUDA the cuDNN backend ran causal GQA 1.8x faster than flash on an H200; it is tried first, then
flash, then memory-efficient, then the math fallback. The CPU uses SDPA's own choice.
FA4 (`kernels/attention_fa4.py`, package flash-attn-4) ran head dim 128 (32 query heads, 8 or 4
key/value heads) 1.10-1.13x faster than cuDNN forward + backward at 8K-64K tokens on an H200, but head
dim 256 (Qwen3.5's full attention) 0.91-1.04x (`benchmarks/attention/results/history/probe_fa4_gqa.jsonl`): so dense
batches take FA4 for head dims up to `FA4_MAX_HEAD_DIM`, packed batches (one varlen launch instead of
one SDPA call per sequence) for every head dim it runs (`benchmarks/attention/bench.py`). Option
`SDPA.fa4` ("auto"; "on" for every shape FA4 runs, "off" for SDPA).
Inside a model's full recompute, dense batches (FA4 or SDPA) keep each layer's attention output and
log-sum-exp from its first forward so the recompute skips attention (`kernels/attention_recompute_kept.py`),
while the outputs kept at once fit `SDPA.recompute_keep_bytes`.
Packed batches without FA4 run PyTorch's FlashAttention 2 varlen kernel in one launch while sequences
are short on average (`kernels/attention_varlen.py`; 11x one SDPA call per sequence at 64 x 512 tokens),
else one SDPA call per sequence. Option `SDPA.varlen` (False for the per-sequence calls).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bumblebee import packing
from bumblebee import recompute
from bumblebee.checks import check_attention_inputs
from bumblebee.kernels import attention_fa4 as _fa4
from bumblebee.kernels import attention_recompute_kept as _kept
from bumblebee.kernels import attention_sdpa_cudnn_first as _sdpa_cudnn
from bumblebee.kernels import attention_varlen as _varlen
from bumblebee.options import Bound, check_bool, check_choice, check_int, option
from bumblebee.registry import register

FA4_MAX_HEAD_DIM = 128  # dense batches: FA4 up to this head dim under fa4="auto"
FA4_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class SDPA:
    """Options of sdpa: `impl={"attention": SDPA(fa4="off")}`, or the string "sdpa:fa4=off,varlen=off"
    (CLI: `--a sdpa:fa4=off`)."""

    impl_name = "sdpa"  # not a field: the implementation these options configure
    fa4: str = option("auto", "FlashAttention 4 (flash-attn-4) where installed and it runs the shapes. auto: "
                      "dense batches up to head dim FA4_MAX_HEAD_DIM (128; FA4 1.10-1.13x cuDNN there, "
                      "0.91-1.04x at 256), packed batches at every head dim (one launch); on: every shape "
                      "FA4 runs; off: SDPA, cuDNN first")
    varlen: bool = option(True, "packed batches without FA4: one launch of PyTorch's FlashAttention 2 varlen "
                          "kernel while sequences are short on average (CUDA, 16-bit); False: one SDPA call "
                          "per sequence")
    recompute_keep_bytes: int = option(
        6 << 30, "dense batches (FA4 or SDPA) inside a model's full recompute: keep each layer's attention "
        "output and log-sum-exp (16-bit [T, H*D] + fp32 [H, T]) from its first forward, so the recompute skips attention (a quarter "
        "of attention's kernel time), while the bytes kept at once across layers stay within this budget; "
        "past it a layer recomputes attention. 0: always recompute")

    def __post_init__(self):
        check_choice(self, "fa4", FA4_CHOICES)
        check_bool(self, "varlen")
        check_int(self, "recompute_keep_bytes", 0)


def _use_fa4(config: SDPA, q, v, packed: bool) -> bool:
    """Dense: head dims up to FA4_MAX_HEAD_DIM (fa4="auto"). Packed: every head dim FA4 runs (one varlen
    launch against one SDPA call per sequence: 12x at 64 sequences of 512 tokens, attention/bench.py)."""
    if config.fa4 == "off":
        return False
    fits = packed or config.fa4 == "on" or max(q.shape[-1], v.shape[-1]) <= FA4_MAX_HEAD_DIM
    return fits and _fa4.available(q, v)


@register("attention", "sdpa", kind="primitive", twin="eager", default=True, config=SDPA)
def sdpa_attention_with(config: SDPA, q, k, v, *, scale=None, cu_seqlens=None):
    """Causal attention with native GQA: FA4 where installed (dense: head dim <= 128; packed: any it runs),
    else SDPA, cuDNN first.
    cu_seqlens: the B*T tokens are one packed stream of sequences; attention stays inside each
    (FA4, else FlashAttention 2 varlen for short sequences: one launch; SDPA: one call per sequence)."""
    check_attention_inputs(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T = q.shape[0], q.shape[2]
    spans = None if cu_seqlens is None else packing.segments(cu_seqlens, B * T)
    # FA4 takes [B, T, H, D]: the callers' [B, H, T, D] are transposed views of it
    fa4 = _use_fa4(config, q, v, spans is not None)
    if spans is None:
        if config.recompute_keep_bytes and recompute.region() is not None and torch.is_grad_enabled():
            return _kept_through_recompute(q, k, v, scale, config.recompute_keep_bytes, fa4)
        return _fa4_dense(q, k, v, scale) if fa4 else _sdpa(q, k, v, scale)
    if fa4:
        return _packed_call(_fa4.causal_attention, q, k, v, scale, cu_seqlens, spans)
    if config.varlen and _varlen.serves(q, k, v, spans):
        return _packed_call(_varlen.causal_attention, q, k, v, scale, cu_seqlens, spans)
    return packing.per_sequence(lambda *qkv: _sdpa(*qkv, scale), q, k, v, spans)


# The public function: sdpa with its default options (the twin's signature); a model's impl choice
# gets it bound to the chosen ones by `registry.resolve`.
sdpa_attention = Bound(sdpa_attention_with, SDPA())


def _packed_call(kernel, q, k, v, scale, cu_seqlens, spans):
    """A varlen kernel on [B*T, H, D] views of the callers' [B, H, T, D] (transposed [B, T, H, D])."""
    B, T = q.shape[0], q.shape[2]
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[-1]) for t in (q, k, v)]
    o = kernel(*flat, scale, cu_seqlens=cu_seqlens, max_seqlen=max(b - a for a, b in spans))
    return o.view(B, T, q.shape[1], -1).transpose(1, 2)


def _kept_through_recompute(q, k, v, scale, limit_bytes: int, fa4: bool):
    """Inside a full-recompute region: the first forward keeps the output of the kernel that runs (FA4, or
    the one SDPA would pick) while `limit_bytes` allows, and the recompute takes it instead of running
    attention; otherwise both passes run the plain path (they must save the same tensors)."""
    nbytes = _kept.kept_bytes(q, v)
    budget = recompute.budget("attention")  # the model's: another model's kept outputs never count here

    def choose():
        if fa4:
            kernel = _FA4_KEPT
        else:
            kernel = _kept.kernel_for(q, _sdpa_cudnn.choice(q, k, v, scale, enable_gqa=k.shape[1] != q.shape[1]))
        return kernel if kernel is not None and budget.reserve(nbytes, limit_bytes) else None
    return recompute.keep_through(
        lambda: (_fa4_dense if fa4 else _sdpa)(q, k, v, scale), choose,
        lambda kernel: _kept.KeptAttention.apply(q, k, v, scale, kernel, lambda: budget.release(nbytes), None),
        lambda kernel, out: _kept.KeptAttention.apply(q, k, v, scale, kernel, None, out))


_FA4_KEPT = _kept.Kernel("fa4", _fa4.kept_forward, _fa4.kept_backward)


def _fa4_dense(q, k, v, scale):
    return _fa4.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)


def _sdpa(q, k, v, scale):
    return _sdpa_cudnn.causal_sdpa(q, k, v, scale, enable_gqa=k.shape[1] != q.shape[1])
