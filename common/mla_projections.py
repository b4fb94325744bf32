"""The parameters of multi-head latent attention, shared by the `mla` slot's twin and primitive.

Module names equal transformers' DeepseekV3Attention, so state_dict keys are checkpoint keys:
`q_proj` (q_lora_rank None) or `q_a_proj`, `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`. One definition keeps the twin's and the primitive's
state_dicts identical by construction; each subclass brings its own forward.
"""
from __future__ import annotations

import torch.nn as nn

from bumblebee.checks import check_mla_config
from bumblebee.norms import RMSNorm


class MLAProjections(nn.Module):
    def __init__(self, dim, n_heads, *, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                 softmax_scale=None, rope_interleave=True, bias=False):
        super().__init__()
        check_mla_config(dim, n_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        self.dim, self.n_heads, self.q_lora_rank, self.kv_lora_rank = dim, n_heads, q_lora_rank, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = self.qk_dim ** -0.5 if softmax_scale is None else softmax_scale
        self.rope_interleave = rope_interleave
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, n_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank)
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, dim, bias=bias)
