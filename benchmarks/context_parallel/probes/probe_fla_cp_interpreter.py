"""Probe (CPU, no GPU): gated DeltaNet under context parallelism on fla's Triton kernels, run by Triton's
interpreter on CPU tensors, at CP = 2 and 4 over gloo, against the single layer on the whole sequence:
`ContextParallel(deltanet="fla")` (fla's own CP kernels and chain code), the same with
`fla_concurrent_parts=True` (the chain passes through `gdn_fla_chain.py`, here in turn as off CUDA),
`fla_transition="bf16x2"` (the transition maps from `kernels/context_parallel_gdn_transition.py`; fp32
operands here, so its bf16 roundings are exact: this checks the wiring, not the rounding) and the maps as they run on CUDA (fla's rule with an entering state, fla's conv over [halo | chunk]
rows for unpacked shards).

fla's CP path needs CUDA; this runs the same Python and the same Triton kernel code on a CPU machine,
to check our wiring (zigzag context, q/k/v conv halos, the chain, the row loop, packed documents)
before a GPU does. What it changes, in a private copy of fla (never the installed one) and in its own
processes only:
- fla-core 0.6.0 and einops are pip-installed into a temporary folder;
- two kernel lines the interpreter cannot run are rewritten to equivalent forms (`i_t.to(tl.int64)`
  on a Python loop counter; a mask made of a Python bool and a tensor);
- Triton's autotuner keeps each kernel's first config (benchmarking configs needs a GPU driver);
- fla's CUDA-only device guard is lifted, and gloo's all-gather takes fla's stacked output as a view.
Numbers (fp32): per rank, output, input gradient and every parameter gradient (summed over the
group) against the float64 twin; beside them the fp32 twin's error and fla's own single layer's
(same interpreter, no CP). A check passes within 4x the larger of those two plus 1e-5 of the
reference's max. Each row also counts the chain passes `gdn_fla_chain.py` served in its run
(`gdn_fla_chain_passes`: > 0 for `fla concurrent` and `fla transition bf16x2`, 0 for the others) and
the maps our kernel made (`transition_maps`: > 0 for the transition form only, on every rank but 0, which
holds the chain's two ends) and the backward passes that took the forward's maps transposed (`kept_maps`:
> 0 there for unpacked rows, and for packed ones where fla keeps the states as they are), else the probe
stops. Writes
results/probe_fla_cp_interpreter.json (stamped).

    python benchmarks/context_parallel/probes/probe_fla_cp_interpreter.py [--ranks 2 4] [--dqkwg ours]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
T, HIDDEN, DIMS = 128, 32, (2, 4, 16, 16)  # 2 key / 4 value heads of 16; parts of 32 (CP 2) or 16 (CP 4)
CASES = {"unpacked B=1": (1, None), "unpacked B=2": (2, None), "packed": (1, (0, 5, 6, 70, 128))}
MODES = {"fla": dict(deltanet="fla"),  # row mode -> ContextParallel's options (all on fla's kernels)
         "fla concurrent": dict(deltanet="fla", fla_concurrent_parts=True),
         # the transition maps from kernels/context_parallel_gdn_transition.py, the parts in turn
         "fla transition bf16x2": dict(deltanet="fla", fla_transition="bf16x2"),
         "maps on fla": dict(deltanet="maps")}
PATCHES = {  # file in fla -> (text, replacement): interpreter limits, same arithmetic
    "ops/common/chunk_delta_h.py": ("i_t.to(tl.int64)", "tl.cast(i_t, tl.int64)"),
    "modules/causal_conv1d/ops.py": ("m_t = (t < seq_len) & m_d", "m_t = (tl.full([BD], t, tl.int64) < seq_len) & m_d"),
}


def _private_fla(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder),
                    "fla-core==0.6.0", "einops"], check=True)
    for rel, (old, new) in PATCHES.items():
        path = folder / "fla" / rel
        text = path.read_text()
        if old not in text:
            raise RuntimeError(f"fla's {rel} no longer has {old!r}: update the probe's patches")
        path.write_text(text.replace(old, new))
    return folder


def _interpreter_shims():
    import torch.distributed as dist
    from triton.runtime import autotuner
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    import fla.ops.cp.chunk_bwd, fla.ops.cp.chunk_delta_h, fla.ops.cp.chunk_fwd, fla.ops.cp.chunk_merge  # noqa: F401,E401
    import fla.ops.cp.context  # noqa: F401
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and hasattr(mod, "_check_cp_device"):
            mod._check_cp_device = lambda device: None
    gather = dist.all_gather_into_tensor

    def stacked_as_concatenated(out, inp, group=None, async_op=False):  # NCCL takes either, gloo the latter
        return gather(out.view(-1, *inp.shape[1:]) if out.dim() == inp.dim() + 1 else out, inp,
                      group=group, async_op=async_op)
    dist.all_gather_into_tensor = stacked_as_concatenated


def _grads(fn, module, x, w):
    import torch
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    params = dict(module.named_parameters())
    got = torch.autograd.grad((out.double() * w).sum(), [x] + list(params.values()))
    return {"out": out.detach(), "dx": got[0], **{f"d{n}": g for n, g in zip(params, got[1:])}}


def _count_chain_passes():
    """Counts the chain passes `gdn_fla_chain.py` serves (its `_run` calls), the transition maps our
    kernel makes (`transition_map` calls) and the backward passes that took the forward's maps
    (`_kept_maps` found them), so each row says which path ran: fla's serial pre-processes, or ours
    (parts at once: here in turn, no CUDA; transition maps from our kernel, the backward's transposed)."""
    from bumblebee.kernels import context_parallel_gdn_transition as transition
    from bumblebee.primitives.context_parallel import gdn_fla_chain
    count, run, make, kept = [0, 0, 0], gdn_fla_chain._run, transition.transition_map, gdn_fla_chain._kept_maps

    def counting(calls, how, device):
        count[0] += 1
        return run(calls, how, device)

    def counting_maps(*args, **kw):
        count[1] += 1
        return make(*args, **kw)
    def counting_kept(*args, **kw):
        got = kept(*args, **kw)
        count[2] += got is not None
        return got
    gdn_fla_chain._run, transition.transition_map, gdn_fla_chain._kept_maps = counting, counting_maps, counting_kept
    return count


def _ours_dqkwg():
    """Hand fla's gated dq/dk/dw/dg to kernels/linear_attention_gdn_backward.py, as on the GPU machines
    where fla refuses its own (Hopper, Triton in [3.4, 3.7.1)); returns the call counter."""
    from bumblebee.kernels import linear_attention_gdn_backward as ours
    from bumblebee.primitives import linear_attention as la
    calls, real = [0], ours.chunk_bwd_dqkwg

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    ours.chunk_bwd_dqkwg = counted
    la.DQKWG_HOOK = la._install_dqkwg()
    return calls


def _worker(rank, world, port, out_dir, dqkwg):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _interpreter_shims()
    from bumblebee.baselines.linear_attention import ChunkedGatedDeltaNet
    from bumblebee.primitives import linear_attention as la
    from bumblebee.primitives.context_parallel import gdn, gdn_fla, layout
    from bumblebee.primitives.context_parallel.gdn import gdn_forward
    gdn_fla.why_not_fla_cp = lambda x, head_k_dim=None: None  # fla's kernels need CUDA: here the interpreter runs them
    gdn.fla_falls_back = lambda *a, **k: None  # the maps on fla's rule and conv, as on CUDA
    la.FLAGatedDeltaNet._fast = lambda self, x: True
    calls = _ours_dqkwg() if dqkwg == "ours" else None
    passes = _count_chain_passes()
    rows = []
    for case, (B, cu) in CASES.items():
        torch.manual_seed(0)
        ref = ChunkedGatedDeltaNet(HIDDEN, *DIMS, conv_kernel_size=4).double()
        twin = ChunkedGatedDeltaNet(HIDDEN, *DIMS, conv_kernel_size=4)
        fla_single = la.FLAGatedDeltaNet(la.FLAConfig(), HIDDEN, *DIMS, conv_kernel_size=4)
        for m in (twin, fla_single):
            m.load_state_dict(ref.state_dict())
        x, w = (torch.randn(B, T, HIDDEN, dtype=torch.float64) for _ in range(2))
        cu_t = None if cu is None else torch.tensor(cu)
        want = _grads(lambda t: ref(t, cu_seqlens=cu_t), ref, x, w)
        singles = [_grads(lambda t: m(t, cu_seqlens=cu_t), m, x.float(), w) for m in (twin, fla_single)]
        batch = layout.make_batch(dist.group.WORLD, T, cu_t)
        for mode in MODES:
            before, maps_before, kept_before, first_row = passes[0], passes[1], passes[2], len(rows)
            _compare(rows, mode, case, world, rank, batch, want, singles,
                     _grads(lambda t: gdn_forward(twin, t, batch, **MODES[mode]), twin,
                            layout.shard(x, world, rank).float(), layout.shard(w, world, rank)))
            taken, maps, kept = passes[0] - before, passes[1] - maps_before, passes[2] - kept_before
            ours = MODES[mode].get("fla_transition", "fla") != "fla"
            # gdn_fla_chain serves the concurrent and transition forms; our maps only the latter, on every
            # rank but 0 (it holds the chain's two ends: the first needs no forward map, the last no
            # backward one); unpacked rows' backward takes the forward's maps, packed rows' where fla keeps the
            # entering states as they are (a rank's parts without a document start inside), else makes its own
            inner = ours and rank > 0
            if ((taken > 0) != (MODES[mode].get("fla_concurrent_parts", False) or ours) or (maps > 0) != inner
                    or (kept > 0 and not inner) or (cu is None and (kept > 0) != inner)):
                raise RuntimeError(f"{mode}: gdn_fla_chain took {taken} chain passes, our kernel {maps} maps, the "
                                   f"backward {kept} kept maps")
            for r in rows[first_row:]:
                r["gdn_fla_chain_passes"], r["transition_maps"], r["kept_maps"] = taken, maps, kept
    if calls is not None:
        if not calls[0]:
            raise RuntimeError("--dqkwg ours: our kernel was never called: the hook did not take fla's calls")
        for r in rows:
            r["ours_dqkwg_calls"] = calls[0]
    (Path(out_dir) / f"{world}-{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _compare(rows, mode, case, world, rank, batch, want, singles, got):
    import torch.distributed as dist
    for name, g in got.items():
        local = name in ("out", "dx")  # this rank's positions; parameter gradients summed over the group
        if not local:
            g = g.clone()
            dist.all_reduce(g)

        def mine(t, local=local):  # a whole-sequence run's values at this rank's positions
            return t[:, batch.index] if local else t
        want_t = mine(want[name]).double()

        def err(t):
            return (t.double() - want_t).abs().max().item()
        row = {"mode": mode, "ranks": world, "rank": rank, "case": case, "tensor": name, "err": err(g),
               "twin_fp32_err": err(mine(singles[0][name])), "fla_single_err": err(mine(singles[1][name])),
               "ref_max": want_t.abs().max().item()}
        row["ok"] = row["err"] <= 4 * max(row["twin_fp32_err"], row["fla_single_err"]) + 1e-5 * row["ref_max"]
        rows.append(row)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, ranks, extra: list[str]) -> list:
    """Runs `script --worker <world> <port> <out dir> *extra` for each world in `ranks`, each in a process
    under Triton's interpreter with the private fla copy on its path; every rank's rows, read back from
    the <world>-<rank>.json files its workers wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        site, out = _private_fla(Path(tmp) / "site"), Path(tmp) / "out"
        out.mkdir()
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        for world in ranks:
            subprocess.run([sys.executable, script, "--worker", str(world), str(_port()), str(out), *extra],
                           env=env, check=True)
        return [r for f in sorted(out.glob("*.json")) for r in json.loads(f.read_text())]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--dqkwg", choices=["fla", "ours"], default="fla",
                   help="whose gated dq/dk/dw/dg kernel fla's backward runs: fla's, or ours as the GPU machines "
                        "install it where fla refuses its own (results/probe_fla_cp_interpreter_ours_dqkwg.json)")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # world, port, out dir, dqkwg (the re-executed run)
    args = p.parse_args()
    if args.worker:
        import torch.multiprocessing as mp
        world, port, out, dqkwg = int(args.worker[0]), int(args.worker[1]), args.worker[2], args.worker[3]
        mp.spawn(_worker, args=(world, port, out, dqkwg), nprocs=world, join=True)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from stamp import stamp
    rows = run_workers(__file__, args.ranks, [args.dqkwg])
    result = {**stamp(), "probe": "fla_cp_interpreter", "fla": "fla-core 0.6.0 (private copy, interpreter patches)",
              "dqkwg": args.dqkwg,
              "tokens": T, "hidden": HIDDEN, "heads_dims": DIMS, "cases": {k: list(v[1] or []) for k, v in CASES.items()},
              "all_ok": all(r["ok"] for r in rows), "rows": rows}
    name = "probe_fla_cp_interpreter" + ("_ours_dqkwg" if args.dqkwg == "ours" else "")
    (HERE.parent / "results" / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        if not r["ok"] or r["rank"] == 0 and r["tensor"] in ("out", "dx", "ddt_bias"):
            print(json.dumps(r))
    print("all within the rule:", result["all_ok"])


if __name__ == "__main__":
    main()
