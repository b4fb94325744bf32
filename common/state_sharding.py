"""What the two `state_sharding` twins share: argument checks, the optimizer step with global-norm
clipping and the non-finite skip, the checkpoint layout, and the HF export of full weights.

A twin subclasses `TrainState` and supplies where the fp32 master shards live and how gradients
become reduced local shards (FSDP2: already reduce-scattered DTensors; ZeRO-1: a reduce-scatter of
the full fp32 gradient buffer), and how updated masters reach the compute parameters.

Every parameter is sharded on dim 0 in `torch.chunk` order (rank r holds rows
[r * d0 / n, (r + 1) * d0 / n)), so both twins present their masters and Adam states as DTensors
with the same placement, and one checkpoint loads into either, on any number of ranks.

Expert parallel: `ep_mesh` is a 2-D DeviceMesh (efsdp, ep) over the same ranks, the model's experts
already split over ep (`bumblebee.parallelize.shard_experts`). Expert parameters (this rank's E/ep
experts) are sharded over efsdp only; in checkpoints they appear as the full [E, ...] tensors
(split over ep, then efsdp), so an EP checkpoint loads without EP and the other way round.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

OPTIMIZERS = ("adamw",)
MIXED_PRECISION = {"bf16": torch.bfloat16, "fp32": torch.float32}


def named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by name, a tied weight once (under its first name, as state_dict keys do)."""
    return dict(model.named_parameters(remove_duplicate=True))


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state_dict holds (e.g. the auxiliary-loss-free routers' fp32
    `e_score_correction_bias`), by name. Neither twin shards them: every rank holds them whole."""
    out = {}
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def check_args(model, mesh, *, optimizer, lr, betas, eps, weight_decay, mixed_precision, grad_clip,
               ep_mesh, reshard_after_forward) -> None:
    """ValueErrors naming both sides for every argument the twins accept."""
    if mesh is None or mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D DeviceMesh over the data-parallel ranks, got {mesh!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} not supported; accepted: {list(OPTIMIZERS)}")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision {mixed_precision!r} not supported; accepted: {sorted(MIXED_PRECISION)}")
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0 or weight_decay < 0:
        raise ValueError(f"eps must be > 0 and weight_decay >= 0, got eps={eps}, weight_decay={weight_decay}")
    if grad_clip is not None and not grad_clip > 0:
        raise ValueError(f"grad_clip must be None or > 0, got {grad_clip!r}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    n = mesh.size()
    # routed experts per MoE block, from the expert modules (configs name it num_experts or n_routed_experts)
    counts = {m.num_experts for m in model.modules() if hasattr(m, "num_local_experts")}
    experts = max(counts) if counts else None
    ep = 1
    if ep_mesh is not None:
        names = tuple(ep_mesh.mesh_dim_names or ())
        if ep_mesh.ndim != 2 or set(names) != {"efsdp", "ep"}:
            raise ValueError(f"ep_mesh must be a 2-D DeviceMesh with dims ('efsdp', 'ep'), got dims {names}")
        if ep_mesh.size() != n:
            raise ValueError(f"ep_mesh covers {ep_mesh.size()} ranks but mesh covers {n}: they must be the same ranks")
        ep = ep_mesh["ep"].size()
        if not experts:
            raise ValueError(f"ep_mesh of size {ep} given, but the model {type(model).__name__} has no experts")
        if experts % ep:
            raise ValueError(f"ep_mesh of size {ep} does not divide the model's {experts} experts")
        local = {getattr(m, "num_local_experts", None) for m in model.modules() if hasattr(m, "num_local_experts")}
        if local != {experts // ep}:
            raise ValueError(f"ep_mesh has ep={ep}, so each rank should hold {experts // ep} of {experts} experts, "
                             f"but the model's expert modules hold {sorted(local)}: shard the experts with "
                             f"bumblebee.parallelize.shard_experts(model, ep_mesh['ep'].get_group()) first")
    for name, p in named_params(model).items():
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {name} is already sharded (a DTensor): apply state sharding once")
        if p.dim() == 0:  # dim 0 is what gets sharded (unevenly where the mesh does not divide it)
            raise ValueError(f"parameter {name} is a scalar: state sharding splits dim 0; make it shape [1]")


def is_expert(name: str) -> bool:
    """Parameters of expert modules (sharded over the expert-data-parallel mesh under EP)."""
    return ".experts." in name


def chunk_rows(rows: int, n: int) -> int:
    """Rows per rank under Shard(0) (torch.chunk's split: ceil(rows / n); the last ranks may get fewer
    or none). Times n, it is the padded row count the collectives move."""
    return -(-rows // n)


def shard_rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's dim-0 chunk of t (a view, possibly empty), where DTensor's Shard(0) and FSDP2 place it,
    also when n does not divide dim 0."""
    c = chunk_rows(t.shape[0], n)
    return t[min(r * c, t.shape[0]):min((r + 1) * c, t.shape[0])]


