"""One composed training step with every primitive: a Qwen3.5-35B-A3B slice, FSDP2 x chunked EP.

    torchrun --nproc_per_node 2 benchmarks/composed_step/bench.py --out DIR
    torchrun --nproc_per_node 2 benchmarks/composed_step/bench.py --seq-lens 32768,65536 --out DIR
    torchrun --nproc_per_node 2 benchmarks/composed_step/bench.py --cpu-smoke   # gloo, tiny config

The slice keeps every size of qwen3.5-35b-a3b (hidden 2048, 256 experts of 512, top-8 + a shared
expert, 16/2 attention heads of 256, 16/32 DeltaNet heads of 128, vocabulary 248320, untied head)
and `--layers` decoder layers (default 4: three gated-DeltaNet layers and one gated-attention
layer, the model's 3:1 pattern). Slots: linear_attention `fla`, attention `sdpa` (cuDNN),
cross_entropy `linear_ce`, moe_dispatch `chunked` (EP = world size by default), state_sharding
`fsdp2` (dense parameters over all ranks, experts over efsdp = world / EP), full activation
recompute, bf16 compute with fp32 master weights and AdamW. One micro-batch of `seq_len` tokens per
rank, each rank its own random tokens.

Per sequence length (increasing; the sweep ends at the first one that does not fit, and the ones
measured before it are already written): median step time over a fixed number of steps (every rank
runs the same steps), tokens/s over all ranks, model TFLOP/s per GPU (3x the forward FLOPs below,
the recompute not counted) and the executed rate (4x, recompute counted), peak and static memory
(max over ranks; `optimizer_state_at_peak`: whether a step with AdamW's moments was measured), the
memory estimator's peak for the same layout (`estimate_peak_GiB`, its optimizer term apart), and the
bf16 8192^3 matmul rate measured in the same process.

Forward FLOPs per token: 2 x every matmul weight a token passes through (the routed experts scaled by
top-k / E; the router, the shared expert and its gate, DeltaNet projections and its short conv, the
LM head; not the embedding), plus causal attention 2 x heads x head_dim x S per full-attention
layer and MTP block (QK^T and PV over S/2 keys on average), plus 4 x value heads x d_k x d_v per
DeltaNet layer (state update and read-out of the recurrent form; the chunked kernels' intra-chunk
work is not counted). The config's MTP depth (one full-attention MoE block, and the head once more)
is part of the step and of the count.

Writes DIR/composed_step.json (rows so far, rewritten after each length); with --profile-len S, also
the top kernels of one profiled step at S (rank 0's view; the profile does not enter the timings).

`--cp N` (context parallelism, `primitives/context_parallel`): each sequence of `seq_len` tokens is
sharded over N ranks (its layers' cp forms, `--cp-exchange`, `--cp-deltanet`), dp = world / N sequences a step, dense
state sharded over all ranks, experts over EP ranks adjacent inside a cp group; tokens/s counts dp x
seq_len. `seq_len` is then the whole sequence's length. Before each length the file records it as
`unfinished_seq_len` and clears it after its row: a run that dies there (out of memory) leaves the
length it could not train, which brackets the longest fit with the last row (rank 0's own
out-of-memory error is recorded as `did_not_fit`; the log says which rank ran out).
"""
from __future__ import annotations

import sys
import argparse
import datetime
import gc
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing, siblings
from siblings import load
state_sharding_bench = load("state_sharding")
build_on_device = state_sharding_bench.build_on_device
from stamp import stamp
from timing import matmul_tflops, step_times_ms, sync

MODEL = "qwen3.5-35b-a3b"
IMPL = {"linear_attention": "fla", "attention": "sdpa", "cross_entropy": "linear_ce", "moe_dispatch": "chunked"}


def forward_flops_per_token(model, hf: dict, seq_len: int) -> dict:
    """The formula of the module docstring, from the unsharded model's parameters and its config.
    MTP depths count like decoder layers (a full-attention block each) and use the head once more."""
    E, k = hf["num_experts"], hf["num_experts_per_tok"]
    c = model.config
    mtp = getattr(c, "mtp_num_hidden_layers", 0) or 0
    weights = mtp * model.lm_head.weight.numel()  # the shared head, once per MTP depth
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        routed = ".experts." in name and p.dim() == 3 and p.shape[0] == E
        weights += p.numel() * (k / E if routed else 1.0)
    types = c.layer_types
    attn = 2 * c.num_attention_heads * c.head_dim * seq_len * (types.count("full_attention") + mtp)
    delta = 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim \
        * types.count("linear_attention")
    return {"matmul_weights": weights, "total": 2 * weights + attn + delta, "attention": attn, "deltanet": delta}


