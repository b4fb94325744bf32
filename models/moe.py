"""The MoE block shared by Qwen3-MoE, Qwen3.5-MoE and DeepSeek-V3: composition only.

    gate (TopKRouter: logits, then the `router` slot's top-k)
      -> `moe_dispatch` slot (local: permute tokens by expert on one rank; all_to_all / chunked:
         expert parallel over the experts' `ep_group`, see `bumblebee.parallelize.shard_experts`)
      -> GroupedExperts (SwiGLU as grouped GEMMs: torch._grouped_mm in bf16 on CUDA, a loop elsewhere)
      -> combine with the routing weights
      (+ shared expert, optionally scaled by Qwen's sigmoid shared_expert_gate)

Expert weights are stored fused, `experts.gate_up_proj [E, 2I, D]` (gate rows first) and
`experts.down_proj [E, D, I]`, as transformers holds them in memory; checkpoints hold per-expert
`experts.{e}.{gate,up,down}_proj.weight` (see `hf_to_ours_sources` / `ours_to_hf_state`).

Routers also keep load statistics (tokens per expert, summed over forward calls until the next
`update_router_bias`), the auxiliary-loss-free bias update, and route record/replay.

Shape legend: N tokens, D model width, E experts, K experts per token, I expert width, M = N*K.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bumblebee import registry
from bumblebee.models.components import CausalLMOutput, SwiGLU

DEFAULT_ROUTER = {"softmax": "softmax_fused", "sigmoid": "aux_free"}


@dataclass
class MoECausalLMOutput(CausalLMOutput):
    aux_loss: torch.Tensor | None = None
    router_logits: tuple | None = None


def _router_impl(scoring: str, name: str | None):
    name = name or DEFAULT_ROUTER[scoring]
    fn = registry.resolve("router", name)
    if getattr(fn, "scoring", None) != scoring:
        fits = sorted(n for n, i in registry.slots()["router"].items() if getattr(i.obj, "scoring", None) == scoring)
        raise ValueError(f"router {name!r} does not compute {scoring} routing; accepted here: {fits}")
    return fn


class TopKRouter(nn.Module):
    """logits = x @ weight.T, then top-k through the `router` slot; load statistics and replay.

    scoring="softmax": Qwen's softmax top-k. scoring="sigmoid": auxiliary-loss-free top-k with an
    fp32 `e_score_correction_bias` buffer [E] (DeepSeek-V3's name) updated by `update_bias`.
    """

    def __init__(self, dim, num_experts, top_k, *, scoring="softmax", norm_topk_prob=True, n_group=1,
                 topk_group=1, scaling_factor=1.0, router=None):
        super().__init__()
        if scoring not in DEFAULT_ROUTER:
            raise ValueError(f"scoring must be one of {sorted(DEFAULT_ROUTER)}, got {scoring!r}")
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob, self.n_group, self.topk_group = norm_topk_prob, n_group, topk_group
        self.scaling_factor = scaling_factor
        self.route = _router_impl(scoring, router)
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        if scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.tokens_per_expert = None  # [E] int64, summed over forward calls; not a buffer (not moved/cast)
        self.last_load = None  # [E] the load of the last bias update (all-reduced), for logging
        self.mode = None  # None | "record" | "replay"
        self.routed_experts = None  # [N, K] recorded (mode "record") or to replay (mode "replay")

    @torch.no_grad()
    def init_buffers(self):
        """Initial values after `to_empty` (a checkpoint load overwrites them afterwards)."""
        if self.scoring == "sigmoid":
            self.e_score_correction_bias.zero_()
        self.tokens_per_expert, self.last_load = None, None

    def _apply(self, fn, recurse=True):
        # The bias stays fp32 whatever dtype the model is cast to (updates of 1e-3 vanish in bf16).
        bias = self._buffers.get("e_score_correction_bias")
        super()._apply(fn, recurse)
        if bias is not None and self._buffers["e_score_correction_bias"].dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(self._buffers["e_score_correction_bias"].device,
                                                               torch.float32)
        return self

    def forward(self, x_ND):
        logits_NE = F.linear(x_ND, self.weight)
        replay = self.routed_experts if self.mode == "replay" else None
        if self.scoring == "softmax":
            w_NK, idx_NK, counts_E = self.route(logits_NE, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                                                routed_experts=replay, return_counts=True)
        else:
            w_NK, idx_NK, counts_E = self.route(
                logits_NE, self.e_score_correction_bias, top_k=self.top_k, n_group=self.n_group,
                topk_group=self.topk_group, scaling_factor=self.scaling_factor,
                norm_topk_prob=self.norm_topk_prob, routed_experts=replay, return_counts=True)
        if self.mode == "record":
            self.routed_experts = idx_NK.detach().clone()
        counts_E = counts_E.detach()
        self.tokens_per_expert = counts_E if self.tokens_per_expert is None else self.tokens_per_expert + counts_E
        return logits_NE, w_NK, idx_NK

    @torch.no_grad()
    def apply_load(self, load_E, *, rate=1e-3, recenter=False):
        """bias += rate * sign(mean(load) - load) (sigmoid routers); reset the counts."""
        self.last_load = load_E.detach().clone()
        self.tokens_per_expert = None
        if self.scoring == "sigmoid":
            load = load_E.to(self.e_score_correction_bias.device, torch.float32)
            self.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            if recenter:
                self.e_score_correction_bias -= self.e_score_correction_bias.mean()


class GroupedExperts(nn.Module):
    """E SwiGLU experts over rows already grouped by expert; `grouped_mm` = auto | always | never.

    Expert parallel: with `ep_group` (a process group of EP ranks; None = one rank) this rank holds
    the `num_local_experts = E / EP` experts [expert_offset, expert_offset + E/EP); the weights are
    [E/EP, ...] and the `moe_dispatch` slot (all_to_all or chunked) moves tokens to their owners.
    """

    accepts_with_weights = True  # forward(x, with_weights=fn): see forward
    expert_parallel_params = ("gate_up_proj", "down_proj")  # per-expert stacks (bumblebee.parallelize)

    def __init__(self, num_experts, dim, hidden, grouped_mm="auto", *, ep_group=None):
        super().__init__()
        if grouped_mm not in ("auto", "always", "never"):
            raise ValueError(f"grouped_mm must be 'auto', 'always' or 'never', got {grouped_mm!r}")
        self.num_experts, self.dim, self.hidden, self.grouped_mm = num_experts, dim, hidden, grouped_mm
        ep, rank = (dist.get_world_size(ep_group), dist.get_rank(ep_group)) if ep_group is not None else (1, 0)
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep group size {ep}")
        self.ep_group = ep_group
        self.num_local_experts = num_experts // ep
        self.expert_offset = rank * self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_local_experts, dim, hidden))

    def _use_grouped_mm(self, x):
        if self.grouped_mm != "auto":
            return self.grouped_mm == "always"
        return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
                and self.dim % 8 == 0 and self.hidden % 8 == 0)

    def forward(self, x_MD, tokens_per_expert_E=None, *, with_weights=None):
        """Grouped experts over x_MD; or, with `with_weights`, return `with_weights(gate_up_proj,
        down_proj)`: a dispatcher that computes the experts itself (chunked) still runs inside this
        module's forward, so module hooks (FSDP2's unshard, reshard and gradient reduce-scatter) apply."""
        if with_weights is not None:
            return with_weights(self.gate_up_proj, self.down_proj)
        if x_MD.shape[0] == 0:
            return x_MD.new_zeros(0, self.dim) + 0 * self.down_proj.sum()  # keep the graph connected
        if self._use_grouped_mm(x_MD):
            offs_E = torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)
            h_M2I = torch._grouped_mm(x_MD, self.gate_up_proj.transpose(-2, -1), offs=offs_E)
            gate, up = h_M2I.chunk(2, dim=-1)
            y_MD = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs_E)
            if y_MD.requires_grad:  # grouped_mm's backward rejects stride-0 (expanded) gradients
                y_MD.register_hook(torch.Tensor.contiguous)
            return y_MD
        outs = []
        for e, x_e in enumerate(x_MD.split(tokens_per_expert_E.tolist())):
            if x_e.shape[0]:
                gate, up = F.linear(x_e, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outs)


class MoEBlock(nn.Module):
    """Router -> dispatch -> grouped SwiGLU experts -> combine (+ gated shared expert). Dropless.

    `ep_group`: shard the routed experts over this process group (or call `bumblebee.parallelize.shard_experts` on a built
    model) and pick moe_dispatch 'all_to_all' or 'chunked'; `dispatch_chunks`: the chunked
    dispatcher's C (or relative chunk sizes), passed as `chunks=` (None: its default)."""

    def __init__(self, dim, moe_hidden, num_experts, top_k, *, scoring="softmax", norm_topk_prob=True,
                 n_group=1, topk_group=1, scaling_factor=1.0, shared_hidden=0, shared_expert_gate=False,
                 impl=None, grouped_mm="auto", ep_group=None, dispatch_chunks=None):
        super().__init__()
        impl = {} if impl is None else impl  # the model's own mapping: it records the slots looked up
        self.num_experts = num_experts
        self.dispatch_chunks = dispatch_chunks  # chunked dispatch: C or relative chunk sizes (None: its default)
        self.gate = TopKRouter(dim, num_experts, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
                               n_group=n_group, topk_group=topk_group, scaling_factor=scaling_factor,
                               router=impl.get("router", DEFAULT_ROUTER.get(scoring)))
        self.experts = GroupedExperts(num_experts, dim, moe_hidden, grouped_mm=grouped_mm, ep_group=ep_group)
        self.dispatch = registry.resolve("moe_dispatch", impl.get("moe_dispatch"))
        if shared_hidden:
            self.shared_expert = SwiGLU(dim, shared_hidden)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x_BTD):
        """(output [B, T, D], router logits [B*T, E])."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits_NE, w_NK, idx_NK = self.gate(x_ND)
        kw = {} if self.dispatch_chunks is None else {"chunks": self.dispatch_chunks}
        y_ND = self.dispatch(x_ND, w_NK, idx_NK, self.experts, self.num_experts, **kw)
        if hasattr(self, "shared_expert"):
            s_ND = self.shared_expert(x_ND)
            if hasattr(self, "shared_expert_gate"):
                s_ND = torch.sigmoid(self.shared_expert_gate(x_ND)) * s_ND
            y_ND = y_ND + s_ND
        return y_ND.view_as(x_BTD), logits_NE


def load_balancing_loss(router_logits, num_experts: int, top_k: int):
    """Switch-Transformer load-balancing loss over all layers, exactly as transformers computes it.

    E * sum_e f_e * P_e, with f_e the fraction of top-k assignments and P_e the mean softmax
    probability of expert e, both summed over layers and divided by the rows of all layers.
    """
    if not router_logits:
        return None
    acc = torch.promote_types(router_logits[0].dtype, torch.float32)  # fp32; float64 logits stay float64
    counts_E = torch.zeros(num_experts, dtype=acc, device=router_logits[0].device)
    probs_E = torch.zeros_like(counts_E)
    rows = 0
    for logits_NE in router_logits:
        probs_NE = torch.softmax(logits_NE, dim=-1)
        idx_NK = torch.topk(probs_NE, top_k, dim=-1)[1]
        counts_E = counts_E + torch.bincount(idx_NK.reshape(-1), minlength=num_experts).to(acc)
        probs_E = probs_E + probs_NE.to(acc).sum(dim=0)
        rows += logits_NE.shape[0]
    return torch.sum((counts_E / rows) * (probs_E / rows)) * num_experts


# ---- model-level helpers: load statistics, bias update, replay, buffers ----------------------------

def routers(model: nn.Module) -> dict[str, TopKRouter]:
    """Every router of `model`, by module name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TopKRouter)}


