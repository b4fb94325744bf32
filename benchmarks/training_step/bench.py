"""The full training step against the stack users already run: bumblebee vs transformers + Liger + FSDP2.

    python benchmarks/training_step/bench.py --model qwen3-30b-a3b --layers 4 --seq-lens 32768,65536,131072
    python benchmarks/training_step/bench.py --longest 131072,163840,196608   # the longest each stack fits
    python benchmarks/training_step/bench.py --cpu-smoke                       # tiny model, fp32, no Liger
    python benchmarks/training_step/bench.py --merge a.json,b.json --out DIR    # one file from split runs

One process per (stack, length) (`--worker`, launched by this driver; torchrun over `--gpus`), so
neither stack sees what the other left in the process. First a transformers model of the named
config cut to `--layers` decoder layers is initialized by transformers (seed 0) and saved with its
own `save_pretrained`; both stacks load that folder (`benchmarks/training_step/step_stacks.py`). Every stack trains
on the same token batches (step i: tokens drawn from a generator seeded with i), fp32 master weights,
bf16 compute, full recompute, AdamW, clipping at 1.0.

The peer (`transformers+liger`) is the best configuration a user gets from flags and installed packages:
FlashAttention 4 where flash-attn-4 imports (else SDPA), fused AdamW, Liger's kernels, non-reentrant
checkpointing; `transformers+liger-reference` is the configuration earlier results used (SDPA, foreach
AdamW), for reference only. Each length runs `--rounds` times interleaved (peer, ours, peer, ours, ...).

Per stack, length and round, one row: tokens/s (median step after `--warmup`), model TFLOP/s (6 x active
matmul weights per token + causal attention, recompute not counted), static memory (allocated after
the first optimizer step), peak memory (max allocated over the run), loss and grad norm of every step,
and, at `--profile-len`, a kernel-time breakdown of one profiled step by category, its top kernels,
and the attention ops it ran; in every row `attention_kernel` and `optimizer`, read from the kernels and
operators one traced step launched (`step_profile.py`). A stack that runs out of memory gets a row with
`fits: false`. The comparison (`step_compare.py`) pairs ours with a fused-AdamW peer of the same attention
kernel family (or says the families differ), with the ratio's spread over the rounds and its verdict
against `--target`. Writes DIR/training_step_<model>_<gpu>_x<gpus>.json: {"rows", "comparison", meta}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing, siblings
sys.path.insert(0, str(HERE))  # step_stacks, step_profile, step_compare
from stamp import commit, stamp  # noqa: E402  (benchmarks/ is not a package)
from timing import Stopwatch, step_times_ms, sync  # noqa: E402
from step_compare import TARGET, compare  # noqa: E402
from step_profile import kernels_launched, profile_step  # noqa: E402

STACKS = ("transformers+liger", "bumblebee")  # the peer first: its kernels autotune once


def hf_slice(name: str, layers: int, cpu_smoke: bool) -> dict:
    from bumblebee.models import NAMED
    hf = {k: v for k, v in NAMED[name].items() if k not in ("text_config",)}
    hf["num_hidden_layers"] = layers
    if "layer_types" in hf:
        hf["layer_types"] = hf["layer_types"][:layers]
    for k in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if k in hf:
            hf[k] = 0  # MTP off for the comparison
    hf["dtype"] = "float32"
    if cpu_smoke:
        hf["output_router_logits"] = False
    return hf


def model_flops_per_token(hf: dict, seq_len: int) -> float:
    """6 x (active matmul weights) + causal attention (forward 2 * heads * head_dim * S per layer, x3)."""
    D, V, L = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or D // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    attn_w = D * hd * (2 * q + 2 * kv)
    E = hf.get("num_experts") or 0
    if E:
        mlp_w = 3 * D * hf["moe_intermediate_size"] * hf["num_experts_per_tok"] + D * E
        mlp_w += 3 * D * hf.get("shared_expert_intermediate_size", 0)
    else:
        mlp_w = 3 * D * hf["intermediate_size"]
    types = hf.get("layer_types") or ["full_attention"] * L
    full = types.count("full_attention")
    weights = L * mlp_w + full * attn_w + D * V
    if full < L:  # gated DeltaNet layers: projections (q, k, v, z, b, a, out) and the chunked recurrence
        kd, vd = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        kh, vh = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        weights += (L - full) * D * (2 * kh * kd + 3 * vh * vd + 2 * vh)
        weights += (L - full) * 2 * vh * kd * vd  # state update and read per token (~2 matmul-weights' worth)
    attention = 2 * q * hd * seq_len * full
    return 3 * (2 * weights + attention)


# ---- the worker: one stack, one length, one process per GPU ----------------------------------------------

def batch(i: int, seq_len: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, vocab, (1, seq_len), generator=g).to(device)


ANCHOR_PACKAGES = ("transformers", "liger-kernel", "flash-attn-4", "fla-core", "flash-linear-attention")


def packages() -> dict:
    """Versions of the packages that change what either stack runs (None: not installed): with
    flash-attn-4 installed ours runs FA4 for head dims up to 128."""
    from importlib import metadata
    out = {}
    for name in ANCHOR_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def sdpa_backend_now(device) -> str | None:
    """The backend a plain causal SDPA call picks now (Qwen3's attention shape, bf16)."""
    if device.type != "cuda":
        return None
    q = torch.randn(1, 32, 256, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 256, 128, device=device, dtype=torch.bfloat16).repeat_interleave(8, 1)
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True)
    from torch.nn.attention import SDPBackend
    return SDPBackend(choice).name


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import step_stacks
    cpu = args.cpu_smoke
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    hf = json.loads((Path(args.init) / "config.json").read_text())
    row = {"stack": args.worker, "model": args.model, "layers": args.layers, "gpus": world,
           "seq_len": args.seq_len, "device": torch.cuda.get_device_name(device) if not cpu else "cpu",
           **commit(), "packages": packages(), "sdpa_backend_at_start": None}
    fits = True
    try:
        stack = step_stacks.build(args.worker, args.init, device, mesh, ep=world if hf.get("num_experts") else 1,
                                  mixed_precision="fp32" if cpu else "bf16")
        row["stack"], row["config"] = stack.name, stack.config
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses, norms, phases, static, ids = [], [], [], 0, [None]
        count = iter(range(args.warmup + args.steps))

        def before():  # the next batch, every rank at the barrier, the device idle: outside the timed step
            i = next(count)
            short = i < args.warmup and args.warmup_len  # the optimizer state exists before the step at seq_len
            ids[0] = batch(i, args.warmup_len if short else args.seq_len, hf["vocab_size"], device)
            dist.barrier()
            sync(device)

        def step():  # one training step, timed on the host clock up to the device's end
            losses.append(stack.forward_backward(ids[0]))
            if len(losses) <= 2 and not cpu:  # where the peak falls: forward + backward, or the optimizer step
                phases.append({"step": len(losses) - 1, "fwd_bwd_peak": torch.cuda.max_memory_allocated()})
            norms.append(stack.optimizer_step())
            sync(device)

        def after(i):
            nonlocal static
            if i < 2 and not cpu:
                phases[-1]["step_peak"] = torch.cuda.max_memory_allocated()
            if i == 0 and not cpu:
                static = torch.cuda.memory_allocated()

        times = step_times_ms(step, args.steps, args.warmup, before=before, after=after, cuda=False)
        peak = torch.cuda.max_memory_allocated() if not cpu else 0
        ms = statistics.median(times)
        stats = torch.tensor([ms, static, peak], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        ms, static, peak = float(stats[0]), int(stats[1]), int(stats[2])
        flops = model_flops_per_token(hf, args.seq_len)
        row.update({"fits": True, "median_ms": ms, "step_ms": times,
                    "tokens_per_s": world * args.seq_len / (ms / 1e3),
                    "model_tflops_per_gpu": flops * args.seq_len / (ms / 1e3) / 1e12,
                    "model_flops_per_token": flops,
                    "static_bytes": static, "peak_bytes": peak,
                    "reserved_bytes": torch.cuda.max_memory_reserved() if not cpu else 0,
                    "losses": losses, "grad_norms": norms, "peak_by_phase": phases})
        # one more step traced: what it launched (every row), the full breakdown at --profile-len
        extra = batch(args.warmup + args.steps, args.seq_len, hf["vocab_size"], device)
        if args.profile:
            row["profile"] = profile_step(stack, extra)
            seen = {k: row["profile"][k] for k in ("attention_kernel", "attention_kernel_ms",
                                                   "linear_attention_kernel_ms", "optimizer")}
        else:
            seen = kernels_launched(stack, extra)
        row.update(seen)
        row["sdpa_backend_after"] = sdpa_backend_now(device)
    except torch.OutOfMemoryError as e:
        fits = False
        row.update({"fits": False, "error": str(e).splitlines()[0][:300]})
    if rank == 0:
        Path(args.row_out).write_text(json.dumps(row))
    if fits:
        dist.barrier()
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------------------

def launch(args, stack: str, seq_len: int, steps: int, profile: bool, tmp: Path, warmup: int | None = None,
           warmup_len: int = 0, round_: int = 0) -> dict:
    row_out = tmp / f"row_{''.join(c if c.isalnum() else '_' for c in stack)}_{seq_len}_{round_}.json"
    row_out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", stack, "--init", str(tmp / "init"),
           "--model", args.model, "--layers", str(args.layers), "--seq-len", str(seq_len), "--steps", str(steps),
           "--warmup", str(args.warmup if warmup is None else warmup), "--warmup-len", str(warmup_len),
           "--row-out", str(row_out)] + (["--profile"] if profile else []) \
        + (["--cpu-smoke"] if args.cpu_smoke else [])
    if args.gpus > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"] + cmd[1:]
    # Triton's autotuning results cached on disk: a stack's kernels tune once (Liger's fused MoE kernels
    # spend minutes tuning at 32K tokens), as they would once per long training job
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port_base + seq_len % 997), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "TRITON_CACHE_AUTOTUNING": "1"}
    # before the worker: a first run at a new shape can autotune Triton kernels for minutes in silence
    print(f"running {stack} at {seq_len} tokens", file=sys.stderr, flush=True)
    clock = Stopwatch()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if row_out.exists():
        row = json.loads(row_out.read_text())
    else:
        tail = (proc.stdout + proc.stderr)[-3000:]
        oom = "OutOfMemory" in tail or "out of memory" in tail
        row = {"stack": stack, "model": args.model, "gpus": args.gpus, "seq_len": seq_len, "fits": not oom and None,
               "error": tail[-1500:], **commit()}
    row["process_s"] = clock.seconds()
    row["round"] = round_
    short = {k: row.get(k) for k in ("stack", "seq_len", "round", "fits", "median_ms", "tokens_per_s", "peak_bytes",
                                     "attention_kernel", "optimizer")}
    print(json.dumps(short), flush=True)
    return row


