"""What every part of the MLA benchmark reads: the sizes, device and dtype of the run (`CFG`,
switched by `--smoke`), the records it gathers (`RESULTS`), the FLOP counts and the small helpers
each case uses. One module object per process (loaded through `siblings.load("mla", "run_config")`),
so that bench.py, core_sweep.py and megatron_anchor.py share one `CFG` and one `RESULTS`."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from timing import median_ms  # noqa: E402

DSV3 = dict(dim=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128)
SMOKE = dict(dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8)
RESULTS: dict = {"cases": []}
# --smoke switches to SMOKE / cpu / fp32 / 16; packed_len: tokens per sequence in the packed cases
CFG = {"sizes": DSV3, "device": "cuda", "dtype": torch.bfloat16, "packed_len": 512}


def cuda():
    return CFG["device"] == "cuda"


def time_ms(fn, iters=10, warmup=3):
    return median_ms(fn, iters, warmup, cuda=cuda())


def case_name(T):
    """The record's `case`: "4K", "16K", ... (a plain count below 1024 tokens, the smoke sizes)."""
    return f"{T // 1024}K" if T >= 1024 else str(T)


def core_flops(T, H=128, dqk=192, dv=128):
    return 3 * H * T * T * (dqk + dv)


def core_flops_fa_convention(T, H=128, dqk=192, dv=128):
    """FlashAttention's benchmark count: backward = 2.5x the forward (recompute included)."""
    return 3.5 * H * T * T * (dqk + dv)


def rope(T, R=None):
    R = R or CFG["sizes"]["qk_rope_head_dim"]
    dev = CFG["device"]
    pos = torch.arange(T, device=dev).float()
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=dev).float() / R))
    f = pos[:, None] * inv
    emb = torch.cat([f, f], -1)[None]
    return emb.cos().to(CFG["dtype"]), emb.sin().to(CFG["dtype"])


def mem():
    return torch.cuda.memory_allocated() if cuda() else 0


