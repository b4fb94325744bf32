"""Memory estimator: per-rank bytes of a training step, term by term, at the step's peak moments.

    est = bumblebee.tools.memory.estimate("qwen3-8b", Parallel(dp=8, sharding="fsdp2", seq_len=32768))
    print(bumblebee.tools.memory.table("qwen3-8b", Parallel(dp=8)))
    python -m bumblebee.tools.memory qwen3-8b --dp 8 --sharding zero1 --seq-len 32768

State terms follow the implementations in primitives/state_sharding.py and
baselines/state_sharding.py (P parameters, n data-parallel ranks; bf16 compute):
  FSDP2   fp32 master 4P/n + fp32 grads 4P/n + Adam 8P/n = 16P/n, plus the bf16 units in flight.
  ZeRO-1  bf16 params 2P + fp32 grads 4P (both divided by PP*EP) + fp32 master and Adam 12P/n.
The recipe quotes FSDP2 as 18P/n (it counts a sharded bf16 copy too); `recipe_state` gives
that number beside ours. With EP, expert parameters are divided over the EP ranks first, then
sharded over the remaining dp/ep ranks, so every state term stays P/(PP*n) for them.

Models: Qwen3 and Qwen3-MoE (GQA), Qwen3.5 dense and MoE (hybrid), DeepSeek-V3 (MLA), with at
most one MTP depth; any other config is a ValueError naming its model type.

The peak is the largest of these moments (`Estimate.phases`):
  loss            the first loss backward (the MTP head's, with MTP): every activation the forward
                  kept, the loss buffers (with MTP also what the main head's loss keeps);
  first_block     the first block rebuilt in the backward (the MTP block, else the top layer);
  loss_after_mtp  (with MTP) the main head's loss backward, which autograd runs after the whole
                  depth's: the root's gradients and the embedding's (its MTP lookup) by then;
  last_block      the first decoder layer's backward: one layer input left, but (FSDP2) the reduced
                  gradients of every other block; ZeRO-1's fp32 gradient buffers exist throughout;
  optimizer       the step: static state and AdamW's temporaries.
FSDP2 gradients: zero_grad leaves none, and a unit's fp32 shard appears when its backward ends, so
the backward's first moments hold none and the last holds all but its own block's, the root's and
the embedding's. In flight: the root unit's bf16 parameters (kept from forward to backward) and its
bf16 gradients (accumulated until the end), the current block's parameters and gradients, the unit
prefetched next (from the backward's start: the top block, or with MTP the embedding), with MTP the
first block (prefetched by the depth's embedding lookup), and the fp32 reduce-scatter input of the
unit reduced before.

Activations, per token, from what autograd keeps in the code (primitives/, models/, fla):
  recompute: one [N, D] input per layer (MLA's lean backward caches its attention outputs only in the
  recompute, see primitives/mla.py), the attention slot's kept outputs and log-sum-exps of the first
  layers that fit `Parallel.attention_keep_bytes` (SDPA.recompute_keep_bytes), plus one rebuilt layer: its saved tensors and the
  buffers of its backward, the largest layer type; without recompute every layer's saved tensors;
  the head: the final norm's saved tensors and the loss input; the MTP depth: its two pre-fc norms
  (DeepSeek: enorm, hnorm), the concatenation and its block's input, kept until its block's backward;
  loss buffers by the cross_entropy slot (materialized: the [N, V] fp32 logits and exp it keeps, and
  the two [N, V] buffers its backward starts with; linear_ce: one fp32 vocabulary chunk and the
  [N, D] hidden gradient in fp32 and compute dtype);
  MoE dispatch: at EP = 1 the `local` twin, N*top_k routed rows (permuted input, expert hidden,
  output; for DeepSeek-V3 tensor by tensor, `_local_rows`); with EP the `chunked` primitive, which
  keeps every chunk's all-to-all buffers until its backward ends (`_chunked_dispatch`; under the
  models' recompute its fused recompute saves the rows' routing weights instead of the combined
  outputs: `Parallel.moe_fused_recompute`). Layers: GQA (Qwen3; with eager chains 2 x saved), Qwen3.5's
  gated attention and gated DeltaNet (fla), and DeepSeek-V3's MLA (the `mla` slot's default, flash, with
  its lean backward) with a dense SwiGLU or the MoE (router, aux-free router, shared experts), tensor by
  tensor, the layer's peak being its MoE/MLP backward (everything saved still alive) or its attention's
  backward.
Routing is taken as balanced (each rank receives N*top_k rows).

Context parallelism (`Parallel.cp`, primitives/context_parallel/): `seq_len` is the whole sequence's and
each rank holds seq_len / cp of its tokens, so every per-token activation term divides by cp; `dp`
stays the ranks the state is sharded over (FSDP2 over the whole (dp, cp) mesh: dp x cp of them). Per
attention layer the exchange adds what grows with the whole sequence (`_cp_attention`): all-gather
keeps the gathered K/V repeated to the query heads for the fused kernel and, in the backward, their
gradients (MLA: the gathered latent, and one key chunk's expanded K/V at a time); the ring
only blocks of T / cp. The DeltaNet rule carries Dk more value columns (`_cp_deltanet`); its conv keeps
fp32 copies off CUDA only (on CUDA the halo rows run fla's conv in the compute dtype, as the single
layer's: the estimate of the Qwen3.5 slice at CP = 4 fell from 24% over the measured peak at 1536K to
5%); on fla's own CP kernels (`cp_deltanet="fla"`) it carries neither: the layer is the single one on
T / cp tokens plus the chain's gathered maps (`_cp_deltanet_fla`).
"""
from __future__ import annotations

import argparse
import functools
import json
from dataclasses import asdict, dataclass, field

import torch

from bumblebee.primitives.attention import SDPA
from bumblebee.primitives.cross_entropy import MIN_CHUNK_COLUMNS, LinearCE
from bumblebee.primitives.mla import FlashMLAConfig

# linear_ce's lean path at its default options: one fp32 logit chunk of workspace_bytes, at least
# MIN_CHUNK_COLUMNS wide (the chunk grows past the workspace beyond 32K tokens)
LINEAR_CE_WORKSPACE = LinearCE.workspace_bytes
LINEAR_CE_MIN_COLUMNS = MIN_CHUNK_COLUMNS
FLA_CHUNK = 64                   # fla's chunk_gated_delta_rule chunk size (its A is [T, H_v, 64])
_BYTES = {"bf16": 2, "fp32": 4}
MOMENTS = ("loss", "first_block", "loss_after_mtp", "last_block")  # the backward's, in time order
_FAMILIES = {"qwen3": "gqa", "qwen3_moe": "gqa", "qwen3_5_text": "hybrid", "qwen3_5_moe_text": "hybrid",
             "deepseek_v3": "mla"}  # model_type -> the layers' terms


