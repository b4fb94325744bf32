"""Context parallelism: a layer's forward + backward over CP ranks against one GPU on the whole sequence.

    torchrun --standalone --nproc_per_node=2 benchmarks/context_parallel/bench.py --out DIR   # CP = 2
    torchrun --standalone --nproc_per_node=4 benchmarks/context_parallel/bench.py --out DIR   # CP = 4
    torchrun --standalone --nproc_per_node=2 benchmarks/context_parallel/bench.py --cpu-smoke --out DIR

First a correctness check at a small length (`check_tokens`): every rank's output and input gradients
of the cp forms against the single-GPU layer in fp32, beside the single-GPU layer's own error in the
benchmark dtype (a cp error within a few times it is right). Then at each total length T: rank 0
alone runs the single-GPU layer on the whole sequence while the others wait (attention: causal SDPA
as a user calls it, `single`, and on the flash backend with repeated K/V heads, `single_flash`, the
cp forms' kernel where cuDNN's SDPA backend is off; gated DeltaNet: the `linear_attention` slot's default layer, fla on CUDA),
then every rank runs its shard (T / CP tokens) of the cp forms: attention by `allgather` and by
`ring`, gated DeltaNet's `cp` (this project's affine maps, `ContextParallel(deltanet="maps")`, fla's
rule where fla serves), `cp_fla` (fla's own CP kernels, `deltanet="fla"`, a rank's two parts' chain
passes one after the other as fla runs them) and `cp_fla_concurrent` (the same with the parts at once:
`fla_concurrent_parts=True`). Each case: fixed
iteration counts, CUDA events, a barrier closing every call (so the slowest rank counts); speed-up =
single / cp and efficiency = speed-up / CP (1.0 ideal) against each single row; tokens/s per GPU =
T / (CP x seconds). A case that fails (a missing kernel, out of memory) is recorded with its error
and the others still run. CUDA: bf16, Qwen3.5-35B-A3B's attention (16 query / 2 key-value heads of
256) and DeltaNet (16 key / 32 value heads of 128, hidden 2048) shapes; --cpu-smoke: gloo, fp32, tiny
shapes, to check the script runs (its numbers mean nothing). Rank 0 writes DIR/context_parallel_cp<CP>.json (`_gdn` added under `--layers gated_deltanet`)
(stamped) after every case, so a run cut short keeps what it measured.
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
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing
from stamp import stamp  # noqa: E402
from timing import median_ms  # noqa: E402

from bumblebee import registry  # noqa: E402
from bumblebee.primitives.context_parallel import layout  # noqa: E402
from bumblebee.primitives.context_parallel.attention import EXCHANGES  # noqa: E402
from bumblebee.primitives.context_parallel.gdn import gdn_forward  # noqa: E402

GPU = dict(tokens=(65536, 131072, 262144), heads=16, kv_heads=2, head_dim=256, hidden=2048,
           gdn=(16, 32, 128, 128), dtype=torch.bfloat16, check_tokens=8192, iters=3)
GDN_ROWS = {"maps": "cp", "fla": "cp_fla", "fla_concurrent": "cp_fla_concurrent",  # --deltanet -> the row's impl
            "fla_fp32": "cp_fla_transition_fp32", "fla_bf16x2": "cp_fla_transition_bf16x2",
            "fla_bf16": "cp_fla_transition_bf16"}
GDN_FORMS = {"maps": dict(deltanet="maps"), "fla": dict(deltanet="fla"),  # --deltanet -> ContextParallel's options
             "fla_concurrent": dict(deltanet="fla", fla_concurrent_parts=True),
             # the transition maps of kernels/context_parallel_gdn_transition.py, both parts at once
             "fla_fp32": dict(deltanet="fla", fla_concurrent_parts=True, fla_transition="fp32"),
             "fla_bf16x2": dict(deltanet="fla", fla_concurrent_parts=True, fla_transition="bf16x2"),
             "fla_bf16": dict(deltanet="fla", fla_concurrent_parts=True, fla_transition="bf16")}
SMOKE = dict(tokens=(256,), heads=4, kv_heads=2, head_dim=16, hidden=64, gdn=(2, 4, 16, 16), dtype=torch.float32,
             check_tokens=64, iters=2)


def _time(fn, device, iters, group):
    """(median ms, peak GiB) of fn; with a group, a barrier closes every call (fixed counts on every rank)."""
    def call():
        fn()
        if group is not None:
            dist.barrier(group=group)
    peak = {}
    ms = median_ms(call, iters=iters, warmup=1, peak=peak, cuda=device.type == "cuda")
    return ms, None if peak.get("peak_MB") is None else peak["peak_MB"] / 1024


def _measure(make, device, iters, group=None) -> dict:
    """Time the fn `make()` returns; a failure (any rank) is recorded, not raised."""
    try:
        ms, gib = _time(make(), device, iters, group)
        result = {"median_ms": ms, "peak_GiB": gib}
    except Exception as e:  # e.g. a kernel this torch lacks, or out of memory: the other cases still run
        result = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _randn(shape, device, dtype, seed, grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(grad)


def _single_attention(q, k, v, scale, flash=False):
    if not flash:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    G = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # scoped to this call
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True,
                                              scale=scale)


def _fwd_bwd(fn, tensors):
    def run():  # the output's gradient is ones in its own dtype: no fp32 copy of a [T, H, D] output
        fn(*tensors).sum().backward()
    return run


# ---- correctness at a small length -----------------------------------------------------------

def _errors(got, want32, single, idx, dim):
    """max |cp - fp32 reference| and the single-GPU run's own max error, at this rank's positions."""
    want = want32.index_select(dim, idx).float()
    return {"cp_err": (got.float() - want).abs().max().item(),
            "single_err": (single.index_select(dim, idx).float() - want).abs().max().item()}


def _outputs_and_grads(fn, leaves, w):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    (out.float() * w).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _check(s, device, cp, rank, layers):
    """Every rank's check rows of the benchmarked layers, gathered (a failure is recorded as the part's
    error). Only those layers: a fresh machine's first fla call autotunes for minutes."""
    batch = layout.make_batch(dist.group.WORLD, s["check_tokens"], None, device)
    rows = []
    for part in [{"attention": _check_attention, "gated_deltanet": _check_gdn}[n] for n in layers]:
        try:
            rows += part(s, device, cp, rank, batch)
        except Exception as e:
            rows.append({"check": part.__name__, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    every = [None] * cp
    dist.all_gather_object(every, [{**r, "rank": rank} for r in rows])
    return [r for part in every for r in part]


def _check_attention(s, device, cp, rank, batch):
    T, dtype, D = s["check_tokens"], s["dtype"], s["head_dim"]
    rows = []
    q, k, v = (_randn((1, h, T, D), device, torch.float32, i, False) for i, h in
               enumerate((s["heads"], s["kv_heads"], s["kv_heads"])))
    w = _randn((1, s["heads"], T, D), device, torch.float32, 9, False)
    ref = _outputs_and_grads(lambda *t: _single_attention(*t, D ** -0.5), (q, k, v), w)
    single = _outputs_and_grads(lambda *t: _single_attention(*t, D ** -0.5), [t.to(dtype) for t in (q, k, v)], w)
    for name, exchange in EXCHANGES.items():
        row = {"check": "attention", "impl": name, "tokens": T, "cp": cp}
        try:
            got = _outputs_and_grads(lambda *t: exchange(*t, scale=D ** -0.5, batch=batch),
                                     [layout.shard(t, cp, rank, dim=2).to(dtype) for t in (q, k, v)],
                                     layout.shard(w, cp, rank, dim=2))
            for part, a, b, c in zip(("out", "dq", "dk", "dv"), got, ref, single):
                row[part] = _errors(a, b, c, batch.index, 2)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
    return rows


def _check_gdn(s, device, cp, rank, batch):
    T, dtype = s["check_tokens"], s["dtype"]
    hk, hv, dk, dv = s["gdn"]
    torch.manual_seed(0)  # the same weights on every rank
    # the fp32 reference is the twin (torch, chunked): independent of fla, and it spares fla's cold
    # autotuning of a third set of kernels (fp32), minutes on a fresh GPU machine
    layer32 = registry.resolve("linear_attention", "torch_chunked")(s["hidden"], hk, hv, dk, dv).to(device)
    layer = registry.resolve("linear_attention", None)(s["hidden"], hk, hv, dk, dv).to(device, dtype)
    layer.load_state_dict(layer32.state_dict())
    x, wx = (_randn((1, T, s["hidden"]), device, torch.float32, i, False) for i in (5, 6))
    ref = _outputs_and_grads(layer32, [x], wx)
    single = _outputs_and_grads(layer, [x.to(dtype)], wx)
    rows = []
    for mode in s["deltanet"]:
        row = {"check": "gated_deltanet", "impl": GDN_ROWS[mode], "tokens": T, "cp": cp}
        try:
            got = _outputs_and_grads(lambda t: gdn_forward(layer, t, batch, **GDN_FORMS[mode]),
                                     [layout.shard(x, cp, rank).to(dtype)], layout.shard(wx, cp, rank))
            for part, a, b, c in zip(("out", "dx"), got, ref, single):
                row[part] = _errors(a, b, c, batch.index, 1)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
    return rows


# ---- timing at the benchmark lengths ---------------------------------------------------------

def _attention(T, s, device, cp, rank, iters):
    H, K, D, dtype = s["heads"], s["kv_heads"], s["head_dim"], s["dtype"]
    rows = {}
    if rank == 0:
        for name, flash in (("single", False), ("single_flash", True)):
            rows[name] = _measure(lambda: _fwd_bwd(lambda *t: _single_attention(*t, D ** -0.5, flash),
                                                   [_randn((1, h, T, D), device, dtype, i) for i, h in
                                                    enumerate((H, K, K))]), device, iters)
    dist.barrier()
    batch = layout.make_batch(dist.group.WORLD, T, None, device)
    for name, exchange in EXCHANGES.items():
        rows[name] = _measure(lambda: _fwd_bwd(lambda *t: exchange(*t, scale=D ** -0.5, batch=batch),
                                               [_randn((1, h, T // cp, D), device, dtype, 10 * rank + i) for i, h in
                                                enumerate((H, K, K))]), device, iters, dist.group.WORLD)
    return rows


def _gdn(T, s, device, cp, rank, iters):
    hk, hv, dk, dv = s["gdn"]
    layer = registry.resolve("linear_attention", None)(s["hidden"], hk, hv, dk, dv).to(device, s["dtype"])
    rows = {}
    if rank == 0:
        rows["single"] = _measure(lambda: _fwd_bwd(layer, [_randn((1, T, s["hidden"]), device, s["dtype"], 0)]),
                                  device, iters)
    dist.barrier()
    batch = layout.make_batch(dist.group.WORLD, T, None, device)
    for mode in s["deltanet"]:
        rows[GDN_ROWS[mode]] = _measure(lambda: _fwd_bwd(lambda t: gdn_forward(layer, t, batch, **GDN_FORMS[mode]),
                                                         [_randn((1, T // cp, s["hidden"]), device, s["dtype"], rank)]),
                                        device, iters, dist.group.WORLD)
    return rows


def _rows(layer_name, T, cp, measured):
    singles = {n: r for n, r in measured.items() if n.startswith("single")}
    out = []
    for name, r in measured.items():
        row = {"layer": layer_name, "impl": name, "tokens": T, "cp": 1 if name in singles else cp, **r}
        if "median_ms" in r:
            row["tokens_per_s_per_gpu"] = T / row["cp"] / (r["median_ms"] / 1e3)
            if name not in singles:
                for sname, sr in singles.items():
                    if "median_ms" in sr:
                        row[f"speedup_vs_{sname}"] = sr["median_ms"] / r["median_ms"]
                        row[f"efficiency_vs_{sname}"] = sr["median_ms"] / r["median_ms"] / cp
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--iters", type=int, default=None, help="timed calls per case (fixed; default 3 on GPU)")
    p.add_argument("--tokens", type=int, nargs="*", default=None, help="total lengths (default 64K 128K 256K)")
    p.add_argument("--layers", nargs="*", default=["attention", "gated_deltanet"],
                   choices=["attention", "gated_deltanet"])
    p.add_argument("--deltanet", nargs="*", default=None, choices=sorted(GDN_ROWS),
                   help="gated DeltaNet's cp forms (GDN_FORMS: ContextParallel.deltanet; fla_concurrent: fla "
                        "with fla_concurrent_parts=True; fla_fp32 / fla_bf16x2 / fla_bf16: that with fla_transition; default "
                        "every form on CUDA, maps on the CPU smoke: fla's CP kernels need CUDA)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # before the process group, so NCCL binds every rank to its own GPU
        torch.cuda.set_device(device)
    # a rank stuck in a collective (another failed inside one) ends the run instead of hanging it
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=240))
    cp, rank = dist.get_world_size(), dist.get_rank()
    s = {**(GPU if cuda else SMOKE), "deltanet": args.deltanet or (list(GDN_FORMS) if cuda else ["maps"])}
    iters = args.iters or s["iters"]
    result = {**stamp(device), "slot": "context_parallel", "ranks": cp, "dtype": str(s["dtype"]), "iters": iters,
              "warmup": 1, "deltanet": s["deltanet"],
              "shapes": {k: v for k, v in s.items() if k not in ("dtype", "tokens", "deltanet")},
              "checks": _check(s, device, cp, rank, args.layers), "rows": []}
    only = {"attention": "", "gated_deltanet": "_gdn"}  # one layer kind: its own file, the other kind's stays
    suffix = only[args.layers[0]] if len(set(args.layers)) == 1 else ""
    path = args.out / f"context_parallel_cp{cp}{suffix}.json"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        for row in result["checks"]:
            print(json.dumps(row), flush=True)
    cases = {"attention": _attention, "gated_deltanet": _gdn}
    for T in args.tokens or s["tokens"]:
        for layer_name in args.layers:
            measured = cases[layer_name](T, s, device, cp, rank, iters)
            if rank == 0:
                for row in _rows(layer_name, T, cp, measured):
                    print(json.dumps(row), flush=True)
                    result["rows"].append(row)
                path.write_text(json.dumps(result, indent=1))
    if rank == 0:
        path.write_text(json.dumps(result, indent=1))
        print(_table(result["rows"]), flush=True)
    dist.destroy_process_group()


def _table(rows) -> str:
    """The rows as a markdown table (the skill's measured table takes its 128K lines)."""
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"
    lines = ["| layer | impl | tokens | CP | ms | eff. vs single | eff. vs single_flash | tokens/s/GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['impl']} | {r['tokens']} | {r['cp']} | {f(r.get('median_ms'), '.1f')} | "
                     f"{f(r.get('efficiency_vs_single'), '.2f')} | {f(r.get('efficiency_vs_single_flash'), '.2f')} | "
                     f"{f(r.get('tokens_per_s_per_gpu'), ',.0f')} |" + (f" {r['error'][:80]}" if "error" in r else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
