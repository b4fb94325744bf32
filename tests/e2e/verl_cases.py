"""What the verl smoke levels share: a tiny HF checkpoint, verl configs for BumblebeeEngine, rollout
data in verl's own layout (left-padded prompts, right-padded responses, turned into its jagged
no-padding TensorDict by verl's `left_right_2_no_padding`), and one actor update the way verl's
`TrainingWorker.train_batch` runs it. Imported only by tests that `importorskip("verl")` first."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from tensordict import TensorDict

from bumblebee import models

B, PROMPT, RESPONSE = 4, 6, 5  # samples, padded prompt and response widths
LR, CLIP_GRAD = 1e-3, 1.0
ACTOR = dict(rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2,
             clip_ratio_high=0.28, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
             kl_loss_type="low_var_kl", calculate_entropy=True)


def tiny_checkpoint(out: Path, name: str = "qwen3-tiny", seed: int = 0) -> Path:
    """A freshly initialized named bumblebee model saved as an HF folder (config.json + safetensors)."""
    path = out / f"{name}-{seed}"
    if not (path / "config.json").exists():
        models.build(name, seed=seed).save_pretrained(path)
    return path


def configs(path: Path, *, ep_size=1, state_sharding="fsdp2", steps=10, warmup=0, optim=None, checkpoint=None,
            **engine):
    """(model, engine, optimizer, checkpoint, actor) configs, fp32 end to end; `optim` and
    `checkpoint`: more fields of verl's optimizer and checkpoint configs."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

    from bumblebee.integrations.verl import BumblebeeActorConfig, BumblebeeEngineConfig
    model = HFModelConfig(path=str(path), load_tokenizer=False)
    eng = BumblebeeEngineConfig(impl={"cross_entropy": "linear_ce"}, dtype="float32", ep_size=ep_size,
                                state_sharding=state_sharding, use_dynamic_bsz=False,
                                micro_batch_size_per_gpu=ACTOR["ppo_micro_batch_size_per_gpu"], **engine)
    optim = FSDPOptimizerConfig(lr=LR, betas=(0.9, 0.95), weight_decay=0.01, clip_grad=CLIP_GRAD,
                                total_training_steps=steps, lr_warmup_steps=warmup, lr_scheduler_type="cosine",
                                **(optim or {}))
    actor = BumblebeeActorConfig(bumblebee=eng, optim=optim, **ACTOR)
    return model, eng, optim, CheckpointConfig(**(checkpoint or {})), actor


def make_engine(path: Path, **kw):
    """BumblebeeEngine through verl's registry (verl's platform "cpu" where there is no GPU), initialized."""
    from verl.workers.engine import EngineRegistry

    from tests.e2e import verl_cpu
    verl_cpu.use_cpu_platform()  # verl detects "cuda" on a machine without accelerators

    import bumblebee.integrations.verl  # noqa: F401  (registers the engine)
    model, eng, optim, ckpt, actor = configs(path, **kw)
    engine = EngineRegistry.new(model_type="language_model", backend="bumblebee", model_config=model,
                                engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)
    engine.initialize()
    return engine, actor


def rollout(vocab: int, seed: int, n: int = B) -> dict:
    """Left-padded prompts and right-padded responses of varied lengths, as verl's rollout returns them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, PROMPT + RESPONSE), generator=g)
    mask = torch.ones(n, PROMPT + RESPONSE, dtype=torch.int64)
    for i in range(n):
        mask[i, :i % 3] = 0  # prompt padding on the left
        mask[i, PROMPT + RESPONSE - (i % 2) * 2:] = 0  # response padding on the right
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    adv = torch.randn(n, 1, generator=g).expand(n, RESPONSE).contiguous()  # GRPO: one advantage a sample
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "prompts": ids[:, :PROMPT],
            "responses": ids[:, PROMPT:], "response_mask": mask[:, PROMPT:], "advantages": adv}


def to_verl(batch: dict, **extra) -> TensorDict:
    """verl's jagged TensorDict of a padded batch, with the non-tensor keys its workers add."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch)).to_tensordict())
    keys = dict(temperature=1.0, global_batch_size=td.shape[0], use_dynamic_bsz=False,
                micro_batch_size_per_gpu=ACTOR["ppo_micro_batch_size_per_gpu"], use_remove_padding=True)
    tu.assign_non_tensor(td, **{**keys, **extra})
    return td


