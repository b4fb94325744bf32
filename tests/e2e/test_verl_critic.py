"""verl's critic on bumblebee's value engine: PPO with GAE through verl's own critic code.

The critic is built as verl's PPO trainer builds it (`critic=bumblebee_critic` composed from
`model_engine=bumblebee`, `omega_conf_to_dataclass`, a `TrainingWorker` of model_type "value_model"
with verl's `value_loss`); each step runs the trainer's `_compute_values` (padding -> no padding,
`infer_batch`), verl's `compute_gae_advantage_return`, and the trainer's `_update_critic` meta keys
through `train_mini_batch`. Checked: the value loss falls; the values equal a float64 transformers
`AutoModelForTokenClassification` loaded from the critic's HF export (save_contents with hf_model);
a second critic resumed from the checkpoint gives the same values; the sharded checkpoint merged
into HF weights (verl_merge) equals the HF export.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from bumblebee import models  # noqa: E402
from tests.e2e import verl_cases as vc  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

STEPS, GAMMA, LAM = 8, 0.99, 0.95


def critic_config(path: Path):
    """verl's critic config from ppo_trainer.yaml with the shipped `model_engine=bumblebee`."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer/config"), version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "hydra.searchpath=[pkg://bumblebee.integrations.verl_config]", "model_engine=bumblebee",
            f"actor_rollout_ref.model.path={path}", f"critic.model.path={path}",
            "critic.bumblebee.dtype=float32", "critic.use_dynamic_bsz=false",
            f"critic.ppo_mini_batch_size={vc.B}", "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=3e-3",
            "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "+critic.model.load_tokenizer=false"])  # the tiny checkpoints have no tokenizer; the critic needs none
    return omega_conf_to_dataclass(cfg.critic)


def make_critic(critic_cfg):
    """The trainer's critic worker (RayPPOTrainer.init_workers, without Ray)."""
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import value_loss
    engine_config = critic_cfg.engine
    engine_config.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine_config.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    worker = TrainingWorker(TrainingWorkerConfig(model_type="value_model", model_config=critic_cfg.model,
                                                 engine_config=engine_config, optimizer_config=critic_cfg.optim,
                                                 checkpoint_config=critic_cfg.checkpoint))
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=critic_cfg))
    return worker


def compute_values(worker, batch: dict) -> torch.Tensor:
    """RayPPOTrainer._compute_values: [B, RESPONSE] values."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch)).to_tensordict())
    tu.assign_non_tensor(td, compute_loss=False)
    return no_padding_2_padding(tu.get(worker.infer_batch(td), "values"), td).float()


def update_critic(worker, batch: dict) -> dict:
    """RayPPOTrainer._update_critic: one mini-batch of the whole batch, one epoch."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch)).to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=vc.B, mini_batch_size=vc.B, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False})
    return tu.get(worker.train_mini_batch(td), "metrics")


def ppo_gae(mesh, out):
    """One rank: STEPS critic updates on one rollout with verl's GAE, a checkpoint, a resumed critic."""
    import os

    import torch.distributed as dist
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from tests.e2e import verl_cpu
    verl_cpu.use_cpu_platform()
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK="0")
    cfg = critic_config(vc.tiny_checkpoint(out))
    critic = make_critic(cfg)
    batch = {k: v for k, v in vc.rollout(1024, seed=3).items() if k != "advantages"}
    mask = batch["response_mask"]
    last = mask.cumsum(-1).argmax(-1)  # each response's last token: the reward lands there
    rewards = torch.zeros(mask.shape).index_put_((torch.arange(vc.B), last), torch.tensor([1.0, -1.0, 0.5, 2.0]))
    losses = []
    for _ in range(STEPS):
        v = compute_values(critic, batch)
        adv, returns = compute_gae_advantage_return(rewards, v, mask, gamma=GAMMA, lam=LAM)
        m = update_critic(critic, dict(batch, values=v, returns=returns, advantages=adv))
        losses.append(sum(m["critic/vf_loss"]) if isinstance(m["critic/vf_loss"], list) else m["critic/vf_loss"])
    values = compute_values(critic, batch)
    ckpt = out / "critic-ckpt"
    critic.save_checkpoint(str(ckpt), global_step=STEPS)
    resumed = make_critic(critic_config(vc.tiny_checkpoint(out)))
    fresh = compute_values(resumed, batch)
    resumed.load_checkpoint(str(ckpt))
    return {"losses": losses, "values": values, "fresh": fresh, "resumed": compute_values(resumed, batch),
            "batch": batch, "ckpt": str(ckpt), "engine": type(critic.engine).__name__,
            "moe": moe_critic(out, rewards)}