def memory_estimate(hf: dict, args, world: int, ep: int, seq_len: int, mixed: str, device, fused: bool) -> dict:
    """The memory estimator's peak for this run's layout (`bumblebee.tools.memory`), written beside
    the measured one so each row carries the estimator's error at its commit. Its optimizer term is
    what the peak of a run of one step lacks (`optimizer_state_at_peak` false)."""
    from bumblebee.tools import memory
    est = memory.estimate(hf, memory.Parallel(dp=world, ep=ep, cp=args.cp, cp_exchange=args.cp_exchange,
                                              cp_deltanet=args.cp_deltanet,
                                              seq_len=seq_len, mixed_precision=mixed, device=device.type,
                                              moe_fused_recompute=fused))
    return {"estimate_peak_GiB": est.peak / 2 ** 30, "estimate_optimizer_GiB": est.optimizer / 2 ** 30}


def step_loss(model, cp_group, depths: int):
    """ids [1, seq_len] -> the step's loss: the model's own, or under cp this rank's share of it
    (scaled for FSDP2's mean over the ranks, `cp_model.loss(..., grads="mean")`)."""
    if cp_group is None:
        return lambda ids: model(ids, labels=ids).loss
    from bumblebee.primitives.context_parallel import layout, model as cp_model
    return lambda ids: cp_model.loss(model, layout.shard_batch(ids, None, cp_group, mtp_depths=depths), grads="mean")


