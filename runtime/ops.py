"""The runtime's operations. Batches are token-aligned: entry t of every [B, T] tensor describes
token t, and its log-prob is that of token t given the tokens before it in its sequence (0 for a
sequence's first token, which has none), as inference engines report sampled tokens.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bumblebee.models import moe
from bumblebee.runtime import export, losses, optim
from bumblebee.runtime.batching import Batch, all_reduce_ints, plan
from bumblebee.runtime.offload import Placement
from bumblebee.runtime.results import ForwardResult, LossInputs
from bumblebee.runtime.routes import routing


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
    every operation (the sharded state holds collectives). `lr_schedule` scales the state's base
    learning rate (`optim.base_lr`: the rate the state was built with, whenever this Runtime is
    built) by `lr_scheduler_step` (default: constant), starting at the state's optimizer step count."""

    def __init__(self, model, state=None, *, router_bias_rate: float = 1e-3,
                 lr_schedule: optim.LRSchedule | None = None):
        self.model, self.state, self.router_bias_rate = model, state, router_bias_rate
        self.placement = Placement(model, state)
        self.lr_schedule = lr_schedule or optim.LRSchedule()
        self.lr_steps = 0
        self._trained_tokens: int | None = None  # since the last step, over all ranks (None: no forward_backward)
        if state is not None:
            self.base_lr = optim.base_lr(state.optimizer)
            self.lr_steps = state.steps  # 0 for a fresh state; a state that stepped resumes its schedule
            optim.set_hyperparameters(state.optimizer, lr=self.base_lr * self.lr_schedule.factor(self.lr_steps))

    # ---- forward and backward ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: Batch, *, temperature: float = 1.0, entropy: bool = False,
                micro_batch_tokens: int | None = None, return_routed_experts: bool = False) -> ForwardResult:
        """Log-probs (and entropy) without a graph, e.g. the reference or old policy's. Router load
        counts are left as they were: only training forwards move the biases."""
        with _counts_kept(self.model):
            return self._run(batch, None, temperature=temperature, entropy=entropy,
                             micro_batch_tokens=micro_batch_tokens, return_routed_experts=return_routed_experts)

    def forward_backward(self, batch: Batch, loss_fn="cross_entropy", *, micro_batch_tokens: int | None = None,
                         loss_agg_mode: str = "sum", temperature: float = 1.0, clip=(0.2, 0.2),
                         entropy_coef: float = 0.0, kl_coef: float = 0.0, kl_penalty: str = "low_var_kl",
                         entropy: bool = False, return_routed_experts: bool = False,
                         reduce_each_micro_batch: bool = False) -> ForwardResult:
        """Forward and backward of `batch`, cut into micro-batches of at most `micro_batch_tokens`
        (whole sequences; None: one); gradients add to those already there (call `optim_step`
        after). `loss_fn`: a named loss (LOSSES) with `clip`, `entropy_coef`, `kl_coef` /
        `kl_penalty` (on batch.ref_logprobs) and `loss_agg_mode` (AGG_MODES: "sum" leaves the
        normalization to `weights`; the means divide by counts over the whole batch on every rank),
        or a callable `loss_fn(model_output, data, dp_group) -> (loss, metrics)` (see LossInputs).
        The gradient is that of the sum of every micro-batch's loss on every rank. FSDP2 reduce-scatters
        once, after the last micro-batch, keeping unsharded fp32 gradients in between (4 bytes per
        parameter per rank); `reduce_each_micro_batch` reduce-scatters after every one instead."""
        named = isinstance(loss_fn, str)
        if named and loss_fn not in losses.LOSSES:
            raise ValueError(f"loss must be one of {losses.LOSSES} or a callable, got {loss_fn!r}")
        if not named and not callable(loss_fn):
            raise ValueError(f"loss_fn must be a loss name {losses.LOSSES} or a callable, got {loss_fn!r}")
        if not (len(clip) == 2 and all(0 <= c for c in clip) and clip[0] < 1):
            raise ValueError(f"clip must be (low, high) with 0 <= low < 1 and high >= 0, got {clip}")
        losses.check_agg_mode(loss_agg_mode)
        losses.check_kl_penalty(kl_penalty)
        losses.check_coef("kl_coef", kl_coef)
        losses.check_coef("entropy_coef", entropy_coef)
        if named:
            opts = dict(clip=clip, entropy_coef=entropy_coef, kl_coef=kl_coef, kl_penalty_name=kl_penalty,
                        loss_agg_mode=loss_agg_mode)
            loss_fn = _named_loss(loss_fn, opts)
        return self._run(batch, loss_fn, temperature=temperature, entropy=entropy or bool(entropy_coef and named),
                         micro_batch_tokens=micro_batch_tokens, return_routed_experts=return_routed_experts,
                         named=named, no_sync=not reduce_each_micro_batch)

    def _run(self, batch, loss_fn, *, temperature, entropy, micro_batch_tokens, return_routed_experts, named=True,
             no_sync=False):
        batch.check()
        self.placement.check("forward_backward" if loss_fn else "forward")
        group = self.state.group if self.state is not None else None
        micro = plan(batch, micro_batch_tokens, group if micro_batch_tokens is not None else None)
        norm = _global_counts(batch, group) if loss_fn else None
        if loss_fn is not None:  # the same global count on every rank: optim_step's skip is unanimous
            self._trained_tokens = (self._trained_tokens or 0) + norm.tokens
        dp = self.state.mesh.size() if self.state is not None else 1
        B, T = batch.input_ids.shape
        log_probs, ent, routes = None, None, None
        total, parts = 0.0, []
        no_sync = no_sync and loss_fn is not None and len(micro) > 1 and hasattr(self.model, "set_requires_gradient_sync")
        try:
            for i, mb in enumerate(micro):
                if no_sync:  # FSDP2 reduce-scatters the accumulated gradient once, after the last
                    self.model.set_requires_gradient_sync(i == len(micro) - 1)
                sub = mb.take(batch)
                head = None
                if loss_fn is not None:
                    data = LossInputs(sub, sub.trained(), losses.Norm(norm.tokens, norm.seqs, sub.sequence_ids()),
                                      i, len(micro))
                    head = _head(loss_fn, data, group, mb.dummy, parts)
                with contextlib.ExitStack() as stack:
                    if mb.dummy:
                        stack.enter_context(_counts_kept(self.model))
                    recorded = stack.enter_context(routing(self.model, sub.routed_experts, return_routed_experts))
                    out = token_logprobs(self.model, sub, temperature=temperature, entropy=entropy, loss_fn=head)
                    got_routes = recorded(*sub.input_ids.shape) if return_routed_experts else None
                if loss_fn is not None:
                    (out.loss * dp).backward()  # the state averages over its ranks: this makes it their sum
                    if not mb.dummy:
                        total += float(out.loss.detach())
                if log_probs is None:
                    log_probs = out.logprobs.new_zeros(B, T)
                    ent = out.entropy.new_zeros(B, T) if out.entropy is not None else None
                    routes = got_routes.new_zeros(B, T, *got_routes.shape[2:]) if got_routes is not None else None
                mb.put(log_probs, out.logprobs.detach())
                if ent is not None:
                    mb.put(ent, out.entropy.detach())
                if routes is not None:
                    mb.put(routes, got_routes)
        finally:
            if no_sync:
                self.model.set_requires_gradient_sync(True)
        metrics = {}
        if parts:
            metrics = losses.combine_metrics(parts) if named else _lists(parts)
        return ForwardResult(log_probs=log_probs, trained=batch.trained(), entropy=ent,
                             loss=total if loss_fn is not None else None, metrics=metrics, routed_experts=routes)

    # ---- optimizer -----------------------------------------------------------------------------
    def optim_step(self, *, lr: float | None = None, betas=None, eps: float | None = None,
                   weight_decay: float | None = None) -> dict:
        """Apply the accumulated gradients (global-norm clipping and the non-finite skip of the
        state), zero them, and move auxiliary-loss-free router biases by their token counts. AdamW
        hyperparameters given here (Tinker's AdamParams) hold from this step on (an `lr` until the
        next `lr_scheduler_step`). Without any gradient on any rank (no forward_backward since the
        last step) nothing changes: {"applied": False, "skipped": "no gradient"}, weights, optimizer
        state, step count and router biases as they were. The same when the forward_backward calls
        since the last step trained no token on any rank ({"skipped": "no trained token"}; AdamW
        would still move the weights by its moments): their gradients and router counts are dropped."""
        state = self._need_state("optim_step")
        hp = optim.check_adam(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.placement.check("optim_step")
        optim.set_hyperparameters(state.optimizer, **hp)
        untrained = self._trained_tokens == 0  # a global count: every rank skips alike
        self._trained_tokens = None
        applied, norm, zeros = state.step(skip="no trained token" if untrained else None)
        state.zero_grad()
        out = {"applied": applied, "grad_norm": norm, "zero_grads": zeros, "step": state.steps,
               "lr": state.optimizer.param_groups[0]["lr"]}
        if not applied:
            out["skipped"] = state.skip_reason
        if state.skip_reason in ("no gradient", "no trained token"):  # nothing trained: the biases stay too
            _drop_router_counts(self.model)
            return out
        if any(r.scoring == "sigmoid" for r in moe.routers(self.model).values()):
            moe.update_router_bias(self.model, rate=self.router_bias_rate, group=state.group)
            out["router_max_over_mean"] = max(s["max_over_mean"] for s in moe.router_load_stats(self.model).values())
        return out

    def optimizer_zero_grad(self) -> None:
        """Drop the accumulated gradients (and the routers' token counts of those forwards)."""
        self._need_state("optimizer_zero_grad").zero_grad()
        self.placement.aside.clear()
        self._trained_tokens = None
        _drop_router_counts(self.model)

    def lr_scheduler_step(self) -> float:
        """Advance the schedule one step; the learning rate the next `optim_step` uses."""
        state = self._need_state("lr_scheduler_step")
        self.lr_steps += 1
        lr = self.base_lr * self.lr_schedule.factor(self.lr_steps)
        optim.set_hyperparameters(state.optimizer, lr=lr)
        return lr

    def hyperparameters(self) -> dict:
        return optim.hyperparameters(self._need_state("hyperparameters").optimizer)

    # ---- modes, devices, weights -----------------------------------------------------------------
    @contextlib.contextmanager
    def train_mode(self):
        """Within: the model in training mode (`model.training`); the modes found are restored."""
        with _mode(self.model, True):
            yield self

    @contextlib.contextmanager
    def eval_mode(self):
        with _mode(self.model, False):
            yield self

    def to(self, device, *, model: bool = True, optimizer: bool = True, grad: bool = True, copy: bool = False):
        """Move the parts asked for (model: parameters and buffers; optimizer: Adam state and ZeRO-1's
        fp32 masters; grad: gradients) to `device`, each on its own, e.g. offload to "cpu" while an
        inference engine uses the GPU. `copy`: new storage even on the same device. Returns self."""
        if torch.device(device).type == "meta":  # meta tensors hold no data: weights and moments would be gone
            raise ValueError(f"Runtime.to: device must hold data (cpu, cuda, ...), got {device!r}: "
                             f"'meta' would drop the weights and the optimizer state")
        self.placement.to(device, model=model, optimizer=optimizer, grad=grad, copy=copy)
        return self

    def export_weights(self, *, bucket_bytes: int = 2**30, dtype: torch.dtype | None = None):
        """Iterator of (HF name, full tensor), equal to what `save_weights` writes, gathered `bucket_bytes`
        at a time on every rank (all ranks iterate to the end)."""
        self.placement.check("export_weights")
        return export.export_weights(self.model, self.state, bucket_bytes=bucket_bytes, dtype=dtype)

    def export_weight_shards(self, *, dtype: torch.dtype | None = None):
        """Iterator of WeightShard: this rank's slices of the HF tensors and their place, no collective."""
        return export.export_weight_shards(self.model, self.state, dtype=dtype)

    def save_state(self, path) -> None:
        """Model, optimizer and buffers (router biases) as a reshardable checkpoint, atomically."""
        self._need_state("save_state").save(path)

    def load_state(self, path, *, check_finite: bool = False) -> None:
        """Load a `save_state` checkpoint; the learning-rate schedule resumes at its optimizer step count.
        Its checksums are verified; check_finite also refuses NaN or inf weights or optimizer state."""
        state = self._need_state("load_state")
        state.load(path, check_finite=check_finite)
        self.lr_steps = state.steps
        optim.set_hyperparameters(state.optimizer, lr=self.base_lr * self.lr_schedule.factor(self.lr_steps))

    def save_weights(self, path) -> None:
        """Full HF weights (config.json + safetensors) that transformers or an inference engine loads."""
        (self.state or self.model).save_pretrained(path)

    def _need_state(self, op):
        if self.state is None:
            raise ValueError(f"Runtime.{op} needs a state: Runtime(model, state) with the TrainState that "
                             f"bumblebee's state_sharding (fsdp2 or zero1) returned for the model")
        return self.state


def _named_loss(name, opts):
    def loss_fn(model_output, data, dp_group):
        lp, b = model_output["log_probs"], data.batch
        w = data.trained.to(lp.dtype) if b.weights is None else b.weights.to(lp.dtype)
        return losses.policy_loss(name, lp, w, advantages=b.advantages, sampler_logprobs=b.sampler_logprobs,
                                  entropy=model_output["entropy"], ref_logprobs=b.ref_logprobs, norm=data.norm,
                                  trained=data.trained, **opts)
    return loss_fn


def _head(loss_fn, data, group, dummy, parts):
    """The head's loss of one micro-batch; a dummy one trains nothing but keeps the graph whole."""
    def head(out: TokenOutput):
        if dummy:
            return out.logprobs.sum() * 0
        value, metrics = loss_fn({"log_probs": out.logprobs, "entropy": out.entropy, "trained": out.trained},
                                 data, group)
        parts.append(metrics)
        return value
    return head


def _global_counts(batch: Batch, group) -> losses.Norm:
    """Trained tokens and sequences with a trained token, over every rank of `group` (one all-reduce)."""
    trained = batch.trained()
    seq = batch.sequence_ids()
    per_seq = torch.zeros(int(seq.max()) + 1, dtype=torch.int64).index_add(
        0, seq.reshape(-1).cpu(), trained.reshape(-1).cpu().long())
    counts = [int(trained.sum()), int((per_seq > 0).sum())]
    if group is not None:
        counts = all_reduce_ints(counts, group)
    return losses.Norm(*counts)


def _lists(parts: list[dict]) -> dict:
    return {k: [p[k] for p in parts if k in p] for k in {k for p in parts for k in p}}


def _drop_router_counts(model) -> None:
    """Forget the routers' token counts of the forwards since the last bias update."""
    for r in moe.routers(model).values():
        r.tokens_per_expert = None


@contextlib.contextmanager
def _counts_kept(model):
    """Router load counts as they were before (forwards that must not move the biases)."""
    counts = {n: r.tokens_per_expert for n, r in moe.routers(model).items()}
    try:
        yield
    finally:
        for n, r in moe.routers(model).items():
            r.tokens_per_expert = counts[n]


@contextlib.contextmanager
def _mode(model, training: bool):
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was
