"""moe_dispatch on 2 GPUs (EP = 2): the no-chunk all_to_all twin vs the chunked primitive (C = 2, 3, 4).

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/bench.py --out DIR

One MoE layer's dispatch + SwiGLU experts + combine, forward and backward, in bf16, with
Qwen3.5-35B-A3B sizes: hidden 2048, 256 experts (128 per rank), top-8, expert width 512; tokens per
rank 4K, 8K, 16K, 24K, 32K, 64K, uniform random routing (fixed seed, the same for every
implementation). Fixed iteration counts on every rank (no adaptive timing around collectives).
Per shape it also times the twin's four all_to_alls alone (same splits, same bytes) and derives
    hidden fraction of the all_to_all = (t_twin - t_chunked) / t_all_to_all_alone
(the twin runs communication and compute back to back, so t_twin - t_a2a is its compute time).
Where megatron-core imports, its MoEAlltoAllTokenDispatcher (same experts) is timed as an anchor.
C = 1 (the primitive's kernels, no overlap) separates the overlap from kernel gains; unequal chunk
sizes (1, 2, 1) and (1, 2) shorten the exposed first/last exchanges; "auto" is the primitive's
default (one chunk below AUTO_MIN_TOKENS tokens on every rank, else (1, 2)); C = 2 and (1, 2) are repeated
with 0, 16 and 32 SMs carved out of the overlapped grouped GEMMs for NCCL (the primitive's SM_CARVEOUT). C = 2 under full recompute
(torch.utils.checkpoint over the layer) is timed at one size. One C = 2 and one twin layer are
profiled at 16K and 4K tokens (kernel totals, stream occupancy); the 16K C = 2 timeline is drawn.

`--rounds R` times the twin and every chunking interleaved (R rounds, each row once per round, the
iterations spread over the rounds), so that a row's place in the run order does not favour it; the
default (1) times them one after the other, as the committed EP = 2 results were.

Writes DIR/moe_dispatch.json, DIR/moe_dispatch_trace.png (and the raw chrome trace).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bumblebee import registry
from bumblebee.models.moe import GroupedExperts
from bumblebee import options
from bumblebee.primitives.moe_dispatch_options import AUTO_CHUNKS, AUTO_MIN_TOKENS, ChunkedDispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing, siblings
from timing import interleaved_median_ms, step_median_ms, step_times_ms  # noqa: E402

D, E, K, I = 2048, 256, 8, 512
TOKENS = [4096, 8192, 16384, 24576, 32768, 65536]
CHUNKS = [1, 2, 3, 4]  # C = 1: the primitive's kernels without overlap (separates overlap from kernel gains)
UNEQUAL = [(1, 2, 1), (1, 2)]  # smaller first/last chunks shorten the exchanges that stay exposed
DEFAULT = ["auto"]  # the primitive's default
CARVEOUTS = [0, 16, 32]  # SMs the overlapped grouped GEMMs leave to NCCL (the primitive's SM_CARVEOUT)
CARVEOUT_CHUNKS = [2, (1, 2)]
WARMUP, ITERS = 3, 10
SINGLES: list = []


def inputs(N, rank, device, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn(N, D, generator=g).to(device, dtype)
    logits = torch.randn(N, E, generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(device), idx.to(device)


def make_experts(group, device):
    torch.manual_seed(0)
    ex = GroupedExperts(E, D, I, ep_group=group).to(device, torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)
        ex.down_proj.normal_(0, 0.02)
    return ex


def spec_name(chunks) -> str:
    if isinstance(chunks, str):
        return chunks
    return f"c{chunks}" if isinstance(chunks, int) else "-".join(map(str, chunks))


def chunk_configs():
    """(name, chunks, SM carveout) of every chunked row: the default carveout, then the sweep."""
    out = [(spec_name(c), c, None) for c in CHUNKS + UNEQUAL + DEFAULT]
    return out + [(f"{spec_name(c)}_sm{sm}", c, sm) for sm in CARVEOUTS for c in CARVEOUT_CHUNKS]


def chunked(sm):
    """The primitive with `sm_carveout=sm` (None: its default)."""
    return ChunkedDispatch() if sm is None else ChunkedDispatch(sm_carveout=sm)


def _barrier(group):
    """Run before every timed call (warm-ups too) by the timers below (CUDA events through timing.py;
    perf_counter on the CPU), which the probes reuse."""
    return lambda: dist.barrier(group=group)


def timed(step, group):
    """Median ms of `step` over ITERS after WARMUP; every rank runs the same count."""
    return step_median_ms(step, ITERS, WARMUP, before=_barrier(group))


def interleaved(steps: dict, group, rounds: int) -> dict:
    """{name: median ms} of several steps timed in `rounds` rounds, every step once per round in the
    same order (ITERS spread over the rounds), so that run order and allocator state weigh on all alike."""
    return interleaved_median_ms(steps, ITERS, WARMUP, rounds, before=_barrier(group))


def step_times(step, group, warmup, iters):
    """ms of each of `iters` calls of `step` after `warmup` calls; every rank runs the same count."""
    return step_times_ms(step, iters, warmup, before=_barrier(group))


def layer_step(name, x, w, idx, experts, chunks=None, recompute=False):
    fn = registry.resolve("moe_dispatch", name)
    kw = {} if chunks is None else {"chunks": chunks}
    g_out = torch.ones_like(x)

    def step():
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        if recompute:
            y = torch.utils.checkpoint.checkpoint(lambda a, b: fn(a, b, idx, experts, E, **kw), xs, ws,
                                                  use_reentrant=False)
        else:
            y = fn(xs, ws, idx, experts, E, **kw)
        y.backward(g_out)
        experts.gate_up_proj.grad = experts.down_proj.grad = None
    return step


def top_kernels(prof, n=25):
    """The n GPU kernels with the most device time in one profiled step: [name, total ms, calls]."""
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"total_kernel_ms": total, "top": [[k[:90], round(ms, 3), c] for k, ms, c in rows[:n]]}


def stream_stats(trace_json: Path):
    """From a chrome trace: span of all kernels and per-stream summed kernel time (NCCL apart), ms."""
    ks = [e for e in json.loads(trace_json.read_text())["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    if not ks:
        return {}
    busy: dict = {}
    grids = sorted({str(e["args"].get("grid")) for e in ks if "nccl" in e["name"].lower()})
    for e in ks:
        key = f"stream {e['args'].get('stream', 0)} {'nccl' if 'nccl' in e['name'].lower() else 'compute'}"
        busy[key] = busy.get(key, 0.0) + e["dur"] / 1e3
    span = (max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)) / 1e3
    return {"kernel_span_ms": round(span, 3), "kernel_ms_by_stream": {k: round(v, 3) for k, v in busy.items()},
            "nccl_kernel_grids": grids}


def profile_layer(step, rank, out: Path, picture=False):
    """One profiled step after two warm-ups (every rank runs it): top kernels and stream occupancy on
    rank 0; with `picture`, rank 0 also writes the chrome trace and its timeline picture."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    res = top_kernels(prof)
    if rank == 0:
        tj = out / ("moe_dispatch_trace.json" if picture else "profile_tmp_trace.json")
        prof.export_chrome_trace(str(tj))
        res.update(stream_stats(tj))
        if picture:
            try:
                trace_picture(tj, out / "moe_dispatch_trace.png",
                              f"chunked dispatch, C = 2, 16K tokens/rank, EP = {dist.get_world_size()}: "
                              "forward then backward")
            except Exception as e:  # noqa: BLE001
                print(f"trace picture failed: {e}", flush=True)
        else:
            tj.unlink()
    dist.barrier()
    return res


