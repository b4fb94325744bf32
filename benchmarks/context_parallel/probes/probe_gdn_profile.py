"""Probe: where a gated DeltaNet layer's forward + backward spends its kernel time at CP = world size
against the single-GPU layer on the whole sequence (bench.py's shapes), by kernel, from the profiler.

Rank 0 profiles the single layer on T tokens and on T / CP (a rank's share, the cp forms' fair
comparison), then every rank profiles `gdn_forward` on its T / CP tokens in each `--deltanet` form
(`maps`; `fla`, fla's CP kernels with its serial chain passes; `fla_concurrent`, the same with a
rank's two parts' passes at once), printing the tables of rank 0 (which skips one chain pass each way) and
of the last rank (which runs every one). Also times the rule alone (`fla_rule`) at the value width
the maps run (Dv + Dk) and at the single layer's (Dv). One JSON line per case, the tables in text.

`--host` adds, per case and rank, whether the step is bound by the host: `host_ms` (the Python call
returning, no synchronize) against `device_ms` (CUDA events around the same call), and `syncs`, the
calls that made the host wait for the device (torch's sync debug mode, set for the count and put
back). host_ms near device_ms with no syncs: the GPU waits for launches (at 16K tokens a rank the
layer's kernels are short); host_ms near device_ms with syncs: a host wait inside the step.

    torchrun --standalone --nproc_per_node=2 benchmarks/context_parallel/probes/probe_gdn_profile.py \
        [--tokens 65536] [--deltanet maps fla fla_concurrent] [--host]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: timing
from stamp import print_stamp  # noqa: E402
from timing import host_seconds, median_ms, sync  # noqa: E402
from context_parallel.bench import GDN_FORMS  # noqa: E402  (the bench's cp forms of the layer)

from bumblebee import registry  # noqa: E402
from bumblebee.primitives.context_parallel import layout  # noqa: E402
from bumblebee.primitives.context_parallel.gdn import fla_rule, gdn_forward  # noqa: E402

HK, HV, DK, DV, HIDDEN = 16, 32, 128, 128, 2048


def _step(fn, x):
    out = fn(x)
    out.backward(torch.ones_like(out))


def _table(fn, x, label, show_ranks, group=None):
    """Profile one step of fn on every rank of `group` (None: this process alone); the ranks in
    `show_ranks` print their tables in turn."""
    for _ in range(2):  # warm: autotuning and compilation stay out of the table
        _step(fn, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        _step(fn, x)
        torch.cuda.synchronize()
    rank = dist.get_rank() if group is not None else 0
    for shown in sorted(set(show_ranks)):
        if rank == shown:
            print(f"==== {label}, rank {rank}", flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70),
                  flush=True)
        if group is not None:
            dist.barrier(group=group)


def _cp_layer(layer, batch, options, t):
    return gdn_forward(layer, t, batch, **options)


def _gather_rows(row):
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def _host_bound(fn, x, label, iters=5):
    """Median host and device ms of a step over `iters` (after two warm ones), and the host waits in one."""
    device_ms = median_ms(lambda: _step(fn, x), iters=iters, warmup=2, cuda=True)
    host = []
    for _ in range(iters):  # the call's return on the host clock, the device idle before each
        sync()
        host.append(host_seconds(lambda: _step(fn, x))[1] * 1e3)
    sync()
    host_ms = sorted(host)[iters // 2]
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode(1)  # warn on every synchronizing call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(fn, x)
    finally:
        torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    syncs = [str(w.message)[:80] for w in caught if "synchroniz" in str(w.message)]
    return {"case": label, "rank": dist.get_rank() if dist.is_initialized() else 0,
            "host_ms": host_ms, "device_ms": device_ms, "syncs": len(syncs), "first_syncs": syncs[:3]}


def _rule_ms(L, rows, width, device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(rows, L, HV, DK, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(rows, L, HV, width, device=device, dtype=torch.bfloat16, generator=g)
    gl = -torch.rand(rows, L, HV, device=device, generator=g) * 0.1
    beta = torch.rand(rows, L, HV, device=device, dtype=torch.bfloat16, generator=g)
    h0 = torch.zeros(rows, HV, DK, width, device=device)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def call():
        o, _ = fla_rule(*leaves, gl, beta, scale=DK ** -0.5, initial_state=h0)
        o.backward(torch.ones_like(o))
    return median_ms(call, iters=5, warmup=2, cuda=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--deltanet", nargs="*", default=list(GDN_FORMS), choices=list(GDN_FORMS),
                   help="the cp forms profiled (bench.py's GDN_FORMS: fla_concurrent is deltanet='fla' with "
                        "fla_concurrent_parts=True)")
    p.add_argument("--host", action="store_true", help="also the host-bound check per case (see the docstring)")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    T = a.tokens
    torch.manual_seed(0)
    layer = registry.resolve("linear_attention", None)(HIDDEN, HK, HV, DK, DV).to(device, torch.bfloat16)
    if rank == 0:
        for n in (T, T // cp):
            x = torch.randn(1, n, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
            _table(layer, x, f"single layer, {n} tokens", (0,))
            if a.host:
                print(json.dumps(_host_bound(layer, x, f"single layer, {n} tokens")), flush=True)
        L = T // (2 * cp)
        for width in (DV, DV + DK):
            print(json.dumps({"rule": "fla_rule", "rows": 2, "chunk": L, "value_width": width,
                              "fwd_bwd_ms": _rule_ms(L, 2, width, device)}), flush=True)
    dist.barrier()
    batch = layout.make_batch(dist.group.WORLD, T, None, device)
    xs = torch.randn(1, T // cp, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    for form in a.deltanet:
        fn = functools.partial(_cp_layer, layer, batch, GDN_FORMS[form])
        label = f"cp layer ({form}), CP = {cp}, {T // cp} tokens a rank"
        _table(fn, xs, label, (0, cp - 1), dist.group.WORLD)
        if a.host:
            got = _host_bound(fn, xs, label)
            for row in _gather_rows(got):
                if rank == 0:
                    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