@dataclass
class Parallel:
    dp: int = 1                   # data-parallel ranks the state is sharded over (n)
    pp: int = 1                   # pipeline stages (layers split evenly)
    ep: int = 1                   # expert-parallel ranks (divides dp)
    cp: int = 1                   # context-parallel ranks one sequence is sharded over (divides dp)
    cp_exchange: str = "allgather"  # how cp attention gets the other ranks' K/V: "allgather" | "ring"
    cp_block_keys: int = 65536    # all-gather: the most keys a fused block takes (ContextParallel's
                                  # allgather_block_keys; 0: a piece's earlier keys in one block)
    cp_deltanet: str = "maps"     # ContextParallel.deltanet: "maps" (widened rule; fp32 conv off CUDA) | "fla";
                                  # its default "auto" runs fla where fla 0.6 serves: "maps" bounds it above
    sharding: str = "fsdp2"       # "fsdp2" | "zero1"
    mixed_precision: str = "bf16"  # compute dtype: "bf16" | "fp32"
    micro_batch: int = 1
    seq_len: int = 4096
    recompute: bool = True
    loss: str = "linear_ce"       # "linear_ce" | "materialized_ce"
    reshard_after_forward: bool = True
    device: str = "cuda"          # "cuda": AdamW fused (or foreach, see adamw); "cpu": its per-tensor path
    adamw: str = "fused"          # on CUDA: "fused" (the state-sharding twins' optimizer: no temporaries)
                                  # or "foreach" (torch's default; results measured before fused AdamW)
    moe_fused_recompute: bool = True  # ChunkedDispatch.fused_recompute under the models' recompute
    moe_dispatch: str = "chunked"  # at EP = 1: "chunked" (its grouped path under the fused recompute) or
                                   # "local" (the twin's rows; also runs measured before that path)
    moe_group_rows: int = 65536    # ChunkedDispatch.group_rows
    compiled_norms: bool = True    # RMSNorm and RoPE compiled (bumblebee.fused); Qwen3.5's chains too (its
                                   # zero-centred and gated norms, q/k norm + RoPE); False for runs before it
    mla_fused_rope: bool = FlashMLAConfig.fused_rope  # the mla slot's flash option fused_rope (on CUDA)
    attention_keep_bytes: int = SDPA.recompute_keep_bytes  # the attention slot's budget of outputs kept
                                                           # through the recompute (0 for runs before it)


@dataclass
class Estimate:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    unsharded_units: int = 0      # units in flight at the last block's backward (FSDP2), a gradient (ZeRO-1)
    activations: int = 0          # kept until the loss backward: layer inputs (recompute; without it
                                  # all saved tensors), the final norm's tensors, the loss input
    mtp_activations: int = 0      # kept by the MTP depth until its block's backward
    layer_working: int = 0        # one layer's peak during its backward beyond the kept activations,
                                  # the dispatch's buffers apart
    loss_buffers: int = 0         # cross-entropy buffers during a loss backward (its saved tensors included)
    moe_dispatch: int = 0         # the dispatch's buffers at that peak (inside the layer's peak)
    cp_buffers: int = 0           # context parallelism: one attention layer's exchange buffers (inside
                                  # the layer's peak), growing with the whole sequence under all-gather
    optimizer_step: int = 0       # transients of the step: reduced grad shards, AdamW temporaries
    recipe_state: int = 0
    phases: dict = field(default_factory=dict)  # moment -> bytes (see the module docstring)
    counts: dict = field(default_factory=dict)

    @property
    def static(self) -> int:
        """Parameters, gradients and optimizer state: what lives across steps (grads at the step)."""
        return self.params + self.grads + self.optimizer

    @property
    def backward_peak(self) -> int:
        return max((v for k, v in self.phases.items() if k != "optimizer"), default=0)

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)


def _model_on_meta(config):
    """(the model on the meta device, its config); built once per config (the estimator only reads
    them, and a recipe search estimates one model at many layouts and lengths)."""
    return _meta_build(config if isinstance(config, str) else ("json", json.dumps(config, sort_keys=True)))


@functools.lru_cache(maxsize=4)
def _meta_build(key):
    from bumblebee import models  # lazy: the core does not need the models to import
    hf = models._hf_config(key if isinstance(key, str) else json.loads(key[1]))
    cls = models._model_class(hf)
    cfg = cls.config_class.from_hf(hf)
    with torch.device("meta"):
        model = cls(cfg, None)
    model.tie_weights()
    return model, cfg


def _family(cfg) -> str:
    """The layer terms for this config; a ValueError naming the model type where the estimator has none."""
    kind = getattr(cfg, "model_type", type(cfg).__name__)
    if kind not in _FAMILIES:
        raise ValueError(f"the memory estimator cannot model model_type {kind!r}; it models {sorted(_FAMILIES)}")
    return _FAMILIES[kind]


def _mtp_depth(cfg) -> int:
    """MTP depths (Qwen3.5's mtp_num_hidden_layers, DeepSeek's num_nextn_predict_layers); the moments model one."""
    depth = getattr(cfg, "mtp_num_hidden_layers", 0) or getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if depth > 1:
        raise ValueError(f"the memory estimator models at most one MTP depth; this {cfg.model_type} config has "
                         f"{depth}")
    return depth


def _is_expert(name: str) -> bool:
    return ".experts." in name


# ---- activations: bytes per token ----------------------------------------------------------------

def _gqa_attention(cfg, b: int, compiled: bool = False) -> int:
    """What one GQA decoder layer's attention part keeps for its backward (Qwen3; SDPA without a [T, T]
    matrix): the input and normed input, q/k/v, the attention output and o_proj's output.
    compiled: RMSNorm and RoPE as `bumblebee.fused` compiles them on CUDA: the norms keep their input
    and rsqrt (no fp32 copy), RoPE keeps nothing, so q and k are kept twice (the projection, the norm's
    input; the rotated rows, SDPA's) instead of three times."""
    d, dh = cfg.hidden_size, cfg.head_dim
    qk, v = (cfg.num_attention_heads + cfg.num_key_value_heads) * dh, cfg.num_key_value_heads * dh
    fp32_copy = 0 if compiled else 4 * d
    return (2 * d * b + fp32_copy     # input, normed input; the fp32 copy inside eager RMSNorm
            + ((2 if compiled else 3) * qk + (1 if compiled else 3) * v) * b  # q/k/v: projected, normed, rotated
            + cfg.num_attention_heads * dh * b + d * b)  # attention output, o_proj output


