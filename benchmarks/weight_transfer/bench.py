"""Weight transfer, p2p against its broadcast twin: bytes per update over simulated layouts up to 64
ranks (no GPU, no ranks), and measured updates between trainer and rollout ranks (torchrun).

    python benchmarks/weight_transfer/bench.py --simulate            # results/simulated.json + .png
    torchrun --nproc_per_node 4 benchmarks/weight_transfer/bench.py --trainers 2 --ep --device cpu
    torchrun --nproc_per_node 2 benchmarks/weight_transfer/bench.py --trainers 1 --layers 2 --out $OUT
    torchrun --nproc_per_node 4 benchmarks/weight_transfer/bench.py --trainers 2 --ep --layers 2 --out $OUT

Simulated: the named model's tensors (default Qwen3-30B-A3B, `--layers` decoder layers, bf16) held
by FSDP2 over `--sim-trainers` ranks (dim-0 shards; our fused experts whole per owner), sent to a
rollout of TP t (t = 1, 2, 4, 8; experts TP-split, or over EP = t with `ep`) in replicas up to 64
ranks: the planner's bytes on the wire (the receivers' specs written by hand from the vLLM-style
engine's rules, `tests/primitives/weight_transfer_engines.py:vllm_spec`) against the twin's (every
rollout rank receives every tensor, plus the gather of (T-1)/T of the model onto the first trainer).

Measured (torchrun; NCCL on cuda, gloo on cpu): the first `--trainers` ranks train-shard the model
with FSDP2 (EP 2 with `--ep`; default model on cuda: Qwen3-30B-A3B cut to `--layers` layers with its
full-size experts, bf16 on the wire), the others hold a vLLM-style engine at TP = their count. Each
implementation (p2p once per `--budget-bytes`, then the twin) runs a first update (plan, layout
check or inference: timed apart) and `--iters` updates after one warm-up, every rank the same calls
(host clock around a device-synchronized call), then `--iters` more back to back as an RL loop makes
them (`back_to_back_ms`: each until the caller's stream is done, the device never drained, so side-stream
work such as `undo_ahead`'s backup runs beside the next update; `period_ms`: the run to a device-wide
sync over `--iters`). The link's own rate is measured in the same run:
one message of the first rollout rank's p2p update size from trainer i to rollout i, all such pairs
at once, by a plain `batch_isend_irecv`. Rates: bytes the receivers take / median update time (the
slowest rank's), and that as a fraction of the link's rate (target for p2p: >= 0.7), with its
spread (`of_link_rate_spread`: a slow update, the 75th percentile of the iterations' slowest-rank
times, against a fast link round, the 25th, and the reverse; `target_shown` when the first clears
the target; the same from the back-to-back times: `..._back_to_back...`). The
transaction's cost: staging bytes and the commit's copy time per rollout rank (`--commit undo`: the
backup's copy, which overlaps the wire; `undo_ahead`: the same copy taken after each update, off the
next one's path, with `window_backups_per_rollout_rank` counting the updates that backed up inside
their own window, the warm-up's first among them). `--nccl-streams high` adds rows (`...-hp@B`) whose link
group runs NCCL on high-priority streams. `--agreement group` adds rows with the prepare and
vote as one all-gather on a gloo group over every rank (host-side) instead of the store's round trips. Writes
<out>/<device>-ranks<N>.json (stamped: commit, versions, device (the accelerator's name), date; the
--device kind under "device_type"; per rank, the copy programs' calls against entries: "copies").
`--profile`: after the timed updates of the first p2p budget, one more on every rank (after a barrier)
under the torch profiler; each rank's breakdown (`profile_breakdown.py`: device time by kernel
category, device idle time, the endpoint's phases, top CPU ops) under ranks[i][impl]["profile"].
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing
sys.path.insert(0, str(ROOT))  # the test suite's engine layouts (benchmarks import references from tests)

from timing import step_times_ms, sync, synced  # noqa: E402


def meta_manifest(name: str, layers: int, dtype="bfloat16"):
    """((hf name, shape, dtype), ...) of the named model cut to `layers` layers, built on meta."""
    from bumblebee import models
    from bumblebee.runtime.export import hf_layout
    hf = {**models.NAMED[name], "num_hidden_layers": layers}
    if "mlp_only_layers" in hf:
        hf["mlp_only_layers"] = []
    cls = models._model_class(hf)
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf(hf), None)
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    return hf, tuple((h, tuple(size), dtype) for lst in hf_layout(model, shapes).values() for h, size, *_ in lst)


def fsdp2_senders(manifest, trainers: int, experts: int):
    """SenderSpecs of FSDP2 over `trainers` ranks: dim-0 shards (ceil split, as Shard(0)); an HF
    expert tensor is a row of our fused [E, ...] tensor, whole on the rank holding that row."""
    import re
    from bumblebee.primitives.weight_transfer.spec import SenderSpec
    boxes = {r: [] for r in range(trainers)}
    for name, shape, _ in manifest:
        m = re.search(r"\.experts\.(\d+)\.", name)
        if m:
            owner = int(m.group(1)) // math.ceil(experts / trainers)
            boxes[owner].append((name, tuple((0, 1, n) for n in shape), False))
            continue
        chunk = math.ceil(shape[0] / trainers)
        for r in range(trainers):
            rows = min(shape[0], (r + 1) * chunk) - r * chunk
            if rows > 0:
                boxes[r].append((name, ((r * chunk, 1, rows),) + tuple((0, 1, n) for n in shape[1:]), False))
    return [SenderSpec(r, tuple(b)) for r, b in boxes.items()]


def simulate(args) -> dict:
    from bumblebee.primitives.weight_transfer import make_plan
    from tests.primitives.weight_transfer_engines import vllm_spec
    hf, manifest = meta_manifest(args.model, args.layers)
    model_bytes = sum(math.prod(s) * 2 for _, s, _ in manifest)
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or 1
    T = args.sim_trainers
    senders = fsdp2_senders(manifest, T, experts)
    rows = []
    for tp, ep in [(1, False), (2, False), (4, False), (8, False), (8, True)]:
        specs = [vllm_spec(manifest, hf, tp_rank=r, tp_size=tp, ep_rank=r if ep else 0, ep_size=tp if ep else 1,
                           dtype=torch.bfloat16)[0] for r in range(tp)]
        for ranks in (1, 2, 4, 8, 16, 32, 64):
            if ranks < tp or ranks > args.max_ranks:
                continue
            receivers = {T + i: specs[i % tp] for i in range(ranks)}
            made = {}
            plan_ms = step_times_ms(lambda: made.update(plan=make_plan(senders, receivers, manifest,
                                                                       budget_bytes=args.budget_bytes)), 1, 0, cuda=False)[0]
            plan = made["plan"]
            sent = plan.bytes_sent()
            rows.append({"rollout_tp": tp, "rollout_ep": tp if ep else 1, "rollout_ranks": ranks,
                         "p2p_bytes": plan.total_bytes, "p2p_bytes_per_rollout_rank": max(plan.bytes_received().values()),
                         "p2p_max_sender_bytes": max(sent.values()), "p2p_min_sender_bytes": min(sent.values()),
                         "p2p_rounds": plan.rounds, "plan_s": round(plan_ms / 1e3, 2),
                         "broadcast_bytes": ranks * model_bytes + (T - 1) * model_bytes // T,
                         "broadcast_bytes_per_rollout_rank": model_bytes})
            r = rows[-1]
            r["broadcast_over_p2p"] = round(r["broadcast_bytes"] / r["p2p_bytes"], 3)
            print(json.dumps({k: r[k] for k in ("rollout_tp", "rollout_ep", "rollout_ranks", "p2p_bytes",
                                                "broadcast_bytes", "broadcast_over_p2p", "plan_s")}), flush=True)
    return {"model": args.model, "layers": args.layers, "dtype": "bfloat16", "model_bytes": model_bytes,
            "trainers": T, "trainer_layout": "fsdp2 dim-0 shards", "budget_bytes": args.budget_bytes,
            "header_bytes_per_message": 0, "rows": rows}


def plot(result, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = result["rows"]
    xs = sorted({r["rollout_ranks"] for r in rows})
    bc = {r["rollout_ranks"]: r["broadcast_bytes"] for r in rows}
    ax.plot(xs, [bc[x] / 2**30 for x in xs], "k--o", label="broadcast twin (gather + broadcast)")
    for tp, ep in sorted({(r["rollout_tp"], r["rollout_ep"]) for r in rows}):
        sel = [r for r in rows if (r["rollout_tp"], r["rollout_ep"]) == (tp, ep)]
        label = f"p2p, rollout TP {tp}" + (f" / EP {ep}" if ep > 1 else "")
        ax.plot([r["rollout_ranks"] for r in sel], [r["p2p_bytes"] / 2**30 for r in sel], "-o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("rollout ranks")
    ax.set_ylabel("GiB on the wire per update")
    ax.set_title(f"{result['model']} ({result['layers']} layers, bf16), trainer FSDP2 x {result['trainers']}")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---- measured updates (torchrun) ---------------------------------------------------------------

def link_rate_ms(trainers, rollouts, nbytes: int, iters: int, device) -> list[float]:
    """The ms of each of `iters` rounds of one `nbytes` message from trainer rank i to rollout rank i,
    all pairs at once, by a plain `batch_isend_irecv` (every rank: the same calls, a barrier before
    each, fixed counts): the link's point-to-point rate that the updates are read against."""
    import torch.distributed as dist
    rank = dist.get_rank()
    peer = {a: b for a, b in zip(trainers, rollouts)} | {b: a for a, b in zip(trainers, rollouts)}
    buf = torch.empty(nbytes if rank in peer else 0, dtype=torch.uint8, device=device)

    def once():
        if rank in peer:
            op = dist.P2POp(dist.isend if rank in trainers else dist.irecv, buf, peer[rank])
            for w in dist.batch_isend_irecv([op]):
                w.wait()
        sync(device)
    ms = step_times_ms(once, iters, 1, cuda=False, before=dist.barrier)
    del buf
    return ms