def make_init(args, hf: dict, path: Path) -> str:
    """The initial checkpoint, made in a child process: the driver never holds device memory (12 GiB of
    a 3B-parameter model's init cached in the driver shrank what the workers could use); the GPU's name."""
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); import step_stacks; "
            "cpu = sys.argv[4] == '1'; step_stacks.make_init_checkpoint(json.loads(sys.argv[2]), sys.argv[3], "
            "'cpu' if cpu else 'cuda'); print('cpu' if cpu else torch.cuda.get_device_name(0))")
    proc = subprocess.run([sys.executable, "-c", code, str(HERE), json.dumps(hf), str(path), str(int(args.cpu_smoke))],
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip().splitlines()[-1].replace("NVIDIA ", "").replace(" ", "-").lower()


def merge(paths: list[Path], out: Path, target: float) -> dict:
    """One result file from several of the same measured code (commit), model, device and GPU count:
    the header of the first, every file's rows, the comparison recomputed over them."""
    runs = [json.loads(p.read_text()) for p in paths]
    keys = ("commit", "model", "layers", "device", "gpus", "torch")
    for p, run in zip(paths[1:], runs[1:]):
        if any(run.get(k) != runs[0].get(k) for k in keys) or run.get("dirty") or runs[0].get("dirty"):
            raise ValueError(f"--merge: {p} differs from {paths[0]} in {keys} or was measured on a dirty tree")
    rows = [r for run in runs for r in run["rows"]]
    report = {**runs[0], "rows": rows, "comparison": compare(rows, target), "merged_dates": [r["date"] for r in runs],
              "merged_notes": [r.get("note", "") for r in runs],  # each part's own (the header keeps the first's)
              "longest_fit": {st: max([r["seq_len"] for r in rows if r["stack"] == st and r.get("fits")], default=None)
                              for st in dict.fromkeys(r["stack"] for r in rows)}}
    out.mkdir(parents=True, exist_ok=True)
    name = f"training_step_{report['model']}_{report['device']}_x{report['gpus']}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print("wrote", out / name)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-lens", default="32768,65536,131072")
    ap.add_argument("--steps", type=int, default=20, help="timed steps at the first length (loss agreement)")
    ap.add_argument("--long-steps", type=int, default=5, help="timed steps at the other lengths")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--longest", default="", help="lengths to try beyond --seq-lens for the longest fit")
    ap.add_argument("--probe-warmup-len", type=int, default=4096,
                    help="a longest-fit probe's warmup step runs this many tokens (it creates the optimizer state "
                         "and compiles), then one step at the probed length; 0: the warmup at that length too")
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--rounds", type=int, default=None,
                    help="each length runs the stacks interleaved this many times (peer, ours, peer, ours, ...); "
                         "default 2 (--cpu-smoke: 1)")
    ap.add_argument("--target", type=float, default=TARGET, help="the speed ratio over the peer a row is judged by")
    ap.add_argument("--merge", default="",
                    help="comma-separated result files of one commit, model, device and GPU count (runs split "
                         "over several calls): their rows as one file in --out, the comparison recomputed")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--profile-len", type=int, default=32768)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--note", default="", help="how the run was made: kept in the result")
    ap.add_argument("--port-base", type=int, default=29500,
                    help="a one-GPU worker's rendezvous port is this plus seq_len %% 997: runs side by side on one "
                         "host, one per GPU, need bases at least 1000 apart")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-len", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.merge:
        return merge([Path(p) for p in args.merge.split(",") if p], Path(args.out), args.target)
    args.rounds = (1 if args.cpu_smoke else 2) if args.rounds is None else args.rounds
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.cpu_smoke:
        args.model = args.model if args.model.endswith("tiny") else "qwen3-moe-tiny"
        from bumblebee.models import NAMED
        args.layers = len(NAMED[args.model].get("layer_types") or ()) or NAMED[args.model]["num_hidden_layers"]
        # --gpus N: N gloo ranks (ours with EP = N)
        args.seq_lens, args.steps, args.long_steps, args.warmup, args.profile_len = "64", 3, 2, 1, 64
        args.probe_warmup_len = min(args.probe_warmup_len, 32)
        args.stacks = ",".join("transformers" if st == "transformers+liger" else st for st in args.stacks.split(","))
    stacks = args.stacks.split(",")
    lens = [int(s) for s in args.seq_lens.split(",") if s]
    hf = hf_slice(args.model, args.layers, args.cpu_smoke)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp_dir = tempfile.TemporaryDirectory(prefix="bench_step_")
    tmp = Path(tmp_dir.name)
    gpu = make_init(args, hf, tmp / "init")
    name = f"training_step_{args.model}_{gpu}_x{args.gpus}{args.tag}.json"

    def write() -> dict:  # after every row: a run cut short still leaves the rows it measured
        report = {**stamp(), "benchmark": "training_step", "model": args.model, "layers": args.layers,
                  "gpus": args.gpus, "hf_config": hf, "device": gpu, "rows": rows,
                  "rounds": args.rounds, "comparison": compare(rows, args.target), "note": args.note,
                  "longest_fit": {st: max([r["seq_len"] for r in rows if r["stack"] == st and r.get("fits")],
                                          default=None) for st in dict.fromkeys(r["stack"] for r in rows)}}
        (out / name).write_text(json.dumps(report, indent=1))
        return report
    with tmp_dir:
        for s in lens:
            for r in range(args.rounds):  # interleaved: machine drift weighs on both stacks alike
                for stack in stacks:
                    rows.append(launch(args, stack, s, args.steps if s == lens[0] else args.long_steps,
                                       s == args.profile_len and r == 0, tmp, round_=r))
                    write()
        for stack in stacks:  # the longest fit: stop at the first length that does not
            for s in [int(x) for x in args.longest.split(",") if x]:
                r = launch(args, stack, s, 1, False, tmp, warmup=1, warmup_len=args.probe_warmup_len)
                r.update(longest_probe=True, warmup_len=args.probe_warmup_len)
                rows.append(r)
                write()
                if not r.get("fits"):
                    break
    report = write()
    print(json.dumps({"comparison": report["comparison"], "longest_fit": report["longest_fit"]}, indent=1))
    print("wrote", out / name)


if __name__ == "__main__":
    main()
