"""verl's own workers drive the engine: `ActorRolloutRefWorker` (actor and reference model on
BumblebeeEngine, built from the shipped Hydra entries `model_engine=bumblebee`) runs
compute_ref_log_prob, compute_log_prob and update_actor on a GRPO batch the way verl's PPO trainer
calls them (its padding -> no-padding conversion, its meta keys, its mini-batch loop, its
TrainingWorker), against float64 transformers; then `TrainingWorker` on two gloo ranks follows one.

verl's CUDA assumptions are met by a CPU platform registered in verl's platform registry
(tests/e2e/verl_cpu.py), not by changing the engine.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.e2e.test_verl_actor_update import check_log_probs, check_update  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

SHIFT_SEED = 1  # the old log-probs' seeded offset (as in level 0): ratios leave the clip range


def compose(path: Path, *overrides: str, level0: bool = True):
    """verl's ppo_trainer.yaml with bumblebee's config entries (set up as level 0's actor)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    a = vc.ACTOR
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer/config"), version_base=None):
        base = ["hydra.searchpath=[pkg://bumblebee.integrations.verl_config]", "model_engine=bumblebee",
                f"actor_rollout_ref.model.path={path}"]
        actor = [
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.rollout.n=1", f"actor_rollout_ref.actor.ppo_mini_batch_size={vc.B}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a['ppo_micro_batch_size_per_gpu']}",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.bumblebee.dtype=float32",
            "actor_rollout_ref.actor.bumblebee.impl={cross_entropy: linear_ce}",
            f"actor_rollout_ref.actor.optim.lr={vc.LR}", "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
            "actor_rollout_ref.actor.optim.weight_decay=0.01", f"actor_rollout_ref.actor.optim.clip_grad={vc.CLIP_GRAD}",
            f"actor_rollout_ref.actor.clip_ratio_low={a['clip_ratio_low']}",
            f"actor_rollout_ref.actor.clip_ratio_high={a['clip_ratio_high']}",
            f"actor_rollout_ref.actor.entropy_coeff={a['entropy_coeff']}", "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.actor.kl_loss_coef={a['kl_loss_coef']}",
            f"actor_rollout_ref.actor.kl_loss_type={a['kl_loss_type']}", "actor_rollout_ref.actor.calculate_entropy=true",
        ]
        return hydra_compose("ppo_trainer", overrides=base + (actor if level0 else []) + list(overrides))