def moe_critic(out, rewards) -> dict:
    """A critic on DeepSeek-V3 (auxiliary-loss-free sigmoid routers): compute_values leaves the
    routers' token counts alone (only training moves their biases); an update moves the biases."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from bumblebee.models import moe
    critic = make_critic(critic_config(vc.tiny_checkpoint(out, "deepseek-v3-tiny")))
    model = critic.engine.model
    batch = {k: v for k, v in vc.rollout(models.NAMED["deepseek-v3-tiny"]["vocab_size"], seed=4).items()
             if k != "advantages"}
    bias = {n: r.e_score_correction_bias.clone() for n, r in moe.routers(model).items()}
    v = compute_values(critic, batch)
    counts_after_infer = [r.tokens_per_expert for r in moe.routers(model).values()]
    adv, returns = compute_gae_advantage_return(rewards, v, batch["response_mask"], gamma=GAMMA, lam=LAM)
    update_critic(critic, dict(batch, values=v, returns=returns, advantages=adv))
    return {"finite": bool(torch.isfinite(v).all()), "counts_after_infer": counts_after_infer,
            "bias_moved": any(not torch.equal(r.e_score_correction_bias, bias[n]) for n, r in moe.routers(model).items())}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-critic")
    return spawn(1, "ppo_gae", out, module=__name__)[0]


def test_critic_is_the_value_engine_and_its_loss_falls(run):
    assert run["engine"] == "BumblebeeValueEngine"
    losses = run["losses"]
    print("vf_loss", [round(x, 4) for x in losses])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_moe_critic_counts_only_its_training_tokens(run):
    got = run["moe"]
    assert got["finite"] and got["bias_moved"]
    assert all(c is None for c in got["counts_after_infer"])


def _hf_values(folder, batch) -> torch.Tensor:
    """[B, RESPONSE] values of float64 transformers token classification, each sample unpadded."""
    from transformers import AutoModelForTokenClassification
    hf = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    P = batch["prompts"].shape[1]
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(out.shape[0]):
            keep = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][keep][None]
            p = int(keep[:P].sum())
            v = hf(ids).logits[0, p - 1:-1, 0]  # the value of the state before each response token
            out[i, :v.shape[0]] = v
    return out


def test_values_equal_transformers_token_classification_of_the_export(run):
    m = run["batch"]["response_mask"].bool()
    want = _hf_values(Path(run["ckpt"]) / "huggingface", run["batch"])
    torch.testing.assert_close(run["values"].double()[m], want[m], rtol=1e-5, atol=1e-5)


def test_resumed_critic_gives_the_same_values(run):
    m = run["batch"]["response_mask"].bool()
    assert not torch.allclose(run["fresh"][m], run["values"][m])  # the load must replace the head and body
    assert torch.equal(run["resumed"][m], run["values"][m])


def test_merged_checkpoint_equals_the_hf_export(run, tmp_path):
    """The sharded (DCP) checkpoint merged into HF safetensors, as verl's model_merger does for its
    own format, holds the HF export's tensors and config."""
    from safetensors.torch import load_file

    from bumblebee.integrations.verl_merge import merge
    merge(run["ckpt"], tmp_path / "merged")
    got, want = load_file(tmp_path / "merged/model.safetensors"), load_file(Path(run["ckpt"]) / "huggingface/model.safetensors")
    assert set(got) == set(want) and "score.weight" in got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    m = run["batch"]["response_mask"].bool()
    torch.testing.assert_close(_hf_values(tmp_path / "merged", run["batch"])[m], run["values"].double()[m],
                               rtol=1e-5, atol=1e-5)
