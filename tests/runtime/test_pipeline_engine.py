"""The producers' shipped engine adapter (transformers' generate on the runtime's export), no Ray:
the sampler's log-probs are the trained model's, prompts of different lengths share a call, and
weights loaded mid-generation give each token the version that sampled it."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from bumblebee.runtime import Batch, Runtime
from bumblebee.runtime.pipeline import CopyDigits, Sampling
from bumblebee.runtime.pipeline.engine import TransformersEngine

TASK = CopyDigits(length=3)
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id, "pad_token_id": TASK.pad_id,
          "eos_token_id": None}


def _policy(seed):
    return Runtime(models.build(CONFIG, seed=seed))


def _logprobs(rt, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, len(prompt):] = True
    return rt.forward(Batch(ids, loss_mask=mask)).log_probs[0, len(prompt):]


def test_sampler_logprobs_are_the_policy_s():
    rt = _policy(0)
    engine = TransformersEngine(CONFIG, pad_token_id=TASK.pad_id)
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate([[10, 1, 11]], 2, Sampling(max_new_tokens=2), seed=0)
    engine.load_weights(rt.export_weights(), version=5)
    prompts = [[10, 3, 1, 4, 11], [10, 11], [10, 9, 11]]  # different lengths: left-padded into one batch
    before = torch.get_rng_state()
    out = engine.generate(prompts, 3, Sampling(max_new_tokens=6), seed=7)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left as it was
    assert [len(cs) for cs in out] == [3, 3, 3]
    for prompt, cs in zip(prompts, out):
        for c in cs:
            assert len(c.tokens) == 6 and c.versions == [5] * 6 and c.spans == [(5, 0, 6)]
            torch.testing.assert_close(torch.tensor(c.logprobs), _logprobs(rt, prompt, c.tokens), rtol=1e-4,
                                       atol=1e-5)
    again = engine.generate(prompts, 3, Sampling(max_new_tokens=6), seed=7)
    assert [[c.tokens for c in cs] for cs in again] == [[c.tokens for c in cs] for cs in out]  # seeded


def test_weights_changed_mid_generation_give_version_spans():
    old, new = _policy(0), _policy(1)
    engine = TransformersEngine(CONFIG, pad_token_id=TASK.pad_id)
    engine.load_weights(old.export_weights(), version=0)
    calls = []

    def refresh():  # the producer's hook: newer weights arrive before the third token
        calls.append(len(calls))
        if len(calls) == 2:
            engine.load_weights(new.export_weights(), version=1)

    prompt = [10, 2, 7, 11]
    (c,), = engine.generate([prompt], 1, Sampling(max_new_tokens=5, chunk_tokens=1), seed=3, refresh=refresh)
    assert len(calls) == 4  # between the five one-token calls
    assert c.versions == [0, 0, 1, 1, 1] and c.spans == [(0, 0, 2), (1, 2, 5)]
    lp = torch.tensor(c.logprobs)
    torch.testing.assert_close(lp[:2], _logprobs(old, prompt, c.tokens)[:2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lp[2:], _logprobs(new, prompt, c.tokens)[2:], rtol=1e-4, atol=1e-5)


def test_weights_that_do_not_fit_are_refused():
    engine = TransformersEngine(CONFIG, pad_token_id=TASK.pad_id)
    weights = dict(_policy(0).export_weights())
    weights.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(weights.items(), version=0)
    with pytest.raises(ValueError, match="model_type"):
        TransformersEngine({k: v for k, v in CONFIG.items() if k != "model_type"})


def test_an_moe_export_loads_into_transformers_fused_experts():
    """transformers 5 holds a Qwen3-MoE layer's experts as two stacks; the export has one tensor per
    expert and projection: the engine fills the stacks, and samples with the trained model's log-probs."""
    moe = {**models.NAMED["qwen3-moe-tiny"], "vocab_size": 16, "eos_token_id": None}
    rt = Runtime(models.build(moe, seed=0))
    engine = TransformersEngine(moe, pad_token_id=TASK.pad_id)
    weights = dict(rt.export_weights())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in weights
    engine.load_weights(weights.items(), version=0)
    prompt = [10, 3, 1, 4, 11]
    (c, _), = engine.generate([prompt], 2, Sampling(max_new_tokens=4), seed=1)
    torch.testing.assert_close(torch.tensor(c.logprobs), _logprobs(rt, prompt, c.tokens), rtol=1e-4, atol=1e-5)
    weights.pop("model.layers.1.mlp.experts.7.gate_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.gate_up_proj'\]"):
        engine.load_weights(weights.items(), version=1)
