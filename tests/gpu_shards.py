"""The GPU suite (`pytest -m gpu`) in shards meant to finish within ten minutes each on one H200.

    python tests/gpu_shards.py                # lists the shards and their files
    python tests/gpu_shards.py 2              # runs shard 2: python -m pytest -m gpu -q <its files>
    python tests/gpu_shards.py 2 -- -x -ra    # pytest arguments after --
    python tests/gpu_shards.py all            # every shard in turn, one pytest process each
    python tests/gpu_shards.py all --gpus 0,1 --limit 3000 --logs /tmp/shards   # one lane per GPU at once
    python tests/gpu_shards.py 3 --save-tuning  # then keep its autotuning in tests/gpu_tuning.json
    python tests/gpu_shards.py 3 --cold         # an empty Triton cache: a fresh machine's time

The shards run with their own Triton cache, seeded with the autotuning results in tests/gpu_tuning.json
when this GPU is the one they were tuned on (tests/gpu_tuning.py says why and how).

A shard groups the files that compile the same kernels, so each pays its compilations once: FA4's
CuTe DSL kernels (seconds per configuration), fla's and Liger's autotuned Triton kernels (minutes on a
fresh machine), Inductor's compiled chains, spawned NCCL ranks. The listing gives each shard's minutes
on a fresh H200 as last timed (`tests/gpu_lanes.py:FRESH_MINUTES`): run a shard with `--durations=0` to
time it, and move a file when a shard passes ten minutes. The runs on H200s, their times and what each moved: tests/GPU_RUNS.md.
`tests/core/test_gpu_shards.py` checks that every file
with a `gpu` mark is in exactly one shard.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHARDS = {
    1: ("attention: FA4, varlen, kept output (FA4 JIT compiles)", (
        "tests/primitives/test_attention_fa4.py",
        "tests/primitives/test_attention_packed.py",
        "tests/primitives/test_attention_recompute_kept.py",
        "tests/primitives/test_attention_varlen.py",
    )),
    2: ("MLA and DeepSeek-V3 (FA4 at head dims 192/128, fused Q/K Triton kernels)", (
        "tests/primitives/test_mla.py",
        "tests/primitives/test_mla_rope_fused.py",
        "tests/models/test_deepseek_v3_hf_parity.py",
        "tests/primitives/test_context_parallel_gpu.py",  # cuDNN / flash blocks; fla's rule at small shapes
    )),
    3: ("gated DeltaNet on fla's kernels and compiled chains (fla autotuning, Inductor)", (
        "tests/primitives/test_linear_attention.py",
        "tests/primitives/test_linear_attention_recompute_kept.py",
        "tests/models/test_fused_chains.py",
    )),
    4: ("MoE dispatch, routers, loss, MTP (our Triton kernels, one- and two-GPU spawns)", (
        "tests/primitives/test_moe_dispatch.py",
        "tests/primitives/test_moe_dispatch_fused_recompute.py",
        "tests/primitives/test_moe_dispatch_fused_permute.py",
        "tests/primitives/test_moe_dispatch_regroup.py",
        "tests/primitives/test_moe_dispatch_swiglu.py",
        "tests/primitives/test_router.py",
        "tests/primitives/test_router_backward.py",
        "tests/primitives/test_cross_entropy_linear.py",
        "tests/primitives/test_mtp.py",
        "tests/primitives/test_weight_transfer_nccl.py",  # two GPU ranks over NCCL, a trainer killed on purpose
    )),
    5: ("processes: state sharding, offload, the RL pipeline, verl (NCCL spawns, Ray actors)", (
        "tests/primitives/test_state_sharding.py",
        "tests/runtime/test_rl_gpu.py",
        "tests/runtime/test_pipeline_learning.py",
        "tests/runtime/test_pipeline_ray_gpus.py",  # Ray actors on 2 GPUs, p2p weights over NCCL
        "tests/runtime/test_pipeline_weights_pack.py",  # the object-store channel's pack of CUDA tensors
        "tests/runtime/test_pipeline_colocated.py",  # the colocated loop on 2 GPUs (NCCL beside gloo)
        "tests/e2e/test_verl_gpu.py",
    )),
    # split from shard 5 at e8c6d11, which ran out of 460 s after these 9 tests: a step of every tiny model (the
    # Qwen3.5 one autotunes fla's kernels, ~250 s on a fresh machine) and Qwen3 against transformers in bf16
    6: ("whole-model training steps in subprocesses, Qwen3 against transformers in bf16", (
        "tests/primitives/test_attention_sdpa_backend_state.py",
        "tests/models/test_qwen3_gpu.py",
    )),
    # split from shard 3 after f38abbb: on a fresh machine shard 3 ran out of 480-520 s in every session
    # (22 of 27 tests), fla's first autotuning of its CP kernels being a few minutes of its own
    7: ("fla's context-parallel kernels for gated DeltaNet (CP = 1 and 2 on two GPUs; a case is ended at 420 s)", (
        "tests/primitives/test_context_parallel_fla_gpu.py",  # fla's CP kernels; CP = 2 on 2 GPUs
    )),
    # split from shards 3 and 7 after 91504d0: on a fresh two-H200 host shard 3 ran out of 571 s after 11 of
    # its 22 tests, in the gated backward's fla comparison; shard 7 did one case in each of two calls
    8: ("our gated DeltaNet kernels: the chunked backward, the CP transition maps (Triton autotuning)", (
        "tests/primitives/test_linear_attention_gdn_backward.py",
        "tests/primitives/test_context_parallel_transition.py",  # our transition maps beside fla's at 16K tokens
    )),
}

GPU_MARK = re.compile(r"pytest\.mark\.gpu\b|\bmark\.gpu\b")


def gpu_files(root: Path = ROOT) -> set[str]:
    """Test files under tests/ that carry a `gpu` mark (on a case or as `pytestmark`)."""
    return {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")
            if GPU_MARK.search(p.read_text())}


def command(shard: int, extra: list[str]) -> list[str]:
    if shard not in SHARDS:
        raise ValueError(f"shard must be one of {sorted(SHARDS)} or 'all', got {shard!r}")
    quiet = [] if any(a in ("-v", "-vv", "--verbose") for a in extra) else ["-q"]  # -q would cancel a -v
    return [sys.executable, "-m", "pytest", "-m", "gpu", *quiet, *SHARDS[shard][1], *extra]


def _tuning_env(cold: bool) -> Path:
    """The shards' own Triton cache (tests/gpu_tuning.py), seeded unless `cold`; set for every child."""
    from tests import gpu_tuning
    cache = Path(tempfile.mkdtemp(prefix="triton-cold-")) if cold else gpu_tuning.CACHE_DIR
    os.environ.update(TRITON_CACHE_DIR=str(cache), TRITON_CACHE_AUTOTUNING="1")
    if not cold:
        gpu = gpu_tuning.this_gpu() or ""
        n = gpu_tuning.seed(cache, gpu)
        print(f"Triton cache {cache}: {n} autotuning results seeded from {gpu_tuning.TUNING_FILE.name}"
              + ("" if n else f" (none new for {gpu or 'no GPU'})"), flush=True)
    return cache


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="gpu_shards.py", description="The GPU suite in shards.")
    ap.add_argument("shards", nargs="*", help="shard numbers, or 'all'; none: list the shards")
    ap.add_argument("--gpus", default="", help="comma-separated GPUs: run the shards at once, one lane per GPU "
                    "(tests/gpu_lanes.py), each shard's output in --logs")
    ap.add_argument("--limit", type=float, default=3000.0, help="with --gpus: seconds for the whole run")
    ap.add_argument("--logs", default="gpu-shard-logs", help="with --gpus: the folder for each shard's log")
    ap.add_argument("--cold", action="store_true", help="an empty Triton cache and no seeded autotuning "
                    "(tests/gpu_tuning.py): times a fresh machine")
    ap.add_argument("--save-tuning", action="store_true", help="after the run (or alone), add the autotuning "
                    "results in the shards' Triton cache to tests/gpu_tuning.json")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if str(ROOT) not in sys.path:  # run as a script: tests/ is on the path, the repository root is not
        sys.path.insert(0, str(ROOT))
    if not args.shards and not args.save_tuning:
        from tests.gpu_lanes import FRESH_MINUTES
        for n, (what, files) in SHARDS.items():
            print(f"shard {n} (~{FRESH_MINUTES[n]} min on a fresh H200): {what}\n  " + "\n  ".join(files))
        return 0
    if args.shards != ["all"] and not all(a.isdigit() for a in args.shards):
        ap.error(f"shards must be shard numbers {sorted(SHARDS)} or 'all', got {args.shards}")
    shards = list(SHARDS) if args.shards == ["all"] else [int(a) for a in args.shards]
    for n in shards:
        command(n, extra)  # an unknown shard is refused before anything runs
    from tests import gpu_tuning
    cache = _tuning_env(args.cold) if shards else gpu_tuning.CACHE_DIR
    status = 0
    if args.gpus and shards:
        from tests.gpu_lanes import run_lanes
        records = run_lanes(shards, args.gpus.split(","), lambda n: command(n, extra), args.limit,
                            Path(args.logs), ROOT)
        status = 0 if all(r["status"] == "passed" for r in records) else 1
    else:
        for n in shards:
            print(f"== shard {n}: {SHARDS[n][0]}", flush=True)
            status = subprocess.run(command(n, extra), cwd=ROOT).returncode or status
    if args.save_tuning:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        gpu = gpu_tuning.this_gpu()
        if gpu is None:
            raise SystemExit("--save-tuning needs the GPU the results were tuned on")
        n = gpu_tuning.save(cache, gpu, f"autotuned by the GPU shards (last added at {commit}); Triton finds an "
                            "entry only for the same kernel source, Triton build and GPU target")
        print(f"{gpu_tuning.TUNING_FILE}: {n} autotuning results for {gpu}")
    if args.cold and shards:
        shutil.rmtree(cache, ignore_errors=True)  # the cold run's own temporary cache
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
