"""moe_dispatch on 2 GPUs (EP = 2): the no-chunk all_to_all twin vs the chunked primitive (C = 2, 3, 4).

    torchrun --nproc_per_node 2 benchmarks/bench_moe_dispatch.py --out DIR

One MoE layer's dispatch + SwiGLU experts + combine, forward and backward, in bf16, with
Qwen3.5-35B-A3B sizes: hidden 2048, 256 experts (128 per rank), top-8, expert width 512; tokens per
rank 4K, 8K, 16K, 32K, 64K, uniform random routing (fixed seed, the same for every
implementation). Fixed iteration counts on every rank (no adaptive timing around collectives).
Per shape it also times the twin's four all_to_alls alone (same splits, same bytes) and derives
    hidden fraction of the all_to_all = (t_twin - t_chunked) / t_all_to_all_alone
(the twin runs communication and compute back to back, so t_twin - t_a2a is its compute time).
Where megatron-core imports, its MoEAlltoAllTokenDispatcher (same experts) is timed as an anchor.
C = 2 under full recompute (torch.utils.checkpoint over the layer) is timed at one size, and one
C = 2 layer at 16K tokens is profiled; its kernel timeline (compute and comm streams) is drawn.

Writes DIR/moe_dispatch.json, DIR/moe_dispatch_trace.png (and the raw chrome trace).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bumblebee import registry
from bumblebee.models.moe import GroupedExperts

D, E, K, I = 2048, 256, 8, 512
TOKENS = [4096, 8192, 16384, 32768, 65536]
CHUNKS = [2, 3, 4]
WARMUP, ITERS = 3, 10
SINGLES: list = []
ANCHOR = {4096: 7.8, 8192: 8.5, 16384: 12.9, 32768: 18.5, 65536: 24.0}  # published speedup %, no-chunk -> chunked


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


def timed(step, group):
    """Median ms of `step` over ITERS after WARMUP; every rank runs the same count."""
    times = []
    for i in range(WARMUP + ITERS):
        dist.barrier(group=group)
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
        else:  # --smoke on the CPU
            t = time.perf_counter()
            step()
            ms = 1e3 * (time.perf_counter() - t)
        if i >= WARMUP:
            times.append(ms)
    return statistics.median(times)


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
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--no-megatron", action="store_true")
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
        row["twin_ms"] = timed(layer_step("all_to_all", x, w, idx, experts), group)
        for c in CHUNKS:
            row[f"chunked_c{c}_ms"] = timed(layer_step("chunked", x, w, idx, experts, chunks=c), group)
        best = min(CHUNKS, key=lambda c: row[f"chunked_c{c}_ms"])
        row["best_chunks"] = best
        row["speedup_pct"] = {c: 100 * (row["twin_ms"] / row[f"chunked_c{c}_ms"] - 1) for c in CHUNKS}
        row["hidden_a2a_fraction"] = {c: (row["twin_ms"] - row[f"chunked_c{c}_ms"]) / row["all_to_all_alone_ms"]
                                      for c in CHUNKS}
        row["exposed_a2a_fraction_of_twin"] = row["all_to_all_alone_ms"] / row["twin_ms"]
        row["anchor_speedup_pct"] = ANCHOR.get(N)
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

    # one profiled C = 2 layer at 16K tokens (both ranks run it; rank 0 writes the trace)
    x, w, idx = inputs(16384, rank, device)
    step = layer_step("chunked", x, w, idx, experts, chunks=2)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    breakdown = {"chunked_c2": top_kernels(prof)}
    if rank == 0:  # the picture before another profiler runs: a new profiler clears these events
        tj = out / "moe_dispatch_trace.json"
        prof.export_chrome_trace(str(tj))
        try:
            trace_picture(tj, out / "moe_dispatch_trace.png",
                          "chunked dispatch, C = 2, 16K tokens/rank, EP = 2: forward then backward")
        except Exception as e:  # noqa: BLE001
            print(f"trace picture failed: {e}", flush=True)
    twin = layer_step("all_to_all", x, w, idx, experts)  # the twin's kernels, for the breakdown
    for _ in range(2):
        twin()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as tprof:
        twin()
        torch.cuda.synchronize()
    breakdown["twin"] = top_kernels(tprof)
    if rank == 0:
        result = {
            "slot": "moe_dispatch", "device": torch.cuda.get_device_name(), "gpus": EP,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "date": datetime.date.today().isoformat(),
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "nccl_high_priority_stream": not args.nccl_normal_priority,
            "shape": {"hidden": D, "experts": E, "experts_per_rank": E // EP, "top_k": K, "expert_width": I,
                      "dtype": "bfloat16", "routing": "uniform random top-8"},
            "iterations": {"warmup": WARMUP, "timed": ITERS, "statistic": "median"},
            "check_chunked_vs_twin_rel_err": check,
            "rows": rows,
            "kernel_breakdown_16K_rank0": breakdown,
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
               "c2": timed(layer_step("chunked", x, w, idx, experts, chunks=2), group),
               "c2_recompute": timed(layer_step("chunked", x, w, idx, experts, chunks=2, recompute=True), group)}
        step, why = megatron_step(x, w, idx, experts, group, rank, EP)
        row["megatron"] = timed(step, group) if step is not None else why
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