def _gqa_mlp(cfg, b: int, compiled: bool = False) -> int:
    """What one GQA decoder layer's MLP part keeps beyond the dispatch's rows: the post-attention norm's
    input and output (and eager RMSNorm's fp32 copy), then the router's saved tensors (`_moe_router`) or
    the dense SwiGLU's gate, up, silu and product."""
    d = cfg.hidden_size
    norm = 2 * d * b + (0 if compiled else 4 * d)
    return norm + (_moe_router(cfg, b) if getattr(cfg, "num_experts", 0) else 4 * cfg.intermediate_size * b)


def _gqa_attention_backward(cfg, b: int) -> int:
    """SDPA's backward (FlashAttention and cuDNN alike): the output gradient, dq/dk/dv and an fp32 dq
    accumulator, plus fp32 log-sum-exp-sized row terms."""
    H, K, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return b * H * dh + b * (H + 2 * K) * dh + 4 * H * dh + 8 * H


def _gqa_layer(cfg, b: int, dispatch: tuple[int, int], recompute: bool, compiled: bool = False) -> tuple[int, int]:
    """(saved, peak) bytes per token of one Qwen3 / Qwen3-MoE decoder layer. Compiled chains (CUDA), as
    `_hybrid_layer` counts Qwen3.5's: the MLP's backward runs first with every saved tensor alive, then
    the attention's with the MLP's tensors freed; the layer output's gradient and the MLP input's
    accumulating one throughout. Eager chains (the CPU): their backward's temporaries taken as large as
    the layer's saved tensors (the rule the CPU tracker's runs fit)."""
    d = cfg.hidden_size
    attn, mlp = _gqa_attention(cfg, b, compiled), _gqa_mlp(cfg, b, compiled) + dispatch[0]
    saved = attn + mlp
    if not compiled:
        return saved, saved + max(saved - dispatch[0] if recompute else 0, dispatch[1])
    if getattr(cfg, "num_experts", 0):
        mlp_bwd = dispatch[1]
    else:
        mlp_bwd = 3 * cfg.intermediate_size * b + b * d  # the SwiGLU's gradients, dx
    peak = max(saved + mlp_bwd, attn + _gqa_attention_backward(cfg, b)) + 2 * b * d
    return saved, peak - (saved if not recompute else 0)


def _rms_norm(d: int, b: int) -> int:
    """bumblebee.norms.RMSNorm: the fp32 input and the normed rows in compute dtype (the weight's operand)."""
    return 4 * d + b * d


def _zc_norm(d: int, b: int, compiled: bool = False) -> int:
    """Qwen3.5's zero-centred RMSNorm computes in fp32. Eager it keeps two [*, d] fp32 tensors: the
    input's fp32 copy (the input itself when computing in fp32) and the normalized rows (the (1 + w)
    operand). Compiled (models/qwen3_5.py on CUDA) it keeps its input in compute dtype and the fp32
    rsqrt of each row (what torch.compile's partitioner saves: 2 bytes an element plus 4 a row in bf16)."""
    if compiled:
        return b * d + 4
    return 8 * d if b < 4 else 4 * d


def _gated_attention(cfg, b: int, compiled: bool = False) -> int:
    """Qwen3.5 full-attention mixer (models/qwen3_5.py GatedAttention, SDPA) beyond its normed input."""
    H, K, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # q/k norms: eager, the fp32 rows and rsqrt; compiled with the partial RoPE, the input and rsqrt
    qk_norms = b * (H + K) * dh if compiled else _zc_norm(H * dh, b) + _zc_norm(K * dh, b)
    return (qk_norms + 4 * (H + K)
            + b * (H + 2 * K) * dh           # rotated q and k, v: SDPA's inputs
            + b * H * dh + 4 * H             # SDPA's output and log-sum-exp
            + 3 * b * H * dh                 # output copied to [T, H*dh], sigmoid(gate), gated product
            + 2 * b * cfg.rotary_dim)        # cos, sin


def _gated_attention_backward(cfg, b: int) -> int:
    """SDPA's backward: output gradient, dq/dk/dv and an fp32 dq accumulator."""
    H, K, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return b * H * dh + b * (H + 2 * K) * dh + 4 * H * dh


def _deltanet(cfg, b: int, compiled: bool = False) -> int:
    """Gated DeltaNet mixer (primitives/linear_attention.py on fla) beyond its normed input."""
    Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    key, value = Hk * dk, Hv * dv
    # eager: fp32 o and z, normed o, w * o, silu(z) in fp32; compiled (bumblebee/norms.py on CUDA): o and z
    # in compute dtype, the rsqrt
    gated_norm = (2 * b * value if compiled else (12 + 2 * b) * value) + 4 * Hv
    return (b * Hv + 8 * Hv                  # beta (sigmoid output); softplus input and output (fp32)
            + b * (2 * key + value)          # causal_conv1d keeps its input, the qkv projection
            + b * (2 * key + value)          # chunk_gated_delta_rule: l2-normed q and k, contiguous v
            + b * Hv * FLA_CHUNK + 4 * Hv + 8 * Hk  # its A [T, H_v, 64], fp32 cumulative gate, q/k rstd
            + gated_norm                     # GatedRMSNorm's saved tensors
            + b * value)                     # out_proj's input


