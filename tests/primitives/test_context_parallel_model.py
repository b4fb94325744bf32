"""Whole tiny models at CP = 2 against CP = 1 over a few AdamW steps (fp32, gloo, one spawn).

Qwen3 (unpacked B = 2; packed with one-token documents; packed with B = 2, one stream across the
row end; the ring exchange), Qwen3.5 (gated DeltaNet and gated attention layers in one layout,
under full recompute, with its MTP depth) and DeepSeek-V3 (MLA by an all-gather of the latent and
RoPE key, MoE, MTP, aux-free router biases moved by the loads of every cp rank's tokens); Qwen3-MoE
with its load-balancing loss over the whole batch's tokens; experts split over the cp ranks (EP =
CP = 2, all-to-all dispatch) for Qwen3-MoE and DeepSeek-V3; FSDP2 over the (dp = 1, cp = 2) mesh
with full recompute for Qwen3 (packed) and Qwen3.5 (the ring), and over (dp = 2, cp = 2) for Qwen3
(`fsdp_dp2_cp2`) and for Qwen3-MoE with `ep_mesh` (EP = 2 along dp or along cp, `fsdp_ep`; both run
in the 4-rank spawn of test_context_parallel.py, grad norms checked too); Qwen3.5-MoE in float64 on
both sides (equal to float64 rounding: the cp paths compute in the inputs' precision). Each step's
loss (the ranks' shares summed) and the final weights lie within the fp32 single-rank run's own
error against float64 (4x plus 8 ulps for losses, 8x per tensor for weights); the single-rank run
is the model's plain forward with labels.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bumblebee import models, registry
from bumblebee.models import moe
from bumblebee.parallelize import shard_experts
from bumblebee.primitives.context_parallel import layout
from bumblebee.primitives.context_parallel import model as cp_model
from tests.primitives.context_parallel_ranks import EPS32, error, spawn, within

PACKED = torch.tensor([0, 5, 6, 30, 31, 48])
STEPS = 3
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)  # eps above fp32 gradient noise
CASES = {  # name -> (config, B, T, cu_seqlens, exchange, recompute); "fsdp2": FSDP2 over the (dp, cp) mesh
    "qwen3": ("qwen3-tiny", 2, 32, None, "allgather", False),
    "qwen3_fsdp2": ("qwen3-tiny", 1, 48, PACKED, "allgather", True),
    "qwen3_packed": ("qwen3-tiny", 1, 48, PACKED, "allgather", False),
    # B = 2 packed (cu_seqlens over the 48 tokens, a document across the row end): one stream under cp
    "qwen3_packed_b2": ("qwen3-tiny", 2, 24, PACKED, "allgather", False),
    "qwen3_ring": ("qwen3-tiny", 1, 48, PACKED, "ring", False),
    "qwen3.5": ("qwen3.5-tiny", 1, 48, PACKED, "allgather", True),
    "deepseek-v3": ("deepseek-v3-tiny", 2, 32, None, "allgather", False),
    # the softmax routers' load-balancing loss over the whole batch's tokens, not each rank's
    "qwen3-moe_aux": ({**models.NAMED["qwen3-moe-tiny"], "output_router_logits": True}, 2, 32, None, "allgather",
                      False),
    # experts split over the cp ranks (EP = CP = 2), tokens exchanged by the all-to-all dispatch
    "qwen3-moe_ep": ("qwen3-moe-tiny", 1, 48, PACKED, "allgather", False),
    # unpacked: packed, a few kv_b_proj gradient entries sit near zero, where AdamW's eps turns their
    # rounding noise into weight moves of ~lr / eps x noise on both sides (packed MLA is held at the
    # gradient level in test_context_parallel.py)
    "deepseek-v3_ep": ("deepseek-v3-tiny", 2, 32, None, "allgather", False),
    # Qwen3.5 (DeltaNet, gated attention, MTP) under FSDP2 over the (dp = 1, cp = 2) mesh, the ring
    "qwen3.5_fsdp2": ("qwen3.5-tiny", 1, 48, PACKED, "ring", True),
    # Qwen3.5-MoE, in float64 on both sides (`EXACT`): its fp32 norm weights sit at the edge of the
    # fp32 rule (near-zero gradient entries, whose noise AdamW's eps scales by lr / eps)
    "qwen3.5-moe": ("qwen3.5-moe-tiny", 1, 48, PACKED, "ring", True),
}


EXACT = {"qwen3.5-moe"}  # compared in float64: the cp path computes in the inputs' precision (fp32 at least)
EXACT_FLOOR = 1e-11  # float64 rounding scaled by AdamW's lr / eps (3e3) on near-zero gradient entries


def _batches(vocab, B, T):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (B, T), generator=g) for _ in range(STEPS)]


def _train(case, dtype, group=None):
    name, B, T, cu, exchange, recompute = CASES[case]
    ep = group is not None and case.endswith("_ep")
    impl = {"moe_dispatch": "all_to_all"} if ep else None
    model = models.build(name, impl, seed=0, dtype=dtype).set_recompute(recompute)
    fsdp = group is not None and case.endswith("fsdp2")
    if ep:
        shard_experts(model, group)
    if group is not None:
        if fsdp:  # dp = 1 x cp = 2: the cp group is the mesh's, FSDP2 shards over both dims
            mesh = cp_model.mesh("cpu", 1, dist.get_world_size(group))
            group = mesh["cp"].get_group()
        cp_model.apply(model, group, cp_model.ContextParallel(exchange=exchange))
    if fsdp:
        state = registry.resolve("state_sharding", "fsdp2")(model, cp_model.data_mesh(mesh), mixed_precision="fp32",
                                                            **HP)
        return _train_fsdp(model, state, group, B, T, cu)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses = []
    for ids in _batches(model.config.vocab_size, B, T):
        if group is None:
            loss = model(ids, labels=ids, cu_seqlens=cu).loss
            loss.backward()
            total = loss.detach()
        else:
            depths = len(model.mtp.layers) if hasattr(model, "mtp") else 0
            loss = cp_model.loss(model, layout.shard_batch(ids, None, group, cu_seqlens=cu, mtp_depths=depths))
            loss.backward()
            cp_model.sync_grads(model, group)
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
        opt.step()
        opt.zero_grad()
        moe.update_router_bias(model, group=group)  # aux-free routers: loads of every cp rank's tokens
        losses.append(total)
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_fsdp(model, state, group, B, T, cu):
    losses = []
    for ids in _batches(model.config.vocab_size, B, T):
        depths = len(model.mtp.layers) if hasattr(model, "mtp") else 0
        loss = cp_model.loss(model, layout.shard_batch(ids, None, group, cu_seqlens=cu, mtp_depths=depths),
                             grads="mean")
        loss.backward()
        assert state.step()[0]
        state.zero_grad()
        moe.update_router_bias(model, group=state.group)
        total = loss.detach() / dist.get_world_size(group)
        dist.all_reduce(total, group=group)
        losses.append(total)
    return torch.stack(losses), state.full_state_dict(torch.float32)


def models_at_cp2(group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # the single-rank runs, float64 and fp32, split between the ranks, then shared
    mine = {case: (_train(case, torch.float64), _train(case, torch.float32))
            for i, case in enumerate(CASES) if i % world == rank}
    shared = [None] * world
    dist.all_gather_object(shared, mine, group=group)
    refs = {case: runs for part in shared for case, runs in part.items()}
    errors = {}
    for case in CASES:
        (l64, w64), (l32, w32) = refs[case]
        if case in EXACT:  # float64 both sides: equal up to float64 rounding
            l, w = _train(case, torch.float64, group)
            errors[f"{case} losses"] = ((l - l64).abs().max().item(), 0.0, EXACT_FLOOR * l64.abs().max().item())
            for k in w64:
                errors[f"{case} {k}"] = ((w[k] - w64[k]).abs().max().item(), 0.0, EXACT_FLOOR)
            continue
        l, w = _train(case, torch.float32, group)
        errors[f"{case} losses"] = error(l, l64, l32)
        for k in w64:
            if w[k].shape != w64[k].shape:  # this rank's experts of an EP run
                n = w[k].shape[0]
                w64[k], w32[k] = (t[rank * n:(rank + 1) * n] for t in (w64[k], w32[k]))
            e, r, _ = error(w[k], w64[k], w32[k])
            errors[f"{case} {k}"] = (e, 2 * r, 8 * EPS32 * w64[k].abs().max().item())  # 8x: within() takes 4x
    return errors


def fsdp_dp2_cp2(world):
    """Qwen3 under FSDP2 over the (dp = 2, cp = 2) mesh of 4 ranks (run inside the 4-rank spawn of
    tests/primitives/test_context_parallel.py): each dp pair shards its own row of a [2, 32] batch;
    against one rank on the whole batch (the mean of the rows' mean losses). Returns the errors as
    `models_at_cp2` does."""
    return _dp2_cp2("qwen3-tiny", _shared_refs("qwen3-tiny", 2, 32))


MOE_AUX = {**models.NAMED["qwen3-moe-tiny"], "output_router_logits": True}


def fsdp_ep(world):
    """Qwen3-MoE (its load-balancing loss on) under FSDP2 over the (dp = 2, cp = 2) mesh with
    `ep_mesh` (efsdp = 2, ep = 2, all-to-all dispatch): experts split over the dp ranks (each expert
    pair held by ranks of different cp groups and sequences) and over the cp ranks; run inside the
    4-rank spawn of tests/primitives/test_context_parallel.py."""
    refs = _shared_refs(MOE_AUX, 2, 32)
    return {**_dp2_cp2(MOE_AUX, refs, ep="dp"), **_dp2_cp2(MOE_AUX, refs, ep="cp")}


def _shared_refs(name, B, T):
    """The single-rank runs `_train_rows` in float64 (rank 0) and fp32 (rank 1), shared with every rank."""
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, _train_rows(name, B, T, (torch.float64, torch.float32)[rank]) if rank < 2 else None)
    return parts[:2]


def _dp2_cp2(name, refs, ep=None):
    """FSDP2 over the (dp = 2, cp = 2) mesh, each dp pair its own row of a [2, 32] batch, over three
    AdamW steps, against one rank on the whole batch (`refs`): losses, grad norms and the final weights.
    ep: split the experts over ep = 2 ranks along the mesh's "dp" or "cp" dimension (`cp_model.expert_mesh`)."""
    B, T = 2, 32
    mesh = cp_model.mesh("cpu", 2, 2)
    group, row = mesh["cp"].get_group(), mesh.get_local_rank("dp")
    model = models.build(name, {"moe_dispatch": "all_to_all"} if ep else None, seed=0, dtype=torch.float32)
    kw = {}
    if ep:
        kw["ep_mesh"] = cp_model.expert_mesh(mesh, 2, over=ep)
        shard_experts(model, kw["ep_mesh"]["ep"].get_group())
    model = cp_model.apply(model, group)
    state = registry.resolve("state_sharding", "fsdp2")(model, cp_model.data_mesh(mesh), mixed_precision="fp32",
                                                        **kw, **HP)
    losses, norms = [], []
    for ids in _batches(model.config.vocab_size, B, T):
        loss = cp_model.loss(model, layout.shard_batch(ids[row:row + 1], None, group), grads="mean")
        loss.backward()
        ok, norm, _ = state.step()
        assert ok
        state.zero_grad()
        total = loss.detach() / (2 * 2)  # the share times CP, over CP, averaged over the dp rows
        dist.all_reduce(total)
        losses.append(total)
        norms.append(norm)
    weights = state.full_state_dict(torch.float32)
    (l64, n64, w64), (l32, n32, w32) = refs
    case = "dp2_cp2" + (f" ep over {ep}" if ep else "")
    errors = {f"{case} losses": error(torch.stack(losses), l64, l32),
              f"{case} grad norms": error(torch.tensor(norms), n64, n32)}
    for k in w64:
        e, r, _ = error(weights[k], w64[k], w32[k])
        errors[f"{case} {k}"] = (e, 2 * r, 8 * EPS32 * w64[k].abs().max().item())
    return errors


def _train_rows(name, B, T, dtype):
    """One rank on the whole [B, T] batches, each row its own forward (as each dp rank runs its own;
    the load-balancing loss is per row), the loss their mean: (losses, grad norms, weights)."""
    model = models.build(name, None, seed=0, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses, norms = [], []
    for ids in _batches(model.config.vocab_size, B, T):
        loss = sum(model(ids[r:r + 1], labels=ids[r:r + 1]).loss for r in range(B)) / B
        loss.backward()
        norms.append(torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]).norm())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(2, __name__, "models_at_cp2", tmp_path_factory.mktemp("cp_models"))