def response_values(engine, td: TensorDict) -> torch.Tensor:
    """[B, RESPONSE] log-probs of the responses from the engine's forward-only pass."""
    from verl.workers.utils.padding import no_padding_2_padding
    with engine.eval_mode():
        out = engine.infer_batch(td)
    return no_padding_2_padding(out["model_output"]["log_probs"].cpu(), td)


def prepare(engine, batch: dict, *, shift_seed: int, rows: slice = slice(None)) -> TensorDict:
    """The trainer's steps before an update, on this rank's `rows` of the global `batch`: old
    log-probs from the actor itself (moved by a seeded offset drawn for the whole batch, as an
    off-policy sampler would move them, so ratios leave the clip range), reference log-probs."""
    local = {k: v[rows] for k, v in batch.items()}
    old = response_values(engine, to_verl(local))
    g = torch.Generator().manual_seed(shift_seed)
    shape = batch["responses"].shape
    shift, ref_shift = 0.3 * torch.randn(shape, generator=g)[rows], 0.1 * torch.randn(shape, generator=g)[rows]
    return to_verl(dict(local, old_log_probs=old + shift, ref_log_prob=old + ref_shift), calculate_entropy=True)


def update(engine, actor, td: TensorDict) -> dict:
    """One actor update as verl's TrainingWorker.train_batch runs it: train_batch under train_mode
    with verl's ppo_loss, then the LR schedule's step. Returns the metrics."""
    from verl.workers.utils.losses import ppo_loss
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=partial(ppo_loss, config=actor))
    lr = engine.lr_scheduler_step()
    return {"metrics": out["metrics"], "loss": out["loss"], "lr": lr}


STEPS, SAVE_AFTER = 3, 2
SYNC_SEED = 999  # the rollout batch the streamed weights are checked on


def weight_sync(engine, vocab: int) -> dict:
    """What verl's sharded syncs take from this rank: `get_per_tensor_param_shard` as (name, flat
    slice, full shape, place, contributes), the delta entries since `prime_delta_snapshots` (without
    their process group), and the trainer's response log-probs of a rollout batch."""
    shards = [(n, t.detach().clone(), tuple(s.full_shape), s.place, s.contributes)
              for n, t, s in engine.get_per_tensor_param_shard()[0]]
    delta = [tuple(e[:-1]) for e in engine.get_per_tensor_param_delta_shard()[0]]
    batch = rollout(vocab, seed=SYNC_SEED)
    return {"shards": shards, "delta": delta, "sync_batch": batch, "sync_lp": response_values(engine, to_verl(batch))}


def train_resume(out: Path, name: str, *, ep_size: int = 1) -> dict:
    """STEPS updates on this rank's rows of each global batch, a checkpoint after SAVE_AFTER; then a
    second engine, built from other initial weights, loads it and repeats the last step. Returns the
    per-step (summed micro-batch loss, grad norm, lr), both last steps and both engines' weights."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * B // world, (rank + 1) * B // world)
    vocab = models.NAMED[name]["vocab_size"]

    def step(engine, actor, i):
        td = prepare(engine, rollout(vocab, seed=100 + i), shift_seed=200 + i, rows=rows)
        got = update(engine, actor, td)
        return {"loss": sum(got["loss"]), "grad_norm": got["metrics"]["grad_norm"], "lr": got["lr"]}

    def weights(engine):
        return {k: v.detach().clone() for k, v in engine.get_per_tensor_param()[0]}

    kw = dict(ep_size=ep_size, steps=STEPS + 2, warmup=1)
    engine, actor = make_engine(tiny_checkpoint(out, name, seed=0), **kw)
    res = {"steps": [step(engine, actor, i) for i in range(SAVE_AFTER)]}
    ckpt = out / f"ckpt-{name}-{world}"
    engine.save_checkpoint(str(ckpt), global_step=SAVE_AFTER)
    res["seed"] = weights(engine)  # what a full sync sent; the delta sync's base from here
    engine.prime_delta_snapshots()
    res["steps"] += [step(engine, actor, i) for i in range(SAVE_AFTER, STEPS)]
    res["weights"] = weights(engine)
    res.update(weight_sync(engine, vocab))
    other, actor = make_engine(tiny_checkpoint(out, name, seed=1), **kw)
    res["fresh"] = weights(other)  # differs from the checkpoint: the load must replace it all
    other.load_checkpoint(str(ckpt), del_local_after_load=True)
    res["resumed"] = [step(other, actor, i) for i in range(SAVE_AFTER, STEPS)]
    res["resumed_weights"] = weights(other)
    res["ckpt_kept"] = (ckpt / "lr_scheduler.pt").is_file()
    res["ckpt"] = str(ckpt)
    return res