def a2a_alone(x, idx, group, EP):
    """The twin's 4 exchanges (dispatch, combine, and their backward) with its split sizes."""
    L = E // EP
    counts = torch.bincount(idx.reshape(-1), minlength=E).view(EP, L).sum(1)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    send, got = counts.tolist(), recv.tolist()
    src = torch.empty(sum(send), D, device=x.device, dtype=x.dtype).normal_()
    dst = torch.empty(sum(got), D, device=x.device, dtype=x.dtype)

    def step():
        for _ in range(2):
            dist.all_to_all_single(dst, src, got, send, group=group)
            dist.all_to_all_single(src, dst, send, got, group=group)
    return step


def megatron_step(x, w, idx, experts, group, rank, EP):
    """megatron-core's all-to-all token dispatcher with our grouped experts; None if it cannot run."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
        cfg = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=16, num_moe_experts=E,
                                moe_router_topk=K, moe_ffn_hidden_size=I, expert_model_parallel_size=EP,
                                moe_token_dispatcher_type="alltoall", bf16=True, params_dtype=torch.bfloat16,
                                add_bias_linear=False)
        pgs = ProcessGroupCollection(ep=group, expt_tp=SINGLES[rank], tp_ep=group)
        L = E // EP
        disp = MoEAlltoAllTokenDispatcher(L, list(range(rank * L, (rank + 1) * L)), cfg, pg_collection=pgs)
        routing_map = torch.zeros(x.shape[0], E, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
        probs_full = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device)

        def step():
            xs = x.detach().requires_grad_()
            probs = probs_full.scatter(1, idx, w.detach())
            h, p = disp.dispatch_preprocess(xs, routing_map, probs)
            h, p = disp.token_dispatch(h, p)
            h, tpe, p = disp.dispatch_postprocess(h, p)
            tpe = torch.as_tensor(tpe, device=x.device)
            y = experts(h, tpe) * p.unsqueeze(-1).to(h.dtype)
            y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))
            y.backward(torch.ones_like(y))
            experts.gate_up_proj.grad = experts.down_proj.grad = None
        step()
        why = None
    except Exception as e:  # noqa: BLE001  (an anchor that cannot run is reported, not fatal)
        step, why = None, f"{type(e).__name__}: {e}"[:300]
    ok = torch.tensor([0 if why else 1], device=x.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # time it only where it ran on every rank
    return (step if ok.item() else None), why or (None if ok.item() else "failed on another rank")


def equality_check(group, device, experts, N=3001):
    """bf16 chunked (C = 1..4, streams on) vs the twin at EP = 2: max relative error of the output and
    the input, routing-weight and expert-weight gradients (expect bf16 noise, ~1e-2 at most)."""
    x, w, idx = inputs(N, dist.get_rank(), device, experts.gate_up_proj.dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(device, x.dtype)

    def run(name, chunks=None):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        kw = {} if chunks is None else {"chunks": chunks}
        y = registry.resolve("moe_dispatch", name)(xs, ws, idx, experts, E, **kw)
        y.backward(g)
        out = [y.detach(), xs.grad, ws.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
        experts.gate_up_proj.grad = experts.down_proj.grad = None
        return out

    ref = run("all_to_all")
    res = {}
    for c in (1, 2, 3, 4, (1, 3)):
        got = run("chunked", c)
        res[str(c)] = max(((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item()
                          for a, b in zip(got, ref))
    return res


def trace_picture(trace_json: Path, png: Path, title: str):
    """Kernel timeline per CUDA stream from a chrome trace: NCCL kernels orange, GEMMs blue."""
    events = json.loads(trace_json.read_text())["traceEvents"]
    ks = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not ks:
        return
    t0 = min(e["ts"] for e in ks)
    streams = sorted({e["args"].get("stream", 0) for e in ks})
    rows = {s: i for i, s in enumerate(streams)}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(16, 1.2 + 0.6 * len(streams)))
    for e in ks:
        name = e["name"].lower()
        gemm = any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "grouped_mm"))
        color = "tab:orange" if "nccl" in name else ("tab:blue" if gemm else "tab:gray")
        ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (rows[e["args"].get("stream", 0)] - 0.4, 0.8),
                       color=color)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("ms (orange: NCCL all_to_all, blue: GEMMs, gray: other kernels)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the twin and every chunking interleaved, in this many rounds (1: one after the other)")
    ap.add_argument("--nccl-normal-priority", action="store_true", help="NCCL streams at normal priority")
    ap.add_argument("--smoke", action="store_true", help="CPU gloo, tiny shapes, fp32: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    opts = None
    if hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = not args.nccl_normal_priority  # NCCL kernels ahead of queued GEMM blocks
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=torch.device("cuda", rank),
                            pg_options=opts)
    group, EP, device = dist.group.WORLD, dist.get_world_size(), torch.device("cuda", rank)
    experts = make_experts(group, device)
    global SINGLES
    SINGLES = [dist.new_group([r]) for r in range(EP)]  # expert tensor parallel of one rank (all ranks make all)
    rows = []
    check = equality_check(group, device, experts)
    if rank == 0:
        print(json.dumps({"check": check}), flush=True)
    for N in map(int, args.tokens.split(",")):
        x, w, idx = inputs(N, rank, device)
        row = {"tokens_per_rank": N, "ep": EP}
        row["all_to_all_alone_ms"] = timed(a2a_alone(x, idx, group, EP), group)
        steps = {"twin_ms": layer_step("all_to_all", x, w, idx, experts)}
        steps.update({f"chunked_{name}_ms": layer_step(chunked(sm), x, w, idx, experts, chunks=c)
                      for name, c, sm in chunk_configs()})
        if args.rounds > 1:
            row.update(interleaved(steps, group, args.rounds))
        else:  # one after the other, each WARMUP + ITERS calls
            for key, step in steps.items():
                row[key] = timed(step, group)
        names = [name for name, _, _ in chunk_configs()]
        row["best_chunks"] = min(names, key=lambda n: row[f"chunked_{n}_ms"])
        row["speedup_pct"] = {n: 100 * (row["twin_ms"] / row[f"chunked_{n}_ms"] - 1) for n in names}
        row["hidden_a2a_fraction"] = {n: (row["twin_ms"] - row[f"chunked_{n}_ms"]) / row["all_to_all_alone_ms"]
                                      for n in names}
        # overlap alone: the same kernels at C = 1 against C chunks
        row["hidden_a2a_fraction_vs_c1"] = {n: (row["chunked_c1_ms"] - row[f"chunked_{n}_ms"])
                                            / row["all_to_all_alone_ms"] for n in names if n != "c1"}
        row["exposed_a2a_fraction_of_twin"] = row["all_to_all_alone_ms"] / row["twin_ms"]
        if N == 16384:
            row["chunked_c2_recompute_ms"] = timed(layer_step("chunked", x, w, idx, experts, chunks=2,
                                                              recompute=True), group)
            row["twin_recompute_ms"] = timed(layer_step("all_to_all", x, w, idx, experts, recompute=True), group)
        step, why = (None, "--no-megatron") if args.no_megatron else megatron_step(x, w, idx, experts, group, rank, EP)
        row["megatron_alltoall_ms"] = timed(step, group) if step is not None else None
        if why:
            row["megatron_skipped"] = why
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del x, w, idx
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    breakdown = {}
    for N in (16384, 4096):  # 16K: the picture; 4K: where chunking loses most
        x, w, idx = inputs(N, rank, device)
        for name, c in (("chunked_c2", 2), ("twin", None)):
            impl = "all_to_all" if c is None else "chunked"
            breakdown[f"{name}_{N // 1024}K"] = profile_layer(layer_step(impl, x, w, idx, experts, chunks=c), rank, out,
                                                            picture=(N == 16384 and c == 2))
        del x, w, idx
    if rank == 0:
        from stamp import stamp
        result = {
            **stamp(device), "slot": "moe_dispatch", "gpus": EP,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "nccl_high_priority_stream": not args.nccl_normal_priority,
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
            "chunked_config": options.record(ChunkedDispatch()),
            "auto_chunks": AUTO_CHUNKS, "auto_min_tokens_by_ep": AUTO_MIN_TOKENS,
            "shape": {"hidden": D, "experts": E, "experts_per_rank": E // EP, "top_k": K, "expert_width": I,
                      "dtype": "bfloat16", "routing": "uniform random top-8"},
            "iterations": {"warmup": WARMUP, "timed": ITERS, "statistic": "median", "rounds": args.rounds},
            "check_chunked_vs_twin_rel_err": check,
            "rows": rows,
            "kernel_breakdown_rank0": breakdown,
        }
        (out / "moe_dispatch.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def smoke():
    global D, E, K, I, WARMUP, ITERS
    D, E, K, I, WARMUP, ITERS = 64, 8, 2, 32, 1, 2
    dist.init_process_group("gloo")
    group, EP, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    global SINGLES
    SINGLES = [dist.new_group([r]) for r in range(EP)]
    device = torch.device("cpu")
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, I, ep_group=group)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    check = equality_check(group, device, experts, N=77)
    if rank == 0:
        print(json.dumps({"check": check}), flush=True)
    for N in (64, 96):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(N, D, generator=g)
        w, idx = torch.topk(torch.softmax(torch.randn(N, E, generator=g), -1), K, dim=-1)
        row = {"tokens": N, "a2a": timed(a2a_alone(x, idx, group, EP), group),
               "twin": timed(layer_step("all_to_all", x, w, idx, experts), group),
               "c2_recompute": timed(layer_step("chunked", x, w, idx, experts, chunks=2, recompute=True), group)}
        for name, c, sm in chunk_configs():
            row[name] = timed(layer_step(chunked(sm), x, w, idx, experts, chunks=c), group)
        row.update({f"interleaved_{k}": v for k, v in interleaved(  # the --rounds path
            {"twin": layer_step("all_to_all", x, w, idx, experts),
             "c1": layer_step("chunked", x, w, idx, experts, chunks=1)}, group, 2).items()})
        step, why = megatron_step(x, w, idx, experts, group, rank, EP)
        row["megatron"] = timed(step, group) if step is not None else why
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