@torch.no_grad()
def update_router_bias(model: nn.Module, *, rate: float = 1e-3, group=None, recenter: bool = False):
    """Once per optimizer step: all-reduce each router's token counts over `group` (the data-parallel
    group; None: this rank alone, `dist.group.WORLD`: all ranks) and move sigmoid routers' biases by
    rate * sign(mean_load - load). Every rank must call it. Returns {name: load [E]}."""
    rs = routers(model)
    if not rs:
        return {}
    dev = next(iter(rs.values())).weight.device
    load_LE = torch.stack([r.tokens_per_expert.to(dev) if r.tokens_per_expert is not None
                           else torch.zeros(r.num_experts, dtype=torch.int64, device=dev) for r in rs.values()])
    if group is not None:
        dist.all_reduce(load_LE, group=group)  # one collective for all layers, on every rank
    for r, load_E in zip(rs.values(), load_LE):
        r.apply_load(load_E, rate=rate, recenter=recenter)
    return {name: r.last_load for name, r in rs.items()}


def router_load_stats(model: nn.Module) -> dict[str, dict]:
    """Per-layer load of the last bias update: tokens per expert and max/min load over the mean."""
    out = {}
    for name, r in routers(model).items():
        if r.last_load is not None:
            load = r.last_load.float()
            mean = load.mean().clamp_min(1e-20)
            out[name] = {"load": r.last_load, "max_over_mean": float(load.max() / mean),
                         "min_over_mean": float(load.min() / mean)}
    return out


