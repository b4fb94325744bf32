"""The two training stacks `training_step/bench.py` compares, built from one HF checkpoint folder.

    bumblebee        our model (`bb.models.from_pretrained`), default slots, full recompute,
                     `state_sharding=fsdp2`, EP over the GPUs for MoE models when there are several
    transformers+liger   the peer at its best from flags and installed packages: transformers' model with
                     `attn_implementation="flash_attention_4"` where flash-attn-4 imports (else "sdpa"),
                     Liger's kernels applied (RoPE, RMSNorm, SwiGLU / fused MoE experts, fused linear
                     cross-entropy), gradient checkpointing (non-reentrant), FSDP2 `fully_shard` per
                     decoder layer and at the root, `torch.optim.AdamW(fused=True)` (Trainer's and
                     torchtitan's default): the shape of verl's FSDP backend
    transformers+liger:attn=sdpa,optim=foreach   the peer with a flag set otherwise (attn: auto,
                     flash_attention_4, sdpa, eager; optim: fused, foreach)
    transformers+liger-reference   the configuration the committed results before the best peer used
                     (SDPA, AdamW's foreach default): for reference only, never paired with ours

Both: fp32 master weights, bf16 compute (`MixedPrecisionPolicy(bf16, reduce fp32)`), AdamW with the
same hyperparameters, gradient clipping at 1.0. `Stack.step(ids)` runs one forward + backward +
optimizer step and returns (loss, grad norm before clipping).
"""
from __future__ import annotations

from pathlib import Path

import torch

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRAD_CLIP = 1.0
LIGER_PATCHES = {"qwen3_moe": "apply_liger_kernel_to_qwen3_moe", "qwen3": "apply_liger_kernel_to_qwen3",
                 "qwen3_5_moe_text": "apply_liger_kernel_to_qwen3_5_moe", "qwen3_5_moe": "apply_liger_kernel_to_qwen3_5_moe"}


