"""bumblebee's runtime as a verl training engine (verl 0.9.1's `BaseEngine` contract).

Importing this module registers `BumblebeeEngine` in verl's `EngineRegistry` under the backend name
"bumblebee" for `language_model` (the key verl's workers look up) and for each HF model type a
bumblebee family serves, on the `cuda` and `cpu` device keys. verl imports it through
`actor_rollout_ref.model.external_lib=bumblebee.integrations.verl`; the actor then sets
`strategy=bumblebee` (config: `BumblebeeActorConfig`, engine options: `BumblebeeEngineConfig`).

What runs where:
- model: `bumblebee.models.from_pretrained(model_config.local_path, impl=...)`, experts split over
  `ep_size` ranks, state sharding (`fsdp2` or `zero1`) over all ranks, wrapped in a `Runtime`;
- `forward_backward_batch`: verl's micro-batching (`prepare_micro_batches`), each micro-batch packed
  into one `Batch` with `cu_seqlens` through `Runtime.forward_backward` with a caller loss: verl's
  loss function sees verl-shaped log-probs/entropy and runs inside the model's forward (the loss
  slot's head), so no [N, V] logits exist with `linear_ce`; FSDP2 reduce-scatters once, after the
  last micro-batch;
- `optimizer_step`: `Runtime.optim_step(lr=...)` (clipping, non-finite skip, router biases) at the
  LR of verl's own schedule; `to`: the runtime's per-part offload; checkpoints: the runtime's
  reshardable DCP state plus the schedule;
- weights for the rollout: `get_per_tensor_param` (full HF-named tensors gathered in buckets: verl's
  naive sync), `get_per_tensor_param_shard` (each rank's blocks of the HF tensors, no collective: the
  weight-transfer primitive's sender boxes) and `get_per_tensor_param_delta_shard` (verl's diff of
  those: its delta_sharded sync); none brings offloaded optimizer state onto the device;
- checkpoints: `huggingface/config.json` always, HF weights with "hf_model" (merging a checkpoint
  afterwards: `verl_merge.py`). The critic (`value_model`) is `verl_critic.py`.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, EngineConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

from bumblebee import models, registry
from bumblebee.integrations import verl_options as options
from bumblebee.integrations.verl_data import next_token_aligned, packed_batch, temperature_of
from bumblebee.integrations.verl_hf import HF_DIR, write_hf_config
from bumblebee.parallelize import shard_experts
from bumblebee.runtime import Runtime, export

BACKEND = "bumblebee"
DEVICES = ("cuda", "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCHEDULE_FILE = "lr_scheduler.pt"


@dataclass
class BumblebeeEngineConfig(EngineConfig):
    """The engine's options (verl's `EngineConfig` fields, plus):
    impl: slot -> implementation for the model (`{"cross_entropy": "linear_ce"}`; defaults elsewhere);
    state_sharding: "fsdp2" or "zero1"; ep_size: expert-parallel ranks (divides the world size and the
    expert count; 1 = no EP); recompute: full activation recompute (also on with verl's
    model.enable_gradient_checkpointing); model_dtype: the masters' dtype when loading;
    mixed_precision: the compute dtype ("bf16" or "fp32"; None: verl's `dtype`, "bfloat16" or
    "float32"); router_bias_rate: the auxiliary-loss-free routers' bias step. verl's options the
    engine does not implement are refused (verl_options.py)."""
    strategy: str = BACKEND
    impl: dict = field(default_factory=dict)
    state_sharding: str = "fsdp2"
    ep_size: int = 1
    recompute: bool = False
    model_dtype: str = "fp32"
    mixed_precision: Optional[str] = None
    router_bias_rate: float = 1e-3
    reshard_after_forward: bool = True
    export_bucket_bytes: int = 2**30

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != BACKEND:
            raise ValueError(f"strategy must be {BACKEND!r} for BumblebeeEngineConfig, got {self.strategy!r}")
        if self.state_sharding not in ("fsdp2", "zero1"):
            raise ValueError(f"state_sharding must be 'fsdp2' or 'zero1', got {self.state_sharding!r}")
        if not (isinstance(self.ep_size, int) and self.ep_size >= 1):
            raise ValueError(f"ep_size must be an int >= 1, got {self.ep_size!r}")
        for name in ("model_dtype", "mixed_precision"):
            if getattr(self, name) not in DTYPES and (name == "model_dtype" or self.mixed_precision is not None):
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        options.check_engine(self)


@dataclass
class BumblebeeActorConfig(ActorConfig):
    """verl's actor config with `strategy="bumblebee"`; the engine options live under `bumblebee`."""
    strategy: str = BACKEND
    bumblebee: BumblebeeEngineConfig = field(default_factory=BumblebeeEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        options.check_actor(self)
        self.engine = self.bumblebee


class _ModeCtx(BaseEngineCtx):
    """verl's train/eval context: offload moves (the base class), the runtime's mode, and on leaving
    training the gradients zeroed (as verl's FSDP engine does)."""

    def __enter__(self):
        super().__enter__()
        rt = self.engine.runtime
        self._mode = rt.train_mode() if self.mode == "train" else rt.eval_mode()
        self._mode.__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._mode.__exit__(exc_type, exc_val, exc_tb)
        if self.mode == "train" and self.engine.runtime.state is not None and \
                (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


class BumblebeeEngine(BaseEngine):
    def __init__(self, model_config, engine_config: BumblebeeEngineConfig, optimizer_config, checkpoint_config=None):
        super().__init__()
        if not isinstance(engine_config, BumblebeeEngineConfig):
            raise TypeError(f"engine_config must be a BumblebeeEngineConfig, got {type(engine_config).__name__}")
        if not dist.is_initialized():
            raise ValueError("BumblebeeEngine needs torch.distributed initialized (verl's workers do it; "
                             "one process: dist.init_process_group('gloo', rank=0, world_size=1))")
        options.check_model(model_config)
        options.check_engine(engine_config)  # again: verl's workers set some fields after construction
        options.check_checkpoint(checkpoint_config, engine_config.forward_only)
        if not engine_config.forward_only:
            self._adamw = options.check_optimizer(optimizer_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.mode = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.runtime = self.lr_scheduler = None
        self._saved: list[str] = []

    # ---- building ----------------------------------------------------------------------------------
    def _mesh(self):
        world, ep = dist.get_world_size(), self.engine_config.ep_size
        if world % ep:
            raise ValueError(f"ep_size={ep} must divide the world size {world}")
        mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
        ep_mesh = init_device_mesh(self.device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep")) \
            if ep > 1 else None
        return mesh, ep_mesh

    def initialize(self):
        """Load the HF checkpoint at model_config.local_path into a bumblebee model (each rank reads
        it whole, then keeps its part), split its experts (EP), shard its state, build verl's LR
        schedule, and offload what the config offloads."""
        cfg, opt = self.engine_config, self.optimizer_config
        self.mesh, self.ep_mesh = self._mesh()
        model = self._load_model()
        if self.ep_mesh is not None:
            shard_experts(model, self.ep_mesh["ep"].get_group())
        model.set_recompute(cfg.recompute or bool(getattr(self.model_config, "enable_gradient_checkpointing", False)))
        state = None
        if cfg.forward_only:  # the reference model: no optimizer state, no gradients
            model.requires_grad_(False)
        else:
            state = registry.resolve("state_sharding", cfg.state_sharding)(
                model, self.mesh, **self._adamw, mixed_precision=options.compute_dtype(cfg),
                ep_mesh=self.ep_mesh, reshard_after_forward=cfg.reshard_after_forward)
            # verl's own schedule, on a stand-in optimizer: its LR goes to each optim_step(lr=...)
            self.lr_scheduler = options.lr_schedule(opt, torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                                         lr=opt.lr))
        self.runtime = Runtime(model, state, router_bias_rate=cfg.router_bias_rate)
        self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled,
                grad=self.is_param_offload_enabled)

    def _load_model(self):
        """The bumblebee model of model_config.local_path (the value engine adds its head here)."""
        cfg = self.engine_config
        return models.from_pretrained(self.model_config.local_path, impl=dict(cfg.impl),
                                      dtype=DTYPES[cfg.model_dtype], device=str(self.device))

    @property
    def model(self):
        return self.runtime.model

    # ---- what verl asks of every engine --------------------------------------------------------------
    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload) and not self.engine_config.forward_only

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def is_mp_src_rank_with_outputs(self):
        return True  # data parallel only: every rank holds its own samples' outputs

    def get_data_parallel_rank(self):
        return dist.get_rank()

    def get_data_parallel_size(self):
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return self.mesh.get_group()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """The runtime's per-part move (verl offloads to "cpu" and brings back to its device name;
        on a machine without CUDA that name is "cuda" for verl, "cpu" here)."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        target = "cpu" if device == "cpu" else self.device
        optimizer = optimizer and self.runtime.state is not None
        if model or optimizer or grad:
            self.runtime.to(target, model=model, optimizer=optimizer, grad=grad and self.runtime.state is not None)

    @contextmanager
    def _resident(self):
        """Within: every part on the engine's device (collectives and exports need them together);
        offloaded parts go back to the CPU after."""
        off = self.device.type != "cpu" and (self.is_param_offload_enabled or self.is_optimizer_offload_enabled)
        if off:
            self.runtime.to(self.device, optimizer=self.runtime.state is not None,
                            grad=self.runtime.state is not None)
        try:
            yield
        finally:
            if off:
                self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled,
                        grad=self.is_param_offload_enabled)

    def _trainable(self, op: str) -> None:
        if self.engine_config.forward_only:
            raise ValueError(f"{op}: this engine is forward only (engine_config.forward_only=True, verl's reference "
                             "model): it computes log-probs, it does not train")

    def optimizer_zero_grad(self):
        self._trainable("optimizer_zero_grad")
        self.runtime.optimizer_zero_grad()

    def optimizer_step(self):
        """The runtime's step at the schedule's LR; returns the global gradient norm before clipping."""
        self._trainable("optimizer_step")
        return float(self.runtime.optim_step(lr=self.lr_scheduler.get_last_lr()[0])["grad_norm"])

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # ---- forward and backward ------------------------------------------------------------------------
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        """verl's micro-batches of `data`, each through the runtime; the loss's backward when
        training. Returns verl's {"model_output", "loss", "metrics"} in the data's sample order."""
        if not forward_only:
            self._trainable("forward_backward_batch")
        options.check_flags("data", **{k: bool(tu.get_non_tensor_data(data=data, key=k, default=d))
                                       for k, d in options.BATCH_FLAGS.items()})
        tu.assign_non_tensor(data, sp_size=1)
        num_tokens = data["loss_mask"].sum().to(device=self.device, dtype=torch.int64)
        dist.all_reduce(num_tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=int(num_tokens.item()), dp_size=self.get_data_parallel_size())
        keep_outputs = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                       same_micro_num_in_dp=True)
        outputs = []
        sync = getattr(self.model, "set_requires_gradient_sync", None) if not forward_only else None
        try:
            for i, micro in enumerate(micro_batches):
                if sync is not None:  # FSDP2: one reduce-scatter, after the last micro-batch
                    sync(i == len(micro_batches) - 1)
                out = self.forward_step(micro, loss_function, forward_only)
                if not forward_only and not keep_outputs:
                    out.pop("model_output", None)
                outputs.append(out)
        finally:
            if sync is not None:
                sync(True)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def forward_step(self, micro: TensorDict, loss_function, forward_only):
        """One verl micro-batch through the runtime: {"model_output", "loss", "metrics"}, verl's
        loss value (its own scale) and metrics."""
        micro = micro.to(self.device)
        batch, offsets = packed_batch(micro)
        entropy = bool(tu.get_non_tensor_data(data=micro, key="calculate_entropy", default=False))
        temperature = temperature_of(micro)
        group, dp = self.get_data_parallel_group(), self.get_data_parallel_size()

        def verl_outputs(out):
            got = {"log_probs": next_token_aligned(out["log_probs"], offsets)}
            if out.get("entropy") is not None:
                got["entropy"] = next_token_aligned(out["entropy"], offsets)
            return got

        if forward_only:  # no graph; router load counts stay as they were
            res = self.runtime.forward(batch, temperature=temperature, entropy=entropy)
            model_output = verl_outputs({"log_probs": res.log_probs, "entropy": res.entropy})
            loss, metrics = (loss_function(model_output=model_output, data=micro, dp_group=group)
                             if loss_function is not None else (torch.zeros(()), {}))
            return {"model_output": model_output, "loss": float(loss), "metrics": metrics}

        found = {}

        def loss_fn(model_output, data, dp_group):  # inside the model's forward: the head is whole
            found["model_output"] = verl_outputs(model_output)
            loss, found["metrics"] = loss_function(model_output=found["model_output"], data=micro, dp_group=group)
            found["loss"] = float(loss.detach())
            # verl scales its loss for a gradient mean over ranks (x dp_size); the runtime makes the
            # gradient the sum of the ranks' losses: undo verl's factor
            return loss / dp, {}

        self.runtime.forward_backward(batch, loss_fn, temperature=temperature, entropy=entropy)
        return {"model_output": detach_tree(found["model_output"]), "loss": found["loss"],
                "metrics": found["metrics"]}

    # ---- weights for the rollout -----------------------------------------------------------------------
    @contextmanager
    def _weights_resident(self):
        """Within: what an export reads on the engine's device - the parameters (FSDP2's are the fp32
        masters) and ZeRO-1's fp32 master shards - never the Adam moments or the gradients: a weight
        sync must not bring offloaded optimizer state back onto the GPU (verl offloads it to make room
        for the rollout). Offloaded parts go back to the CPU after."""
        rt, state = self.runtime, self.runtime.state
        on_device = self.device.type != "cpu"
        model_off = on_device and self.is_param_offload_enabled
        params = {id(p) for p in self.model.parameters()}
        masters = [m for m in state.masters().values() if id(m) not in params] \
            if on_device and state is not None and self.is_optimizer_offload_enabled else []  # ZeRO-1's
        if model_off:
            rt.to(self.device, model=True, optimizer=False, grad=False)
        for m in masters:
            m.data = m.data.to(self.device)
        try:
            yield
        finally:
            for m in masters:
                m.data = m.data.to("cpu")
            if model_off:
                rt.to("cpu", model=True, optimizer=False, grad=False)

    def _export_dtype(self) -> torch.dtype:
        """What the export writes: the checkpoint's dtype (config.json), as `save_pretrained` does."""
        return getattr(self.model.config, "dtype", torch.float32)

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """(generator of (HF name, full tensor), None), gathered in buckets: every rank must run it
        to the end (it holds the gathers). verl's naive and full-tensor checkpoint-engine syncs."""
        def tensors():
            with self._weights_resident():
                for name, t in export.export_weights(self.model, self.runtime.state,
                                                     bucket_bytes=self.engine_config.export_bucket_bytes,
                                                     dtype=self._export_dtype()):
                    yield name, t.to(self.device)
        return tensors(), None

    def get_per_tensor_param_shard(self, **kwargs):
        """(generator of (HF name, this rank's flat slice, verl ShardSpec), None), no collective: the
        weight-transfer sender's boxes (`export_weight_shards` -> `sender_spec`), each named by its HF
        tensor and placed in it as a block. Every rank yields every HF tensor in the same order
        (verl's delta engine runs in lockstep): a tensor this rank holds nothing of comes empty, and
        a replicated one (router biases) counts on rank 0 only."""
        from verl.workers.engine.spec import BlockPlacement, ShardSpec

        from bumblebee.primitives.weight_transfer.spec import sender_spec
        rank, group = dist.get_rank(), self.get_data_parallel_group()

        def shards():
            with self._weights_resident():
                got = list(export.export_weight_shards(self.model, self.runtime.state, dtype=self._export_dtype()))
                spec, _, local = sender_spec(rank, got)
                held = {name: (box, replicated) for name, box, replicated in spec.boxes}
                for name, shape, dtype in self._hf_manifest():
                    if name not in held:
                        empty = torch.empty(0, dtype=dtype, device=self.device)
                        yield name, empty, ShardSpec(full_shape=shape, place=0, gather_group=group, contributes=False)
                        continue
                    box, replicated = held[name]
                    t = local[(name, box)]
                    place = BlockPlacement(tuple(c for _, _, c in box), tuple(s for s, _, _ in box), shape)
                    yield name, t.contiguous().view(-1).to(self.device), ShardSpec(
                        full_shape=shape, place=place, gather_group=group, contributes=not replicated or rank == 0)
        return shards(), None

    def _hf_manifest(self) -> list[tuple[str, tuple, torch.dtype]]:
        """(HF name, full shape, dtype) of every exported tensor, in the export's order, the same on
        every rank (from the full shapes alone)."""
        src = export.sources(self.model, self.runtime.state)
        layout = export.hf_layout(self.model, {n: s[2] for n, s in src.items()})
        buffers = set(export.persistent_buffers(self.model))
        return [(hf, tuple(size), src[n][0].dtype if n in buffers else self._export_dtype())
                for n in src for hf, size, _, _ in layout[n]]

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's delta-sync entries (the elements changed since the last `prime_delta_snapshots` or
        delta export, in HF coordinates): verl's own diff over `get_per_tensor_param_shard`, whose
        names and blocks are already HF's (verl's identity entry)."""
        from verl.workers.engine.utils import _hf_entry_identity, hf_delta_export
        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})
        gen, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(gen, self._delta_shard_snap, _hf_entry_identity), None

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, global_step: int = 0,
                        max_ckpt_to_keep: Optional[int] = None, **kwargs) -> None:
        """The runtime's DCP state (model, optimizer, router biases) and the LR schedule into
        `local_path`; HF weights under `local_path/huggingface` when save_contents has "hf_model"."""
        rt = self.runtime
        hf_dir = os.path.join(local_path, HF_DIR)
        with self._resident():
            rt.save_state(local_path)
            if "hf_model" in (getattr(self.checkpoint_config, "save_contents", None) or ()):
                rt.save_weights(hf_dir)
        if dist.get_rank() == 0:  # the config always (as verl's FSDP engine): what merging the state needs
            write_hf_config(self.model, hf_dir)
            tmp = os.path.join(local_path, f".{SCHEDULE_FILE}.tmp")
            torch.save({"lr_scheduler": self.lr_scheduler.state_dict(), "global_step": int(global_step)}, tmp)
            os.replace(tmp, os.path.join(local_path, SCHEDULE_FILE))
        dist.barrier()
        if hdfs_path is not None and dist.get_rank() == 0:
            from verl.utils import hdfs_io
            hdfs_io.makedirs(hdfs_path, exist_ok=True)
            hdfs_io.copy(src=local_path, dst=hdfs_path, dirs_exist_ok=True)
        self._saved = [p for p in self._saved if p != local_path] + [local_path]
        if max_ckpt_to_keep and max_ckpt_to_keep > 0:
            while len(self._saved) > max_ckpt_to_keep:  # only checkpoints this engine wrote
                old = self._saved.pop(0)
                if dist.get_rank() == 0:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        """Load what `save_checkpoint` wrote (any rank count: DCP reshards). A local copy is deleted
        afterwards only when it was fetched from `hdfs_path`."""
        fetched = False
        if hdfs_path is not None and (local_path is None or not os.path.isdir(local_path)):
            from verl.utils.fs import copy_to_local
            local_path, fetched = copy_to_local(hdfs_path), True
        with self._resident():  # the state's load drops FSDP2's gathered parameters a forward left
            self.runtime.load_state(local_path)
        sched = os.path.join(local_path, SCHEDULE_FILE)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=False)["lr_scheduler"])
        dist.barrier()
        if fetched and del_local_after_load and dist.get_rank() == 0:
            shutil.rmtree(local_path, ignore_errors=True)


def _register() -> None:
    types = ["language_model", *sorted(models.MODEL_TYPES)]
    for model_type in types:
        have = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {})
        devices = [d for d in DEVICES if d not in have]  # importing twice registers once
        if devices:
            EngineRegistry.register(model_type=model_type, backend=BACKEND, device=devices)(BumblebeeEngine)


_register()

__all__ = ["BACKEND", "BumblebeeActorConfig", "BumblebeeEngine", "BumblebeeEngineConfig"]
