"""Elementwise chains fused by torch.compile on CUDA, eager elsewhere.

RMSNorm and RoPE are chains of small elementwise ops (casts, a square-mean, multiplies, the
rotate-half concatenation); eagerly each is a pass over the activation, forward, recompute and
backward. Inductor fuses each chain into one kernel each way. On a Qwen3-30B-A3B slice at 32K tokens
the eager chains cost ~57 ms of a ~700 ms step (benchmarks/training_step/NOTES.md). The function is
the same on every device: `fused(fn)(*args)` runs `fn` eagerly unless its first argument is a CUDA
tensor of a training dtype (not float64), so CPU runs (and tests) execute the plain ops.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode


def fused(fn):
    """`fn` compiled (dynamic shapes) for CUDA inputs, `fn` itself for the rest."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        nonlocal compiled
        # eager inside another compile, and in float64 (reference runs: Inductor's fp64 reductions do not
        # compile with Triton 3.6, a loop-carried fp32 accumulator re-assigned in fp64)
        if not x.is_cuda or x.dtype == torch.float64 or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        moded = _get_current_dispatch_mode() is not None
        if moded and type(x) is not torch.Tensor:  # fake or subclass tensors under their mode
            return fn(x, *args, **kwargs)
        if compiled is None:
            # not fullgraph: past dynamo's recompile limit (a process that runs many dtypes and ranks,
            # a test session) a fullgraph function raises, this one runs eagerly
            compiled = torch.compile(fn, dynamic=True)
        if moded:
            # Compiled under a dispatch mode too, the mode not seeing the chain's ops: a full recompute
            # compares what each pass saves, and a mode active in one pass only (an op observer around
            # the backward) would otherwise switch the recompute to the eager chain, which saves other
            # tensors. Selective checkpointing then treats the chain alike in both passes (recomputed).
            with _disable_current_modes():
                return compiled(x, *args, **kwargs)
        return compiled(x, *args, **kwargs)
    run.eager = fn
    return run