def _high_priority_group(ranks):
    """An NCCL group over `ranks` whose kernels run on high-priority streams: where a receiver copies on a
    side stream beside the wire (`commit="undo"`'s backup, `undo_ahead`'s in the next update's window),
    the GPU's block scheduler then starts NCCL's kernels first instead of after the copy's queued blocks."""
    import torch.distributed as dist
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return dist.new_group(ranks, backend="nccl", pg_options=opts)


def _back_to_back_ms(update, device, iters) -> tuple[list[float], float]:
    """`iters` updates in a row as an RL loop makes them, each timed until the caller's stream is done
    (the new weights usable there; the device is not drained, so work an endpoint leaves on its side
    stream, `undo_ahead`'s backup for the next update, runs beside the next update and slows it
    wherever it competes), and the period: those times plus the last drain (a device-wide sync), over
    `iters` (the loop's own host time between calls is microseconds)."""
    done = (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else (lambda: None)
    sync(device)
    times = step_times_ms(lambda: (update(), done()), iters, 0, cuda=False)
    drain = step_times_ms(lambda: sync(device), 1, 0, cuda=False)[0]
    return times, (sum(times) + drain) / iters


def _endpoint_run(end, call, device, iters, rollout: bool, profile: bool = False) -> dict:
    """First update (plan, layout check or inference) timed apart, then `iters` after one warm-up;
    with `profile`, one more under the torch profiler after a barrier (every rank alike)."""
    import torch.distributed as dist
    first = step_times_ms(synced(lambda: call(0), device), 1, 0, cuda=False)[0] / 1e3
    times = step_times_ms(synced(lambda: call(1), device), iters, 1, cuda=False)
    in_row, period = _back_to_back_ms(lambda: call(1), device, iters)
    got = {"first_update_s": first, "median_ms": statistics.median(times), "times_ms": times,
           "back_to_back_ms": statistics.median(in_row), "back_to_back_times_ms": in_row, "period_ms": period,
           "stats": dict(end.stats)}
    if profile:
        from profile_breakdown import profile_update
        got["profile"] = profile_update(lambda: call(1), device, before=dist.barrier)
    if getattr(end, "mover", None) is not None:  # per update: entries against the copy calls made for them
        got["copies"] = end.mover.copy_stats()
    if rollout and hasattr(end, "mover"):  # the transaction's cost: staging bytes and the commit's copy
        # after the wire, or (undo) the backup's copy, which runs while round 0 is on the wire
        m = end.mover
        copy = (lambda: m.commit(end.targets)) if m.staging else (lambda: m.backup(end.targets))
        c = step_times_ms(synced(copy, device), 3, 1, cuda=False)
        got["commit_ms" if m.staging else "backup_ms"] = statistics.median(c)
        got["window_backups"] = m.window_backups
    return got


def measured(args) -> dict | None:
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from bumblebee import models, registry
    from bumblebee.primitives.weight_transfer import Link, P2PTransfer
    from bumblebee.runtime import export
    from tests.primitives.weight_transfer_engines import VllmStyleEngine, vllm_spec

    cuda = args.device == "cuda"
    if cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    dist.barrier()  # every rank's first call on the group: NCCL's communicator before any pair's p2p
    rank, world = dist.get_rank(), dist.get_world_size()
    T = args.trainers
    if not 0 < T < world or (args.ep and T % 2):
        raise ValueError(f"--trainers {T} needs 0 < T < world ({world}) and, with --ep, an even T")
    trainers, rollouts = tuple(range(T)), tuple(range(T, world))
    device = torch.device("cuda" if cuda else "cpu")
    wire = torch.bfloat16 if cuda else torch.float32
    hf, manifest = meta_manifest(args.model, args.layers, str(wire).removeprefix("torch."))
    mesh = DeviceMesh(device.type, torch.tensor(trainers), mesh_dim_names=("dp",))
    ep_mesh = DeviceMesh(device.type, torch.tensor(trainers).view(T // 2, 2), mesh_dim_names=("efsdp", "ep")) \
        if args.ep else None
    impl = {f"p2p{'' if c == 'stage' else '-' + c}{'' if a == 'store' else '-' + a}{'' if st == 'default' else '-hp'}@{b}":
            registry.resolve("weight_transfer", P2PTransfer(budget_bytes=b, timeout_s=600, commit=c, agreement=a))
            for st in args.nccl_streams for a in args.agreement for c in args.commit for b in args.budget_bytes}
    impl["broadcast"] = registry.resolve("weight_transfer", "broadcast")
    # the group vote runs on the host: one gloo group over every rank, made by all of them before any update
    votes = dist.new_group(list(range(world)), backend="gloo") if "group" in args.agreement else None
    high = _high_priority_group(list(range(world))) if "high" in args.nccl_streams else None
    link = {k: Link(trainers, rollouts, name=k, group=high if "-hp@" in k else None,
                    vote_group=votes if "-group" in k else None) for k in impl}
    first_p2p = next(k for k in impl if k.startswith("p2p"))
    out = {}
    if rank in trainers:
        model = models.build({**hf, "dtype": "float32"}, impl={"moe_dispatch": "all_to_all" if args.ep else "local"}
                             if hf.get("num_experts") else None, seed=0, device=device)
        if args.ep:
            from bumblebee.parallelize import shard_experts
            shard_experts(model, ep_mesh["ep"].get_group())
        state = registry.resolve("state_sharding", "fsdp2")(model, mesh, lr=1e-4, mixed_precision="bf16" if cuda else "fp32",
                                                            grad_clip=None, ep_mesh=ep_mesh)
        shards = list(export.export_weight_shards(model, state, dtype=wire))
        for k, fn in impl.items():
            end = fn(link[k])
            out[k] = _endpoint_run(end, lambda v: end.update(shards, v), device, args.iters, False,
                                   args.profile and k == first_p2p)
    else:
        r, n = rank - T, len(rollouts)
        eng = VllmStyleEngine(manifest, hf, tp_rank=r, tp_size=n, dtype=wire, device=device)
        # "given": the engine's layout written from its rules and checked by one real load_weights
        # call; "infer": probed (several loader calls and a host-side fit over every element)
        given = (lambda man: vllm_spec(man, hf, tp_rank=r, tp_size=n, dtype=wire)[0]) if args.layout == "given" else None
        for k, fn in impl.items():
            end = fn(link[k], load_weights=eng.load_weights, targets=eng.params, layout_key=f"tp{r}", layout=given)
            out[k] = _endpoint_run(end, lambda v: end.update(), device, args.iters, True,
                                   args.profile and k == first_p2p)
    # the link's own rate, one message per (trainer i, rollout i) pair at once, of the size the
    # first rollout rank receives in a p2p update
    size = [out[first_p2p]["stats"]["bytes_received"] if rank == rollouts[0] else 0]
    dist.broadcast_object_list(size, src=rollouts[0])
    nbytes = args.link_bytes or max(1, size[0])
    link_ms = link_rate_ms(trainers, rollouts, nbytes, args.iters, device)
    rate_ms = statistics.median(link_ms)
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    pairs = min(T, world - T)
    link_GBps = pairs * nbytes / rate_ms / 1e6
    per = {}
    for k in impl:
        median = max(g[k]["median_ms"] for g in gathered)  # an update ends when its slowest rank does
        wire_bytes = sum(g[k]["stats"]["bytes_received"] for g in gathered[T:])
        in_row = max(g[k]["back_to_back_ms"] for g in gathered)
        period = max(g[k]["period_ms"] for g in gathered)
        per[k] = {"median_ms": median, "first_update_s": max(g[k]["first_update_s"] for g in gathered),
                  "wire_bytes": wire_bytes, "GBps": wire_bytes / median / 1e6,
                  "of_link_rate": wire_bytes / median / 1e6 / link_GBps,
                  "of_link_rate_spread": _spread(gathered, k, "times_ms", link_ms, wire_bytes / (pairs * nbytes)),
                  "back_to_back_ms": in_row, "period_ms": period,
                  "of_link_rate_back_to_back": wire_bytes / in_row / 1e6 / link_GBps,
                  "of_link_rate_back_to_back_spread": _spread(gathered, k, "back_to_back_times_ms", link_ms,
                                                              wire_bytes / (pairs * nbytes)),
                  "of_link_rate_period": wire_bytes / period / 1e6 / link_GBps,
                  "staging_bytes_per_rollout_rank": [g[k]["stats"]["staged_bytes"] for g in gathered[T:]],
                  "commit_ms_per_rollout_rank": [g[k].get("commit_ms") for g in gathered[T:]],
                  "backup_ms_per_rollout_rank": [g[k].get("backup_ms") for g in gathered[T:]],
                  "window_backups_per_rollout_rank": [g[k].get("window_backups") for g in gathered[T:]]}
    best = max((k for k in impl if k.startswith("p2p")), key=lambda k: per[k]["GBps"])
    in_row_best = min((k for k in impl if k.startswith("p2p")), key=lambda k: per[k]["back_to_back_ms"])
    # "device" is stamp()'s (the accelerator's name); the kind of device the ranks ran on apart
    return {"model": args.model, "layers": args.layers, "device_type": args.device, "wire_dtype": str(wire),
            "world": world, "trainers": T, "rollout_tp": world - T, "trainer_ep": 2 if args.ep else 1,
            "layout": args.layout, "iters": args.iters, "budgets_bytes": list(args.budget_bytes),
            "profiled": first_p2p if args.profile else None,
            "per_impl": per, "ranks": gathered,
            "link": {"method": "batch_isend_irecv, trainer i -> rollout i, all pairs at once", "pairs": pairs,
                     "message_bytes": nbytes, "median_ms": rate_ms, "GBps": link_GBps, "times_ms": link_ms},
            "p2p_best": best, "p2p_over_link_rate": per[best]["of_link_rate"], "target_over_link_rate": 0.7,
            "target_shown": per[best]["of_link_rate_spread"][0] >= 0.7,
            "p2p_best_back_to_back": in_row_best, "target_shown_back_to_back":
                per[in_row_best]["of_link_rate_back_to_back_spread"][0] >= 0.7,
            "broadcast_over_p2p_time": per["broadcast"]["median_ms"] / per[best]["median_ms"]}


def _spread(gathered, k, key, link_ms, bytes_ratio: float) -> list[float]:
    """The fraction of the link's rate over the quartiles: [a slow update (the 75th percentile of the
    slowest rank's iteration times) against a fast link round (the 25th), the reverse]. A target is
    shown when the first clears it."""
    def quartiles(xs):
        if len(xs) < 2:  # one iteration: no spread to give
            return xs[0], xs[0]
        q = statistics.quantiles(xs, n=4)
        return q[0], q[2]
    upd = [max(times) for times in zip(*(g[k][key] for g in gathered))]  # an iteration: its slowest rank
    (u25, u75), (l25, l75) = quartiles(upd), quartiles(link_ms)
    return [bytes_ratio * l25 / u75, bytes_ratio * l75 / u25]  # `of_link_rate` at those times


def main():
    from bumblebee.primitives.weight_transfer import COMMITS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true", help="bytes per update over layouts up to 64 ranks (no ranks)")
    ap.add_argument("--model", default=None, help="default: qwen3-30b-a3b (simulate, cuda), qwen3-moe-tiny (cpu)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the slice (default 4 / 2 / model's)")
    ap.add_argument("--sim-trainers", type=int, default=8)
    ap.add_argument("--max-ranks", type=int, default=64, help="the largest simulated rollout")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--ep", action="store_true", help="trainer experts over EP = 2")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-bytes", type=int, nargs="+", default=[256 << 20],
                    help="p2p's per-round budget; several: one p2p endpoint each, in one run")
    ap.add_argument("--commit", nargs="+", choices=COMMITS, default=list(COMMITS),
                    help="p2p's transaction (P2PTransfer.commit), each with every budget: stage (rows p2p@B) "
                         "receives whole and copies after the wire; undo (rows p2p-undo@B) lands rounds in place "
                         "behind a backup; undo_ahead (rows p2p-undo_ahead@B) with the backup taken after the "
                         "previous update")
    ap.add_argument("--agreement", nargs="+", choices=("store", "group"), default=["store"],
                    help="P2PTransfer.agreement, each with every commit and budget: store (rows as above) or group "
                         "(rows ...-group@B: the prepare and vote as one all-gather on one gloo group of every rank)")
    ap.add_argument("--nccl-streams", nargs="+", choices=("default", "high"), default=["default"],
                    help="the link's NCCL group (cuda): the default one, or (rows ...-hp@B) a group of every rank "
                         "with high-priority streams (ProcessGroupNCCL.Options.is_high_priority_stream)")
    ap.add_argument("--layout", choices=("given", "infer"), default=None,
                    help="the rollout's layout: written from the engine's rules and checked by one loader call "
                         "(default on cuda: probing a 30B slice takes minutes on the host), or inferred (cpu default)")
    ap.add_argument("--link-bytes", type=int, default=None,
                    help="link-rate message size (default: what the first rollout rank receives per p2p update)")
    ap.add_argument("--profile", action="store_true",
                    help="one more update of the first p2p budget under the torch profiler: per rank, its breakdown "
                         "(profile_breakdown.py) under ranks[i][impl]['profile']")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    from stamp import stamp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.simulate:
        args.model, args.layers = args.model or "qwen3-30b-a3b", args.layers or 4
        args.budget_bytes = args.budget_bytes[0]
        result = {**stamp("cpu"), "slot": "weight_transfer", "kind": "simulated bytes", **simulate(args)}
        (out / "simulated.json").write_text(json.dumps(result, indent=2) + "\n")
        print("plot:", plot(result, out / "simulated.png"))
        return
    cpu = args.device == "cpu"
    if cpu and "high" in args.nccl_streams:
        raise ValueError("--nccl-streams high needs --device cuda (stream priorities are NCCL's)")
    args.model = args.model or ("qwen3-moe-tiny" if cpu else "qwen3-30b-a3b")
    from bumblebee import models
    args.layers = args.layers or (models.NAMED[args.model]["num_hidden_layers"] if cpu else 2)
    args.layout = args.layout or ("infer" if cpu else "given")
    result = measured(args)
    if result is not None:
        result = {**stamp(args.device), "slot": "weight_transfer", **result}
        path = out / f"{args.device}-ranks{result['world']}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(json.dumps({k: result[k] for k in ("per_impl", "link", "p2p_over_link_rate", "broadcast_over_p2p_time")},
                         indent=2, default=str))
        if result["profiled"]:
            for i, g in enumerate(result["ranks"]):
                p = g[result["profiled"]]["profile"]
                print(f"rank {i} profile:", json.dumps({k: p[k] for k in ("wall_ms", "window_ms", "gpu_ms", "gpu_idle_ms",
                                                                          "lead_ms", "tail_ms", "phases")}))
        print("wrote", path)


if __name__ == "__main__":
    main()
