"""RL smoke level 0: one verl actor update through BumblebeeEngine, against transformers.

The engine is looked up in verl's EngineRegistry, reads verl's jagged rollout TensorDict, runs verl's
`ppo_loss` (clip-higher, dual clip, entropy bonus, low-variance KL to a reference) in two
micro-batches, steps AdamW under verl's LR schedule and streams the weights for the rollout. The
reference is independent: a float64 transformers Qwen3 on the *padded* batch (its own attention mask
and positions), the loss written out by hand, torch's AdamW and clip_grad_norm_.
"""
from __future__ import annotations

import pytest
import torch

from bumblebee import models

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

CLIP_C = 3.0  # verl's dual-clip bound (its default)


def one_update(mesh, out, **engine):
    """One rank: old log-probs from the engine, one update, the weights the rollout would receive."""
    path = vc.tiny_checkpoint(out)
    engine, actor = vc.make_engine(path, **engine)
    batch = vc.rollout(1024, seed=0)
    td = vc.prepare(engine, batch, shift_seed=1)
    got = vc.update(engine, actor, td)
    weights, peft = engine.get_per_tensor_param()
    return {"batch": batch, "old": td["old_log_probs"], "ref": td["ref_log_prob"], "loss": got["loss"],
            "grad_norm": got["metrics"]["grad_norm"], "lr": got["lr"], "peft": peft,
            "weights": {k: v.detach().cpu().clone() for k, v in weights}, "engine_type": type(engine).__name__,
            "param_device": next(engine.model.parameters()).device.type}


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")


def _reference(hf, batch, old, ref):
    """verl's PPO actor loss, written out: float64 transformers, each sample alone without padding."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    m = batch["response_mask"].bool()
    lp = torch.zeros(m.shape, dtype=torch.float64)
    ent = torch.zeros(m.shape, dtype=torch.float64)
    for i in range(m.shape[0]):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        p = int(keep[:P].sum())  # this sample's prompt length
        logp_all = hf(ids).logits[0, p - 1:-1].log_softmax(-1)  # row p - 1 + j predicts response token j
        r = logp_all.shape[0]
        lp = lp.index_put((torch.tensor([i]), torch.arange(r)), logp_all.gather(-1, ids[0, p:, None])[:, 0])
        ent = ent.index_put((torch.tensor([i]), torch.arange(r)), -(logp_all.exp() * logp_all).sum(-1))
    assert R >= int(m.sum(1).max())
    n = m.sum()
    adv, cfg = batch["advantages"].double(), vc.ACTOR
    ratio = torch.exp(torch.clamp(lp - old.double(), -20, 20))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg["clip_ratio_low"],
                                                             1 + cfg["clip_ratio_high"]))
    pg = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, clipped), clipped)
    kl = torch.clamp(ref.double() - lp, -20, 20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    loss = ((pg * m).sum() - cfg["entropy_coeff"] * (ent * m).sum() + cfg["kl_loss_coef"] * (kld * m).sum()) / n
    return loss, lp, (clipped != -adv * ratio)[m].double().mean()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-l0")
    return spawn(1, "one_update", out, module=__name__)[0], out


def test_engine_is_registered_for_every_shipped_model_type_and_the_cpu_key(monkeypatch):
    from verl.workers.engine import EngineRegistry

    from bumblebee.integrations.verl import BumblebeeEngine
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    for model_type in ("language_model", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "deepseek_v3",
                       *models.MODEL_TYPES):
        assert EngineRegistry.get_engine_cls(model_type, "bumblebee") is BumblebeeEngine, model_type
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    assert EngineRegistry.get_engine_cls("language_model", "bumblebee") is BumblebeeEngine


def test_one_actor_update_matches_transformers(run):
    check_update(*run)


def check_update(res, out, rel=1e-5):
    assert res["engine_type"] == "BumblebeeEngine" and res["peft"] is None
    hf = _hf(vc.tiny_checkpoint(out))
    loss, _, clipped = _reference(hf, res["batch"], res["old"], res["ref"])
    assert 0 < clipped < 1  # some ratios leave the clip range: the comparison covers the clip
    # the update: verl's micro-batch losses add up to the whole batch's loss
    assert sum(res["loss"]) == pytest.approx(loss.item(), rel=rel, abs=1e-6)
    loss.backward()
    params = [p for p in hf.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(params, vc.CLIP_GRAD)
    assert res["grad_norm"] == pytest.approx(norm.item(), rel=rel)
    assert norm.item() > vc.CLIP_GRAD  # clipping is active: the comparison covers it
    before = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    opt = torch.optim.AdamW(params, lr=vc.LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt.step()
    want = hf.state_dict()
    got = res["weights"]
    assert set(got) == set(want)  # HF names, every tensor, for the rollout's weight sync
    for k, v in want.items():
        moved = (v - before[k]).abs().max()
        assert moved > 0.5 * vc.LR, k  # the update moved every tensor
        # fp32 against float64; Adam's first step is lr * g / |g|, so an entry whose gradient is
        # rounding noise may move by up to lr either way: almost all within 1% of lr, none beyond 2 lr
        d = (got[k].double() - v).abs()
        assert (d > 1e-2 * vc.LR).float().mean() <= 1e-3 and d.max() <= 2 * vc.LR, k


def test_forward_only_log_probs_match_transformers(run):
    """infer_batch's log-probs (verl's next-token alignment undone by no_padding_2_padding) equal
    transformers' on the padded batch; the old log-probs are those plus the seeded offset."""
    check_log_probs(*run)


