"""Static-memory estimator: per-rank bytes of a training step, term by term.

    est = bumblebee.memory.estimate("qwen3-8b", Parallel(dp=8, sharding="fsdp2", seq_len=32768))
    print(bumblebee.memory.table("qwen3-8b", Parallel(dp=8)))
    python -m bumblebee.memory qwen3-8b --dp 8 --sharding zero1 --seq-len 32768

State terms follow the implementations in primitives/state_sharding.py and
baselines/state_sharding.py (P parameters, n data-parallel ranks; bf16 compute):
  FSDP2   fp32 master 4P/n + fp32 grads 4P/n + Adam 8P/n = 16P/n, plus the bf16 parameters of the
          units in flight (one block, the prefetched next one, the root unit) and one block's fp32
          unsharded gradient before its reduce-scatter.
  ZeRO-1  bf16 params 2P + fp32 grads 4P (both divided by PP*EP) + fp32 master and Adam 12P/n.
The recipe quotes FSDP2 as 18P/n (it counts a sharded bf16 copy too); `recipe_state` gives
that number beside ours. With EP, expert parameters are divided over the EP ranks first, then
sharded over the remaining dp/ep ranks, so every state term stays P/(PP*n) for them.

Activation terms assume full recompute (one [N, D] input kept per layer, plus one layer's working
set rebuilt during its backward) or none (every layer's working set kept); loss buffers depend on
the cross_entropy slot (materialized: [N, V] logits in fp32 and their gradient; linear_ce: one
fp32 vocabulary chunk and the fp32 [N, D] hidden gradient); MoE dispatch buffers hold the N*top_k
routed rows (permuted input, expert hidden, output) and, with EP, the all-to-all send/receive copies.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

import torch

LINEAR_CE_WORKSPACE = 128 << 20  # primitives/cross_entropy.py WORKSPACE_BYTES (one fp32 logit chunk)
_BYTES = {"bf16": 2, "fp32": 4}


@dataclass
class Parallel:
    dp: int = 1                   # data-parallel ranks the state is sharded over (n)
    pp: int = 1                   # pipeline stages (layers split evenly)
    ep: int = 1                   # expert-parallel ranks (divides dp)
    sharding: str = "fsdp2"       # "fsdp2" | "zero1"
    mixed_precision: str = "bf16"  # compute dtype: "bf16" | "fp32"
    micro_batch: int = 1
    seq_len: int = 4096
    recompute: bool = True
    loss: str = "linear_ce"       # "linear_ce" | "materialized_ce"
    reshard_after_forward: bool = True
    device: str = "cuda"          # "cuda": AdamW's foreach path; "cpu": its per-tensor path


@dataclass
class Estimate:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    unsharded_units: int = 0      # FSDP2: bf16 units in flight + one unsharded fp32 unit gradient
    activations: int = 0          # kept across the whole backward (recompute: one [N, D] per layer)
    layer_working: int = 0        # one layer's saved tensors and their gradients during its backward
    loss_buffers: int = 0         # cross-entropy buffers at the start of the backward
    moe_dispatch: int = 0         # routed-row buffers of one MoE layer (inside the layer working set)
    optimizer_step: int = 0       # transients of the step: reduced grad shards, AdamW temporaries
    recipe_state: int = 0
    counts: dict = field(default_factory=dict)

    @property
    def static(self) -> int:
        """Parameters, gradients and optimizer state: what lives across steps (grads at the step)."""
        return self.params + self.grads + self.optimizer

    @property
    def backward_peak(self) -> int:
        # the loss buffers are freed before the first layer's backward rebuilds its working set
        return (self.static + self.unsharded_units + self.activations
                + max(self.loss_buffers, self.layer_working + self.moe_dispatch))

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.static + self.optimizer_step)


def _model_on_meta(config):
    from bumblebee import models  # lazy: the core does not need the models to import
    hf = models._hf_config(config)
    cls = models._model_class(hf)
    cfg = cls.config_class.from_hf(hf)
    with torch.device("meta"):
        model = cls(cfg, None)
    model.tie_weights()
    return model, cfg


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _layer_working_set(cfg, n_tok: int, b: int) -> int:
    """Bytes autograd keeps for one decoder layer's backward (SDPA without a [T, T] matrix)."""
    d, dh = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * dh
    attn = n_tok * (2 * d * b + 4 * d        # input, normed input; the fp32 copy inside RMSNorm
                    + 3 * qkv * b            # q/k/v projections, normed, rotated
                    + cfg.num_attention_heads * dh * b + d * b)  # attention output, o_proj output
    experts = getattr(cfg, "num_experts", 0)
    if experts:
        mlp = n_tok * (2 * d * b + 4 * d + experts * 4)  # normed input, router logits (fp32)
    else:
        f = cfg.intermediate_size
        mlp = n_tok * (2 * d * b + 4 * d + 4 * f * b)  # normed input; gate, up, silu, product
    return attn + mlp