def measure(state, seq_len, args, device, rank, world, loss_of, seed_rank) -> dict:
    """Median step time and memory at one length; every rank runs the same steps and collectives.
    seed_rank: the rank's batch stream (a cp group's ranks share one sequence)."""
    g = torch.Generator(device=device).manual_seed(100 + seed_rank)
    batches = [torch.randint(0, state.model.config.vocab_size, (1, seq_len), device=device, generator=g)
               for _ in range(2)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    static, last = 0, {}
    count = iter(range(args.warmup + args.steps))

    def before():  # every rank at the barrier, the device idle: outside the timed step
        last["ids"] = batches[next(count) % len(batches)]
        dist.barrier()
        sync(device)

    def step():  # one training step, timed on the host clock up to the device's end
        out = loss_of(last["ids"])
        out.backward()
        last["ok"], last["norm"], _ = state.step()
        sync(device)
        last["loss"] = out.detach()

    def after(i):
        nonlocal static
        if i == 0 and device.type == "cuda":
            static = torch.cuda.memory_allocated(device)  # params, grads, optimizer state all exist now
        state.zero_grad()

    times = step_times_ms(step, args.steps, args.warmup, before=before, after=after, cuda=False)
    loss, norm, ok = float(last["loss"]), last["norm"], last["ok"]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    stats = torch.tensor([statistics.median(times), static, peak, reserved], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank's time, the largest rank's memory
    return {"seq_len": seq_len, "median_ms": float(stats[0]), "static_GiB": float(stats[1]) / 2 ** 30,
            "peak_GiB": float(stats[2]) / 2 ** 30, "reserved_GiB": float(stats[3]) / 2 ** 30,
            "last_loss": loss, "last_grad_norm": norm, "last_step_ok": ok,
            # the first step's backward runs before AdamW's moments exist (made by its first step()):
            # with one step in all, the peak lacks them and a second step needs that much more
            "optimizer_state_at_peak": args.warmup + args.steps >= 2,
            "step_times_ms": [round(t, 2) for t in times]}


def profile_step(state, seq_len, device, loss_of, seed_rank, n=30) -> dict:
    """One profiled step (after the timed ones): the n kernels with the most device time on this rank,
    [name, ms, calls], and the total; every rank runs it (collectives inside)."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator(device=device).manual_seed(200 + seed_rank)
    ids = torch.randint(0, state.model.config.vocab_size, (1, seq_len), device=device, generator=g)
    cuda = device.type == "cuda"  # the CPU smoke ranks host ops by their CPU time instead
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        loss_of(ids).backward()
        state.step()
        sync(device)
    state.zero_grad()
    rows = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3, e.count)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    return {"seq_len": seq_len, "kernel_ms_total": sum(r[1] for r in rows),
            "top": [[k[:100], round(ms, 2), c] for k, ms, c in rows[:n]]}


def report_name(cp: int) -> str:
    return "composed_step.json" if cp == 1 else f"composed_step_cp{cp}.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-lens", default="32768,65536,131072,196608")
    ap.add_argument("--ep", type=int, default=0, help="expert parallel size (default: the world size)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel size (a sequence over this many ranks)")
    ap.add_argument("--cp-exchange", default="allgather", help="attention's cp exchange: allgather or ring")
    ap.add_argument("--cp-deltanet", default="maps", choices=["maps", "fla"],
                    help="gated DeltaNet under cp (ContextParallel.deltanet): maps or fla's own CP kernels")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--profile-len", type=int, default=0,
                    help="also profile one step at this length (one of --seq-lens) and store its top kernels")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo, qwen3.5-moe-tiny, fp32: checks the script")
    args = ap.parse_args()

    # the CPU smoke shares 2 loaded cores with the test suite: a peer may lag minutes behind a collective
    wait = datetime.timedelta(minutes=50 if args.cpu_smoke else 3)
    dist.init_process_group("gloo" if args.cpu_smoke else "nccl", timeout=wait)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu_smoke:
        device, name, impl = torch.device("cpu"), "qwen3.5-moe-tiny", {**IMPL, "linear_attention": "torch_chunked"}
        lens, mixed = [64, 128], "fp32"
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, name, impl, mixed = torch.device("cuda", local), MODEL, IMPL, "bf16"
        lens = [int(s) for s in args.seq_lens.split(",")]
    ep = args.ep or world
    if world % ep:
        raise ValueError(f"--ep {ep} must divide the world size {world}")
    if args.cp < 1 or world % args.cp:
        raise ValueError(f"--cp {args.cp} must be a positive divisor of the world size {world}")
    from torch.distributed.device_mesh import init_device_mesh
    from bumblebee.primitives.context_parallel import model as cp_model
    if args.cp > 1:  # (dp, cp): dense state over every rank, experts over ep ranks inside a cp group first
        cp_mesh = cp_model.mesh(device.type, world // args.cp, args.cp, timeout=wait)
        mesh, ep_mesh = cp_model.data_mesh(cp_mesh), cp_model.expert_mesh(cp_mesh, ep, over="cp", timeout=wait)
        cp_group, seed_rank = cp_mesh["cp"].get_group(), cp_mesh.get_local_rank("dp")
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        ep_mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        cp_group, seed_rank = None, rank
    rate = matmul_tflops(device=device) if device.type == "cuda" else None

    from bumblebee import registry
    from bumblebee.parallelize import shard_experts
    model, hf = build_on_device(name, args.layers, impl, device)
    n_params = sum(p.numel() for p in model.parameters())
    flops = {s: forward_flops_per_token(model, hf, s) for s in lens}
    shard_experts(model, ep_mesh["ep"].get_group())
    model.set_recompute(True)
    if cp_group is not None:
        cp_model.apply(model, cp_group, cp_model.ContextParallel(exchange=args.cp_exchange, deltanet=args.cp_deltanet))
    loss_of = step_loss(model, cp_group, len(model.mtp.layers) if hasattr(model, "mtp") else 0)
    state = registry.resolve("state_sharding", "fsdp2")(model, mesh, lr=1e-4, weight_decay=0.1, grad_clip=1.0,
                                                         mixed_precision=mixed, ep_mesh=ep_mesh)
    report = {
        **stamp(device), "slot": "composed_step", "world_size": world, "ep": ep, "cp": args.cp,
        "cp_exchange": args.cp_exchange if args.cp > 1 else None,
        "cp_deltanet": args.cp_deltanet if args.cp > 1 else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)",
        "model": name, "layers": args.layers, "layer_types": list(model.config.layer_types), "params": n_params,
        "impl": {**impl, "state_sharding": "fsdp2", "recompute": "full", "mixed_precision": mixed,
                 "moe_fused_recompute": model.impl_configs().get("moe_dispatch", {}).get("fused_recompute", False)},
        # every slot the model uses, with its options
        "impl_configs": {**model.impl_configs(), "state_sharding": registry.record("state_sharding", "fsdp2")},
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "matmul_tflops_bf16_8192": rate,
        "iterations": {"warmup": args.warmup, "timed": args.steps, "statistic": "median, slowest rank"},
        "rows": [],
    }
    out = Path(args.out)

    def write():
        if rank == 0 and not args.cpu_smoke:
            out.mkdir(parents=True, exist_ok=True)
            (out / report_name(args.cp)).write_text(json.dumps(report, indent=1))
    for s in lens:
        report["unfinished_seq_len"] = s
        write()
        try:
            row = measure(state, s, args, device, rank, world, loss_of, seed_rank)
        except torch.OutOfMemoryError as e:  # rank 0's own: recorded; another rank's ends the run unrecorded
            report["did_not_fit"] = {"seq_len": s, "rank": rank, "error": str(e)[:400]}
            write()
            raise
        f = flops[s]
        row["tokens_per_s"] = world // args.cp * s / (row["median_ms"] / 1e3)
        row["forward_gflop_per_token"] = f["total"] / 1e9
        row["model_tflops_per_gpu"] = 3 * f["total"] * s / args.cp / (row["median_ms"] / 1e3) / 1e12
        row["executed_tflops_per_gpu"] = 4 * f["total"] * s / args.cp / (row["median_ms"] / 1e3) / 1e12
        row["attention_share_of_flops"] = f["attention"] / f["total"]
        row.update(memory_estimate(hf, args, world, ep, s, mixed, device, report["impl"]["moe_fused_recompute"]))
        report["rows"].append(row)
        if s == args.profile_len:
            report["profile"] = profile_step(state, s, device, loss_of, seed_rank)
            if rank == 0:
                print(json.dumps({"profile_top": report["profile"]["top"][:5]}), flush=True)
        report["unfinished_seq_len"] = None
        write()
        if rank == 0:
            print(json.dumps(row), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
