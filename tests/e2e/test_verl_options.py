"""Every option verl's engine, model, optimizer, checkpoint and actor configs hand to BumblebeeEngine
is honoured (each test below fails if the engine ignores it) or refused with an error naming it
(bumblebee/integrations/verl_options.py; the table in skills/rl-smoke/SKILL.md)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402


# ---- refused ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("use_fused_kernels", True),
                                         ("use_remove_padding", False), ("full_determinism", True),
                                         ("mixed_precision", "fp16")])
def test_engine_config_refuses(field, value):
    from bumblebee.integrations.verl import BumblebeeEngineConfig
    with pytest.raises(ValueError, match=field):
        BumblebeeEngineConfig(**{field: value})


def test_router_replay_modes_are_refused():
    from verl.workers.config.engine import EngineRouterReplayConfig

    from bumblebee.integrations.verl import BumblebeeEngineConfig
    with pytest.raises(ValueError, match="router_replay.mode"):
        BumblebeeEngineConfig(router_replay=EngineRouterReplayConfig(mode="R3"))


@pytest.mark.parametrize("field,value", [("lora_rank", 8), ("use_liger", True), ("enable_activation_offload", True),
                                         ("use_fused_kernels", True), ("override_config", {"rope_theta": 1.0}),
                                         ("tiled_mlp", {"enabled": True, "num_shards": 4})])
def test_model_config_refuses(field, value):
    from types import SimpleNamespace

    from bumblebee.integrations.verl_options import check_model
    with pytest.raises(ValueError, match=f"model.{field}"):
        check_model(SimpleNamespace(**{field: value}))


@pytest.mark.parametrize("field,value", [("optimizer", "AdamW8bit"), ("optimizer_impl", "torchao.optim"),
                                         ("override_optimizer_config", {"amsgrad": True})])
def test_optimizer_config_refuses(field, value):
    from verl.workers.config import FSDPOptimizerConfig

    from bumblebee.integrations.verl_options import check_optimizer
    with pytest.raises(ValueError, match=f"optim.{field}"):
        check_optimizer(FSDPOptimizerConfig(lr=1e-3, **{field: value}))


@pytest.mark.parametrize("field,value", [("save_contents", ["model"]), ("load_contents", ["model", "extra"]),
                                         ("save_contents", ["model", "optimizer", "extra", "dataloader"]),
                                         ("async_save", True)])
def test_checkpoint_config_refuses(field, value):
    from verl.trainer.config import CheckpointConfig

    from bumblebee.integrations.verl_options import check_checkpoint
    with pytest.raises(ValueError, match=f"checkpoint.{field}"):
        check_checkpoint(CheckpointConfig(**{field: value}), forward_only=False)
    check_checkpoint(CheckpointConfig(**{field: value}), forward_only=True)  # the reference model saves nothing


@pytest.mark.parametrize("field", ["use_fused_kernels", "use_prefix_grouper", "calculate_sum_pi_squared"])
def test_actor_config_refuses(field):
    from bumblebee.integrations.verl import BumblebeeActorConfig
    with pytest.raises(ValueError, match=f"actor.{field}"):
        BumblebeeActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=2, **{field: True})


# ---- honoured: the LR schedule ------------------------------------------------------------------
def _closed_form(kind, lr, step, warmup, total, min_ratio=0.0, cycles=0.5):
    """verl's schedules written out: linear warm-up from 0, then constant, or a cosine of `cycles`
    periods between 1 and min_ratio."""
    if step < warmup:
        return lr * step / warmup
    if kind == "constant":
        return lr
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * 2 * cycles * progress)))


@pytest.mark.parametrize("kind,opts,warmup", [
    ("constant", dict(lr_warmup_steps=3), 3), ("constant", dict(lr_warmup_steps_ratio=0.25), 2),
    ("cosine", dict(lr_warmup_steps=2, min_lr_ratio=0.1), 2), ("cosine", dict(lr_warmup_steps_ratio=0.5), 4),
    ("cosine", dict(num_cycles=1.0), 0)])
def test_lr_schedule_follows_verl_options(kind, opts, warmup):
    from verl.workers.config import FSDPOptimizerConfig

    from bumblebee.integrations.verl_options import lr_schedule
    cfg = FSDPOptimizerConfig(lr=1e-3, total_training_steps=8, lr_scheduler_type=kind, **opts)
    sched = lr_schedule(cfg, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr))
    for step in range(8):
        want = _closed_form(kind, 1e-3, step, warmup, 8, opts.get("min_lr_ratio", 0.0), opts.get("num_cycles", 0.5))
        assert sched.get_last_lr()[0] == pytest.approx(want, rel=1e-9, abs=1e-15), (kind, opts, step)
        sched.step()


# ---- honoured: through the engine ---------------------------------------------------------------
def _weights(engine):
    return {k: v.detach().clone() for k, v in engine.get_per_tensor_param()[0]}


def _losses(engine, actor, td):
    """verl's per-micro-batch loss values of a forward-only pass with its ppo_loss."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss
    with engine.eval_mode():
        return engine.infer_batch(td, loss_function=partial(ppo_loss, config=actor))["loss"]


