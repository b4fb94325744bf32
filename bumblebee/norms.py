"""RMS norms shared by models, primitives and their twins (all of which may import this core module).

`RMSNorm`: rmsnorm(x) in fp32, cast back, then the weight (transformers' Qwen/Llama/DeepSeek order).
`GatedRMSNorm`: weight * rmsnorm(x) * silu(gate), as transformers' Qwen3_5RMSNormGated (fp32 inside).
`to_acc`: x in fp32, or in its own dtype when wider (float64 references stay float64).
Both norms run as one compiled kernel each way on CUDA (`bumblebee/fused.py`), their eager ops elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bumblebee.fused import fused


def to_acc(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


@fused
def rms_norm(x, weight, eps: float):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        return gated_rms_norm(x, gate, self.weight, self.eps)


@fused
def gated_rms_norm(x, gate, weight, eps: float):
    """Compiled on CUDA (one kernel each way): eagerly the chain is about ten fp32 passes over a DeltaNet
    layer's [T, H_v, D_v] output, in the first forward, the recompute and the backward."""
    dtype = x.dtype
    h = to_acc(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(dtype) * F.silu(to_acc(gate))).to(dtype)
