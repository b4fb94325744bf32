"""The runtime's operations. Batches are token-aligned: entry t of every [B, T] tensor describes
token t, and its log-prob is that of token t given the tokens before it in its sequence (0 for a
sequence's first token, which has none), as inference engines report sampled tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bumblebee.checks import check_batch_shape
from bumblebee.models import moe
from bumblebee.runtime.losses import LOSSES, policy_loss


@dataclass
class Batch:
    """[B, T] token-aligned inputs. `loss_mask` (bool): the tokens trained on (default: all that
    have a prefix); `weights`: per-token loss weights (default: 1 on trained tokens), where the
    caller's normalization goes; `advantages` and `sampler_logprobs` (the log-probs of the policy
    that sampled the tokens, PPO's old policy) for the policy-gradient losses; `cu_seqlens` [S + 1]:
    the B*T tokens are one packed stream of sequences."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def check(self):
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"batch.input_ids must be an int [B, T] tensor, got "
                             f"{getattr(ids, 'dtype', type(ids))} of shape {tuple(getattr(ids, 'shape', ()))}")
        check_batch_shape(ids, "batch.input_ids")
        for name in ("loss_mask", "weights", "advantages", "sampler_logprobs", "position_ids"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
                raise ValueError(f"batch.{name} must be a [B, T] = {tuple(ids.shape)} tensor like input_ids, got "
                                 f"shape {tuple(getattr(t, 'shape', ()))}")
        if self.loss_mask is not None and self.loss_mask.dtype != torch.bool:
            raise ValueError(f"batch.loss_mask must be bool, got {self.loss_mask.dtype}")
        for name in ("weights", "advantages", "sampler_logprobs"):
            t = getattr(self, name)
            if t is not None and not t.is_floating_point():
                raise ValueError(f"batch.{name} must be a floating-point tensor, got {t.dtype}")
        return self


@dataclass
class TokenOutput:
    logprobs: torch.Tensor  # [B, T] token-aligned, 0 where no token is predicted
    entropy: torch.Tensor | None  # [B, T] entropy of the distribution each token was drawn from
    trained: torch.Tensor  # bool [B, T]: tokens with a log-prob (masked in and with a prefix)
    loss: torch.Tensor | None = None


def token_logprobs(model, batch: Batch, *, temperature: float = 1.0, entropy: bool = False, loss_fn=None):
    """TokenOutput of `batch` through `model`'s forward (its `cross_entropy` slot with
    reduction="none": with `linear_ce` no [N, V] logits exist). `loss_fn(out) -> scalar`, when
    given, becomes `out.loss` inside the forward (so a sharded model's head is whole)."""
    batch.check()
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    ids = batch.input_ids
    mask = torch.ones_like(ids, dtype=torch.bool) if batch.loss_mask is None else batch.loss_mask
    labels = ids.masked_fill(~mask, -100).long()
    res = {}

    def head(hidden_NH, weight_VH, targets_N):
        got = model.loss_fn(hidden_NH, weight_VH, targets_N, reduction="none", temperature=temperature,
                            return_entropy=entropy)
        ce_N, ent_N = got if entropy else (got, None)
        B, T = ids.shape
        shift = (lambda t_N: F.pad(t_N.view(B, T)[:, :-1], (1, 0)))  # row i predicts token i + 1
        trained = shift(targets_N != -100)
        out = TokenOutput(logprobs=-shift(ce_N), entropy=None if ent_N is None else shift(ent_N), trained=trained)
        res["out"] = out
        return loss_fn(out) if loss_fn is not None else out.logprobs.sum()

    with model.custom_head(head):
        model_out = model(ids, labels=labels, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
    out = res["out"]
    if loss_fn is not None:
        out.loss = model_out.loss  # loss_fn's value, plus any auxiliary term the model's config adds
    return out


class Runtime:
    """Training operations on `model` (a bumblebee causal LM) and `state` (the TrainState that
    `state_sharding` returns for it, or None: forward-only, or the caller steps). Every rank calls
    every operation (the sharded state holds collectives)."""

    def __init__(self, model, state=None, *, router_bias_rate: float = 1e-3):
        self.model, self.state, self.router_bias_rate = model, state, router_bias_rate

    @torch.no_grad()
    def forward(self, batch: Batch, *, temperature: float = 1.0, entropy: bool = False) -> TokenOutput:
        """Log-probs (and entropy) without a graph, e.g. the reference or old policy's. Router load
        counts are left as they were: only training forwards move the biases."""
        counts = {n: r.tokens_per_expert for n, r in moe.routers(self.model).items()}
        try:
            return token_logprobs(self.model, batch, temperature=temperature, entropy=entropy)
        finally:
            for n, r in moe.routers(self.model).items():
                r.tokens_per_expert = counts[n]

    def forward_backward(self, batch: Batch, loss: str = "cross_entropy", *, temperature: float = 1.0,
                         clip=(0.2, 0.2), entropy_coef: float = 0.0) -> dict:
        """One micro-batch: the loss's forward and backward; gradients add to those already there
        (call `optim_step` after the last micro-batch). The gradient is that of the sum of the losses
        of every micro-batch on every rank. Returns {"loss" (this rank's), "logprobs" [B, T]
        (detached), "entropy" (when entropy_coef), metrics...}."""
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if not (len(clip) == 2 and all(0 <= c for c in clip) and clip[0] < 1):
            raise ValueError(f"clip must be (low, high) with 0 <= low < 1 and high >= 0, got {clip}")
        batch.check()

        metrics = {}

        def loss_fn(out):
            w = out.trained.to(out.logprobs.dtype)
            if batch.weights is not None:
                w = w * batch.weights.to(w.dtype)
            value, m = policy_loss(loss, out.logprobs, w, advantages=batch.advantages,
                                   sampler_logprobs=batch.sampler_logprobs, clip=clip,
                                   entropy=out.entropy, entropy_coef=entropy_coef)
            metrics.update(m)
            return value

        out = token_logprobs(self.model, batch, temperature=temperature, entropy=bool(entropy_coef), loss_fn=loss_fn)
        # the state averages gradients over its ranks: scaled by their number, the gradient is that
        # of the sum of every rank's loss, so weights = 1 / (global token count) give the global mean
        (out.loss * (self.state.mesh.size() if self.state is not None else 1)).backward()
        result = {"loss": float(out.loss.detach()), "logprobs": out.logprobs.detach(), **metrics}
        if out.entropy is not None:
            result["entropy"] = out.entropy.detach()
        return result

    def optim_step(self) -> dict:
        """Apply the accumulated gradients (global-norm clipping and the non-finite skip of the
        state), zero them, and move auxiliary-loss-free router biases by their token counts.
        Without any gradient on any rank (no forward_backward since the last step) nothing changes:
        {"applied": False, "skipped": "no gradient"}, weights, optimizer state, step count and router
        biases as they were."""
        state = self._need_state("optim_step")
        applied, norm, zeros = state.step()
        state.zero_grad()
        out = {"applied": applied, "grad_norm": norm, "zero_grads": zeros, "step": state.steps}
        if not applied:
            out["skipped"] = state.skip_reason
        if state.skip_reason == "no gradient":  # no tokens were trained on: the biases stay too
            return out
        if any(r.scoring == "sigmoid" for r in moe.routers(self.model).values()):
            moe.update_router_bias(self.model, rate=self.router_bias_rate, group=state.group)
            out["router_max_over_mean"] = max(s["max_over_mean"] for s in moe.router_load_stats(self.model).values())
        return out

    def save_state(self, path) -> None:
        """Model, optimizer and buffers (router biases) as a reshardable checkpoint, atomically."""
        self._need_state("save_state").save(path)

    def load_state(self, path) -> None:
        self._need_state("load_state").load(path)

    def save_weights(self, path) -> None:
        """Full HF weights (config.json + safetensors) that transformers or an inference engine loads."""
        (self.state or self.model).save_pretrained(path)

    def _need_state(self, op):
        if self.state is None:
            raise ValueError(f"Runtime.{op} needs a state: Runtime(model, state) with the TrainState that "
                             f"bumblebee's state_sharding (fsdp2 or zero1) returned for the model")
        return self.state