def _as_trainer_sends(batch: dict, **meta):
    """The PPO trainer's steps 1-3: DataProto -> TensorDict -> verl's no-padding layout + meta keys."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch), meta_info={"temperature": 1.0})
                                 .to_tensordict())
    tu.assign_non_tensor(td, **meta)
    return td


def _padded(output, td, key="log_probs"):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding
    return no_padding_2_padding(tu.get(output, key), td).float()


def actor_and_ref(mesh, out):
    """One rank: verl's ActorRolloutRefWorker as "ref" and as "actor", one GRPO step."""
    import os

    import torch.distributed as dist

    from tests.e2e import verl_cpu
    verl_cpu.use_cpu_platform()
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK="0")
    from verl.workers.engine_workers import ActorRolloutRefWorker
    cfg = compose(vc.tiny_checkpoint(out))
    ref = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="ref")
    ref.init_model()
    actor = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    actor.init_model()
    batch = vc.rollout(1024, seed=0)

    def ref_lp():
        td = _as_trainer_sends(batch, calculate_entropy=False, compute_loss=False)
        return _padded(ref.compute_ref_log_prob(td), td)

    def old_lp():
        td = _as_trainer_sends(batch, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
        return _padded(actor.compute_log_prob(td), td)

    ref_before, old = ref_lp(), old_lp()
    g = torch.Generator().manual_seed(SHIFT_SEED)
    shifted = old + 0.3 * torch.randn(old.shape, generator=g)
    train = dict(batch, old_log_probs=shifted, ref_log_prob=ref_before)
    td = _as_trainer_sends(train, calculate_entropy=True, global_batch_size=vc.B, mini_batch_size=vc.B,
                           epochs=1, seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    from verl.utils import tensordict_utils as tu
    metrics = tu.get(actor.update_actor(td), "metrics")
    return {"batch": batch, "old": shifted, "ref": ref_before, "ref_state": ref.ref.engine.runtime.state,
            "metrics": metrics, "ref_after": ref_lp(), "old_before": old, "old_after": old_lp(),
            "weights": {k: v.detach().clone() for k, v in actor.actor.engine.get_per_tensor_param()[0]},
            "ref_requires_grad": any(p.requires_grad for p in ref.ref.engine.model.parameters())}


def test_actor_rollout_ref_worker_grpo_step_matches_transformers(tmp_path):
    res = spawn(1, "actor_and_ref", tmp_path, module=__name__)[0]
    m = res["metrics"]
    print({k: v for k, v in m.items() if not k.startswith("perf")})
    # the reference model: no optimizer state, no gradients, unchanged by the actor's update
    assert res["ref_state"] is None and not res["ref_requires_grad"]
    assert torch.equal(res["ref_after"], res["ref"])
    # before the update actor and reference are the same weights: the same log-probs
    torch.testing.assert_close(res["old_before"], res["ref"], rtol=0, atol=0)
    assert not torch.equal(res["old_after"], res["old_before"])
    check_log_probs(res, tmp_path)  # compute_log_prob == float64 transformers
    # update_actor through verl's mini-batch loop and TrainingWorker == float64 transformers + AdamW
    res.update(loss=m["loss"], grad_norm=m["grad_norm"][0], lr=m["lr"][0], peft=None, engine_type="BumblebeeEngine")
    check_update(res, tmp_path)


def training_worker(mesh, out):
    """verl's TrainingWorker, built from its own config, on this rank's half of two GRPO mini-batches."""
    import os
    from functools import partial

    import torch.distributed as dist

    from tests.e2e import verl_cpu
    verl_cpu.use_cpu_platform()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    model, eng, optim, ckpt, actor = vc.configs(vc.tiny_checkpoint(out), steps=4, infer_micro_batch_size_per_gpu=2)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=eng,
                                                 optimizer_config=optim, checkpoint_config=ckpt))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    rows = slice(rank * vc.B // world, (rank + 1) * vc.B // world)
    steps = []
    for i in range(2):
        batch = vc.rollout(1024, seed=100 + i)
        old = _padded(worker.infer_batch(_as_trainer_sends(batch, calculate_entropy=False, compute_loss=False)),
                      _as_trainer_sends(batch))
        g = torch.Generator().manual_seed(200 + i)
        train = dict(batch, old_log_probs=old + 0.3 * torch.randn(old.shape, generator=g), ref_log_prob=old)
        td = _as_trainer_sends({k: v[rows] for k, v in train.items()}, calculate_entropy=True,
                               global_batch_size=vc.B, mini_batch_size=vc.B, epochs=1, seed=42,
                               dataloader_kwargs={"shuffle": False}, compute_loss=True)
        m = tu.get(worker.train_mini_batch(td), "metrics")
        steps.append({"loss": m["loss"][0], "grad_norm": m["grad_norm"][0], "lr": m["lr"][0]})
    return {"steps": steps, "weights": {k: v.detach().clone() for k, v in worker.engine.get_per_tensor_param()[0]}}


def test_training_worker_on_two_ranks_follows_one(tmp_path):
    """Each rank's TrainingWorker takes half of each batch (as verl's dispatch hands it out): the
    dp-averaged loss, the grad norm and the LR equal one rank's on the whole batch."""
    vc.tiny_checkpoint(tmp_path)
    two, one = spawn(2, "training_worker", tmp_path, module=__name__), spawn(1, "training_worker", tmp_path,
                                                                           module=__name__)[0]
    for i, want in enumerate(one["steps"]):
        for r in two:
            got = r["steps"][i]
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), i
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), i
            assert got["lr"] == want["lr"]
    assert 0 < one["steps"][1]["lr"] < one["steps"][0]["lr"] < vc.LR  # the schedule stepped once a mini-batch
    for k, v in one["weights"].items():
        assert torch.equal(two[0]["weights"][k], two[1]["weights"][k]), k
        d = (two[0]["weights"][k] - v).abs()
        assert (d > 1e-5).float().mean() <= 1e-3 and d.max() <= 4 * vc.LR, k  # as level 2


