"""FSDP2 state sharding: parameters, gradients and Adam states all sharded over data parallel.

`fully_shard` wraps every decoder block as one unit; the token embedding is a unit of its own
(when untied) and the root unit holds the final norm and the LM head. The head stays in the root
because the loss reads `lm_head.weight` directly (linear cross-entropy never calls the module), and
FSDP2 unshards a unit only around its module's forward; the root's parameters stay unsharded from
forward to backward, which is what the head needs anyway. Sharded parameters are fp32 (the master
weights, the optimizer updates them in place); `MixedPrecisionPolicy` all-gathers them as bf16 for
compute and reduce-scatters gradients in fp32. Forward and backward prefetch are set explicitly
(next block in forward, previous block in backward). With `ep_mesh` (dims efsdp x ep, experts
already split over ep by `bumblebee.parallelize.shard_experts`) each block's experts are a nested
unit sharded over efsdp only (MTP blocks' experts too), dense parameters over the whole mesh. MTP
depths stay in the root unit (the loss calls their head norm outside their forward); their experts
are nested units, so the root holds only their dense part unsharded. Per rank: 16P/n bytes of state
(4 master + 4 grad + 8 Adam) plus the unsharded bf16 parameters of the units in flight.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from bumblebee.registry import register
from bumblebee.common.state_sharding import MIXED_PRECISION, TrainState, check_args, named_params


class FSDP2State(TrainState):
    impl = "fsdp2"

    def __init__(self, model, mesh, *, reshard_after_forward: bool, ep_mesh=None, **kw):
        super().__init__(model, mesh, ep_mesh=ep_mesh, **kw)
        mp = (MixedPrecisionPolicy(param_dtype=MIXED_PRECISION["bf16"], reduce_dtype=torch.float32)
              if self.compute_dtype == torch.bfloat16 else MixedPrecisionPolicy())
        model.to(torch.float32)  # the sharded parameters are the fp32 master weights
        inner = model.model
        tied = getattr(model.config, "tie_word_embeddings", False)
        units = []
        if ep_mesh is not None:
            # this rank's E/ep experts, sharded over the ranks holding the same experts: every MoE
            # block's, the decoder layers' and the MTP blocks' alike (inside the root unit they would
            # be sharded over ranks that hold other experts)
            for experts in [getattr(m, "experts", None) for m in model.modules()]:
                if isinstance(experts, torch.nn.Module):
                    fully_shard(experts, mesh=ep_mesh["efsdp"], mp_policy=mp,
                                reshard_after_forward=reshard_after_forward)
        if not tied:  # a tied embedding is the head's weight: it lives in the root unit
            units.append(fully_shard(inner.embed_tokens, mesh=mesh, mp_policy=mp,
                                     reshard_after_forward=reshard_after_forward))
        for layer in inner.layers:
            units.append(fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward))
        # the root (final norm, head) is needed again right at the start of the backward: keep it
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
        self.units = units
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._params = named_params(model)
        self.full_shapes = {n: self.global_shape(n, p) for n, p in self._params.items()}
        self.optimizer = self._make_optimizer(list(self._params.values()))

    def masters(self):
        return self._params

    def after_update(self):
        """Drop the gathered parameters FSDP2 keeps after a forward that no backward followed (the root
        unit's always: final norm, head or tied embedding; every unit's under reshard_after_forward=False):
        the next forward reuses them without a gather, so after the masters change (a step, a load) it
        would compute with the old weights. Resharding a unit that is sharded already does nothing."""
        for m in self._fsdp_modules:
            m.reshard()

    def reduced_grad_shards(self):
        out = []
        ep = self.ep_mesh["ep"].size() if self.ep_mesh is not None else 1
        for name, p in self._params.items():
            if p.grad is None:  # a parameter that took no part in the loss: a zero gradient
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if name in self.expert_names and ep > 1:
                # an expert gradient already sums the tokens of its whole ep group, and FSDP2 took the
                # mean over efsdp = n/ep ranks: the mean over all n ranks is 1/ep of it (a local
                # scale: gloo has no pre-multiplied reduce-scatter for a custom divide factor)
                g.div_(ep)
            out.append(g)
        return out

    def zero_grad(self):
        for p in self._params.values():
            p.grad = None

    def has_local_grad(self):
        return any(p.grad is not None for p in self._params.values())


@register("state_sharding", "fsdp2", kind="primitive", twin="zero1", default=True)
def fsdp2(model, mesh, *, optimizer="adamw", lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
          mixed_precision="bf16", grad_clip=None, ep_mesh=None, reshard_after_forward=True) -> TrainState:
    """FSDP2 (fully_shard per block): params, grads and Adam states sharded over the data-parallel mesh."""
    check_args(model, mesh, optimizer=optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
               mixed_precision=mixed_precision, grad_clip=grad_clip, ep_mesh=ep_mesh,
               reshard_after_forward=reshard_after_forward)
    state = FSDP2State(model, mesh, reshard_after_forward=reshard_after_forward, ep_mesh=ep_mesh, lr=lr, betas=betas,
                       eps=eps, weight_decay=weight_decay, mixed_precision=mixed_precision, grad_clip=grad_clip)
    model.save_pretrained = state.save_pretrained  # HF export gathers the shards
    return state
