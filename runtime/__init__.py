"""Atomic training operations that RL frameworks compose, on a bumblebee model (optionally under a
`state_sharding` TrainState): per-token log-probs and entropy, a policy loss's forward + backward
in micro-batches, the optimizer step with schedules and per-step AdamW hyperparameters, device
offload, checkpoints, and HF weights for an inference engine (gathered, or as rank-local shards).

    rt = Runtime(model, state, lr_schedule=LRSchedule("cosine", warmup_steps=10, total_steps=500))
    old = rt.forward(batch).log_probs                                   # [B, T], no graph
    out = rt.forward_backward(batch, "ppo", clip=(0.2, 0.28), loss_agg_mode="token-mean",
                              micro_batch_tokens=16384)                 # ForwardResult
    rt.optim_step(); rt.lr_scheduler_step()
    rt.to("cpu"); ...; rt.to("cuda")                                    # offload / onload
    for name, tensor in rt.export_weights(bucket_bytes=2**30): ...      # HF names, full tensors
"""
from bumblebee.runtime.batching import Batch
from bumblebee.runtime.export import WeightShard
from bumblebee.runtime.losses import AGG_MODES, KL_ESTIMATORS, LOSSES, Norm, aggregate, kl_penalty, policy_loss
from bumblebee.runtime.ops import Runtime, TokenOutput, token_logprobs
from bumblebee.runtime.optim import SCHEDULES, LRSchedule
from bumblebee.runtime.results import ForwardResult, LossInputs

__all__ = ["AGG_MODES", "Batch", "ForwardResult", "KL_ESTIMATORS", "LOSSES", "LRSchedule", "LossInputs", "Norm",
           "Runtime", "SCHEDULES", "TokenOutput", "WeightShard", "aggregate", "kl_penalty", "policy_loss",
           "token_logprobs"]