@contextlib.contextmanager
def router_modes(rs: list, set_mode):
    """Within: `set_mode(router)` applied to each router of `rs` (yielded); on exit each router's mode and
    routes are as they were found, so no call leaves a model recording or replaying."""
    saved = [(r.mode, r.routed_experts) for r in rs]
    try:
        for r in rs:
            set_mode(r)
        yield rs
    finally:
        for r, (mode, routes) in zip(rs, saved):
            r.mode, r.routed_experts = mode, routes


@contextlib.contextmanager
def record_routes(model: nn.Module):
    """`with record_routes(model) as recorded:` every router keeps the experts it chose in its last
    forward; `recorded()` (inside the block) -> one [N, K] per MoE layer, in layer order."""
    def record(r):
        r.mode, r.routed_experts = "record", None

    with router_modes(list(routers(model).values()), record) as rs:
        yield lambda: [r.routed_experts for r in rs]


def recorded_routes(model: nn.Module) -> list[torch.Tensor]:
    """[N, K] experts per MoE layer, in layer order, from the last forward in record mode."""
    return [r.routed_experts for r in routers(model).values()]


@contextlib.contextmanager
def replay_routes(model: nn.Module, routes):
    """`with replay_routes(model, routes):` every forward routes through the given experts (one [N, K]
    per MoE layer); the weights are recomputed from the current scores, so gradients flow to the router."""
    rs = list(routers(model).values())
    routes = list(routes)
    if len(routes) != len(rs):
        raise ValueError(f"replay needs one routed_experts tensor per MoE layer: {len(rs)} layers, got {len(routes)}")
    for i, (r, idx) in enumerate(zip(rs, routes)):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] != r.top_k:
            raise ValueError(f"routed_experts of MoE layer {i} must be [N, k={r.top_k}], "
                             f"got shape {tuple(getattr(idx, 'shape', ()))}")
    given = dict(zip(map(id, rs), routes))

    def replay(r):
        r.mode, r.routed_experts = "replay", given[id(r)].to(r.weight.device)

    with router_modes(rs, replay):
        yield