def _deltanet_backward(cfg, b: int) -> int:
    """fla's chunk_gated_delta_rule backward at its fullest (prepare_wy_repr_bwd): the output gradient, the
    recomputed w, u, v_new and per-chunk states h [T/64, H_v, d_k, d_v], their gradient dh, two dv, dq,
    dk, dw, and dk at H_v heads before its sum (all in compute dtype; fla saves no state in the forward)."""
    Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    return b * (Hv * dv + 3 * Hv * dk + 4 * Hv * dv + 2 * Hv * dk * dv // FLA_CHUNK + 3 * Hk * dk)


def _moe_router(cfg, b: int) -> int:
    """The fused softmax router's saved logits (compute dtype), its top-k indices (int64) and weights."""
    return b * cfg.num_experts + (8 + b) * cfg.num_experts_per_tok


def _shared_expert(cfg, b: int) -> int:
    """Qwen3.5's shared expert: SwiGLU (gate, silu, up, product) and its sigmoid gate with the output it
    scales. Its backward runs before the dispatch's (created after it) and frees these."""
    s = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    return 4 * s * b + b * cfg.hidden_size + b if s else 0


def _hybrid_layer(cfg, layer_type: str, b: int, dispatch: tuple[int, int], recompute: bool,
                  compiled: bool = False) -> tuple[int, int]:
    """(saved, peak) bytes per token of one Qwen3.5 decoder layer: what its forward saves (its input
    apart; dispatch rows included), and its peak during the backward beyond what is kept without
    recompute. dispatch = (saved, backward) bytes per token of the MoE dispatch (0, 0 for dense);
    compiled: its elementwise chains compiled (CUDA)."""
    d = cfg.hidden_size
    if layer_type == "linear_attention":
        mixer, mixer_bwd = _deltanet(cfg, b, compiled), _deltanet_backward(cfg, b)
    else:
        mixer, mixer_bwd = _gated_attention(cfg, b, compiled), _gated_attention_backward(cfg, b)
    front = _zc_norm(d, b, compiled) + b * d + mixer           # input norm, its output (the projections' input), mixer
    if getattr(cfg, "num_experts", 0):
        mlp = _moe_router(cfg, b) + _shared_expert(cfg, b) + dispatch[0]
        mlp_bwd = dispatch[1] - _shared_expert(cfg, b)
    else:
        f = cfg.intermediate_size
        mlp, mlp_bwd = 4 * f * b, 3 * f * b + b * d  # gate, silu, up, product; their gradients, dx
    saved = front + _zc_norm(d, b, compiled) + b * d + mlp      # post norm, its output
    grads = 2 * b * d  # the layer output's gradient (held for the residual), the MLP input's accumulating one
    # the MLP's backward runs first with every saved tensor alive; then the mixer's, the MLP's freed
    peak = max(saved + mlp_bwd, front + mixer_bwd) + grads
    return saved, peak - (saved if not recompute else 0)


def _chunk_spec(n_tok: int, ep: int) -> tuple:
    """Relative chunk sizes the chunked dispatch uses at n_tok tokens per rank (its default)."""
    from bumblebee.primitives import moe_dispatch_options as mo  # lazy, like the models
    config = mo.ChunkedDispatch()
    spec, auto = mo.chunk_spec(config.chunks)
    return spec if not auto or n_tok >= mo.min_tokens(config, ep) else (1,)


def _grouped_dispatch(cfg, n_tok: int, b: int, group_rows: int) -> tuple[int, int]:
    """(saved, backward) bytes per token of primitives/moe_dispatch_local.py (one rank under the fused
    recompute). Saved: the int64 order and inverse and the [E] counts, nothing per routed row. Backward:
    the [N, D] fp32 input gradient, fp32 sorted weights and gw, the int64 token ids, and one expert
    group's rows at once: x, fc1's h [2I], g, the fc2 dgrad [I], w a [I], dh [2I] and dx (added into the
    input gradient in place by add_group_copies); then the input gradient's compute-dtype copy."""
    d, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    rows = min(k * n_tok, group_rows + k * n_tok // max(1, _num_experts(cfg)))  # an expert is never split
    group = rows * (b * (3 * d + 6 * i) + 8) // max(1, n_tok)  # + the group's int64 token ids
    cast = b * d if b < 4 else 0
    return 16 * k, 24 * k + 4 * d + max(group, cast)


def _chunked_dispatch(cfg, n_tok: int, b: int, ep: int, fused: bool = False) -> tuple[int, int, bool]:
    """(saved, backward) bytes per token of primitives/moe_dispatch.py at its backward's fullest, and
    whether it splits the tokens into several chunks. Rows per rank: R = N * top_k sent and received.
    Saved: each chunk's expert input rows x_e, expert hidden h [R, 2I] and combine output y [R, D]
    (`fused`, its fused recompute: the rows' fp32 routing weights instead of y).
    Backward (kept by the schedule until its end): the combine-backward all-to-all (send and receive),
    each chunk's wgrad inputs (g_e, a [R, I], dh [R, 2I]), the dispatch-backward all-to-all (send and
    receive), the last chunk's dx, the [N, D] input gradient; int64 permutations and fp32 weight grads."""
    d, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    spec = _chunk_spec(n_tok, ep)
    last = max(spec) / sum(spec)
    saved = k * (b * (d + 2 * i) + (4 if fused else b * d)) + 32 * k
    backward = k * b * (5 * d + 3 * i + last * d) + b * d + 14 * k
    return saved, int(backward), len(spec) > 1


def _local_dispatch(cfg, b: int) -> int:
    """baselines/moe_dispatch.py local: N*top_k routed rows (permuted input, expert hidden, output)."""
    return cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * cfg.moe_intermediate_size) * b


# ---- DeepSeek-V3: MLA, dense and MoE layers (models/deepseek_v3.py) --------------------------------

def _norm_kept(n: int, b: int, input_kept: bool) -> int:
    """What bumblebee.norms.RMSNorm keeps beyond its input: the fp32 input (the input itself in fp32, counted
    by whoever keeps it when input_kept), the fp32 rsqrt and the normed rows in compute dtype."""
    return (0 if input_kept and b == 4 else 4 * n) + 4 + b * n


def _mla(cfg, b: int) -> int:
    """FlashMLA (primitives/mla.py, the `mla` slot's default) with its lean backward (on by default) beyond
    its normed input: the q latent (q_a_layernorm's tensors and its output), the kv_a projection (the rope
    key, a view, keeps all of it), kv_a_layernorm's tensors and output, SDPA's output (o_proj's input is a
    view of it) and fp32 log-sum-exp. Per-head q, k, v are not kept: the backward recomputes them."""
    H, r, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = 0 if cfg.q_lora_rank is None else _norm_kept(cfg.q_lora_rank, b, False) + b * cfg.q_lora_rank
    return q + b * (r + R) + _norm_kept(r, b, True) + b * r + b * H * cfg.v_head_dim + 4 * H


def _mla_backward(cfg, b: int, fused_rope: bool) -> int:
    """The lean backward's recompute and SDPA's backward: per-head q and k assembled (with the torch RoPE
    path also the q projection, which the rotation keeps), the kv_b projection (v is a view of it), the
    output gradient, dq, dk, dv and an fp32 dq accumulator."""
    H, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    recomputed = b * H * ((2 if fused_rope else 3) * qk + dn + dv)
    return recomputed + b * H * dv + b * H * (2 * qk + dv) + 4 * H * qk


def _aux_free_router(cfg, b: int) -> int:
    """DeepSeek-V3's router (router slot aux_free): its logits [E] (the fused kernel keeps them for its
    backward; the torch path keeps the fp32 sigmoid scores), top-k indices (int64) and weights (fp32)."""
    return b * cfg.n_routed_experts + 12 * cfg.num_experts_per_tok


def _local_rows(cfg, b: int, n_tok: int, loop: bool) -> tuple[int, int]:
    """(saved, backward) bytes per token of baselines/moe_dispatch.py local, tensor by tensor. Saved: the
    permuted input [K, D], the experts' gate-up output [K, 2I] (silu's and the product's operand), silu's
    output and the product [K, I] each, the output rows [K, D] and the int64 order and inverse (Unpermute).
    Backward beyond them at its fullest: the un-permute's gathered gradient and its product with the rows
    ([K, D] each, fp32 weight gradient); or, when GroupedExperts loops over its experts (off
    torch._grouped_mm: CPU, fp32), later, the output rows freed, each expert's weight gradient arriving as
    a full-size select_backward added to the sum: two more [E, 2I, D] at once."""
    d, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    unpermute = k * (2 * b * d + 4)
    wgrad = 2 * b * _num_experts(cfg) * 2 * i * d // max(1, n_tok) - k * b * d if loop else 0
    return k * (b * (2 * d + 4 * i) + 16), max(unpermute, wgrad)


def _mla_layer(cfg, moe: bool, b: int, dispatch: tuple[int, int], recompute: bool,
               fused_rope: bool) -> tuple[int, int]:
    """(saved, peak) bytes per token of one DeepSeek-V3 decoder layer, as `_hybrid_layer` counts them:
    MLA, then a dense SwiGLU (the first `first_k_dense_replace` layers) or the MoE (router, dispatch, shared
    experts). dispatch = (saved, backward) bytes per token of the MoE dispatch."""
    d = cfg.hidden_size
    # input norm (its input is the kept layer input), its output (the latent projections' input), MLA
    front = _norm_kept(d, b, True) + b * d + _mla(cfg, b)
    if moe:
        s = cfg.moe_intermediate_size * cfg.n_shared_experts  # shared experts: SwiGLU, no gate
        mlp = _aux_free_router(cfg, b) + 4 * s * b + dispatch[0]
        mlp_bwd = dispatch[1] - 4 * s * b  # the shared experts' backward runs first and frees theirs
    else:
        f = cfg.intermediate_size
        mlp, mlp_bwd = 4 * f * b, 3 * f * b + b * d  # gate, silu, up, product; their gradients, dx
    saved = front + _norm_kept(d, b, False) + b * d + mlp  # post norm (its input, the residual sum, not kept), output
    grads = 2 * b * d  # the layer output's gradient (held for the residual), the MLP input's accumulating one
    # the MLP's backward runs first with every saved tensor alive; then the attention's, the MLP's freed
    peak = max(saved + mlp_bwd, front + _mla_backward(cfg, b, fused_rope)) + grads
    return saved, peak - (saved if not recompute else 0)


# ---- state: FSDP2 units ---------------------------------------------------------------------------

def _param_groups(model, ep: int, pp: int) -> dict:
    """Parameter counts this rank holds before data-parallel sharding: dense and expert totals (layers
    divided over the pp stages), per decoder block (experts / ep), the root unit, the untied embedding."""
    dense = expert = 0
    unit, unit_dense = {}, {}
    for name, p in model.named_parameters():
        k = p.numel()
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            unit[i] = unit.get(i, 0) + (k // ep if _is_expert(name) else k)
            if not _is_expert(name):
                unit_dense[i] = unit_dense.get(i, 0) + k
            k = k / pp
        if _is_expert(name):
            expert += k / ep
        else:
            dense += k
    cfg = model.config
    embed = 0 if cfg.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    # the root unit: everything outside the blocks and the untied embedding; under EP every experts
    # module (the MTP block's too) is a unit of its own
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("model.layers.")
               and not (name.startswith("model.embed_tokens") and embed) and not (ep > 1 and _is_expert(name)))
    block = max(unit.values()) if unit else 0
    largest_block = max(unit, key=unit.get) if unit else None
    return {"dense": dense, "expert": expert, "block": block,
            "block_dense": unit_dense.get(largest_block, 0), "block_expert": block - unit_dense.get(largest_block, 0),
            "layer0": unit.get(0, 0), "layer0_dense": unit_dense.get(0, 0),
            "root": root, "embed": embed, "head": model.lm_head.weight.numel()}


def _fsdp2_units(g: dict, b: int, n: int, ep: int, mtp: bool, all_blocks: int, loss: str) -> dict:
    """FSDP2 bytes besides the persistent state at the backward moments: the fp32 gradient shards already
    reduced, and the units in flight. all_blocks: the other blocks kept unsharded
    (reshard_after_forward=False), else 0."""
    def shard(dense, expert=0):  # this rank's fp32 shard of a unit
        return dense / n + expert / (n // ep)
    p_shard = shard(g["dense"], g["expert"])
    block, embed, root = g["block"], g["embed"], g["root"]
    reduced = 4 * (p_shard - shard(g["block_dense"], g["block_expert"]) - shard(root) - shard(embed))
    current = 2 * b * block + b * all_blocks      # a block's bf16 parameters and their bf16 gradients
    # the unit prefetched next: at the loss, the root's pre-backward all-gathers the last unit the forward
    # used (the top block; with MTP the embedding, for the depth's lookup); at the first rebuilt block the
    # block below the top layer, or before the MTP block FSDP2's implicit prefetch, the embedding again
    prefetched = b * (embed if mtp else block)
    # with MTP, the depth's embedding lookup runs the embedding's forward again, and with it its forward
    # prefetch of the first block (its dense part under EP); nothing uses that before the first layer's
    # backward (where it is the current block)
    stray = b * (g["layer0_dense"] if ep > 1 else g["layer0"]) if mtp and embed and not all_blocks else 0
    units = {
        # root parameters; the head's bf16 gradient where linear_ce writes it during its backward
        # (materialized_ce computes it after its [N, V] buffers are gone)
        "loss": b * (root + all_blocks + (g["head"] if loss == "linear_ce" else 0)) + prefetched + stray,
        # root parameters, the head's gradient, the unit prefetched next, the current block's parameters
        # and gradients; the MTP block lives in the root unit (its parameters counted there): its
        # gradients, and under EP its experts (a unit of their own) unsharded
        "first_block": b * (root + g["head"]) + prefetched + stray
        + (b * block + (b * g["block_expert"] if ep > 1 else 0) + b * all_blocks if mtp else current),
        # root parameters and gradients; the embedding's parameters (and, after the MTP lookup's backward,
        # its gradient); the fp32 reduce-scatter input of the unit reduced before (under EP the blocks'
        # dense part: the experts are their own units)
        "last_block": 2 * b * root + current + b * embed * (2 if mtp else 1)
        + 4 * (g["block_dense"] if ep > 1 else block),
        "reduced": reduced,
    }
    if mtp:  # the main head's loss backward, after the MTP depth's: root parameters and gradients (head
        # and MTP depth), the embedding's parameters and gradient (its MTP lookup), the top block prefetched
        units["loss_after_mtp"] = 2 * b * root + 2 * b * embed + b * block + b * all_blocks + stray
    return units


def _loss_buffers(loss: str, n_tok: int, v: int, d: int, b: int) -> int:
    """A head's loss backward at its fullest (its saved tensors included)."""
    if loss == "materialized_ce":
        # the fp32 logits and their exp, kept from the forward (`_loss_saved`), and the first two [N, V]
        # fp32 buffers of the backward: the gather's gradient (zeros, then scatter_add)
        return int(n_tok * v * 16)
    # one fp32 vocabulary chunk (at least LINEAR_CE_MIN_COLUMNS wide), the fp32 [N, D] hidden gradient
    # and its compute-dtype copy (the Triton path on CUDA; the CPU path of primitives/cross_entropy.py
    # holds several chunk-sized temporaries)
    cols = min(v, max(LINEAR_CE_MIN_COLUMNS, LINEAR_CE_WORKSPACE // max(1, 4 * n_tok) // 256 * 256))
    return int(4 * n_tok * cols + n_tok * d * (4 + (b if b < 4 else 0)))


def _loss_saved(loss: str, n_tok: int, v: int) -> int:
    """What a head's loss keeps from its forward to its backward beyond the head's per-token tensors: with
    materialized_ce the fp32 logits (the gather's input) and their exp; linear_ce only per-token statistics."""
    return n_tok * v * 8 if loss == "materialized_ce" else 0


def _check(par: Parallel) -> None:
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
    if not isinstance(par.cp, int) or par.cp < 1 or par.dp % par.cp:
        raise ValueError(f"cp must be a positive int dividing dp (the ranks the state is sharded over, dp x cp of "
                         f"the mesh), got cp={par.cp!r}, dp={par.dp}")
    if par.seq_len % (2 * par.cp):
        raise ValueError(f"seq_len={par.seq_len} must be divisible by 2 x cp = {2 * par.cp} (pad the sequence)")
    if par.cp_exchange not in ("allgather", "ring"):
        raise ValueError(f"cp_exchange {par.cp_exchange!r} not supported; accepted: ['allgather', 'ring']")
    if par.cp_deltanet not in ("maps", "fla"):
        raise ValueError(f"cp_deltanet {par.cp_deltanet!r} not supported; accepted: ['maps', 'fla']")


def _state_terms(est: Estimate, model, g: dict, par: Parallel, b: int, mtp: bool) -> tuple[dict, dict]:
    """Fills the state terms of `est`; returns (units in flight, gradients present) per backward moment."""
    n, ep = par.dp, par.ep
    p_rank = g["dense"] + g["expert"]         # parameters on this rank before data-parallel sharding
    p_shard = g["dense"] / n + g["expert"] / (n // ep)  # this rank's shard
    largest = max(p.numel() // (ep if _is_expert(name) else 1) for name, p in model.named_parameters())
    # AdamW's temporaries: fused (CUDA) none, foreach one fp32 list as large as the shard; the
    # per-tensor path (CPU) one tensor as large as the largest parameter shard
    if par.adamw not in ("fused", "foreach"):
        raise ValueError(f"adamw must be 'fused' or 'foreach', got {par.adamw!r}")
    adam_temp = 4 * (p_shard if par.adamw == "foreach" else 0) if par.device == "cuda" else 4 * largest / n
    if par.sharding == "fsdp2":
        est.params, est.grads, est.optimizer = int(4 * p_shard), int(4 * p_shard), int(8 * p_shard)
        local_layers = -(-model.config.num_hidden_layers // par.pp)
        others = 0 if par.reshard_after_forward else (local_layers - 1) * g["block"]
        units = _fsdp2_units(g, b, n, ep, mtp, others, par.loss)
        grads_at = {"loss": 0, "first_block": 0, "loss_after_mtp": 0, "last_block": units.pop("reduced")}
        est.optimizer_step = int(adam_temp)
        est.recipe_state = int(18 * p_shard)
    else:
        est.params, est.grads, est.optimizer = int(b * p_rank), int(4 * p_rank), int(12 * p_shard)
        # a parameter's own gradient before the hook adds it to the fp32 buffers (which exist throughout)
        units = dict.fromkeys(MOMENTS, b * largest)
        if par.loss != "linear_ce":  # materialized_ce's first gradient comes after its [N, V] buffers are gone
            units["loss"] = 0
        grads_at = dict.fromkeys(units, est.grads)
        # the reduce-scattered gradient shards, then AdamW's temporaries or the compute-dtype copies
        # of the updated shards sent to the all-gather
        est.optimizer_step = int(4 * p_shard + max(adam_temp, b * p_shard if b < 4 else 0))
        est.recipe_state = int(6 * p_rank + 12 * p_shard)
    est.unsharded_units = int(units["last_block"])
    est.counts = {"P": int(sum(p.numel() for p in model.parameters())), "P_rank": int(p_rank),
                  "P_shard": int(p_shard), "block": int(g["block"]), "root": int(g["root"])}
    return units, grads_at


def _cp_attention(cfg, family: str, b: int, par: Parallel) -> int:
    """Bytes of one attention layer's context-parallel exchange at its backward (0 at cp = 1).
    all-gather (primitives/context_parallel/flash.py): the gathered K/V [T, K, dh] and their fp32
    gradient accumulators, T the whole sequence, and the largest block's keys (at most `cp_block_keys`,
    else up to T) repeated to the query heads, the kernel's K/V gradients for them and one fp32 copy
    of a gradient to fold; MLA (primitives/context_parallel/mla_blocks.py, its default latent exchange): the
    gathered latent and rope key (saved) and their fp32 gradient, one key chunk (T / (2 cp)) expanded at
    a time (kv_b_proj's output, k and v padded to one head size, their fp32 gradients) and the local
    tokens' fp32 merged output. ring: two K/V blocks of
    T / cp in flight, the held one repeated to H heads, and fp32 dK/dV accumulators (held, in flight)."""
    if par.cp == 1:
        return 0
    T = par.micro_batch * par.seq_len
    H = cfg.num_attention_heads
    if family == "mla":
        r, R, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = cfg.qk_nope_head_dim + R
        chunk_key = H * (b * (cfg.qk_nope_head_dim + v) + 2 * b * max(qk, v) + 4 * (qk + v))
        return T * (b + 4) * (r + R) + T // (2 * par.cp) * chunk_key + T // par.cp * 4 * H * v
    K, dh = cfg.num_key_value_heads, cfg.head_dim
    if par.cp_exchange == "allgather":
        keys = min(par.cp_block_keys or T, T)
        return T * (b + 4) * 2 * K * dh + keys * (4 * b + 4) * H * dh
    return T // par.cp * (4 * b * K * dh + 2 * b * H * dh + 2 * 8 * K * dh)


def _cp_attention_saved(cfg, family: str, b: int, par: Parallel) -> int:
    """Bytes one attention layer's exchange keeps for its backward beyond the local tokens' tensors:
    the all-gather's gathered K/V (MLA: latent and rope key), the ring nothing (its blocks travel again)."""
    T = par.micro_batch * par.seq_len
    if par.cp == 1 or (par.cp_exchange == "ring" and family != "mla"):
        return 0
    if family == "mla":
        return T * b * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return T * b * 2 * cfg.num_key_value_heads * cfg.head_dim


def _cp_deltanet(cfg, b: int, fp32_conv: bool) -> tuple[int, int]:
    """(saved, backward) bytes per token the context-parallel DeltaNet adds (primitives/context_parallel/
    gdn.py): the rule's values and output widened by Dk columns (and their share of fla's backward, as
    `_deltanet_backward` counts the value columns); with `fp32_conv` (`halo_conv_silu`: off CUDA, and
    packed shards) the conv's fp32 input copy and output. On CUDA unpacked shards run fla's conv in the
    compute dtype over [halo | chunk] rows (`halo_conv_rows`), which replace the single layer's conv input."""
    Hv, dk = cfg.linear_num_value_heads, cfg.linear_key_head_dim
    conv = 2 * cfg.linear_num_key_heads * dk + Hv * cfg.linear_value_head_dim
    return 2 * b * Hv * dk + (8 * conv if fp32_conv else 0), b * (5 * Hv * dk + 2 * Hv * dk * dk // FLA_CHUNK)


def _cp_deltanet_fla(cfg, cp: int) -> int:
    """Bytes (per layer, not per token) fla's CP kernels add at once: every part's state map
    [HV, Dk, Dv + Dk] fp32 all-gathered (2 cp parts; the backward's chain the same again)."""
    Hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return 2 * (2 * cp) * Hv * dk * (dv + dk) * 4


def _num_experts(cfg) -> int:
    return getattr(cfg, "num_experts", 0) or getattr(cfg, "n_routed_experts", 0)


def _mla_fused_rope(par: Parallel) -> bool:
    """Whether FlashMLA assembles q and k with the fused Triton kernel (on CUDA, option fused_rope)."""
    return par.device == "cuda" and par.mla_fused_rope


def _activation_terms(est: Estimate, cfg, g: dict, par: Parallel, b: int, mtp: bool) -> dict:
    """Fills the activation terms of `est`; returns the activation bytes at each backward moment."""
    n_tok, d, ep = par.micro_batch * par.seq_len // par.cp, cfg.hidden_size, par.ep
    family = _family(cfg)
    dispatch, wgrad_extra = (0, 0), 0
    if _num_experts(cfg) and ep == 1 and par.moe_dispatch == "chunked" and par.recompute and par.moe_fused_recompute:
        dispatch = _grouped_dispatch(cfg, n_tok, b, par.moe_group_rows)
    elif _num_experts(cfg) and ep > 1:  # the chunked expert-parallel primitive
        saved_d, bwd_d, chunked = _chunked_dispatch(cfg, n_tok, b, ep, par.recompute and par.moe_fused_recompute)
        dispatch = (saved_d, bwd_d)
        # several chunks: one more expert-weight-sized bf16 wgrad before its add
        wgrad_extra = b * g["block_expert"] if chunked else 0
    elif _num_experts(cfg) and family == "mla":
        grouped = par.device == "cuda" and b == 2 and d % 8 == 0 and cfg.moe_intermediate_size % 8 == 0
        dispatch = _local_rows(cfg, b, n_tok, loop=not grouped)  # GroupedExperts' grouped_mm condition
    elif _num_experts(cfg):
        dispatch = (0, _local_dispatch(cfg, b))
    local_layers = -(-cfg.num_hidden_layers // par.pp)
    if family == "hybrid":  # Qwen3.5: per layer type, (saved, peak) per token
        types = list(cfg.layer_types)[:local_layers]
        first_type = "full_attention" if mtp else types[-1]  # Qwen3.5's MTP block: full attention
        compiled = par.device == "cuda" and par.compiled_norms
        per_type = {t: _hybrid_layer(cfg, t, b, dispatch, par.recompute, compiled) for t in set(types) | {first_type}}
        if par.cp > 1 and "linear_attention" in per_type:  # per token (fla's maps: a layer's bytes over its tokens)
            extra = _cp_deltanet(cfg, b, par.device != "cuda") if par.cp_deltanet == "maps" else (0, -(-_cp_deltanet_fla(cfg, par.cp) // n_tok))
            saved, peak = per_type["linear_attention"]
            per_type["linear_attention"] = (saved + extra[0], peak + sum(extra) if par.recompute else peak + extra[1])
        norm = _zc_norm(d, b, compiled)
        mtp_norms = 2 * norm
    elif family == "mla":  # DeepSeek-V3: dense layers first, then MoE; its MTP blocks are MoE layers too
        def kind(i):
            return "moe" if i >= cfg.first_k_dense_replace and _num_experts(cfg) else "dense"
        types = [kind(i) for i in range(local_layers)]
        first_type = kind(cfg.num_hidden_layers) if mtp else types[-1]
        fused = _mla_fused_rope(par)
        per_type = {t: _mla_layer(cfg, t == "moe", b, dispatch, par.recompute, fused)
                    for t in set(types) | {first_type}}
        norm = _norm_kept(d, b, False)  # the final norm: its input, the last layer's output, is not kept
        mtp_norms = norm + _norm_kept(d, b, True)  # enorm; hnorm's input is the main loss input, kept
    else:  # GQA layers (Qwen3, Qwen3-MoE)
        types, first_type = ["gqa"] * local_layers, "gqa"
        per_type = {"gqa": _gqa_layer(cfg, b, dispatch, par.recompute,
                                      compiled=par.device == "cuda" and par.compiled_norms)}
        norm = _rms_norm(d, b)
        mtp_norms = 2 * norm
    # context parallelism: an attention layer's exchange buffers grow with the whole sequence, not n_tok
    est.cp_buffers = _cp_attention(cfg, family, b, par)
    attn_types = ("gqa", "full_attention", "dense", "moe")  # every MLA layer attends
    if est.cp_buffers:
        per_type = {t: (s, p + est.cp_buffers / n_tok) if t in attn_types else (s, p) for t, (s, p) in per_type.items()}
    worst = max(set(types), key=lambda t: per_type[t][1])  # under recompute one layer is rebuilt at a time
    est.moe_dispatch = int(n_tok * ((dispatch[0] if par.recompute else 0) + dispatch[1])) + wgrad_extra
    # the rest of that layer's peak (without recompute the shared expert's release can outweigh it)
    est.layer_working = max(0, int(n_tok * per_type[worst][1]) + wgrad_extra - est.moe_dispatch)

    def kept(ts):  # what the forward keeps of these layers: their inputs (recompute) or every saved tensor
        return sum(b * d + (0 if par.recompute else per_type[t][0]) for t in ts)
    # the attention slot's outputs kept through the recompute: the first layers that fit the budget; a
    # rebuilt kept layer's output is the kept one (counted once: its working set holds it)
    attn = [i for i, t in enumerate(types) if t in ("gqa", "full_attention")] if par.recompute else []
    out_tok, lse_tok = (b * cfg.num_attention_heads * cfg.head_dim, 4 * cfg.num_attention_heads) if attn else (0, 0)
    n_keep = min(len(attn), par.attention_keep_bytes // max(1, n_tok * (out_tok + lse_tok)))
    keep_all = n_tok * n_keep * (out_tok + lse_tok)
    keep_last = n_tok * (n_keep * (out_tok + lse_tok) - (out_tok if attn and attn[-1] == len(types) - 1
                                                        and n_keep == len(attn) else 0))
    keep_first = n_tok * lse_tok if n_keep and attn[0] == 0 and worst in ("gqa", "full_attention") else 0
    head = norm + b * d + 25  # final norm; the loss input (a copy of the valid rows); labels, lse, etc.
    est.activations = int(n_tok * (kept(types) + head) + keep_all)
    if est.cp_buffers and not par.recompute:  # every other attention layer keeps what its exchange saved
        est.activations += int((sum(t in attn_types for t in types) - 1) * _cp_attention_saved(cfg, family, b, par))
    mtp_block = mtp_head = main_saved = 0
    if mtp:
        # the pre-fc norms of embedding and hidden (DeepSeek's enorm, hnorm), their concatenation (fc's,
        # eh_proj's input) and the block's input, plus the block's saved tensors without recompute; then the
        # MTP head (norm, loss input)
        mtp_block = mtp_norms + 3 * b * d + 8 + (0 if par.recompute else per_type[first_type][0])
        mtp_head = norm + b * d + 25
        # the main head's loss runs its backward last: what it keeps stays through the depth's backward
        main_saved = _loss_saved(par.loss, n_tok, cfg.vocab_size)
    est.mtp_activations = int(n_tok * mtp_block)
    est.loss_buffers = _loss_buffers(par.loss, n_tok, cfg.vocab_size, d, b)
    est.counts["tokens"] = n_tok
    acts = {
        # the loss backward (the MTP head's first): everything the forward kept, the loss buffers
        "loss": est.activations + est.mtp_activations + n_tok * mtp_head + main_saved + est.loss_buffers,
        # the first rebuilt block: every layer input, and with MTP the head's and the depth's tensors
        "first_block": n_tok * (kept(types) + (head + mtp_block if mtp else 0) + per_type[first_type][1])
        + main_saved + wgrad_extra + keep_last,
        # the first layer: its input (or saved tensors) only; the largest layer type
        "last_block": n_tok * (kept([worst]) + per_type[worst][1]) + wgrad_extra + keep_first,
    }
    if mtp:  # the main head's loss backward, after the depth's: the hidden's gradient from the depth
        acts["loss_after_mtp"] = est.activations + n_tok * b * d + est.loss_buffers
    return {k: acts[k] for k in MOMENTS if k in acts}


def estimate(config, parallel: Parallel | None = None) -> Estimate:
    """Per-rank bytes of each term for model `config` (a named config or an HF config dict)."""
    par = parallel or Parallel()
    _check(par)
    model, cfg = _model_on_meta(config)
    _family(cfg)
    b = _BYTES[par.mixed_precision]
    mtp = bool(_mtp_depth(cfg))
    # parameters held by this rank's pipeline stage (layers split evenly; embedding and head counted
    # on every stage, which over-counts for pp > 1 by at most their size)
    g = _param_groups(model, par.ep, par.pp)
    est = Estimate()
    units, grads_at = _state_terms(est, model, g, par, b, mtp)
    acts = _activation_terms(est, cfg, g, par, b, mtp)
    persistent = est.params + est.optimizer
    est.phases = {k: int(persistent + grads_at[k] + units[k] + acts[k]) for k in acts}
    est.phases["optimizer"] = est.static + est.optimizer_step
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
    head = (f"{name}: dp={par.dp} pp={par.pp} ep={par.ep} cp={par.cp} {par.mixed_precision} "
            f"tokens/rank={par.micro_batch}x{par.seq_len // par.cp} recompute={par.recompute} loss={par.loss}")
    lines = [head, f"{'GiB per rank':<18}{'fsdp2':>10}{'zero1':>10}"]
    for term in ("params", "grads", "optimizer", "static", "recipe_state", "unsharded_units", "activations",
                 "mtp_activations", "layer_working", "loss_buffers", "moe_dispatch", "cp_buffers", "optimizer_step"):
        lines.append(f"{term:<18}{_gib(getattr(rows['fsdp2'], term))} {_gib(getattr(rows['zero1'], term))}")
    for phase in rows["fsdp2"].phases:
        lines.append(f"{'at ' + phase:<18}{_gib(rows['fsdp2'].phases[phase])} {_gib(rows['zero1'].phases[phase])}")
    lines.append(f"{'peak':<18}{_gib(rows['fsdp2'].peak)} {_gib(rows['zero1'].peak)}")
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