@pytest.mark.parametrize("case", list(CASES))
def test_model_at_cp2_equals_cp1(case, two_ranks):
    for rank, errors in enumerate(two_ranks):
        mine = {k: v for k, v in errors.items() if k.startswith(case + " ")}
        assert len(mine) > 5
        assert within(mine) == [], f"rank {rank}"


def test_apply_refuses_a_second_time():
    model = cp_model.apply(models.build("qwen3-tiny"), None)
    with pytest.raises(ValueError, match="already applied"):
        cp_model.apply(model, None)
    with pytest.raises(ValueError, match="exchange"):
        cp_model.ContextParallel(exchange="a2a")


def test_sync_grads_refuses_experts_over_another_group_and_expert_mesh_bad_input():
    """Experts split over a group other than the cp group need state sharding with `ep_mesh`
    (`test_fsdp2_with_ep_mesh_beside_cp_equals_one_rank`): sync_grads says so before any collective."""
    from types import SimpleNamespace
    model = models.build("qwen3-moe-tiny")
    for m in model.modules():
        if getattr(m, "expert_parallel_params", None):
            m.ep_group = object()  # some group other than the cp group (None here)
    with pytest.raises(ValueError, match=r"ep group != cp group.*ep_mesh=expert_mesh"):
        cp_model.sync_grads(model, None)
    mesh = SimpleNamespace(mesh=torch.arange(4).view(2, 2), device_type="cpu")
    with pytest.raises(ValueError, match="ep must be a positive int dividing the mesh's 4 ranks"):
        cp_model.expert_mesh(mesh, 3)
    with pytest.raises(ValueError, match="over must be 'cp' or 'dp'"):
        cp_model.expert_mesh(mesh, 2, over="ep")
