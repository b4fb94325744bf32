"""RL smoke level 5, the learning signal: GRPO written against the runtime alone (no verl).

A tiny Qwen3 learns to copy a short digit string. Each step: the runtime exports its weights, a
transformers Qwen3 loads them and samples G answers per prompt with `generate` (plain sampling, the
policy's own distribution); a rule scores each answer (the fraction of digits in place); advantages
are the group-normalized rewards; the runtime computes the old and the reference policy's log-probs,
runs the PPO loss with an entropy bonus, and steps. Asserted, seeded: the mean reward of the last
WINDOW steps beats the first WINDOW's by MARGIN, and loss, KL, entropy and grad norm stay finite.
"""
from __future__ import annotations

import math

import torch

from bumblebee import models, registry
from bumblebee.runtime import Batch, Runtime
from tests.primitives.test_state_sharding import spawn

DIGITS, BOS, SEP, PAD = 10, 10, 11, 12  # token ids: 0-9 are the digits
LENGTH, PROMPTS, GROUP = 3, 16, 8  # digits to copy, prompts a step, answers a prompt
STEPS, WINDOW, MARGIN = 80, 8, 0.3
LR, ENTROPY_COEF, KL_COEF = 3e-3, 1e-3, 1e-3
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": BOS, "pad_token_id": PAD,
          "eos_token_id": None}


def reward(prompt_digits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The rule: the fraction of the answer's tokens equal to the prompt's digits in place."""
    return (answer == prompt_digits).float().mean(-1)


def _hf_sampler():
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = {k: v for k, v in CONFIG.items() if k not in ("model_type", "dtype")}
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # answers have exactly LENGTH tokens
    return hf


def _export(rt) -> dict:
    """The runtime's weights under transformers' names, as an inference engine receives them."""
    return dict(rt.export_weights(dtype=torch.float32))


def grpo(mesh, out):
    torch.manual_seed(0)
    model = models.build(CONFIG, impl={"cross_entropy": "linear_ce"}, seed=0)
    state = registry.resolve("state_sharding", "fsdp2")(model, mesh, lr=LR, mixed_precision="fp32", grad_clip=1.0)
    rt = Runtime(model, state)
    ref = Runtime(models.build(CONFIG, seed=0))  # the initial policy, for the KL
    hf = _hf_sampler()
    g = torch.Generator().manual_seed(1)
    log = []
    for step in range(STEPS):
        hf.load_state_dict(_export(rt))
        digits = torch.randint(0, DIGITS, (PROMPTS, LENGTH), generator=g).repeat_interleave(GROUP, 0)
        prompt = torch.cat([torch.full((len(digits), 1), BOS), digits, torch.full((len(digits), 1), SEP)], 1)
        torch.manual_seed(1000 + step)
        with torch.no_grad():
            ids = hf.generate(prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=LENGTH, min_new_tokens=LENGTH, pad_token_id=PAD)
        r = reward(digits, ids[:, -LENGTH:])
        grouped = r.view(PROMPTS, GROUP)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[:, -LENGTH:] = True
        old = rt.forward(Batch(ids, loss_mask=mask)).log_probs
        ref_lp = ref.forward(Batch(ids, loss_mask=mask)).log_probs
        batch = Batch(ids, loss_mask=mask, sampler_logprobs=old, ref_logprobs=ref_lp,
                      advantages=adv[:, None].expand(ids.shape).contiguous())
        res = rt.forward_backward(batch, "ppo", clip=(0.2, 0.28), entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF,
                                  kl_penalty="low_var_kl", loss_agg_mode="token-mean")
        opt = rt.optim_step()
        log.append({"reward": r.mean().item(), "loss": res.loss, "grad_norm": opt["grad_norm"],
                    "entropy": res.entropy[mask].mean().item(), "kl": res.metrics["kl"],
                    "applied": opt["applied"]})
    return log


def test_grpo_reward_rises(tmp_path):
    log = spawn(1, "grpo", tmp_path, module=__name__)[0]
    for i, row in enumerate(log):
        assert row["applied"], i
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert math.isfinite(row[key]), (i, key, row[key])
    first = sum(r["reward"] for r in log[:WINDOW]) / WINDOW
    last = sum(r["reward"] for r in log[-WINDOW:]) / WINDOW
    assert last > first + MARGIN, (first, last)
    assert log[-1]["kl"] > 0  # the policy moved away from the reference


if __name__ == "__main__":  # prints the run: python -m tests.e2e.test_grpo_learns
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        for i, row in enumerate(spawn(1, "grpo", Path(d), module="tests.e2e.test_grpo_learns")[0]):
            print(i, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
