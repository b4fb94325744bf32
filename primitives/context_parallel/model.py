"""A built model under context parallelism: its layers swapped for their cp forms, and the loss.

`apply(model, cp_group, ContextParallel(...))` (after loading the full checkpoint, beside
`bumblebee.parallelize.shard_experts` and state sharding): every attention module's `attend` (the
`attention` slot) becomes the cp exchange, every gated DeltaNet layer (the `linear_attention` slot)
and MLA layer (the `mla` slot) runs its cp forward. The model then takes a `Shard`
(`layout.shard_batch`): `loss(model, shard)` runs the model's own forward on the shard with its
`CPBatch` where packed batches pass `cu_seqlens` (the layers read the layout from it; it travels
through full recompute with the layer's arguments), positions and targets set on the full sequence,
and the loss slot's sum over this rank's targets divided by the whole batch's count. Summed over the
cp ranks that is the single-rank mean: the replicated parameters' gradients are summed over the
group (`sync_grads`, or a data-parallel reduction that sums over cp).

Token-wise layers (norms, MLPs, MoE routing and dispatch) need nothing: each rank's tokens are a
batch of their own; only the softmax routers' load-balancing loss needs the global token means
(`_aux_share`). MTP depths read tokens and targets shifted on the full sequence (`Shard.mtp_*`).
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from bumblebee import recompute
from bumblebee.distributed import reduce_from_group
from bumblebee.options import check_choice, option
from bumblebee.primitives.context_parallel.attention import EXCHANGES, check_batch
from bumblebee.primitives.context_parallel.flash import BLOCK_KEYS
from bumblebee.primitives.context_parallel.gdn import DELTANET, FLA_TRANSITIONS, gdn_forward
from bumblebee.primitives.context_parallel.layout import Shard
from bumblebee.primitives.context_parallel.mla import EXCHANGES as MLA_EXCHANGES, mla_forward


@dataclass(frozen=True)
class ContextParallel:
    """Options of context parallelism: `apply(model, group, ContextParallel(exchange="ring"))`."""

    exchange: str = option("allgather", "how attention layers get the other ranks' keys and values: "
                           "allgather (one all-gather of K/V, reduce-scatter backward) or ring (blocks "
                           "passed around the ring, overlapped with compute; fp32 log-sum-exp merging)")
    allgather_block_keys: int = option(BLOCK_KEYS, "allgather: the most keys one fused block takes (a piece's "
                                       "earlier keys are cut into such blocks, bounding the K/V repeated to the "
                                       "query heads and their gradients at any length); 0: one block")
    mla_exchange: str = option("auto", "what MLA layers all-gather: latent (the normalized latent and roped "
                               "key, r + R numbers a token; K/V expanded by kv_b_proj on every rank), heads "
                               "(the expanded K/V, H x (qk + v) a token), or auto (whichever moves fewer bytes: "
                               "latent for DeepSeek-V3, 71x fewer)")
    deltanet: str = option("auto", "how gated DeltaNet layers pass the conv halo and the recurrent state: fla "
                           "(flash-linear-attention 0.6's own CP kernels: a transition-only chain pass, then the "
                           "plain rule; CUDA), maps (this project's exact fp32 affine maps from one widened call "
                           "of the rule; any device), or auto (fla where its CP kernels serve the layer's input, "
                           "else maps)")
    fla_concurrent_parts: bool = option(True, "fla's CP kernels (deltanet=fla, or auto where it takes them): a "
                                        "rank's two parts' state maps (the chain passes, forward and backward) "
                                        "scanned at once on two CUDA streams (gdn_fla_chain.py; equal results) "
                                        "instead of one after the other as fla 0.6 does: 2-5% off the layer on "
                                        "H200s; False: fla's own order")
    fla_transition: str = option("bf16x2", "fla's CP kernels: what computes each part's transition map (the entering "
                                 "state's [K, K] map, forward and backward): bf16x2 (default), fp32 or bf16 from "
                                 "kernels/context_parallel_gdn_transition.py (the map's columns carried as a state; "
                                 "bf16x2: hi + lo bf16 operands, 1.8e-6 from float64 over a 16K map; fp32: tf32x3; "
                                 "bf16: the state scan's rounding, 8.7e-4), or fla (fla 0.6's summary kernels, the "
                                 "map composed [K, K] by [K, K] in tf32x3; 1.9e-3). With bf16x2 the layer runs "
                                 "0.85 / 0.76 of the ideal speed-up at 128K, CP = 2 / 4, against fla's 0.68 / 0.61 "
                                 "(four H200s)")

    def __post_init__(self):
        check_choice(self, "exchange", tuple(EXCHANGES))
        check_choice(self, "mla_exchange", MLA_EXCHANGES)
        check_choice(self, "deltanet", DELTANET)
        check_choice(self, "fla_transition", FLA_TRANSITIONS)
        if not isinstance(self.fla_concurrent_parts, bool):
            raise ValueError(f"ContextParallel.fla_concurrent_parts must be a bool; got {self.fla_concurrent_parts!r}")
        if isinstance(self.allgather_block_keys, bool) or not isinstance(self.allgather_block_keys, int) \
                or self.allgather_block_keys < 0:
            raise ValueError(f"ContextParallel.allgather_block_keys must be an int >= 0; got {self.allgather_block_keys!r}")


class CPAttend:
    """The attention slot's call, `(q, k, v, *, scale, cu_seqlens=CPBatch)`, over the cp group."""

    def __init__(self, config: ContextParallel):
        self.config = config
        self.exchange = EXCHANGES[config.exchange]
        self.kw = {"block_keys": config.allgather_block_keys} if config.exchange == "allgather" else {}

    def __call__(self, q, k, v, *, scale=None, cu_seqlens=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return self.exchange(q, k, v, scale=scale, batch=check_batch(cu_seqlens, q), **self.kw)


def _is_gdn(m: nn.Module) -> bool:
    return all(hasattr(m, n) for n in ("A_log", "dt_bias", "conv1d", "in_proj_qkv"))


def _is_mla(m: nn.Module) -> bool:
    return all(hasattr(m, n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "softmax_scale"))


def apply(model: nn.Module, cp_group, config: ContextParallel | None = None) -> nn.Module:
    """Swap every sequence-mixing layer of `model` for its cp form over `cp_group`; returns the model.
    Refuses a model applied twice and a module that mixes tokens in a way this file does not know."""
    config = ContextParallel() if config is None else config
    if getattr(model, "cp_config", None) is not None:
        raise ValueError("context parallelism is already applied to this model")
    for m in model.modules():
        if _is_gdn(m):
            m.forward = functools.partial(gdn_forward, m, deltanet=config.deltanet,
                                          fla_concurrent_parts=config.fla_concurrent_parts,
                                          fla_transition=config.fla_transition)
        elif _is_mla(m):
            m.forward = functools.partial(mla_forward, m, exchange=config.mla_exchange)
        elif hasattr(m, "attend"):
            m.attend = CPAttend(config)
    model.cp_group, model.cp_config = cp_group, config
    return model


def loss(model: nn.Module, shard: Shard, grads: str = "sum") -> torch.Tensor:
    """This rank's share of the batch's mean next-token loss: sum over its targets / the global count
    (through the model's own forward, so FSDP2's hooks run; the loss is its `cross_entropy` slot),
    plus the MTP term of a model with depths, each depth's sum over its global count.
    grads: how the gradient reduction combines the cp ranks: "sum" (`sync_grads`), or "mean" (FSDP2
    over a mesh that includes cp averages over it): then the share is multiplied by CP."""
    if not isinstance(shard, Shard):
        raise ValueError(f"shard must be a context_parallel Shard (layout.shard_batch), got {type(shard).__name__}")
    if grads not in ("sum", "mean"):
        raise ValueError(f"grads must be 'sum' or 'mean', got {grads!r}")
    depths = len(model.mtp.layers) if hasattr(model, "mtp") else 0
    if len(shard.mtp_ids) != depths:
        raise ValueError(f"the model has {depths} MTP depths: shard with shard_batch(..., mtp_depths={depths}), "
                         f"got {len(shard.mtp_ids)}")
    targets = shard.targets.reshape(-1)
    aux = bool(getattr(model.config, "output_router_logits", False))
    main = []

    def head(hidden, weight, _labels):  # the model's own shift is local: the targets were shifted in full
        total = model.loss_fn(hidden, weight, targets, ignore_index=-100, reduction="sum") / max(shard.count, 1)
        if depths:
            total = total + _mtp_loss(model, hidden.view(*shard.input_ids.shape, -1), weight, shard)
        main.append(total)
        return total

    with model.custom_head(head):
        out = model(shard.input_ids, labels=shard.targets, position_ids=shard.position_ids, cu_seqlens=shard.batch,
                    **({"output_router_logits": True} if aux else {}))
    total = main[0]
    if aux and out.router_logits:  # the model's aux_loss is over this rank's tokens: replaced by the global one
        total = total + model.config.router_aux_loss_coef * _aux_share(model, out.router_logits, shard.batch)
    return total * (shard.batch.cp if grads == "mean" else 1)


def _aux_share(model, router_logits, batch):
    """transformers' load-balancing loss (`models/moe.py` load_balancing_loss) over the whole batch's
    tokens: expert counts, rows and summed probabilities all-reduced over cp. Its value is 1/CP of
    the loss (the ranks' shares sum to it) and its gradient the whole loss's, as every rank's tokens
    get the gradient of the global means (the all-reduce passes the gradient through)."""
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    counts = router_logits[0].new_zeros(E, dtype=torch.promote_types(router_logits[0].dtype, torch.float32))
    probs, rows = counts.clone(), 0
    for logits in router_logits:
        p = torch.softmax(logits, dim=-1)
        counts = counts + torch.bincount(torch.topk(p, k, dim=-1)[1].reshape(-1), minlength=E).to(counts.dtype)
        probs = probs + p.to(counts.dtype).sum(0)
        rows += logits.shape[0]
    rows = torch.tensor([float(rows)], device=counts.device)
    if batch.group is not None:
        for t in (counts, rows):
            dist.all_reduce(t, group=batch.group)
    probs = reduce_from_group(probs, batch.group)
    aux = torch.sum((counts / rows) * (probs / rows)) * E
    return aux + (aux.detach() / batch.cp - aux.detach())


def _mtp_loss(model, hidden_BTD, weight, shard: Shard):
    """The MTP slot's function (loss_scale / D * sum over depths of the mean CE) on this rank's share:
    depth k reads the tokens k ahead and predicts the labels k + 1 ahead, both shifted in full."""
    stack, mtp = model.model, model.mtp
    cos, sin = stack.rotary_emb(shard.position_ids, model.compute_dtype())

    def run_block(block, x):  # the model's run_layer: recompute as the model does it
        if stack.recompute and torch.is_grad_enabled():
            return checkpoint(block, x, cos, sin, shard.batch, use_reentrant=False,
                              context_fn=lambda: recompute.contexts(stack.kept))[0]
        return block(x, cos, sin, shard.batch)[0]

    h, total = hidden_BTD, 0
    for layer, ids, targets, count in zip(mtp.layers, shard.mtp_ids, shard.mtp_targets, shard.mtp_counts):
        h = layer(stack.embed_tokens(ids), h, run_block)
        hn = layer.head_norm(h)
        total = total + model.loss_fn(hn.reshape(-1, hn.shape[-1]), weight, targets.reshape(-1), ignore_index=-100,
                                      reduction="sum") / max(count, 1)
    return mtp.loss_scale / len(mtp.layers) * total


def mesh(device_type: str, dp: int, cp: int, timeout: datetime.timedelta | None = None):
    """The device mesh (dp, cp) over dp x cp ranks (a sequence's cp ranks adjacent): `mesh["cp"]
    .get_group()` is the cp group; state sharding shards over all of it (`data_mesh`), so its
    gradient mean spans dp x cp: use `loss(..., grads="mean")`. Its groups wait `timeout` (default:
    the default group's), not c10d's 30-minute default for new groups, so a dead rank in an exchange
    raises when the rest of the job would."""
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return _with_timeout(m, ("dp", "cp"), timeout)


def _with_timeout(m, names, timeout):
    if timeout is None:  # the default group's, as init_process_group set it
        backend = dist.group.WORLD._get_backend(torch.device(m.device_type))
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is None:  # a backend that does not say: its groups keep c10d's default
            return m
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    for name in names:
        group = m[name].get_group()
        if group is not dist.group.WORLD:  # the default group is the caller's: left as it is
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return m


def data_mesh(m):
    """The 1-D mesh over every rank of a (dp, cp) mesh, for FSDP2 / ZeRO-1 (`state_sharding`)."""
    return m["dp", "cp"]._flatten("dp_cp")


def expert_mesh(m, ep: int, over: str = "cp", timeout: datetime.timedelta | None = None):
    """The (efsdp, ep) mesh over the ranks of a (dp, cp) mesh `m`, for state sharding's `ep_mesh`
    (`shard_experts(model, expert_mesh(...)["ep"].get_group())` first): groups of `ep` ranks adjacent
    along `over` ("cp": inside a sequence's cp group first; "dp": across the dp rows first) hold the
    same E / ep experts. Any grouping is exact: the dispatch's backward sums every rank's tokens into
    the experts of its ep group and state sharding averages the rest over efsdp. `timeout` as `mesh`'s."""
    from torch.distributed.device_mesh import DeviceMesh
    if over not in ("cp", "dp"):
        raise ValueError(f"over must be 'cp' or 'dp', got {over!r}")
    ranks = m.mesh if over == "cp" else m.mesh.transpose(0, 1)
    if not isinstance(ep, int) or ep < 1 or ranks.numel() % ep:
        raise ValueError(f"ep must be a positive int dividing the mesh's {ranks.numel()} ranks, got {ep!r}")
    em = DeviceMesh(m.device_type, ranks.reshape(-1, ep), mesh_dim_names=("efsdp", "ep"))
    return _with_timeout(em, ("efsdp", "ep"), timeout)


@torch.no_grad()
def sync_grads(model: nn.Module, cp_group) -> None:
    """Sum every replicated parameter's gradient over the cp group (no FSDP). Experts sharded over
    the cp group itself (`bumblebee.parallelize.shard_experts(model, cp_group)`) already hold the
    gradient of every cp rank's tokens (the dispatch's backward brings it) and are left alone;
    experts sharded over another group are refused: their gradients need a sum over the ranks that
    hold the same experts, which a sum over the cp group does not reach."""
    experts = set()
    for m in model.modules():
        if getattr(m, "ep_group", None) is None:
            continue
        if m.ep_group is not cp_group:
            raise ValueError("sync_grads: experts sharded over a group other than the cp group (ep group != cp "
                             "group) need their gradients summed over the ranks holding the same experts, beyond "
                             "this sum over cp; shard the state instead: state_sharding over data_mesh(mesh) with "
                             "ep_mesh=expert_mesh(mesh, ep, over=...) (primitives/context_parallel/model.py)")
        experts.update(id(getattr(m, name)) for name in m.expert_parallel_params)
    for p in model.parameters():
        if p.grad is not None and id(p) not in experts:
            dist.all_reduce(p.grad, group=cp_group)
