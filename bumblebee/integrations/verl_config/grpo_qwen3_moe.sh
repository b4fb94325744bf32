#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (Qwen3-MoE) with verl 0.9.1's PPO trainer, actor and reference model on
# bumblebee's engine (model_engine=bumblebee), vLLM as the rollout, GSM8K as the task.
#
#   pip install -e '.[verl]' vllm                       # bumblebee + verl (+ the rollout engine)
#   python -m verl.examples.data_preprocess.gsm8k --local_save_dir ~/data/gsm8k   # or verl's examples/ script
#   MODEL=Qwen/Qwen3-30B-A3B NODES=1 GPUS=8 bash bumblebee/integrations/verl_config/grpo_qwen3_moe.sh [overrides...]
#
# Engine options live under actor_rollout_ref.actor.bumblebee (BumblebeeEngineConfig): experts split
# over EP ranks (ep_size divides the GPU count and the expert count), FSDP2 over all ranks, the
# linear cross-entropy head (no [tokens, vocab] logits), full recompute. Options verl passes that the
# engine does not implement stop the run with an error naming them (skills/rl-smoke/SKILL.md).
#
# PPO with GAE and a bumblebee critic (critic/bumblebee_critic.yaml, selected by model_engine=bumblebee):
#   bash grpo_qwen3_moe.sh algorithm.adv_estimator=gae critic.model.path="$MODEL" \
#       critic.bumblebee.ep_size=8 critic.bumblebee.dtype=bfloat16 critic.ppo_micro_batch_size_per_gpu=4
# Merge a checkpoint's sharded state into HF weights:
#   python -m bumblebee.integrations.verl_merge --local_dir CKPT/global_step_N/actor --target_dir OUT
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
DATA=${DATA:-$HOME/data/gsm8k}
NODES=${NODES:-1}
GPUS=${GPUS:-8}
EP=${EP:-8}

python3 -m verl.trainer.main_ppo \
    hydra.searchpath=[pkg://bumblebee.integrations.verl_config] \
    model_engine=bumblebee \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=false \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.external_lib=bumblebee.integrations.verl \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.bumblebee.ep_size="$EP" \
    actor_rollout_ref.actor.bumblebee.state_sharding=fsdp2 \
    actor_rollout_ref.actor.bumblebee.impl="{cross_entropy: linear_ce}" \
    actor_rollout_ref.actor.bumblebee.dtype=bfloat16 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    trainer.logger=[console] \
    trainer.project_name=bumblebee_grpo \
    trainer.experiment_name=qwen3_30b_a3b_gsm8k \
    trainer.nnodes="$NODES" \
    trainer.n_gpus_per_node="$GPUS" \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    "$@"
