"""Atomic training operations that RL frameworks compose, on a bumblebee model (optionally under a
`state_sharding` TrainState): per-token log-probs and entropy, a policy loss's forward + backward,
the optimizer step, checkpoints, and HF weight export for an inference engine.

    rt = Runtime(model, state)                       # state: fsdp2 / zero1 TrainState, or None
    old = rt.forward(batch).logprobs                 # [B, T], no graph
    out = rt.forward_backward(batch, "ppo", clip=(0.2, 0.28))   # gradients accumulate
    rt.optim_step()                                  # {"applied", "grad_norm", "step", ...}
    rt.save_state(dir); rt.load_state(dir); rt.save_weights(hf_dir)
"""
from bumblebee.runtime.losses import LOSSES, policy_loss
from bumblebee.runtime.ops import Batch, Runtime, TokenOutput, token_logprobs

__all__ = ["Batch", "LOSSES", "Runtime", "TokenOutput", "policy_loss", "token_logprobs"]
