"""Elementwise chains fused by torch.compile on CUDA, eager elsewhere.

RMSNorm and RoPE are chains of small elementwise ops (casts, a square-mean, multiplies, the
rotate-half concatenation); eagerly each is a pass over the activation, forward, recompute and
backward. Inductor fuses each chain into one kernel each way. On a Qwen3-30B-A3B slice at 32K tokens
the eager chains cost ~57 ms of a ~700 ms step (benchmarks/training_step/NOTES.md). The function is
the same on every device: `fused(fn)(*args)` runs `fn` eagerly unless its first argument is a CUDA
tensor, so CPU runs (and tests) execute the plain ops.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def fused(fn):
    """`fn` compiled (dynamic shapes) for CUDA inputs, `fn` itself for the rest."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        nonlocal compiled
        # eager inside another compile, and under a dispatch mode (selective activation checkpointing
        # decides per aten op what to keep: a compiled region would hide its ops from it)
        if not x.is_cuda or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return fn(x, *args, **kwargs)
        if compiled is None:
            # not fullgraph: past dynamo's recompile limit (a process that runs many dtypes and ranks,
            # a test session) a fullgraph function raises, this one runs eagerly
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)
    run.eager = fn
    return run
