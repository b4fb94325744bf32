"""Probe (CPU, no GPU): what a gated DeltaNet step asks of the host, single layer against the CP layer.

On H200s the CP layer's step (fla's kernels, `ContextParallel`'s defaults) returns to the host after
22 ms for 27 ms of device work at 32K tokens a rank, the single layer after 12 ms for 21.5 ms
(`probe_gdn_profile.py --host`): at 16K a rank the host sets the step. This counts what that host work
is made of, with fla's real kernels run by Triton's interpreter (the private fla copy and shims of
`probe_fla_cp_interpreter.py`): per rank, one forward + backward after a warm one, the single layer on
one rank's share of the tokens against the CP layer at CP = 2 / 4:
- `triton`: kernel launches, by kernel (each one a Python launcher call on a GPU host, 10-40 us);
- `aten`: the ops torch dispatches (device kernels, allocations, copies), views apart, collectives apart;
- `python_calls`: Python function calls by package (fla, bumblebee, torch, other), outside the
  interpreter's own work: the wrappers' cost, which a GPU host pays per call as well.
Counts do not depend on the tokens beyond the number of parts and documents (each kernel is one launch
whatever its grid), so small shapes stand for the long ones. Writes results/probe_gdn_launches.json
(stamped); prints the totals per case.

    python benchmarks/context_parallel/probes/probe_gdn_launches.py [--ranks 2 4]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from probe_fla_cp_interpreter import _interpreter_shims, run_workers  # noqa: E402

T, HIDDEN, DIMS = 512, 32, (2, 4, 16, 16)  # parts of 128 (CP 2) or 64 (CP 4): two chunks or one
DEFAULTS = dict(deltanet="fla", fla_concurrent_parts=True, fla_transition="bf16x2")  # ContextParallel's on CUDA


class Inventory:
    """Counts the Triton launches and torch's dispatched ops of one step, then the Python calls of this
    thread in another (nothing inside a launch: the interpreter's own work is not the host's on a GPU)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.inside, self.on = threading.local(), False
        self.triton, self.aten, self.views, self.comm, self.py, self.fns = (collections.Counter() for _ in range(6))
        # in this order: the installed packages first, then this repository (where a venv may sit)
        self.roots = {"fla": "/fla/", "torch": "/torch/", "triton": "/triton/",
                      "bumblebee": str(HERE.parents[2]) + os.sep}
        inv = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inside = getattr(inv.inside, "v", False)
                if inv.on and not inside:
                    name = str(func.overloadpacket.__name__)
                    ns = func.namespace
                    (inv.comm if ns == "c10d" else inv.views if func.is_view else inv.aten)[f"{ns}.{name}"] += 1
                inv.inside.v = True  # the mode's own Python calls are not the step's
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    inv.inside.v = inside
        self.mode = Mode()

    def install(self):
        from triton.runtime.interpreter import InterpretedFunction
        run, inv = InterpretedFunction.run, self

        def counted(fn_self, *args, **kwargs):
            inside = getattr(inv.inside, "v", False)
            if inv.on and not inside:
                inv.triton[getattr(fn_self.fn, "__name__", "?")] += 1
            inv.inside.v = True
            try:
                return run(fn_self, *args, **kwargs)
            finally:
                inv.inside.v = inside
        InterpretedFunction.run = counted

    def _profile(self, frame, event, arg):
        if event == "call" and not getattr(self.inside, "v", False):
            f = frame.f_code.co_filename
            pkg = next((name for name, root in self.roots.items() if root in f), "other")
            self.py[pkg] += 1
            self.fns[f"{pkg}:{Path(f).name}:{frame.f_code.co_name}"] += 1

    def count(self, step):
        for c in (self.triton, self.aten, self.views, self.comm, self.py, self.fns):
            c.clear()
        self.on = True
        try:  # two steps: the dispatch mode's own Python would count as the step's under the profile hook
            with self.mode:
                step()
            self.on = False
            sys.setprofile(self._profile)
            step()
        finally:
            sys.setprofile(None)
            self.on = False
        return {"triton": sum(self.triton.values()), "aten": sum(self.aten.values()),
                "views": sum(self.views.values()), "collectives": sum(self.comm.values()),
                "python_calls": dict(self.py), "triton_by_kernel": dict(self.triton.most_common()),
                "aten_by_op": dict(self.aten.most_common()), "views_by_op": dict(self.views.most_common()),
                "collectives_by_op": dict(self.comm),
                "python_calls_by_function": dict(self.fns.most_common(60))}


def _worker(rank, world, port, out_dir):
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
    gdn_fla.why_not_fla_cp = lambda x, head_k_dim=None: None  # fla's kernels need CUDA: the interpreter runs them
    gdn.fla_falls_back = lambda *a, **k: None
    la.FLAGatedDeltaNet._fast = lambda self, x: True
    inv = Inventory()
    inv.install()
    torch.manual_seed(0)
    twin = ChunkedGatedDeltaNet(HIDDEN, *DIMS, conv_kernel_size=4)
    single = la.FLAGatedDeltaNet(la.FLAConfig(), HIDDEN, *DIMS, conv_kernel_size=4)
    single.load_state_dict(twin.state_dict())
    x = torch.randn(1, T, HIDDEN)
    batch = layout.make_batch(dist.group.WORLD, T, None)
    share = x[:, :T // world].clone()
    cases = {f"single layer, {T // world} tokens": (single, share),
             f"cp layer (defaults), CP = {world}, {T // world} tokens a rank":
                 (lambda t: gdn_forward(twin, t, batch, **DEFAULTS), layout.shard(x, world, rank))}
    rows = []
    for label, (fn, inp) in cases.items():
        def step(fn=fn, inp=inp):
            t = inp.detach().requires_grad_()
            fn(t).sum().backward()
        step()  # warm: contexts, caches, first-call imports
        rows.append({"case": label, "rank": rank, "ranks": world, **inv.count(step)})
    (Path(out_dir) / f"{world}-{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # world, port, out dir (the re-executed run)
    args = p.parse_args()
    if args.worker:
        import torch.multiprocessing as mp
        world, port, out = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        mp.spawn(_worker, args=(world, port, out), nprocs=world, join=True)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from stamp import stamp
    rows = run_workers(__file__, args.ranks, [])
    result = {**stamp(), "probe": "gdn_launches", "fla": "fla-core 0.6.0 (private copy, interpreter patches)",
              "tokens": T, "hidden": HIDDEN, "heads_dims": DIMS, "cp_options": DEFAULTS, "rows": rows}
    (HERE.parent / "results" / "probe_gdn_launches.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(json.dumps({k: r[k] for k in ("case", "rank", "triton", "aten", "views", "collectives", "python_calls")}))


if __name__ == "__main__":
    main()