class TrainState:
    """Sharded optimizer state around a model: forward/backward through `state.model`, then
    `ok, grad_norm, num_zeros = state.step()` and `state.zero_grad()`.

    `state_dict()` holds DTensors (fp32 masters, Adam moments) and the step count, for
    `torch.distributed.checkpoint`; `save(path)`/`load(path)` wrap it atomically with a check
    that the checkpoint belongs to this model; `save_pretrained(path)` writes full HF weights.
    """

    impl = "?"

    def __init__(self, model, mesh, *, lr, betas, eps, weight_decay, mixed_precision, grad_clip, ep_mesh=None):
        self.model, self.mesh, self.group = model, mesh, mesh.get_group()
        self.grad_clip, self.steps = grad_clip, 0
        self.skip_reason: str | None = None  # why the last step() did not update, if it did not
        self.compute_dtype = MIXED_PRECISION[mixed_precision]
        self.full_shapes: dict[str, torch.Size] = {}  # global shapes (experts: all E of them)
        self.hp = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.ep_mesh = ep_mesh
        self.expert_names: set[str] = set()
        if ep_mesh is not None:
            self.expert_names = {name for name in named_params(model) if is_expert(name)}
            # the global view of an expert tensor: split over ep first (rank k holds experts
            # [k*E/ep, (k+1)*E/ep)), then each block over efsdp; one checkpoint then serves any layout
            ranks = ep_mesh.mesh.transpose(ep_mesh.mesh_dim_names.index("ep"), 0).contiguous()
            # over ep_mesh's own groups: new ones would wait torch's default 30 minutes whatever the
            # caller's groups were given (the export's gathers run on these)
            self.expert_view = DeviceMesh.from_group([ep_mesh["ep"].get_group(), ep_mesh["efsdp"].get_group()],
                                                     ep_mesh.device_type, mesh=ranks, mesh_dim_names=("ep", "efsdp"))

    def shard_group(self, name: str):
        """(process group, size, rank) over which parameter `name` is sharded."""
        m = self.ep_mesh["efsdp"] if name in self.expert_names else self.mesh
        return m.get_group(), m.size(), m.get_local_rank()

    def global_shape(self, name: str, p: torch.Tensor) -> torch.Size:
        if name in self.expert_names:
            return torch.Size((p.shape[0] * self.ep_mesh["ep"].size(), *p.shape[1:]))
        return p.shape

    # ---- supplied by a twin -------------------------------------------------------------------
    def masters(self) -> dict[str, torch.Tensor]:
        """name -> the tensor the optimizer updates (a DTensor, or this rank's plain shard)."""
        raise NotImplementedError

    def reduced_grad_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the data-parallel mean gradient, fp32, set as the masters' grads."""
        raise NotImplementedError

    def after_update(self) -> None:
        """Bring the compute parameters up to date with the masters (ZeRO-1: gather them; FSDP2: drop
        the unsharded parameters a forward without a backward left, so the next forward gathers)."""

    def zero_grad(self) -> None:
        raise NotImplementedError

    def has_local_grad(self) -> bool:
        """Whether a backward has given this rank any gradient since `zero_grad`."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------
    def _make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # fused on CUDA: one kernel per group of tensors instead of foreach's several passes over
        # params and moments (the same AdamW update; its step counters live on the device)
        fused = bool(params) and all(p.is_cuda for p in params)
        opt = torch.optim.AdamW(params, **self.hp, fused=fused)
        for p in params:  # states exist from the start, so state_dict()/load work before step 1
            step = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        return opt

    def _as_dtensor(self, name: str, t: torch.Tensor) -> DTensor:
        shape = self.full_shapes[name]
        stride = torch.empty(shape, device="meta").stride()
        if name in self.expert_names:
            local = t.to_local() if isinstance(t, DTensor) else t
            return DTensor.from_local(local, self.expert_view, [Shard(0), Shard(0)], run_check=False,
                                      shape=shape, stride=stride)
        if isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    @torch.no_grad()
    def step(self, skip: str | None = None) -> tuple[bool, float, int]:
        """(ok, global grad norm before clipping, zero gradient entries). The update is skipped on
        every rank (they all see the same all-reduced values; `skip_reason` says why) when the norm
        is non-finite, or when no rank received a gradient since `zero_grad`: AdamW would still move
        the weights by its moments and decay them, and count a step. `skip`: a reason, given alike on
        every rank, to skip after the norm is measured (the gradients are dropped, as without any). A
        skip leaves the weights, the optimizer state and `steps` as they were."""
        got_grad = self.has_local_grad()  # before reduced_grad_shards, which fills absent gradients
        grads = self.reduced_grad_shards()
        dev = grads[0].device if grads else torch.device("cpu")
        acc = torch.zeros(3, dtype=torch.float64, device=dev)
        if grads:  # per tensor, in the twins' common order: both twins round alike
            acc[0] = torch.stack(torch._foreach_norm([g.float() for g in grads])).double().pow(2).sum()
            acc[1] = sum(g.numel() for g in grads) - sum(_nonzeros(g) for g in grads)
        acc[2] = float(got_grad)
        dist.all_reduce(acc, group=self.group)
        norm, zeros = math.sqrt(acc[0].item()), int(acc[1].item())
        self.skip_reason = None
        if acc[2].item() == 0 or skip is not None:
            self.skip_reason = "no gradient" if acc[2].item() == 0 else skip
            self.zero_grad()  # as before the call: no gradient anywhere
            return False, norm, zeros
        if not math.isfinite(norm):
            self.skip_reason = "non-finite gradient norm"
            return False, norm, zeros
        coef = 1.0
        if self.grad_clip is not None:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
        self._clipped_step(grads, coef)
        self.after_update()
        self.steps += 1
        return True, norm, zeros

    def _clipped_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """AdamW on the gradients times `coef`. Fused AdamW takes the clip as its `grad_scale` divisor (the
        AMP unscale hook): the kernel that reads every gradient anyway scales it, instead of a separate
        read and write of all gradients first."""
        if coef == 1.0:
            self.optimizer.step()
            return
        if not self.optimizer.defaults.get("fused"):
            torch._foreach_mul_(grads, coef)
            self.optimizer.step()
            return
        self.optimizer.grad_scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=grads[0].device)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale

    def state_dict(self) -> dict:
        model, optim = {}, {}
        for name, m in self.masters().items():
            model[name] = self._as_dtensor(name, m)
            st = self.optimizer.state[m]
            optim[f"{name}.exp_avg"] = self._as_dtensor(name, st["exp_avg"])
            optim[f"{name}.exp_avg_sq"] = self._as_dtensor(name, st["exp_avg_sq"])
        out = {"model": model, "optim": optim, "step": torch.tensor(self.steps, dtype=torch.int64)}
        buffers = persistent_buffers(self.model)
        if buffers:  # router biases move every step: a resume without them would route differently
            out["buffers"] = buffers
        return out

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        ours = self.state_dict()
        for part in ("model", "optim") + (("buffers",) if "buffers" in ours else ()):
            if set(sd.get(part, {})) != set(ours[part]):
                raise ValueError(f"state dict keys differ: given {sorted(set(sd[part]) - set(ours[part]))[:3]}... "
                                 f"not in this state, this state's {sorted(set(ours[part]) - set(sd[part]))[:3]}... "
                                 f"not given")
            for k, dst in ours[part].items():
                src = sd[part][k]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{k}: given shape {tuple(src.shape)}, this state has {tuple(dst.shape)}")
                if part == "buffers":
                    if src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
                    continue
                src = src.to_local() if isinstance(src, DTensor) else self._local_rows(k, src)
                if src.data_ptr() != dst.to_local().data_ptr():
                    dst.to_local().copy_(src)
        self.steps = int(sd["step"])
        for m in self.masters().values():
            self.optimizer.state[m]["step"].fill_(float(self.steps))
        self.after_update()

    def _local_rows(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (global) tensor given for state-dict entry `key`."""
        name = key.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")
        if name in self.expert_names:
            full = shard_rows(full, self.ep_mesh["ep"].size(), self.ep_mesh["ep"].get_local_rank())
        _, n, r = self.shard_group(name)
        return shard_rows(full, n, r)

    def param_shapes(self) -> dict[str, list[int]]:
        return {name: list(self._as_dtensor(name, m).shape) for name, m in self.masters().items()}

    def save(self, path) -> None:
        """DCP checkpoint of model and optimizer state, written aside and renamed into place."""
        from bumblebee import checkpoint
        checkpoint.save(self.state_dict(), path, meta=self._meta(), group=self.group)

    def load(self, path, *, check_finite: bool = False) -> None:
        """Load a checkpoint written by either twin on any number of ranks (DCP reshards); check_finite:
        refuse NaN or inf in what it holds (`checkpoint.load`)."""
        from bumblebee import checkpoint
        sd = self.state_dict()
        if "buffers" in sd and "buffers" not in checkpoint.read_meta(path):
            # written before buffers were saved: the model keeps its current ones, and says so
            warnings.warn(f"checkpoint {path} holds no buffers: {sorted(sd['buffers'])[:3]}... keep their "
                          f"current values", stacklevel=2)
            del sd["buffers"]
        checkpoint.load(sd, path, meta=self._meta(), check_finite=check_finite)
        self.load_state_dict(sd)

    def _meta(self) -> dict:
        config = getattr(self.model, "config", None)
        meta = {"impl": self.impl, "world_size": self.mesh.size(), "params": self.param_shapes(),
                "model_type": getattr(config, "model_type", type(self.model).__name__)}
        buffers = persistent_buffers(self.model)
        if buffers:
            meta["buffers"] = {name: list(b.shape) for name, b in buffers.items()}
        configs = _impl_configs(self.model)
        if configs is not None:  # a record of what ran; any implementation loads the checkpoint
            meta["impl_configs"] = configs
        return meta

    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype | None = None, *, rank0_only: bool = False) -> dict:
        """Full (unsharded) master weights on the CPU, cast to `dtype` (default: the model config's),
        and the persistent buffers in their own dtype (the router biases stay fp32). Every rank takes
        part in the gathers; with rank0_only the other ranks return {}."""
        config = getattr(self.model, "config", None)
        dtype = dtype or getattr(config, "dtype", torch.float32)
        from bumblebee.files import progress
        keep = not rank0_only or dist.get_rank(self.group) == 0
        out = {}
        total = sum(math.prod(self.full_shapes[name]) for name in self.masters()) * dtype.itemsize
        with progress(total, "gathering weights", disable=dist.get_rank(self.group) != 0) as bar:
            for name, m in self.masters().items():
                full = self._as_dtensor(name, m).full_tensor()  # one all-gather per tensor, on every rank
                if keep:
                    out[name] = full.to(dtype).cpu()
                bar.update(full.numel() * dtype.itemsize)
        if keep:
            out.update({name: b.detach().cpu().clone() for name, b in persistent_buffers(self.model).items()})
        return out

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        """HF export from the sharded state: every rank gathers, rank 0 writes (each file atomically,
        nothing else in the folder touched); an error is raised on every rank."""
        from bumblebee.distributed import on_rank0
        from bumblebee import hf_io
        state = self.full_state_dict(rank0_only=True)

        def write():
            out = self.model.ours_to_hf_state(state) if hasattr(self.model, "ours_to_hf_state") else state
            config, generation_config = hf_io.export_configs(self.model)
            hf_io.save_weights(out, config, path, generation_config=generation_config,
                               impl_configs=_impl_configs(self.model), max_shard_bytes=max_shard_bytes)
        on_rank0(write, self.group)


def _impl_configs(model) -> dict | None:
    """The model's resolved slot configs (`CausalLM.impl_configs()`), or None for a model without slots."""
    configs = getattr(model, "impl_configs", None)
    return configs() if callable(configs) else None


_COUNT_ROW = 1 << 20  # entries per counted row: a row's count stays exact in fp32 (below 2 ** 24)


def _nonzeros(g: torch.Tensor) -> torch.Tensor:
    """Nonzero entries of `g` as a float64 scalar, in one read of `g` (the zero-norm of rows of 2 ** 20
    entries, exact in fp32, summed in float64) instead of a bool copy and an int64 sum."""
    flat = g.reshape(-1)
    n = flat.numel() // _COUNT_ROW * _COUNT_ROW
    rows = torch.linalg.vector_norm(flat[:n].view(-1, _COUNT_ROW), ord=0, dim=1).double().sum()
    return rows + torch.linalg.vector_norm(flat[n:], ord=0).double()
