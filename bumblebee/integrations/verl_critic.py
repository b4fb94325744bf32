"""bumblebee's engine as verl 0.9.1's critic: a value model (`model_type="value_model"` in verl's
`EngineRegistry`, backend "bumblebee") for PPO with GAE.

The value model is the bumblebee causal LM with a value head `score` (nn.Linear(hidden, 1), no
bias: transformers' `*ForTokenClassification` head with one label) on the final-normed hidden
state. The head is a submodule of the model, so it is sharded with it (FSDP2's root unit), trained
by the same AdamW state, saved and loaded in the same DCP checkpoint, and written by the HF export
(`save_contents` with "hf_model") beside `model.*`, with a config that names the token-classification
class: transformers' `AutoModelForTokenClassification` loads it as verl's FSDP critic would.

verl's critic worker (`TrainingWorker` with model_type "value_model") asks `infer_batch` for
`{"values"}` (jagged [bsz, j1], one value per token: the value of the state after that token; verl's
`no_padding_2_padding` takes the response's from the token before each response token) and trains
with verl's `value_loss` through `train_mini_batch`. The critic's head is new: it starts at
normal(0, initializer_range), seeded (the same on every rank), as transformers initializes it.

Select it with `critic=bumblebee_critic` (verl_config/critic/bumblebee_critic.yaml); the critic
config is `BumblebeeCriticConfig` (engine options under `critic.bumblebee`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from verl.workers.config import CriticConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.utils import detach_tree

from bumblebee.integrations.verl import BACKEND, DEVICES, BumblebeeEngine, BumblebeeEngineConfig
from bumblebee.integrations.verl_data import packed_batch
from bumblebee.integrations.verl_hf import VALUE_HEAD, add_value_head
from bumblebee.runtime.ops import _counts_kept

def values(model, batch, head_fn=None):
    """Per-token values [N] of the packed `batch` through `model`'s own forward (FSDP2's hooks hold
    the root unit, head included, whole in there): the head on the final-normed hidden state, in
    fp32. `head_fn(values_N) -> loss`, when given, is the forward's result (`out.loss`)."""
    got = {}

    def head(hidden_NH, weight_VH, targets_N):
        w = model.score.weight
        got["values"] = (hidden_NH.float() @ w.float().t()).squeeze(-1)
        return head_fn(got["values"]) if head_fn is not None else got["values"].sum() * 0

    with model.custom_head(head):  # labels only to reach the head: no token's log-prob is computed
        out = model(batch.input_ids, labels=batch.input_ids, position_ids=batch.position_ids,
                    cu_seqlens=batch.cu_seqlens)
    return got["values"], out.loss


class BumblebeeValueEngine(BumblebeeEngine):
    """The bumblebee engine with a value head: verl's critic (`value_model`). Everything but the
    model's output is the language-model engine's (micro-batching, optimizer, schedule, offload,
    checkpoints, HF export)."""

    def _load_model(self):
        # the LM head stays (the state and the export keep the checkpoint whole); it takes no part
        return add_value_head(super()._load_model())

    def forward_step(self, micro, loss_function, forward_only):
        """One verl micro-batch: {"model_output": {"values"}, "loss", "metrics"} (verl's value_loss)."""
        micro = micro.to(self.device)
        batch, offsets = packed_batch(micro)
        group, dp = self.get_data_parallel_group(), self.get_data_parallel_size()
        found = {"metrics": {}, "loss": 0.0}

        def as_verl(values_N):
            return {"values": torch.nested.nested_tensor_from_jagged(values_N, offsets.to(values_N.device))}

        def head_fn(values_N):
            if loss_function is None:
                return values_N.sum() * 0
            loss, found["metrics"] = loss_function(model_output=as_verl(values_N), data=micro,
                                                   dp_group=group)
            found["loss"] = float(loss.detach())
            return loss

        if forward_only:  # no graph; router load counts stay as they were (only training moves biases)
            with torch.no_grad(), _counts_kept(self.model):
                vals, _ = values(self.model, batch, head_fn if loss_function is not None else None)
        else:
            vals, loss = values(self.model, batch, head_fn)
            # verl scales its loss for a gradient mean over ranks; the state averages over its ranks
            # too: the backward of verl's loss as it is gives verl's gradient
            loss.backward()
        return {"model_output": detach_tree(as_verl(vals)), "loss": found["loss"], "metrics": found["metrics"]}


@dataclass
class BumblebeeCriticEngineConfig(BumblebeeEngineConfig):
    """The critic's engine options (those of `BumblebeeEngineConfig`). A class of this module, so a
    worker that unpickles the critic's config imports it, and with it the value engine's registration."""


@dataclass
class BumblebeeCriticConfig(CriticConfig):
    """verl's critic config with `strategy="bumblebee"`; the engine options live under `bumblebee`.
    The critic's micro-batch sizes reach the engine here (verl's trainer copies only the token
    limits): ppo_micro_batch_size_per_gpu for training, forward_micro_batch_size_per_gpu (default:
    the same) for compute_values."""
    _mutable_fields = CriticConfig._mutable_fields | {"forward_micro_batch_size_per_gpu"}

    strategy: str = BACKEND
    bumblebee: BumblebeeEngineConfig = field(default_factory=BumblebeeCriticEngineConfig)
    forward_micro_batch_size_per_gpu: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != BACKEND:
            raise ValueError(f"critic.strategy must be {BACKEND!r} for BumblebeeCriticConfig, got {self.strategy!r}")
        eng = self.bumblebee
        if self.forward_micro_batch_size_per_gpu is None:
            self.forward_micro_batch_size_per_gpu = self.ppo_micro_batch_size_per_gpu
        eng.use_dynamic_bsz = self.use_dynamic_bsz
        eng.micro_batch_size_per_gpu = self.ppo_micro_batch_size_per_gpu
        eng.infer_micro_batch_size_per_gpu = self.forward_micro_batch_size_per_gpu
        eng.max_token_len_per_gpu = self.ppo_max_token_len_per_gpu
        eng.infer_max_token_len_per_gpu = self.forward_max_token_len_per_gpu
        self.engine = eng


def _register() -> None:
    for model_type in ("value_model",):
        have = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {})
        devices = [d for d in DEVICES if d not in have]  # importing twice registers once
        if devices:
            EngineRegistry.register(model_type=model_type, backend=BACKEND, device=devices)(BumblebeeValueEngine)


_register()

__all__ = ["BumblebeeCriticConfig", "BumblebeeCriticEngineConfig", "BumblebeeValueEngine", "add_value_head", "values",
           "VALUE_HEAD"]