def honoured(mesh, out):
    """One rank: each option set to a non-default value, and what the engine did with it."""
    path, batch, res = vc.tiny_checkpoint(out), vc.rollout(1024, seed=0), {}
    hf = ["model", "optimizer", "extra", "hf_model"]
    engine, actor = vc.make_engine(path, warmup=2, optim={"override_optimizer_config": {"eps": 1e-3}},
                                   checkpoint={"save_contents": hf})
    res["recompute"] = engine.model.model.recompute  # verl's model.enable_gradient_checkpointing (default on)
    res["eps"] = engine.runtime.hyperparameters()["eps"]
    res["lp_t1"] = old = vc.response_values(engine, vc.to_verl(batch))
    train = dict(batch, old_log_probs=old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)),
                 ref_log_prob=old)
    res["losses"] = {n: _losses(engine, actor, vc.to_verl(train, micro_batch_size_per_gpu=n, calculate_entropy=True))
                     for n in (1, 2, 4)}
    res["dynamic"] = _losses(engine, actor, vc.to_verl(train, use_dynamic_bsz=True, calculate_entropy=True,
                                                         max_token_len_per_gpu=vc.PROMPT + vc.RESPONSE + 1))
    res["lp_t2"] = vc.response_values(engine, vc.to_verl(batch, temperature=2.0))
    res["flag_errors"] = {}
    for key, value in (("use_remove_padding", False), ("use_fused_kernels", True), ("calculate_sum_pi_squared", True)):
        try:  # verl's workers copy these into each batch
            vc.response_values(engine, vc.to_verl(batch, **{key: value}))
        except ValueError as e:
            res["flag_errors"][key] = str(e)
    res["w0"], res["lrs"], res["w"] = _weights(engine), [], []
    for _ in range(2):  # warm-up over 2 steps: the first at LR 0 leaves every weight as it was
        res["lrs"].append(engine.lr_scheduler.get_last_lr()[0])
        vc.update(engine, actor, vc.prepare(engine, batch, shift_seed=1))
        res["w"].append(_weights(engine))
    for i in range(3):
        engine.save_checkpoint(str(out / f"global_step_{i}"), global_step=i, max_ckpt_to_keep=2)
    res["kept"] = sorted(p.name for p in out.glob("global_step_*"))
    res["export_moves"] = _export_moves(path)
    ref, _ = vc.make_engine(path, forward_only=True)
    res["ref_state"], res["ref_grad"] = ref.runtime.state, any(p.requires_grad for p in ref.model.parameters())
    res["ref_lp"] = vc.response_values(ref, vc.to_verl(batch))
    try:
        vc.update(ref, actor, vc.to_verl(train, calculate_entropy=True))
    except ValueError as e:
        res["ref_train_error"] = str(e)
    return res