class Stack:
    name = "?"
    config: dict = {}

    def forward_backward(self, ids: torch.Tensor) -> float:
        raise NotImplementedError

    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients; the grad norm before clipping."""
        raise NotImplementedError

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        loss = self.forward_backward(ids)
        return loss, self.optimizer_step()


class Bumblebee(Stack):
    name = "bumblebee"

    def __init__(self, path, device, mesh, *, ep: int = 1, impl: dict | None = None, mixed_precision="bf16"):
        from bumblebee import models, registry
        from bumblebee.parallelize import shard_experts
        from torch.distributed.device_mesh import init_device_mesh
        impl = dict(impl or {})
        world = mesh.size()
        ep_mesh = None
        if ep > 1:
            impl.setdefault("moe_dispatch", "chunked")
            ep_mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        model = models.from_pretrained(path, impl, dtype=torch.float32, device=device)
        if ep_mesh is not None:
            shard_experts(model, ep_mesh["ep"].get_group())
        model.set_recompute(True)
        self.state = registry.resolve("state_sharding", "fsdp2")(
            model, mesh, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"],
            grad_clip=GRAD_CLIP, mixed_precision=mixed_precision, ep_mesh=ep_mesh)
        configs = model.impl_configs()  # every slot the model uses, with its options
        self.config = {"impl": {slot: c["impl"] for slot, c in configs.items()} | {"state_sharding": "fsdp2"},
                       "impl_configs": configs, "ep": ep, "recompute": "full"}

    def forward_backward(self, ids):
        loss = self.state.model(ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    def optimizer_step(self):
        ok, norm, _ = self.state.step()
        self.state.zero_grad()
        return norm


class TransformersLiger(Stack):
    name = "transformers+liger"

    def __init__(self, path, device, mesh, *, liger: bool = True, mixed_precision="bf16", attn: str = "auto",
                 optim: str = "fused"):
        import transformers
        if attn not in PEER_ATTN or optim not in PEER_OPTIM:
            raise ValueError(f"peer options attn={attn!r}, optim={optim!r}; accepted: attn in {PEER_ATTN}, "
                             f"optim in {PEER_OPTIM}")
        attn = peer_attention(device) if attn == "auto" else attn
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        hf = transformers.AutoConfig.from_pretrained(path)
        patched = None
        if liger:
            import liger_kernel
            import liger_kernel.transformers as lt
            patched = LIGER_PATCHES[hf.model_type]
            getattr(lt, patched)()  # before the model is built: the classes are patched
            self.name = "transformers+liger"
            version = getattr(liger_kernel, "__version__", None)
        else:
            self.name, version = "transformers", None
        deltanet = None
        if hf.model_type.startswith("qwen3_5"):
            # transformers' gated DeltaNet runs flash-linear-attention's chunk_gated_delta_rule where
            # installed; where fla refuses its own gated backward (Hopper, Triton < 3.7.1) the peer gets
            # the dq/dk/dw/dg kernel we install into fla for ourselves (its rule call marked as ours:
            # scope_deltanet_rule), so both run the same DeltaNet
            from bumblebee.primitives import linear_attention as la
            ops = la.fla_ops() if device.type == "cuda" else None
            ours_kernel = f"with our chunk_bwd_dqkwg ({la.DQKWG_HOOK}), its rule call marked"
            deltanet = ("transformers' torch path (fla absent)" if ops is None else
                        f"fla {ours_kernel if la.DQKWG_HOOK else 'as is'}")
        model = _transformers_model(path, device, attn_implementation=attn)
        if deltanet and la.DQKWG_HOOK:
            scope_deltanet_rule(model, la.scoped)
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        bf16 = mixed_precision == "bf16"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.train()
        self.model = model
        # fused=False is not the default: AdamW's default (None) picks foreach on CUDA
        self.optimizer = torch.optim.AdamW(model.parameters(), **HP, **({"fused": True} if optim == "fused" else
                                                                         {"foreach": True}))
        self.config = {"transformers": transformers.__version__, "liger_kernel": version, "liger_patch": patched,
                       "attn_implementation": attn, "gradient_checkpointing": "non-reentrant",
                       "fsdp2": "fully_shard per decoder layer + root", "optimizer": f"torch AdamW ({optim})",
                       "deltanet": deltanet}

    def forward_backward(self, ids):
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    def optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


PEER_ATTN = ("auto", "flash_attention_4", "sdpa", "eager")
PEER_OPTIM = ("fused", "foreach")
REFERENCE = {"attn": "sdpa", "optim": "foreach"}  # transformers+liger-reference


def peer_attention(device) -> str:
    """What a user passes for the best attention: "flash_attention_4" where flash-attn-4 imports and
    transformers accepts it, else "sdpa"."""
    if device.type != "cuda":
        return "sdpa"
    try:
        import flash_attn.cute  # noqa: F401  (the package flash-attn-4)
        from transformers.utils import is_flash_attn_4_available
    except Exception:  # noqa: BLE001 - absent, or its CUDA libraries missing: not importable
        return "sdpa"
    return "flash_attention_4" if is_flash_attn_4_available() else "sdpa"


def _options(stack: str) -> tuple[str, dict]:
    base, _, opts = stack.partition(":")
    return base, dict(kv.split("=", 1) for kv in opts.split(",")) if opts else {}


def build(stack: str, path, device, mesh, *, ep: int = 1, mixed_precision="bf16") -> Stack:
    """`bumblebee`, `bumblebee:slot=impl,slot=impl` (a swap), `transformers+liger[:attn=..,optim=..]`,
    `transformers+liger-reference` or `transformers` (no Liger: the CPU smoke run)."""
    base, opts = _options(stack)
    if base == "bumblebee":
        s = Bumblebee(path, device, mesh, ep=ep, impl=opts, mixed_precision=mixed_precision)
    elif base in ("transformers+liger", "transformers", "transformers+liger-reference"):
        if set(opts) - {"attn", "optim"}:
            raise ValueError(f"stack {stack!r}: unknown peer options {sorted(set(opts) - {'attn', 'optim'})}; "
                             "accepted: attn, optim")
        if base.endswith("-reference"):
            opts = {**REFERENCE, **opts}
        s = TransformersLiger(path, device, mesh, liger=base != "transformers", mixed_precision=mixed_precision,
                              **opts)
    else:
        raise ValueError(f"unknown stack {stack!r}; accepted: bumblebee[:slot=impl,...], "
                         "transformers+liger[:attn=..,optim=..], transformers+liger-reference, transformers")
    s.name = stack
    return s


def scope_deltanet_rule(model, scoped) -> list[str]:
    """Run transformers' gated delta rule calls inside our layers' marks (`scoped`, from
    `primitives/linear_attention.py`): the dq/dk/dw/dg kernel we install into fla's backend registry,
    where fla refuses its own (Hopper, Triton < 3.7.1), serves only calls inside those marks, so without
    this the peer's backward gets fla's refusal. transformers' DeltaNet layers call the rule through their
    module's global `torch_chunk_gated_delta_rule` (fla's function where fla is installed), which is
    replaced here by the same call, marked, returning the same (output, final state). Returns the
    modules changed (the benchmark's worker process only: one process per stack)."""
    import sys
    changed = []
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    for name in sorted(modules):
        module = sys.modules[name]
        rule = getattr(module, "torch_chunk_gated_delta_rule", None)
        if rule is None:  # a transformers whose layers call the rule otherwise: the peer would get the refusal
            raise RuntimeError(f"{name} has no torch_chunk_gated_delta_rule to mark: transformers' DeltaNet "
                               "layers call the rule otherwise in this version; update scope_deltanet_rule")
        if getattr(rule, "scoped_rule", False):
            continue

        def marked(query, key, value, *, g, beta, _rule=rule, **kwargs):
            state = []

            def run(q, k, v, g_, beta_):  # positional tensors: the marks wrap each one
                out, final = _rule(q, k, v, g=g_, beta=beta_, **kwargs)
                state.append(final)
                return out
            return scoped(run, query, key, value, g, beta), state[0]
        marked.scoped_rule = True
        module.torch_chunk_gated_delta_rule = marked
        changed.append(name)
    return changed


def _transformers_model(path, device, **kw):
    """transformers' model built on `device` from the folder's config, its weights loaded from the
    folder's `model.safetensors` (transformers' own in-memory state dict: no per-expert conversion)."""
    import transformers
    from safetensors.torch import load_file
    cfg = transformers.AutoConfig.from_pretrained(path, **kw)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_file(str(Path(path) / "model.safetensors"), device=str(device))
    model.load_state_dict(state, strict=not getattr(cfg, "tie_word_embeddings", False))
    del state
    return model


def make_init_checkpoint(hf_config: dict, path, device, seed: int = 0) -> None:
    """transformers' own model and init (seed 0); its state dict as `model.safetensors` beside its
    config.json: both stacks load this folder (ours reads transformers' fused expert names directly)."""
    import transformers
    from safetensors.torch import save_file
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    Path(path).mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(Path(path) / "model.safetensors"))
    del model, state