def clear_routes(model: nn.Module) -> None:
    for r in routers(model).values():
        r.mode, r.routed_experts = None, None


# ---- checkpoint key mapping: fused experts <-> Hugging Face per-expert keys -------------------------

_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def hf_to_ours_sources(model: nn.Module, checkpoint_names) -> dict:
    """{our fused name: (checkpoint names, combine)} for expert tensors stored per expert; names that
    the checkpoint holds fused already (transformers' in-memory layout) load directly."""
    names = set(checkpoint_names)
    out = {}
    for name, p in model.named_parameters():
        m = _FUSED.match(name)
        if not m or name in names:
            continue
        prefix, kind = m.groups()
        E = p.shape[0]
        off = getattr(model.get_submodule(prefix), "expert_offset", 0)  # expert-parallel shards: their own experts
        if kind == "gate_up_proj":
            srcs = [f"{prefix}.{off + e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]
            out[name] = (srcs, lambda ts, E=E: torch.stack([torch.cat(ts[2 * e:2 * e + 2]) for e in range(E)]))
        else:
            out[name] = ([f"{prefix}.{off + e}.down_proj.weight" for e in range(E)], torch.stack)
    return out


def ours_to_hf_state(state: dict) -> dict:
    """Our state_dict with fused expert tensors split into the per-expert keys transformers saves."""
    out = {}
    for name, t in state.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out
