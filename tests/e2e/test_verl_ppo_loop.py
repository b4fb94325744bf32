"""Level 5 through verl's own PPO loop: `python -m verl.trainer.main_ppo` (Ray, `RayPPOTrainer.fit`,
the agent loop and `LLMServerManager`) runs GRPO with the actor on BumblebeeEngine and the
transformers rollout (`rollout.name=hf`, bumblebee/integrations/verl_rollout.py); after each update
verl's naive weight sync streams the engine's weights into the rollout. Toy task on a tiny model and
a character tokenizer: reward = alphanumeric characters in a 4-token answer / 4 (random weights
over a 1024-token vocabulary whose 98 first ids are characters: ~0.05). The reward rises past a
stated margin within a bounded number of steps, with no NaN; verl's own rollout-vs-trainer check
(`training/rollout_probs_diff_max`: the rollout's sampled-token probabilities against the actor's
recomputed ones) stays at fp32 rounding every step, so each update reached the rollout."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

from tests.e2e.test_verl_sft import sft_data  # noqa: E402  (tiny checkpoint + char tokenizer)
from tests.limits import SUBPROCESS_TIMEOUT_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, RISE = 30, 0.5  # reward of the last 3 steps > the first 3 + RISE
# The take-off step varies with the sampled tokens (rollout seeds 42-45 at n = 4: the reward passed 0.5 at steps
# 15-19, one run on another CPU was at 0.27 by step 24); n = 8 gives each group more signal (seeds 43/44: 0.5 at
# step 15, >= 0.94 from step 21) and 30 steps leave room for a late take-off.
PROBS_DIFF = 1e-4  # rollout vs trainer token probs, fp32 both (seen: <= 1.1e-6)
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return min(sum(c.isalnum() for c in solution_str), 4) / 4.0
'''


def ppo_data(out: Path) -> tuple[Path, Path, Path]:
    """(checkpoint with tokenizer, train parquet of 8 prompts, reward file)."""
    import pandas as pd
    path, _ = sft_data(out)
    rows = [{"data_source": "digits", "prompt": [{"role": "user", "content": f"n{i}"}],
             "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}} for i in range(8)]
    data = out / "ppo.parquet"
    pd.DataFrame(rows).to_parquet(data)
    reward = out / "reward.py"
    reward.write_text(REWARD)
    return path, data, reward


def overrides(path: Path, data: Path, reward: Path, out: Path) -> list[str]:
    """main_ppo's command line: GRPO, the bumblebee actor, the hf rollout, CPU-sized."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        "hydra.searchpath=[pkg://bumblebee.integrations.verl_config]", "model_engine=bumblebee",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=4",
        "data.max_prompt_length=32", "data.max_response_length=4", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.external_lib=bumblebee.integrations.verl",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"{a}.bumblebee.dtype=float32", f"{a}.optim.lr=1e-2", f"{a}.ppo_mini_batch_size=4",
        f"{a}.ppo_micro_batch_size_per_gpu=16", f"{a}.use_dynamic_bsz=false", f"{a}.use_kl_loss=false",
        f"{a}.entropy_coeff=0",
        f"{r}.name=hf", f"{r}.n=8", f"{r}.seed=42", f"{r}.tensor_model_parallel_size=1", f"{r}.temperature=1.0",
        f"{r}.log_prob_micro_batch_size_per_gpu=16", f"{r}.agent.num_workers=1", f"{r}.free_cache_engine=false",
        f"{r}.checkpoint_engine.backend=naive",
        "reward.num_workers=1", f"reward.custom_reward_function.path={reward}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu", "trainer.logger=[console,file]",
        f"trainer.total_training_steps={STEPS}", "trainer.total_epochs=100", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.use_v1=false", "ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.num_gpus=1",
    ]


def test_grpo_reward_rises_through_verl_ppo_loop(tmp_path):
    path, data, reward = ppo_data(tmp_path)
    log = tmp_path / "metrics.jsonl"
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cpu", VERL_FILE_LOGGER_PATH=str(log),
               VERL_USE_EXTERNAL_MODULES="tests.e2e.verl_cpu,bumblebee.integrations.verl_rollout",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides(path, data, reward, tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rewards = [s["data"]["critic/score/mean"] for s in steps if "critic/score/mean" in s.get("data", {})]
    assert len(rewards) == STEPS, rewards
    for s in steps:
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            v = s["data"].get(k)
            assert v is None or math.isfinite(v), (k, s["step"], v)
        assert s["data"]["training/rollout_probs_diff_max"] < PROBS_DIFF, (s["step"], s["data"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + RISE, rewards