def _export_moves(path):
    """The runtime moves an export makes with param and optimizer offload on, as on a GPU engine
    (the engine's device set to CUDA, the moves recorded instead of made)."""
    engine, _ = vc.make_engine(path, param_offload=True, optimizer_offload=True)
    moves = []
    engine.runtime.to = lambda device, **parts: moves.append((str(device), parts))
    engine.device = torch.device("cuda", 0)
    with engine._weights_resident():
        pass
    return moves


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-options")
    return spawn(1, "honoured", out, module=__name__)[0], out


def test_micro_batch_options_are_honoured(got):
    """micro_batch_size_per_gpu sets the micro-batch count, use_dynamic_bsz + max_token_len_per_gpu
    packs by tokens; the summed loss is the same however the batch is cut."""
    res, _ = got
    assert [len(res["losses"][n]) for n in (1, 2, 4)] == [4, 2, 1]
    assert len(res["dynamic"]) == 4  # at most one sample of <= 11 tokens fits 12 tokens
    for got_ in (*res["losses"].values(), res["dynamic"]):
        assert sum(got_) == pytest.approx(sum(res["losses"][4]), rel=1e-5)


def test_temperature_is_honoured(got):
    """log-probs at temperature 2 equal float64 transformers' log_softmax(logits / 2)."""
    from tests.e2e.test_verl_actor_update import _hf
    res, out = got
    hf, batch = _hf(vc.tiny_checkpoint(out)), vc.rollout(1024, seed=0)
    for i in range(vc.B):
        keep = batch["attention_mask"][i].bool()
        ids, p = batch["input_ids"][i][keep][None], int(keep[:vc.PROMPT].sum())
        with torch.no_grad():
            lp = (hf(ids).logits[0, p - 1:-1] / 2).log_softmax(-1).gather(-1, ids[0, p:, None])[:, 0]
        torch.testing.assert_close(res["lp_t2"][i, :lp.numel()].double(), lp, rtol=1e-5, atol=1e-5)


def test_warmup_eps_and_recompute_are_honoured(got):
    res, _ = got
    assert res["lrs"] == [0.0, pytest.approx(vc.LR / 2)]
    assert all(torch.equal(res["w"][0][k], v) for k, v in res["w0"].items())  # LR 0: nothing moved
    assert sum(not torch.equal(res["w"][1][k], v) for k, v in res["w0"].items()) > 0.9 * len(res["w0"])
    assert res["eps"] == 1e-3 and res["recompute"] is True


def test_checkpoint_options_are_honoured(got):
    """max_ckpt_to_keep=2 keeps the last two; save_contents with hf_model writes HF weights that
    transformers loads and that equal the exported ones."""
    from transformers import AutoModelForCausalLM
    res, out = got
    assert res["kept"] == ["global_step_1", "global_step_2"]
    hf = AutoModelForCausalLM.from_pretrained(out / "global_step_2" / "huggingface", dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, res["w"][1][k]), k


def test_reference_model_is_forward_only(got):
    """forward_only (verl's ref): no optimizer state, no gradients, training refused, and the same
    log-probs as the actor's weights before any update."""
    res, _ = got
    assert res["ref_state"] is None and not res["ref_grad"]
    assert "forward only" in res["ref_train_error"]
    assert torch.equal(res["ref_lp"], res["lp_t1"])


def test_batch_flags_are_refused(got):
    res, _ = got
    assert sorted(res["flag_errors"]) == ["calculate_sum_pi_squared", "use_fused_kernels", "use_remove_padding"]
    for key, msg in res["flag_errors"].items():
        assert f"data.{key}" in msg, msg


def test_weight_export_leaves_offloaded_optimizer_state_off_the_device(got):
    """param_offload + optimizer_offload: a weight sync brings the parameters (FSDP2's fp32 masters)
    to the device and back, never the optimizer state or the gradients (GPU: test_verl_gpu.py)."""
    res, _ = got
    assert [d for d, _ in res["export_moves"]] == ["cuda:0", "cpu"]
    for _, parts in res["export_moves"]:
        assert parts == {"model": True, "optimizer": False, "grad": False}
