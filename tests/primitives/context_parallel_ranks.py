"""Multi-rank harness of the context-parallel tests: `spawn(world, scenario, out)` runs
`scenario(group)` of tests.primitives.test_context_parallel* on `world` gloo ranks (CPU, fp32, one
thread each) and returns every rank's result; and the tolerance rule they share."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.limits import PROCESS_GROUP_TIMEOUT
from tests.ranks import free_port, leave_group

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps



def _worker(rank, world, port, module, scenario, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        result = getattr(importlib.import_module(module), scenario)(dist.group.WORLD)
        torch.save(result, Path(out) / f"{scenario}-{world}-{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def spawn(world: int, module: str, scenario: str, out: Path) -> list:
    mp.spawn(_worker, args=(world, free_port(), module, scenario, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"{scenario}-{world}-{r}.pt", weights_only=False) for r in range(world)]


def cp_groups(world) -> list[tuple[int, object]]:
    """(CP, group) of this rank in a 4-rank spawn: CP = 4 over all, then CP = 2 over ranks {0, 1} or
    {2, 3} (every rank creates every group, as new_group requires)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(4, world), (2, pairs[dist.get_rank() // 2])]


def error(got: torch.Tensor, want64: torch.Tensor, fp32: torch.Tensor) -> tuple[float, float, float]:
    """(max |got - want64|, the fp32 single-rank run's own max error, 8 ulps of the reference's max):
    a check passes when the first is within 4x the second plus the third (`within`)."""
    want64 = want64.double()
    return ((got.double() - want64).abs().max().item(), (fp32.double() - want64).abs().max().item(),
            8 * EPS32 * want64.abs().max().item())


def compare_module(errors: dict, off: dict, case: str, rule, group, idx, got, ref64, ref32) -> None:
    """Record a module's cp run against its single-rank runs, each (output, input gradient, {name:
    parameter gradient}) over [B, T, ...]: output and input gradient at this rank's positions idx by
    `rule` (`error`, `error64`), the input gradient off them in `off`, parameter gradients summed
    over the group."""
    (o, gx, grads), (o64, gx64, p64), (o32, gx32, p32) = got, ref64, ref32
    errors[f"{case} out"] = rule(o, o64[:, idx], o32[:, idx])
    errors[f"{case} dx"] = rule(gx[:, idx], gx64[:, idx], gx32[:, idx])
    rest = gx.clone()
    rest[:, idx] = 0
    off[f"{case} dx"] = rest.abs().max().item()
    for n, g in grads.items():
        g = g.clone()
        dist.all_reduce(g, group=group)
        errors[f"{case} d{n}"] = rule(g, p64[n], p32[n])


def within(errors: dict) -> list[str]:
    """The names of the checks outside the rule, with their numbers."""
    return [f"{name}: {e} > 4 x {r} + {floor}" for name, (e, r, floor) in errors.items() if not e <= 4 * r + floor]


def error64(got: torch.Tensor, want64: torch.Tensor, fp32: torch.Tensor) -> tuple[float, float, float]:
    """`error` for a float64 run against the float64 reference: PyTorch's own float64 error taken as
    the fp32 run's scaled by eps64 / eps32 (the same operations' rounding, one precision down)."""
    e, r, floor = error(got, want64, fp32)
    return e, r * EPS64 / EPS32, floor * EPS64 / EPS32
