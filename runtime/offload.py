"""Moving the runtime's three parts between devices, each on its own: the model (parameters and
buffers: FSDP2's sharded parameters, ZeRO-1's full compute parameters, expert shards alike), the
optimizer (Adam moments; ZeRO-1's fp32 master shards, which FSDP2 keeps as the parameters), and the
gradients (parameters' `.grad`; ZeRO-1's fp32 main-grad buffers).

Objects keep their identity (the optimizer, FSDP2 and ZeRO-1's gradient hooks hold references):
parameters move through `nn.Module._apply` (FSDP2 reshards first and re-registers its shards),
ZeRO-1's buffers and masters through `.data`. A gradient whose parameter sits on another device is
kept aside (torch refuses a `.grad` on another device) and put back when they meet again.
Routers' token counts (plain tensor attributes, not buffers) travel with the model. When every
part has left a CUDA device, FSDP2's retained reduce-scatter / all-gather buffers and the cuBLAS
workspaces (64 MiB of device memory on an H200 after a backward) are released too: an offload is
there to free the device for rollout.
"""
from __future__ import annotations

import gc

import torch

PARTS = ("model", "optimizer", "grad")
ROUTER_TENSORS = ("tokens_per_expert", "last_load", "routed_experts")


class Placement:
    def __init__(self, model, state):
        self.model, self.state = model, state
        p = next(iter(model.parameters()))
        home = _local(p).device
        self.where = {part: home for part in PARTS}
        self.aside: dict[torch.nn.Parameter, torch.Tensor] = {}  # gradients off their parameter's device

    def check(self, op: str) -> None:
        """ValueError unless every part is on one device (where the operation runs)."""
        if len(set(self.where.values())) != 1:
            raise ValueError(f"Runtime.{op} needs the model, optimizer and gradients on one device, but they are "
                             f"on {', '.join(f'{k}: {v}' for k, v in self.where.items())}: call "
                             f"rt.to(device) first")

    @torch.no_grad()
    def to(self, device, *, model: bool = True, optimizer: bool = True, grad: bool = True, copy: bool = False):
        device = torch.device(device)
        left = set(self.where.values()) - {device}

        def move(t):
            return t.to(device, copy=copy)

        for p in self.model.parameters():  # gradients travel on their own (see the module docstring)
            if p.grad is not None:
                self.aside[p] = p.grad
                p.grad = None
        if model:
            self.model._apply(move)
            for r in _routers(self.model):  # not buffers: `_apply` leaves them behind
                for k in ROUTER_TENSORS:
                    if isinstance(getattr(r, k, None), torch.Tensor):
                        setattr(r, k, move(getattr(r, k)))
            self.where["model"] = device
        if grad:
            self.aside = {p: move(g) for p, g in self.aside.items()}
            for padded, view in _main_grads(self.state):
                padded.data = move(padded.data)
                view.data = padded.data[:view.shape[0]]
            self.where["grad"] = device
        if optimizer and self.state is not None:
            params = {id(p) for p in self.model.parameters()}
            for m in self.state.masters().values():
                if id(m) not in params:  # ZeRO-1's master shards: optimizer state
                    m.data = move(m.data)
            for st, k in _optimizer_entries(self.state.optimizer):
                st[k] = move(st[k])
            self.where["optimizer"] = device
        for p in list(self.aside):
            if self.aside[p].device == _local(p).device:
                p.grad = self.aside.pop(p)
        for d in left:
            if d.type == "cuda" and d not in self.where.values():
                _release_cuda(self.model, d)

    @torch.no_grad()  # a DTensor's to_local under autograd links the result to the parameter's graph node,
    # which would keep the parameter's device storage alive after a move
    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor of each part (local shards), for checks and measurements."""
        out = {"model": [_local(t) for t in list(self.model.parameters()) + list(self.model.buffers())],
               "grad": [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
               + [_local(g) for g in self.aside.values()] + [pad for pad, _ in _main_grads(self.state)],
               "optimizer": []}
        if self.state is not None:
            params = {id(p) for p in self.model.parameters()}
            out["optimizer"] += [m for m in self.state.masters().values() if id(m) not in params]
            out["optimizer"] += [_local(st[k]) for st, k in _optimizer_entries(self.state.optimizer)]
        return out


def _routers(model):
    return [m for m in model.modules() if hasattr(m, "tokens_per_expert")]


def _release_cuda(model, device):
    """Free what holds device memory outside the three parts once none of them is on `device`:
    FSDP2's kept reduce-scatter inputs and all-gather result (it drops them only at the next
    backward or forward), the cuBLAS workspaces (created again by the next matmul), and tensors that
    only reference cycles keep alive (an autograd graph caught in a cycle holds its saved tensors
    until the collector happens to run)."""
    gc.collect()
    torch.cuda.synchronize(device)
    for m in model.modules():
        ctx = getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_comm_ctx", None)
        if ctx is not None:
            getattr(ctx, "reduce_scatter_states", []).clear()
            ctx.all_gather_state = None
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        with torch.cuda.device(device):
            clear()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_entries(opt):
    """(state dict, key) of every optimizer tensor that lives with the parameters (a non-fused AdamW
    keeps its step counters on the CPU)."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and (k != "step" or group.get("fused")):
                    yield st, k


def _main_grads(state):
    """(padded buffer, view) pairs of ZeRO-1's fp32 main grads; none for other states."""
    padded = getattr(state, "_padded_grads", None)
    if not padded:
        return []
    return [(padded[name], state.main_grads[name]) for name in padded]
