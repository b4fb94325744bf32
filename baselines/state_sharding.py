"""ZeRO-1, as Megatron's distributed optimizer: only the optimizer state is sharded.

Every rank holds the full compute parameters (bf16, or fp32) and a full fp32 gradient buffer (the
"main grads": a hook adds each parameter's gradient into it and frees the parameter's own). At
`step()` every parameter's gradient is reduce-scattered over the data-parallel mesh (each rank gets
the mean over ranks of its dim-0 chunk), the rank's fp32 master chunk and Adam moments are updated,
and the updated chunks are all-gathered back into the full compute parameters. Chunks follow
DTensor's Shard(0) split (ceil(rows / n) per rank, the last ranks fewer or none) where n does not
divide dim 0 (Qwen3.5-MoE's [1, D] shared-expert gate); those collectives run on zero-padded buffers. With `ep_mesh`,
expert parameters (this rank's E/ep experts) are sharded, reduced and gathered over efsdp only,
their gradient divided by the whole mesh size like every other. Per rank:
2P (bf16 params) + 4P (fp32 grads) + 12P/n (fp32 master + Adam) bytes.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from bumblebee.registry import register
from bumblebee.common.state_sharding import TrainState, check_args, chunk_rows, named_params, shard_rows

warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.")


class Zero1State(TrainState):
    impl = "zero1"

    def __init__(self, model, mesh, *, ep_mesh=None, **kw):
        super().__init__(model, mesh, ep_mesh=ep_mesh, **kw)
        self._params = named_params(model)
        self.full_shapes = {name: self.global_shape(name, p) for name, p in self._params.items()}
        self._shard = {name: self.shard_group(name) for name in self._params}  # (group, size, rank)
        # rows per rank (Shard(0)'s split); the collectives move n * chunk rows, the tail padded with zeros
        self._chunk = {name: chunk_rows(p.shape[0], self._shard[name][1]) for name, p in self._params.items()}
        with torch.no_grad():
            self._masters = {name: shard_rows(p.detach(), *self._shard[name][1:]).to(torch.float32, copy=True)
                             for name, p in self._params.items()}
            model.to(self.compute_dtype)  # keeps tied parameters tied
        self._padded_grads = {name: torch.zeros((self._chunk[name] * self._shard[name][1], *p.shape[1:]),
                                                dtype=torch.float32, device=p.device)
                              for name, p in self._params.items()}
        self.main_grads = {name: g[:self._params[name].shape[0]] for name, g in self._padded_grads.items()}
        self._got_grad = [False]  # set by the hooks (a list: they must not hold `self`, see _accumulate)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate(name))
                       for name, p in self._params.items()]
        self.optimizer = self._make_optimizer(list(self._masters.values()))

    def _accumulate(self, name):
        # The hook holds the buffer, not `self`: hooks live in the parameters' C++ autograd state,
        # where the garbage collector cannot see a cycle, so a reference to self would leak the state.
        main_grad, got_grad = self.main_grads[name], self._got_grad

        def hook(p):
            main_grad.add_(p.grad)
            p.grad = None  # the fp32 main grad is the only full gradient kept
            got_grad[0] = True
        return hook

    def masters(self):
        return self._masters

    def reduced_grad_shards(self):
        n = self.mesh.size()
        out, works = [], []
        for name, m in self._masters.items():  # queued together, then waited on: one batch of work
            g = m.new_empty((self._chunk[name], *m.shape[1:]))
            group = self._shard[name][0]
            works.append(dist.reduce_scatter_tensor(g, self._padded_grads[name], group=group, async_op=True))
            out.append(g[:m.shape[0]])  # this rank's real rows (fewer, or none, at an uneven tail)
        for w in works:
            w.wait()
        for m, g in zip(self._masters.values(), out):
            g.div_(n)  # sum over ranks of this rank's chunk -> mean over all n data-parallel ranks
            m.grad = g
        return out

    @torch.no_grad()
    def after_update(self):
        sent, recv, works = {}, {}, []  # alive until waited
        for name, p in self._params.items():
            m, c, n = self._masters[name], self._chunk[name], self._shard[name][1]
            if c * n == p.shape[0]:  # even split: gather straight into the parameter
                sent[name], recv[name] = m.to(p.dtype), p.data
            else:
                sent[name] = p.new_zeros((c, *p.shape[1:]))
                sent[name][:m.shape[0]] = m
                recv[name] = p.new_empty((c * n, *p.shape[1:]))
            works.append(dist.all_gather_into_tensor(recv[name], sent[name], group=self._shard[name][0],
                                                     async_op=True))
        for w in works:
            w.wait()
        for name, p in self._params.items():
            if recv[name] is not p.data:
                p.data.copy_(recv[name][:p.shape[0]])
        for m in self._masters.values():
            m.grad = None

    def zero_grad(self):
        for name, g in self.main_grads.items():
            g.zero_()
            self._params[name].grad = None
            self._masters[name].grad = None
        self._got_grad[0] = False

    def has_local_grad(self):
        return self._got_grad[0]


@register("state_sharding", "zero1", kind="baseline", twin="fsdp2")
def zero1(model, mesh, *, optimizer="adamw", lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
          mixed_precision="bf16", grad_clip=None, ep_mesh=None, reshard_after_forward=True) -> TrainState:
    """ZeRO-1 distributed optimizer: full params and grads per rank, fp32 master + Adam sharded.

    `reshard_after_forward` is accepted for the twin's signature and has no effect here."""
    check_args(model, mesh, optimizer=optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
               mixed_precision=mixed_precision, grad_clip=grad_clip, ep_mesh=ep_mesh,
               reshard_after_forward=reshard_after_forward)
    state = Zero1State(model, mesh, ep_mesh=ep_mesh, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                       mixed_precision=mixed_precision, grad_clip=grad_clip)
    model.save_pretrained = state.save_pretrained  # HF export of the fp32 masters
    return state