def estimate(config, parallel: Parallel | None = None) -> Estimate:
    """Per-rank bytes of each term for model `config` (a named config or an HF config dict)."""
    par = parallel or Parallel()
    if par.sharding not in ("fsdp2", "zero1"):
        raise ValueError(f"sharding {par.sharding!r} not supported; accepted: ['fsdp2', 'zero1']")
    if par.mixed_precision not in _BYTES:
        raise ValueError(f"mixed_precision {par.mixed_precision!r} not supported; accepted: {sorted(_BYTES)}")
    if par.device not in ("cuda", "cpu"):
        raise ValueError(f"device {par.device!r} not supported; accepted: ['cpu', 'cuda']")
    if par.loss not in ("linear_ce", "materialized_ce"):
        raise ValueError(f"loss {par.loss!r} not supported; accepted: ['linear_ce', 'materialized_ce']")
    if min(par.dp, par.pp, par.ep) < 1 or par.dp % par.ep:
        raise ValueError(f"need dp, pp, ep >= 1 with ep dividing dp, got dp={par.dp}, pp={par.pp}, ep={par.ep}")
    model, cfg = _model_on_meta(config)
    b = _BYTES[par.mixed_precision]
    n, pp, ep = par.dp, par.pp, par.ep
    layers = cfg.num_hidden_layers
    # parameters held by this rank's pipeline stage (layers split evenly; embedding and head counted
    # on every stage, which over-counts for pp > 1 by at most their size)
    dense = expert = 0
    unit = {}
    for name, p in model.named_parameters():
        k = p.numel()
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            unit[i] = unit.get(i, 0) + (k // ep if _is_expert(name) else k)
            k = k / pp
        if _is_expert(name):
            expert += k / ep
        else:
            dense += k
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("model.layers.")
               and not (name.startswith("model.embed_tokens") and not cfg.tie_word_embeddings))
    p_rank = dense + expert                  # parameters on this rank before data-parallel sharding
    p_shard = dense / n + expert / (n // ep)  # this rank's shard
    largest = max(p.numel() // (ep if _is_expert(name) else 1) for name, p in model.named_parameters())
    # AdamW's temporaries: foreach (CUDA) holds one fp32 list as large as the shard; the per-tensor
    # path (CPU) one tensor as large as the largest parameter shard
    adam_temp = 4 * (p_shard if par.device == "cuda" else largest / n)
    est = Estimate()
    if par.sharding == "fsdp2":
        est.params, est.grads, est.optimizer = int(4 * p_shard), int(4 * p_shard), int(8 * p_shard)
        embed = 0 if cfg.tie_word_embeddings else model.model.embed_tokens.weight.numel()
        block = max(unit.values()) if unit else 0
        in_flight = 2 if par.reshard_after_forward else layers // pp  # current + prefetched, or all
        # bf16 copies of the root unit and the blocks in flight; one unit's fp32 gradient before
        # its reduce-scatter (the largest unit: a block, or the untied embedding)
        est.unsharded_units = int(b * (root + in_flight * block) + 4 * max(block, embed))
        est.optimizer_step = int(adam_temp)
        est.recipe_state = int(18 * p_shard)
    else:
        est.params, est.grads, est.optimizer = int(b * p_rank), int(4 * p_rank), int(12 * p_shard)
        est.unsharded_units = int(b * largest)  # a parameter's own gradient before the hook adds it
        # the reduce-scattered gradient shards, then AdamW's temporaries or the compute-dtype copies
        # of the updated shards sent to the all-gather
        est.optimizer_step = int(4 * p_shard + max(adam_temp, b * p_shard if b < 4 else 0))
        est.recipe_state = int(6 * p_rank + 12 * p_shard)
    n_tok = par.micro_batch * par.seq_len
    work = _layer_working_set(cfg, n_tok, b)
    d = cfg.hidden_size
    local_layers = -(-layers // pp)
    if par.recompute:
        est.activations = int(local_layers * n_tok * d * b)  # each layer's input
        est.layer_working = int(2 * work)                    # one rebuilt layer and its gradients
    else:
        est.activations = int(local_layers * work)
        est.layer_working = int(work)
    v = cfg.vocab_size
    if par.loss == "materialized_ce":
        # [N, V] logits (a bf16 matmul output first when computing in bf16), fp32 logits and exp
        est.loss_buffers = int(n_tok * v * (8 + (b if b < 4 else 0)))
    else:
        # one fp32 vocabulary chunk and the fp32 [N, D] hidden gradient (the Triton path on CUDA;
        # the CPU path of primitives/cross_entropy.py holds several chunk-sized temporaries)
        est.loss_buffers = int(min(LINEAR_CE_WORKSPACE, n_tok * v * 4) + n_tok * d * 4)
    experts = getattr(cfg, "num_experts", 0)
    if experts:
        k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        rows = n_tok * k
        est.moe_dispatch = int(rows * (2 * d + 3 * f) * b + (2 * rows * d * b if ep > 1 else 0))
    est.counts = {"P": int(sum(p.numel() for p in model.parameters())), "P_rank": int(p_rank),
                  "P_shard": int(p_shard), "block": int(max(unit.values()) if unit else 0), "root": int(root),
                  "tokens": n_tok}
    return est


def _gib(x: int) -> str:
    return f"{x / 2**30:9.3f}"


def table(config, parallel: Parallel | None = None, name: str | None = None) -> str:
    """A per-rank table: FSDP2 and ZeRO-1 side by side at the same parallel layout."""
    par = parallel or Parallel()
    rows = {}
    for sharding in ("fsdp2", "zero1"):
        rows[sharding] = estimate(config, Parallel(**{**asdict(par), "sharding": sharding}))
    name = name or (config if isinstance(config, str) else config.get("model_type", "model"))
    head = (f"{name}: dp={par.dp} pp={par.pp} ep={par.ep} {par.mixed_precision} "
            f"tokens/rank={par.micro_batch}x{par.seq_len} recompute={par.recompute} loss={par.loss}")
    lines = [head, f"{'GiB per rank':<18}{'fsdp2':>10}{'zero1':>10}"]
    for term in ("params", "grads", "optimizer", "static", "recipe_state", "unsharded_units", "activations",
                 "layer_working", "loss_buffers", "moe_dispatch", "optimizer_step", "peak"):
        lines.append(f"{term:<18}{_gib(getattr(rows['fsdp2'], term))} {_gib(getattr(rows['zero1'], term))}")
    c = rows["fsdp2"].counts
    lines.append(f"P={c['P']:,} per-rank shard={c['P_shard']:,} largest block={c['block']:,} root unit={c['root']:,}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Per-rank memory estimate, FSDP2 vs ZeRO-1.")
    ap.add_argument("model")
    for k, v in asdict(Parallel()).items():
        if k == "sharding":
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=v)
        else:
            ap.add_argument(flag, type=type(v), default=v)
    args = vars(ap.parse_args(argv))
    model = args.pop("model")
    print(table(model, Parallel(**args)))


if __name__ == "__main__":
    main()
