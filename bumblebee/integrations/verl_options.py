"""Which of verl's options the bumblebee engine honours, and a clear error for those it does not.

verl's configs hand the engine more than it reads: an option that is silently ignored is a wrong
run, so every option verl 0.9.1's engine, model, optimizer, checkpoint and actor configs carry is
either honoured (the table in skills/rl-smoke/SKILL.md names the test that fails if it is not) or
refused here when set to a value the engine does not implement.
"""
from __future__ import annotations

# verl's compute dtype names (`EngineConfig.dtype`) -> the runtime's mixed-precision names
COMPUTE_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}
# what the runtime's one DCP state holds: model, optimizer, router biases and the LR schedule together
STATE_CONTENTS = frozenset({"model", "optimizer", "extra"})
CHECKPOINT_CONTENTS = STATE_CONTENTS | {"hf_model"}
OPTIMIZER_OVERRIDES = frozenset({"eps"})  # override_optimizer_config keys passed to the AdamW state
# the flags verl's workers and trainer put into each batch, with their defaults
BATCH_FLAGS = {"use_fused_kernels": False, "use_remove_padding": True, "calculate_sum_pi_squared": False}


def _refuse(where: str, value, why: str):
    raise ValueError(f"{where}={value!r} is not supported by the bumblebee engine: {why}")


def compute_dtype(cfg) -> str:
    """The runtime's compute dtype: `mixed_precision` when set, else verl's `dtype`."""
    if cfg.mixed_precision is not None:
        return cfg.mixed_precision
    if cfg.dtype not in COMPUTE_DTYPES:
        _refuse("engine.dtype", cfg.dtype, f"the compute dtype is one of {sorted(COMPUTE_DTYPES)} (no float16 "
                "loss scaling)")
    return COMPUTE_DTYPES[cfg.dtype]


def check_engine(cfg) -> None:
    """verl's `EngineConfig` fields the engine does not implement."""
    compute_dtype(cfg)
    check_flags("engine", use_fused_kernels=cfg.use_fused_kernels, use_remove_padding=cfg.use_remove_padding)
    if cfg.full_determinism:
        _refuse("full_determinism", True, "the engine does not switch its kernels to deterministic algorithms")
    mode = getattr(getattr(cfg, "router_replay", None), "mode", "disabled")
    if mode != "disabled":
        _refuse("router_replay.mode", mode, "the engine replays the rollout's experts when the batch carries "
                "`routed_experts`; verl's R2/R3 record/replay modes are not implemented")


def check_flags(where: str, *, use_fused_kernels: bool, use_remove_padding: bool,
                calculate_sum_pi_squared: bool = False) -> None:
    """The flags verl's workers copy from the model config into the engine config and each batch."""
    if calculate_sum_pi_squared:
        _refuse(f"{where}.calculate_sum_pi_squared", True, "the engine returns per-token log-probs and entropy only")
    if use_fused_kernels:
        _refuse(f"{where}.use_fused_kernels", True, "the fused LM head is bumblebee's linear_ce; set "
                "impl={'cross_entropy': 'linear_ce'} (and model.use_fused_kernels=False)")
    if not use_remove_padding:
        _refuse(f"{where}.use_remove_padding", False, "the engine always packs the samples end to end "
                "(cu_seqlens, exact); set model.use_remove_padding=True")


def check_model(model_config) -> None:
    """verl's `HFModelConfig` fields that would change the model the engine builds."""
    if getattr(model_config, "lora_rank", 0):
        _refuse("model.lora_rank", model_config.lora_rank, "LoRA is not implemented")
    for name in ("enable_activation_offload", "use_liger", "use_fused_kernels"):
        if getattr(model_config, name, False):
            _refuse(f"model.{name}", True, "bumblebee's slots choose the kernels (engine impl=...)")
    if getattr(model_config, "override_config", None):
        _refuse("model.override_config", dict(model_config.override_config), "the engine builds the model from "
                "config.json as it is; edit the checkpoint's config instead")
    if (getattr(model_config, "tiled_mlp", None) or {}).get("enabled", False):
        _refuse("model.tiled_mlp.enabled", True, "bumblebee's recompute and chunked experts bound the MLP memory")
    mtp = getattr(model_config, "mtp", None)
    if mtp is not None and getattr(mtp, "enable_train", False):
        _refuse("model.mtp.enable_train", True, "verl's MTP loss is not wired to the engine")


def check_optimizer(opt) -> dict:
    """verl's optimizer config -> the AdamW keyword arguments of the engine's state."""
    name = str(getattr(opt, "optimizer", "AdamW"))
    if name.lower() != "adamw":
        _refuse("optim.optimizer", name, "the engine's state sharding runs AdamW (fp32 masters)")
    impl = getattr(opt, "optimizer_impl", "torch.optim")
    if impl != "torch.optim":
        _refuse("optim.optimizer_impl", impl, "the engine's AdamW is its own (torch.optim semantics)")
    over = dict(getattr(opt, "override_optimizer_config", None) or {})
    if set(over) - OPTIMIZER_OVERRIDES:
        _refuse("optim.override_optimizer_config", over, f"only {sorted(OPTIMIZER_OVERRIDES)} can be overridden")
    kind = getattr(opt, "lr_scheduler_type", "constant")
    if kind not in ("constant", "cosine"):
        _refuse("optim.lr_scheduler_type", kind, "verl's constant and cosine schedules are the ones implemented")
    return {"lr": opt.lr, "betas": tuple(opt.betas), "eps": float(over.get("eps", 1e-8)),
            "weight_decay": opt.weight_decay, "grad_clip": opt.clip_grad}


def check_checkpoint(ckpt, forward_only: bool) -> None:
    """save_contents / load_contents: the state is saved and loaded whole; "hf_model" adds HF weights."""
    if ckpt is None or forward_only:
        return
    for key in ("save_contents", "load_contents"):
        got = set(getattr(ckpt, key, None) or STATE_CONTENTS)
        if got - CHECKPOINT_CONTENTS:
            _refuse(f"checkpoint.{key}", sorted(got), f"the contents are {sorted(CHECKPOINT_CONTENTS)}")
        if not STATE_CONTENTS <= got:
            _refuse(f"checkpoint.{key}", sorted(got), "model, optimizer and extra (LR schedule, router biases) "
                    "are one resharding DCP state, saved and loaded together")
    if getattr(ckpt, "async_save", False):
        _refuse("checkpoint.async_save", True, "checkpoints are written synchronously")


def check_actor(actor) -> None:
    """verl's `ActorConfig` fields that reach the engine and are not implemented."""
    for name in ("use_fused_kernels", "use_prefix_grouper", "calculate_sum_pi_squared"):
        if getattr(actor, name, False):
            _refuse(f"actor.{name}", True, "the engine returns per-token log-probs and entropy only")


def lr_schedule(opt, optimizer):
    """verl's own LR schedule (its constant / cosine functions, warm-up from steps or ratio) on
    `optimizer`, exactly as verl's FSDP engine builds it."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    total = opt.total_training_steps
    warmup = opt.lr_warmup_steps if opt.lr_warmup_steps is not None else -1
    if warmup <= 0:
        warmup = int(opt.lr_warmup_steps_ratio * total)
    if opt.lr_scheduler_type == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                           min_lr_ratio=opt.min_lr_ratio or 0.0, num_cycles=opt.num_cycles,
                                           zero_indexed_step=opt.zero_indexed_step)
