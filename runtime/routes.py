"""Routes of the MoE decoder layers in the runtime's [B, T, layers, k] layout: replay the rollout
engine's experts (`Batch.routed_experts`) and record the ones a forward chose. MTP depths are not
run by the runtime's forwards, so only the decoder layers' routers take part."""
from __future__ import annotations

import contextlib

import torch

from bumblebee.models import moe


def decoder_routers(model) -> list:
    return [r for name, r in moe.routers(model).items() if not name.startswith("mtp.")]


@contextlib.contextmanager
def routing(model, replay: torch.Tensor | None, record: bool):
    """Within: the decoder routers replay `replay` [b, t, layers, k] and/or record their choice;
    yields a function giving the recorded [b, t, layers, k]. Routers are left as they were found."""
    rs = decoder_routers(model)
    if (replay is not None or record) and not rs:
        raise ValueError(f"routed experts given or asked for, but {type(model).__name__} has no MoE router")
    if replay is not None:
        b, t, layers, k = replay.shape
        if layers != len(rs) or any(r.top_k != k for r in rs):
            raise ValueError(f"batch.routed_experts must be [B, T, layers={len(rs)}, k={rs[0].top_k}] "
                             f"(one entry per MoE decoder layer), got {tuple(replay.shape)}")
    layer = {id(r): i for i, r in enumerate(rs)}

    def set_mode(r):
        if replay is not None:
            r.mode, r.routed_experts = "replay", replay[:, :, layer[id(r)]].reshape(-1, replay.shape[-1]).long().to(
                r.weight.device)
        elif record:
            r.mode, r.routed_experts = "record", None

    with moe.router_modes(rs, set_mode):
        yield lambda b, t: torch.stack([_routes(r) for r in rs], dim=1).view(b, t, len(rs), -1)


def _routes(router) -> torch.Tensor:
    if router.routed_experts is None:
        raise RuntimeError("a MoE decoder layer recorded no routes in the forward")
    return router.routed_experts.detach()
