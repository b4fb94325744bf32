"""transformers' own tensor-parallel model (`from_pretrained(..., tp_plan="auto")`, DTensor
parameters) as a receiver layout on 2 gloo ranks: the layout inferred from a loader built on
transformers' own per-parameter shard operation (`DtensorShardOperation.shard_tensor`, what its
from_pretrained reads each rank's slice with) is the TP plan's (colwise rows, rowwise columns,
vocabulary rows, replicated norms) and replays, bit for bit, the local shards from_pretrained
loaded. Needs `accelerate` (transformers asks for it with a tp_plan); skipped without it.

A transfer into this model from trainer ranks in the same process group is not possible:
transformers builds its TP mesh over the whole default world and refuses any other size ("The
parallel mesh requires 2 processes, but world_size is 3"), so trainer and rollout cannot share it."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from tests.limits import SUBPROCESS_TIMEOUT_S as LIMIT
from tests.primitives import weight_transfer_ranks as R

pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
MOD = __name__


class HFTensorParallelReceiver:
    """The local shards of a tp_plan="auto" model as targets; load_weights slices each full tensor
    with transformers' own shard operation for that DTensor parameter."""

    def __init__(self, model):
        from torch.distributed.tensor import DTensor
        from transformers.distributed.sharding_utils import DtensorShardOperation
        named = {n: p.data for n, p in model.named_parameters()}  # a Parameter over a DTensor: its .data is one
        self.params = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in named.items()}
        self.shard = {n: DtensorShardOperation(p) for n, p in named.items() if isinstance(p, DTensor)}
        self.placements = {n: tuple(repr(x) for x in p.placements) for n, p in named.items() if isinstance(p, DTensor)}

    @torch.no_grad()
    def load_weights(self, weights):
        for name, w in weights:
            self.params[name].copy_(self.shard[name].shard_tensor(w) if name in self.shard else w)


def tp2(ctx):
    import transformers
    from bumblebee.primitives.weight_transfer import infer_layout
    from bumblebee.primitives.weight_transfer.spec import manifest_of
    import os
    path = ctx.params["path"]
    world = str(len(ctx.rollouts))  # transformers sizes its TP mesh from the launcher's variables
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=world, LOCAL_RANK=str(ctx.rank), LOCAL_WORLD_SIZE=world)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    rec = HFTensorParallelReceiver(model)
    loaded = {n: t.detach().clone() for n, t in rec.params.items()}
    full = torch.load(f"{path}/full.pt")
    man = manifest_of((n, t.shape, t.dtype) for n, t in full.items())
    spec = infer_layout(rec.load_weights, rec.params, man, key=f"hf-tp{ctx.rank}/2")  # checked by a real call
    same = spec == infer_layout(rec.load_weights, rec.params, man, trace=False, verify=False)  # the value probes'
    with torch.no_grad():
        for t in rec.params.values():
            t.normal_()  # poison, then replay the spec from the checkpoint
    spec.apply(full, rec.params)
    replayed = {n: t.detach().clone() for n, t in rec.params.items()}
    return {"loaded": loaded, "replayed": replayed, "placements": rec.placements, "traced_equals_probed": same,
            "pieces": {p.hf_name: (p.box, p.target) for p in spec.pieces}}


def test_transformers_tp_plan_layout_is_inferred_and_replays_from_pretrained(tmp_path):
    import transformers
    cfg = dict(models.NAMED["qwen3-tiny"])
    cfg.pop("model_type")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg))
    hf.save_pretrained(tmp_path)
    full = {n: p.detach().clone() for n, p in hf.named_parameters()}
    torch.save(full, tmp_path / "full.pt")
    r = R.spawn(0, 2, MOD, "tp2", tmp_path, path=str(tmp_path))
    a = "model.layers.0.self_attn"
    for rank, res in enumerate(r):
        assert res["placements"][f"{a}.q_proj.weight"] == ("Shard(dim=0)",)  # the plan ran: DTensor shards
        assert res["traced_equals_probed"], rank
        for n, t in res["loaded"].items():
            assert torch.equal(res["replayed"][n], t), (rank, n)
        q, o = full[f"{a}.q_proj.weight"].shape, full[f"{a}.o_proj.weight"].shape
        assert res["pieces"][f"{a}.q_proj.weight"][0] == ((rank * q[0] // 2, 1, q[0] // 2), (0, 1, q[1]))  # colwise
        assert res["pieces"][f"{a}.o_proj.weight"][0] == ((0, 1, o[0]), (rank * o[1] // 2, 1, o[1] // 2))  # rowwise
        assert res["pieces"]["model.norm.weight"][0] == ((0, 1, full["model.norm.weight"].shape[0]),)  # replicated