def test_shipped_recipe_composes_to_bumblebee_actor_and_ref(tmp_path):
    """The GRPO recipe's overrides on verl's ppo_trainer.yaml give typed bumblebee actor and
    reference configs (EP 8, linear_ce, bf16, the reference forward only)."""
    import re

    from verl.utils.config import omega_conf_to_dataclass

    from bumblebee.integrations import verl_config
    from bumblebee.integrations.verl import BumblebeeActorConfig
    script = (Path(verl_config.__file__).parent / "grpo_qwen3_moe.sh").read_text()
    keys = re.findall(r"^\s+((?:actor_rollout_ref|algorithm)\.[\w.]+)=(\S+) \\$", script, flags=re.M)
    values = {"$MODEL": str(vc.tiny_checkpoint(tmp_path)), "$EP": "8"}
    overrides = [f"{k}={values.get(v.strip(chr(34)), v.strip(chr(34)))}" for k, v in keys
                 if not k.endswith("model.path")]
    assert len(overrides) > 20
    cfg = compose(vc.tiny_checkpoint(tmp_path), *overrides, level0=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, BumblebeeActorConfig) and actor.engine.ep_size == 8
    assert actor.engine.impl == {"cross_entropy": "linear_ce"} and actor.engine.dtype == "bfloat16"
    assert not actor.engine.forward_only and actor.optim.lr_warmup_steps == 10
    # the reference model (typed by verl's worker after it moves its log_prob_* keys, as the worker test shows)
    ref = cfg.actor_rollout_ref.ref.bumblebee
    assert ref.forward_only and ref.ep_size == 8 and ref.impl == {"cross_entropy": "linear_ce"}
    assert cfg.algorithm.adv_estimator == "grpo"
    # PPO with the bumblebee critic: the header's critic overrides on the same command line
    from bumblebee.integrations.verl_critic import BumblebeeCriticConfig, BumblebeeCriticEngineConfig
    ppo = [o.replace('"$MODEL"', values["$MODEL"]) for o in re.findall(r"(critic\.[\w.]+=\S+)", script)]
    assert len(ppo) >= 4
    cfg = compose(vc.tiny_checkpoint(tmp_path), *overrides, "algorithm.adv_estimator=gae", *ppo, level0=False)
    critic = omega_conf_to_dataclass(cfg.critic)
    assert isinstance(critic, BumblebeeCriticConfig) and isinstance(critic.engine, BumblebeeCriticEngineConfig)
    assert critic.engine.ep_size == 8 and critic.engine.dtype == "bfloat16"
    assert critic.engine.micro_batch_size_per_gpu == critic.engine.infer_micro_batch_size_per_gpu == 4


def test_sft_trainer_config_selects_the_engine():
    """verl's SFT trainer config with `engine=bumblebee` types its engine entry as ours."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from bumblebee.integrations.verl import BumblebeeEngineConfig
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer/config"), version_base=None):
        cfg = hydra_compose("sft_trainer_engine", overrides=[
            "hydra.searchpath=[pkg://bumblebee.integrations.verl_config]", "engine=bumblebee", "engine.ep_size=2"])
    eng = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(eng, BumblebeeEngineConfig) and eng.ep_size == 2 and eng.impl == {"cross_entropy": "linear_ce"}
