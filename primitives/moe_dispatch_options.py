"""Options of the chunked dispatch (`ChunkedDispatch`) and the per-call choices derived from them.

`impl={"moe_dispatch": ChunkedDispatch(chunks="1/2")}`, or the string
`"chunked:chunks=1/2,sm_carveout=32"` (CLI: `--a chunked:fused_permute=false`). Every field has the
measured default; `bumblebee list` prints them and results record the resolved config.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from bumblebee import recompute
from bumblebee.kernels import moe_dispatch_fused_permute as _fused
from bumblebee.kernels import moe_dispatch_regroup as _regroup_kernel
from bumblebee.kernels import moe_dispatch_swiglu as _swiglu
from bumblebee.options import check_bool, check_choice, check_int, option
from bumblebee.primitives.moe_dispatch_rows import regroup_rows

# "auto" chunking: AUTO_CHUNKS where the ep group's largest token count is >= the threshold for its
# ep size, else one chunk (always one at EP = 1: nothing to overlap). Per ep size: the entry of the
# largest key <= EP. Measured with the fused kernels on H200s over NVLink (moe_dispatch/NOTES.md): at
# EP = 2 one chunk is faster up to 48K tokens/rank, (1, 2) at 64K; at EP = 4, where 3/4 of the copies
# leave the rank, (1, 2) wins from 16K. EP >= 8 takes EP = 4's (checked at EP = 8: one chunk ahead at
# 8K, (1, 2) ahead by 21 points at 16K).
AUTO_CHUNKS, AUTO_MIN_TOKENS = (1, 2), {2: 65536, 4: 16384}
# SMs the overlapped grouped GEMMs leave to NCCL by ep size: NCCL's all-to-all runs on 32 blocks at
# EP = 2 and 4; leaving it 32 SMs moved EP = 2 rows by +-0.6 ms either way and sped the overlapped
# (1, 2) up by 4-9 points at EP = 4 (at EP = 8: 0.1-1.7 ms at 16K-64K).
AUTO_SM_CARVEOUT = {2: 0, 4: 32}
WGRAD_MODES = ("auto", "gather", "add")
TRITON_KERNELS = (_fused, _regroup_kernel, _swiglu)  # fused_permute's and fused_swiglu's Triton kernels


@dataclass(frozen=True)
class ChunkedDispatch:
    """Options of the chunked expert-parallel dispatch."""

    impl_name = "chunked"  # not a field: the implementation these options configure
    chunks: str = option("auto", "token chunks of the pipeline: 'auto' (1/3 + 2/3 of the tokens where the ep "
                         "group's largest token count reaches auto_min_tokens, else one), a count ('3') or "
                         "relative sizes ('1/2/2'); a call's chunks= argument overrides it")
    auto_min_tokens: int | None = option(None, "tokens per rank from which 'auto' splits into chunks; None: "
                                         "the measured table by ep size (65536 at EP = 2-3, 16384 from 4)")
    sm_carveout: int | None = option(None, "SMs the overlapped grouped GEMMs leave to NCCL; None: by ep "
                                     "size (0 at EP = 2-3, 32 from 4); 0: off")
    wgrad: str = option("auto", "delayed wgrad of several chunks: 'gather' (regroup the rows, one GEMM per "
                        "weight), 'add' (one GEMM per chunk plus adds) or 'auto' (fewer bytes moved)")
    fused_permute: bool = option(True, "un-permute, its gradient, the sum over K and the one-rank group "
                                 "accumulation as fused Triton kernels (kernels/moe_dispatch_fused_permute.py, "
                                 "kernels/moe_dispatch_regroup.py) on CUDA")
    fused_swiglu: bool = option(True, "the experts' SwiGLU elementwise as one Triton pass each way "
                                "(kernels/moe_dispatch_swiglu.py) on CUDA")
    fused_recompute: bool = option(True, "under the models' full recompute: the recompute skips fc2 and "
                                   "the combine, the backward weights the experts' rows itself")
    group_rows: int = option(65536, "one rank under the models' recompute: routed rows per expert group of "
                             "the backward (primitives/moe_dispatch_local.py); fewer rows, less memory")
    forward_group_rows: int = option(1 << 20, "one rank under the models' recompute: routed rows per expert group "
                                     "of the first forward, which keeps nothing per row (one group copies no "
                                     "rows: up to 128K tokens at top-8; ~12.8 KiB of transient per row at "
                                     "Qwen3-30B-A3B's sizes, below the backward's peak); fewer rows, less "
                                     "transient memory")

    def __post_init__(self):
        chunk_spec(self.chunks)  # raises on a malformed value
        check_int(self, "auto_min_tokens", 0, optional=True)
        check_int(self, "sm_carveout", 0, optional=True)
        check_choice(self, "wgrad", WGRAD_MODES)
        for name in ("fused_permute", "fused_swiglu", "fused_recompute"):
            check_bool(self, name)
        check_int(self, "group_rows", 1)
        check_int(self, "forward_group_rows", 1)


def by_ep(table, EP: int) -> int:
    """A per-ep-size setting: the entry of the largest key <= EP (the smallest key below it); an int
    is one value for every size."""
    if isinstance(table, int):
        return table
    return table[max((k for k in table if k <= EP), default=min(table))]


def chunk_spec(chunks) -> tuple:
    """(relative chunk sizes the counts are exchanged in, auto: whether one chunk may replace them) of
    'auto', an int, a sequence of relative sizes, or their text forms ('3', '1/2/2')."""
    if isinstance(chunks, str) and chunks != "auto":
        parts = chunks.split("/")
        if not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"chunks must be 'auto', a count or relative sizes such as '1/2', got {chunks!r}")
        chunks = int(parts[0]) if len(parts) == 1 else tuple(int(p) for p in parts)
    if isinstance(chunks, str):
        return AUTO_CHUNKS, True  # the first chunk the short one: its dispatch and combine-backward stay exposed
    if isinstance(chunks, int) and not isinstance(chunks, bool):
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        return (1,) * chunks, False
    spec = tuple(int(c) for c in chunks)
    if not spec or min(spec) < 1 or any(int(c) != c for c in chunks):
        raise ValueError(f"chunks must be an int >= 1 or a sequence of positive integer relative sizes, got {chunks}")
    return spec, False


def min_tokens(config: ChunkedDispatch, EP: int) -> float:
    if EP == 1:
        return float("inf")
    return by_ep(AUTO_MIN_TOKENS, EP) if config.auto_min_tokens is None else config.auto_min_tokens


def fused_recompute_phase(config: ChunkedDispatch):
    """recompute.phase() ("forward" | "recompute") where fused_recompute is on, else None."""
    return recompute.phase() if config.fused_recompute else None


@contextlib.contextmanager
def sm_carveout(config: ChunkedDispatch, active: bool, device, EP: int):
    n = by_ep(AUTO_SM_CARVEOUT, EP) if config.sm_carveout is None else config.sm_carveout
    if not active or not n or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if n >= sms:
        raise ValueError(f"ChunkedDispatch.sm_carveout must be below this GPU's {sms} SMs, got {n}")
    prev = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(n)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(prev)


def swiglu_fns(config: ChunkedDispatch, t: torch.Tensor):
    """(swiglu, swiglu_grads, swiglu_grads_weighted) of `kernels/moe_dispatch_swiglu.py` where fused_swiglu is on and
    Triton runs on t (CUDA, or TRITON_INTERPRET=1), else Nones: the torch ops."""
    if config.fused_swiglu and _swiglu.use_triton(t):
        return _swiglu.swiglu, _swiglu.swiglu_grads, _swiglu.swiglu_grads_weighted
    return None, None, None


def permute_fns(config: ChunkedDispatch, t: torch.Tensor):
    """(unpermute, unpermute_grads, sum_copies, regroup, add_group_copies) for this call: the fused kernels
    where fused_permute is on and Triton runs on t (CUDA, or TRITON_INTERPRET=1), else the kernels'
    algorithms in torch (`*_torch`, `moe_dispatch_rows.regroup_rows`): never the twins' functions."""
    if config.fused_permute and _fused.use_triton(t):
        return (_fused.unpermute, _fused.unpermute_grads, _fused.sum_copies, _regroup_kernel.regroup,
                _fused.add_group_copies)
    return (_fused.unpermute_torch, _fused.unpermute_grads_torch, _fused.sum_copies_torch, regroup_rows,
            _fused.add_group_copies_torch)
