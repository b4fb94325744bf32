"""Multi-rank harness of the weight-transfer tests: trainer ranks (FSDP2, optionally EP = 2) and
rollout ranks (a vLLM-style engine at TP n, or transformers' model) in one gloo world (or, with
`cuda=True`, one NCCL world of one GPU a rank).

`spawn` runs `scenario(ctx)` on every rank; each rank returns a picklable result saved to disk. A
rank may be killed on purpose (a dead sender): the harness then collects whatever ranks wrote,
and every survivor leaves with os._exit (a gloo group with a dead peer cannot be torn down).
A rank that raises fails the run: spawn ends the other ranks `CRASH_GRACE_S` later (they may wait on
it up to the limit) and reports every rank's traceback.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee import models, registry
from tests.primitives.weight_transfer_engines import HFReceiver, VllmStyleEngine
from tests.ranks import free_port


@dataclass
class Ctx:
    rank: int
    trainers: tuple
    rollouts: tuple
    out: Path
    params: dict = field(default_factory=dict)

    @property
    def is_trainer(self):
        return self.rank in self.trainers



def _worker(rank, world, port, module, scenario, trainers, out, params):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests.limits import PROCESS_GROUP_TIMEOUT
    if params.get("cuda"):  # one GPU a rank, NCCL (the control store is still rank 0's TCP store)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    ranks = tuple(range(world))
    # rollout_first: the rollout ranks come first, so a trainer that dies is not the store's host
    trainer_ranks = ranks[world - trainers:] if params.get("rollout_first") else ranks[:trainers]
    ctx = Ctx(rank, trainer_ranks, tuple(r for r in ranks if r not in trainer_ranks), Path(out), params)
    try:
        result = getattr(importlib.import_module(module), scenario)(ctx)
    except BaseException as e:
        import traceback
        result = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    torch.save(result, Path(out) / f"{scenario}-{rank}.pt")
    if "crash" in result:  # tells spawn() to end the other ranks (they may wait on this one for long)
        (Path(out) / f"{scenario}-{rank}.crash").touch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


CRASH_GRACE_S = 10.0  # after a rank raised, how long its peers get to record their own errors


def spawn(trainers: int, rollouts: int, module: str, scenario: str, out: Path, timeout_s=None, **params) -> list:
    from tests.limits import SUBPROCESS_TIMEOUT_S
    timeout_s = timeout_s or SUBPROCESS_TIMEOUT_S
    world = trainers + rollouts
    ctx = mp.start_processes(_worker, args=(world, free_port(), module, scenario, trainers, str(out), params),
                             nprocs=world, join=False, start_method="spawn")
    deadline, crashed_at = time.time() + timeout_s, None
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{scenario}: ranks still running after {timeout_s} s")
        if crashed_at is None and any(Path(out).glob(f"{scenario}-*.crash")):
            crashed_at = time.time()
        if crashed_at is not None and time.time() > crashed_at + CRASH_GRACE_S:  # a rank raised: the run
            for p in ctx.processes:  # failed; its peers may wait on it up to the limit, so end them
                p.kill()
            break
    res = []
    for r in range(world):
        f = Path(out) / f"{scenario}-{r}.pt"
        res.append(torch.load(f, weights_only=False) if f.exists() else {"dead": True})
    crashed = [(r, x["crash"]) for r, x in enumerate(res) if isinstance(x, dict) and "crash" in x]
    assert not crashed, "\n".join(f"rank {r}: {c}" for r, c in crashed)
    return res


def transfer_error(fn):
    """The TransferError `fn()` raised, as text (None: it returned)."""
    from bumblebee.primitives.weight_transfer import TransferError
    try:
        fn()
    except TransferError as e:
        return f"{type(e).__name__}: {e}"
    return None


# ---- the two sides ---------------------------------------------------------------------------

def trainer_state(ctx: Ctx, name: str, *, ep: bool = False, seed: int = 0):
    """FSDP2 over the trainer ranks (EP = 2 when `ep`): the model and its TrainState."""
    from torch.distributed.device_mesh import DeviceMesh
    n = len(ctx.trainers)
    dispatch = {"moe_dispatch": "all_to_all" if ep else "local"} if models.NAMED[name].get(
        "num_experts") or models.NAMED[name].get("n_routed_experts") else None
    model = models.build(name, impl=dispatch, seed=seed)
    mesh = DeviceMesh("cpu", torch.tensor(ctx.trainers), mesh_dim_names=("dp",))
    ep_mesh = None
    if ep:
        from bumblebee.parallelize import shard_experts
        ep_mesh = DeviceMesh("cpu", torch.tensor(ctx.trainers).view(n // 2, 2), mesh_dim_names=("efsdp", "ep"))
        shard_experts(model, ep_mesh["ep"].get_group())
    state = registry.resolve("state_sharding", "fsdp2")(model, mesh, lr=1e-2, mixed_precision="fp32",
                                                        grad_clip=None, ep_mesh=ep_mesh)
    return model, state, mesh


def other_meshes(ctx: Ctx, ep: bool):
    """What rollout ranks must call so that the trainer's meshes can be made (new_group is world-wide)."""
    from torch.distributed.device_mesh import DeviceMesh
    n = len(ctx.trainers)
    DeviceMesh("cpu", torch.tensor(ctx.trainers), mesh_dim_names=("dp",))
    if ep:
        DeviceMesh("cpu", torch.tensor(ctx.trainers).view(n // 2, 2), mesh_dim_names=("efsdp", "ep"))


def train_step(model, state, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    state.model(ids, labels=ids).loss.backward()
    state.step()
    state.zero_grad()


def hf_full(model, state) -> dict:
    """The full HF tensors (gathered over the trainer ranks: every trainer rank must call it)."""
    from bumblebee.runtime import export
    return {k: v.clone() for k, v in export.export_weights(model, state, bucket_bytes=1 << 30)}


def shards(model, state):
    from bumblebee.runtime import export
    return list(export.export_weight_shards(model, state))


def engine(ctx: Ctx, name: str, manifest, kind: str = "vllm", ep: bool = False):
    """(load_weights, targets, layout key) of a rollout rank: a vLLM-style engine at TP = rollouts
    (its experts over EP = rollouts when `ep`) or transformers' own model."""
    r, n = ctx.rollouts.index(ctx.rank), len(ctx.rollouts)
    if kind == "hf":
        import transformers
        cfg = dict(models.NAMED[name])
        cls = {"qwen3": transformers.Qwen3Config}[cfg.pop("model_type")]
        with torch.random.fork_rng():
            rec = HFReceiver(transformers.AutoModelForCausalLM.from_config(cls(**cfg)))
        return rec.load_weights, rec.params, "hf"
    eng = VllmStyleEngine(manifest, models.NAMED[name], tp_rank=r, tp_size=n, ep_rank=r if ep else 0,
                          ep_size=n if ep else 1)
    return eng.load_weights, eng.params, f"tp{r}/{n}-ep{int(ep)}"


def manifest_of_model(name: str):
    from bumblebee.primitives.weight_transfer.spec import manifest_of
    from bumblebee.runtime import export
    m = models.build(name, seed=0)
    return manifest_of((s.name, s.shape, s.tensor.dtype) for s in export.export_weight_shards(m, None))
