"""The runtime's RL surface on 1 and 2 gloo ranks, under both `state_sharding` twins and with expert
parallelism (EP = 2): one batch split over micro-batches and ranks gives one gradient (ranks with
different micro-batch counts included, FSDP2 reducing once or after every micro-batch), routes
recorded in micro-batches replay, offload round trips are bitwise and the next step equals
one without, per-step AdamW hyperparameters and the schedule match plain torch AdamW, and the
exports (gathered and rank-local shards) equal save_pretrained's safetensors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bumblebee import models, registry
from bumblebee.runtime import Batch, LRSchedule, Runtime
from tests.primitives.test_state_sharding import spawn

NAME, ROWS, T, LR = "qwen3-moe-tiny", 5, 9, 1e-2
EPS = 1e-6  # Adam's eps above the gradients' float32 rounding (tests/primitives/test_state_sharding.py: HP)
VARIANTS = {"fsdp2": ("fsdp2", False), "zero1": ("zero1", False), "fsdp2_ep": ("fsdp2", True),
            "zero1_ep": ("zero1", True)}


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.NAMED[NAME]["vocab_size"], (ROWS, T), generator=g)
    mask = torch.rand(ROWS, T, generator=g) < 0.8
    adv = torch.randn(ROWS, T, generator=g)
    old = -3 + 0.3 * torch.randn(ROWS, T, generator=g)
    return ids, mask, adv, old


def _rows(n, r):
    """Uneven shares (3 + 2 rows on two ranks): micro-batch counts differ, dummies keep step."""
    cuts = [0, 3, ROWS] if n == 2 else [0, ROWS]
    return slice(cuts[r], cuts[r + 1])


def _batch(n, r, seed=0):
    ids, mask, adv, old = (t[_rows(n, r)] for t in _data(seed))
    return Batch(ids, loss_mask=mask, advantages=adv, sampler_logprobs=old)


def _replay(batch, routes):
    batch.routed_experts = routes
    return batch


def _runtime(mesh, variant, seed=0, **kw):
    impl, ep = VARIANTS[variant]
    ep_mesh = None
    model = models.build(NAME, impl={"moe_dispatch": "all_to_all" if ep else "local"}, seed=seed)
    if ep:
        from torch.distributed.device_mesh import init_device_mesh
        from bumblebee.parallelize import shard_experts
        ep_mesh = init_device_mesh("cpu", (mesh.size() // 2, 2), mesh_dim_names=("efsdp", "ep"))
        shard_experts(model, ep_mesh["ep"].get_group())
    state = registry.resolve("state_sharding", impl)(model, mesh, lr=LR, eps=EPS, mixed_precision="fp32",
                                                     grad_clip=None, ep_mesh=ep_mesh)
    return Runtime(model, state, **kw)


def _full_grads(state):
    shards = state.reduced_grad_shards()
    out = {name: state._as_dtensor(name, g).full_tensor() for name, g in zip(state.masters(), shards)}
    state.zero_grad()
    return out


def _snapshot(rt):
    return {part: [t.clone() for t in ts] for part, ts in rt.placement.tensors().items()}


def _ptrs(rt):
    return {part: [t.data_ptr() for t in ts if t.numel()] for part, ts in rt.placement.tensors().items()}


def _step(rt, n, r, seed):
    rt.forward_backward(_batch(n, r, seed), "ppo", loss_agg_mode="token-mean", micro_batch_tokens=2 * T)
    return rt.optim_step()


def rl_ranks(mesh, out: Path):
    n, r = mesh.size(), mesh.get_local_rank()
    res = {"grads": {}, "offload": {}, "export": {}, "hp": {}}
    for variant, (impl, ep) in VARIANTS.items():
        if ep and n < 2:
            continue
        rt = _runtime(mesh, variant)
        for mbt, each in ((None, False), (2 * T, False), (T, False), (T, True)):  # 1, rows of 2, rows of 1
            rt.forward_backward(_batch(n, r), "ppo", loss_agg_mode="seq-mean-token-mean", micro_batch_tokens=mbt,
                                reduce_each_micro_batch=each)
            res["grads"][(variant, mbt, each)] = _full_grads(rt.state)
        # routes recorded in micro-batches, then replayed by routers whose weights moved
        rec = rt.forward(_batch(n, r), return_routed_experts=True, micro_batch_tokens=T)
        _step(rt, n, r, 3)
        fresh = rt.forward(_batch(n, r), return_routed_experts=True)
        again = rt.forward(_replay(_batch(n, r), rec.routed_experts), return_routed_experts=True)
        res.setdefault("replay", {})[variant] = {"replayed": torch.equal(again.routed_experts, rec.routed_experts),
                                                 "moved": not torch.equal(fresh.routed_experts, rec.routed_experts)}

        # offload: each part alone onto new storage, then the whole round trip; then a step
        a, b = _runtime(mesh, variant), _runtime(mesh, variant)
        for x in (a, b):
            _step(x, n, r, 1)
            x.forward_backward(_batch(n, r, 2), "ppo", loss_agg_mode="token-mean")
        before, ptrs = _snapshot(a), _ptrs(a)
        moved = {}
        for part in ("model", "optimizer", "grad"):
            a.to("cpu", copy=True, **{p: p == part for p in ("model", "optimizer", "grad")})
            now = _ptrs(a)
            moved[part] = {q: sum(x != y for x, y in zip(ptrs[q], now[q])) / max(len(ptrs[q]), 1) for q in ptrs}
            ptrs = now
        after = _snapshot(a)
        same = all(torch.equal(x, y) for p in before for x, y in zip(before[p], after[p]))
        steps = [x.optim_step() for x in (a, b)]
        res["offload"][variant] = {"moved": moved, "bitwise": same, "norms": [s["grad_norm"] for s in steps],
                                   "same_weights": all(torch.equal(x, y) for x, y in zip(
                                       a.placement.tensors()["model"], b.placement.tensors()["model"]))}

        hf = out / f"hf-{variant}-{n}"
        rt.save_weights(hf)
        res["export"][variant] = {"full": dict(rt.export_weights(bucket_bytes=20_000)),
                                  "shards": [(s.name, s.tensor.clone(), s.offsets, s.shape, s.replicated)
                                             for s in rt.export_weight_shards()],
                                  "path": hf}

        # AdamW hyperparameters per step and a warm-up schedule (lr 0, then half, then all of LR)
        h = _runtime(mesh, variant, lr_schedule=LRSchedule("linear_warmup", warmup_steps=2))
        lrs = []
        for i, hp in enumerate(({"betas": (0.8, 0.9), "weight_decay": 0.1}, {}, {"lr": 3e-3, "eps": 1e-5})):
            if i:
                lrs.append(h.lr_scheduler_step())
            h.forward_backward(_batch(n, r, 10 + i), "importance_sampling", loss_agg_mode="token-mean")
            lrs.append(h.optim_step(**hp)["lr"])
        res["hp"][variant] = {"lrs": lrs, "weights": h.state.full_state_dict(torch.float32),
                              "hyperparameters": h.hyperparameters()}
    return res


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request, tmp_path_factory):
    return spawn(request.param, "rl_ranks", tmp_path_factory.mktemp("rl"), module=__name__)


def _reference_grads():
    model = models.build(NAME, impl={"moe_dispatch": "local"}, seed=0)
    rt = Runtime(model)
    rt.forward_backward(_batch(1, 0), "ppo", loss_agg_mode="seq-mean-token-mean")
    return {n: p.grad for n, p in model.named_parameters()}


def test_micro_batches_and_ranks_give_one_gradient(runs):
    want = _reference_grads()
    assert len(runs[0]["grads"]) == 4 * (4 if len(runs) == 2 else 2)  # EP variants on two ranks only
    for key, got in runs[0]["grads"].items():
        assert set(got) == set(want), key
        for name, g in got.items():
            torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=f"{key} {name}")


def test_routes_replay_on_every_layout(runs):
    for rank in runs:
        for variant, res in rank["replay"].items():
            assert res["replayed"], variant
    assert any(res["moved"] for rank in runs for res in rank["replay"].values())  # the step moved some route


def test_offload_round_trip_is_bitwise_and_the_next_step_unchanged(runs):
    for rank in runs:
        for variant, res in rank["offload"].items():
            assert res["bitwise"], variant
            for part, moved in res["moved"].items():  # each part moved all of its tensors, and only those
                assert moved[part] == 1.0 and all(v == 0 for q, v in moved.items() if q != part), (variant, part)
            assert res["norms"][0] == res["norms"][1] and res["same_weights"], variant


def test_hyperparameters_and_schedule_match_torch_adamw(runs):
    model = models.build(NAME, impl={"moe_dispatch": "local"}, seed=0)
    # eps starts at 1e-6 on both sides (EPS): at 1e-8 a rounding-noise gradient entry moves by +-lr
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    rt = Runtime(model)
    steps = [dict(lr=0.0, betas=(0.8, 0.9), weight_decay=0.1), dict(lr=LR / 2), dict(lr=3e-3, eps=1e-5)]
    for i, hp in enumerate(steps):
        for group in opt.param_groups:
            group.update(hp)
        rt.forward_backward(_batch(1, 0, 10 + i), "importance_sampling", loss_agg_mode="token-mean")
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    for rank in runs:
        for variant, res in rank["hp"].items():
            assert res["lrs"] == pytest.approx([0.0, LR / 2, LR / 2, LR, 3e-3]), variant
            assert res["hyperparameters"] == {"lr": 3e-3, "betas": (0.8, 0.9), "eps": 1e-5, "weight_decay": 0.1}
            for k, v in want.items():
                torch.testing.assert_close(res["weights"][k], v, rtol=1e-4, atol=2e-4, msg=f"{variant} {k}")


def test_exports_equal_save_pretrained(runs):
    from safetensors.torch import load_file
    for variant in runs[0]["export"]:
        want = load_file(runs[0]["export"][variant]["path"] / "model.safetensors")
        filled = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
        for rank in runs:
            got = rank["export"][variant]["full"]
            assert set(got) == set(want), variant
            assert all(torch.equal(got[k], v) for k, v in want.items()), variant
            for name, t, offsets, shape, replicated in rank["export"][variant]["shards"]:
                assert shape == tuple(want[name].shape), name
                filled[name][tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
        for k, v in want.items():  # the ranks' shards tile every tensor exactly
            assert torch.equal(filled[k], v), (variant, k)