def check_log_probs(res, out, tol=1e-5):
    hf = _hf(vc.tiny_checkpoint(out))
    batch = res["batch"]
    with torch.no_grad():
        _, lp, _ = _reference(hf, batch, res["old"], res["ref"])
    g = torch.Generator().manual_seed(1)
    offset = 0.3 * torch.randn(lp.shape, generator=g)
    m = batch["response_mask"].bool()
    torch.testing.assert_close((res["old"] - offset)[m].double(), lp[m], rtol=tol, atol=tol)
    assert not (res["old"] - offset)[~m].any()  # padding positions stay 0


FAMILIES = ("qwen3-moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny", "deepseek-v3-tiny")


def every_family(mesh, out):
    """Per shipped family: the engine's forward-only response log-probs, and one update."""
    res = {}
    for name in FAMILIES:
        engine, actor = vc.make_engine(vc.tiny_checkpoint(out, name))
        batch = vc.rollout(models.NAMED[name]["vocab_size"], seed=3)
        lp = vc.response_values(engine, vc.to_verl(batch))
        before = {k: v.clone() for k, v in engine.get_per_tensor_param()[0]}
        got = vc.update(engine, actor, vc.prepare(engine, batch, shift_seed=4))
        after = dict(engine.get_per_tensor_param()[0])
        res[name] = {"batch": batch, "lp": lp, "grad_norm": got["metrics"]["grad_norm"],
                     "moved": sum(not torch.equal(before[k], after[k]) for k in before) / len(before)}
    return res


def test_every_shipped_family_trains_through_the_engine(tmp_path):
    """verl's packed, next-token-aligned log-probs equal the runtime's on each sample alone (no
    packing, no shift), and one update moves the weights with a finite gradient norm."""
    from bumblebee.runtime import Batch, Runtime
    for name in FAMILIES:
        vc.tiny_checkpoint(tmp_path, name)
    res = spawn(1, "every_family", tmp_path, module=__name__)[0]
    for name, r in res.items():
        rt = Runtime(models.from_pretrained(vc.tiny_checkpoint(tmp_path, name)))
        batch, P = r["batch"], vc.PROMPT
        for i in range(vc.B):
            keep = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][keep][None]
            p = int(keep[:P].sum())
            want = rt.forward(Batch(ids)).log_probs[0, p:]
            n = int(batch["response_mask"][i].sum())
            torch.testing.assert_close(r["lp"][i, :n], want, rtol=1e-5, atol=1e-5, msg=f"{name} sample {i}")
        assert 0 < r["grad_norm"] < float("inf"), name
        assert r["moved"] > 0.9, name


def test_actor_config_builds_from_a_trainer_config():
    """verl's trainer turns YAML into dataclasses through `_target_`: the actor config with the
    engine options under `bumblebee` comes out typed, its engine the bumblebee one."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from bumblebee.integrations.verl import BumblebeeActorConfig, BumblebeeEngineConfig
    cfg = OmegaConf.create({
        "_target_": "bumblebee.integrations.verl.BumblebeeActorConfig", "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 2, "optim": {"_target_": "verl.workers.config.FSDPOptimizerConfig", "lr": 1e-6},
        "bumblebee": {"_target_": "bumblebee.integrations.verl.BumblebeeEngineConfig", "ep_size": 2,
                      "impl": {"cross_entropy": "linear_ce"}}})
    actor = omega_conf_to_dataclass(cfg)
    assert isinstance(actor, BumblebeeActorConfig) and isinstance(actor.engine, BumblebeeEngineConfig)
    assert actor.strategy == actor.engine.strategy == "bumblebee" and actor.engine.ep_size == 2
    with pytest.raises(ValueError, match="state_sharding must be"):
        BumblebeeEngineConfig(state_sharding="ddp")
