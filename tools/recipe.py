"""`bumblebee recipe`: the long-context recipe's layout for a model on G GPUs at one sequence length,
each candidate checked with the memory estimator (`tools/memory.py`), printed as a table, as JSON and
as the Python that builds it.

    r = bumblebee.tools.recipe.plan("qwen3.5-35b-a3b", gpus=16, seq_len=131072, gpu="h100")
    print(r.table()); print(r.snippet())
    bumblebee recipe qwen3.5-35b-a3b --gpus 16 --seq-len 131072 --gpu h100 [--cp 4] [--json r.json]

The rule (skills/long-context-recipe/SKILL.md, skills/context-parallel/SKILL.md): full recompute,
linear cross-entropy, FSDP2 over every GPU (fp32 masters, bf16 compute, fused AdamW), chunked
expert dispatch with EP for the MoE weights (the largest size up to one node's 8 GPUs dividing both
the GPUs and the experts), and CP the smallest size that leaves each GPU at most 32K tokens of a
sequence (about 16K-32K each); dp = GPUs / CP ranks each train their own sequences. Where that
layout does not fit, the levers in order: the ring exchange instead of all-gather (attention's
exchange then holds two blocks, not the whole sequence's K/V), no layer outputs kept through the
recompute (`recompute_keep_bytes=0` of the attention and linear_attention slots), a larger CP, a
smaller one (MLA's exchange grows with the sequence, so CP can cost more than it saves). The first
candidate whose estimated peak is within the budget (GPU memory less a headroom for the CUDA
context, NCCL buffers and fragmentation) is the recipe; where none is, the longest length at which
one is, bracketed by the next step. `cp=N` checks that size alone.

Beyond the estimator: FLAConfig.recompute_keep_bytes (gated DeltaNet's rule kept through the
recompute, one rank only: its cp form recomputes) is added to the peak as its whole budget, an upper
bound the estimator does not model. Not levers: offload (none inside a step; `runtime.offload` moves
the state between RL phases) and pipeline stages (the library has none).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from bumblebee import registry
from bumblebee.primitives.attention import SDPA
from bumblebee.primitives.cross_entropy import LinearCE
from bumblebee.primitives.linear_attention import FLAConfig
from bumblebee.primitives.mla import FlashMLAConfig
from bumblebee.primitives.moe_dispatch_options import ChunkedDispatch
from bumblebee.tools import memory

GIB = 2 ** 30
GPU_MEMORY = {"h100": 81559 * 2 ** 20, "h200": 143771 * 2 ** 20}  # what torch reports (nvidia-smi's MiB)
MAX_TOKENS_PER_GPU = 32768  # the recipe's rule: about 16K-32K tokens of a sequence per GPU
NODE_GPUS = 8               # EP stays within one node's all-to-all
STEP = 1024                 # the longest-length search's granularity (a multiple of 2 x CP too)
EXCHANGES = ("allgather", "ring")
TERMS = ("static", "activations", "layer_working", "loss_buffers", "moe_dispatch", "cp_buffers", "optimizer_step")


@dataclass(frozen=True)
class Layout:
    """One candidate: dp x cp GPUs (FSDP2 over all of them), experts over ep, the cp exchange, and
    whether layer outputs are kept through the recompute at the slots' default budgets."""
    dp: int
    cp: int
    ep: int
    exchange: str = "allgather"
    keep: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.cp


@dataclass(frozen=True)
class Check:
    """A layout at a length, as the estimator sees it: its peak (bytes a GPU) and the terms."""
    layout: Layout
    seq_len: int
    peak: int
    fits: bool
    terms: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    model: str
    gpus: int
    seq_len: int
    gpu_memory: int                # bytes a GPU
    headroom: float                # fraction left to the CUDA context, NCCL buffers, fragmentation
    max_tokens_per_gpu: int
    rule_cp: int                   # what the tokens-per-GPU rule asks for
    forced_cp: int | None
    slots: tuple                   # the slots the model uses
    checks: tuple                  # every Check tried at seq_len, in order
    chosen: Check | None           # the first that fits, or None
    longest: Check | None = None   # where none fits: the longest length that does (None: no length)
    longest_next: int | None = None  # the step above `longest`, where nothing fits
    step: int = STEP

    @property
    def budget(self) -> int:
        return int(self.gpu_memory * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def built(self) -> Check | None:
        """The layout the snippet builds: the chosen one, else the one at the longest fitting length."""
        return self.chosen or self.longest

    def impl(self, layout: Layout | None = None) -> dict:
        """The `impl` a user passes to `bb.models.from_pretrained` for `layout` (the built one)."""
        layout = layout or self.built.layout
        return _impl(self.slots, layout)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slots"], d["checks"] = list(self.slots), [asdict(c) for c in self.checks]
        d["impl"] = {s: registry.record(s, c) for s, c in self.impl().items()} if self.built else None
        d["budget"] = self.budget
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        def check(c):
            return None if c is None else Check(**{**c, "layout": Layout(**c["layout"])})
        kept = {k: v for k, v in d.items() if k not in ("impl", "budget")}
        return cls(**{**kept, "slots": tuple(d["slots"]), "checks": tuple(check(c) for c in d["checks"]),
                      "chosen": check(d["chosen"]), "longest": check(d["longest"])})

    def table(self) -> str:
        return _table(self)

    def snippet(self) -> str:
        return _snippet(self)


def _impl(slots, layout: Layout) -> dict:
    """The recipe's typed options of every slot it sets that the model uses."""
    impl = {"cross_entropy": LinearCE()}
    if "attention" in slots:
        impl["attention"] = SDPA() if layout.keep else SDPA(recompute_keep_bytes=0)
    if "linear_attention" in slots:
        impl["linear_attention"] = FLAConfig() if layout.keep else FLAConfig(recompute_keep_bytes=0)
    if "mla" in slots:
        impl["mla"] = FlashMLAConfig()
    if "moe_dispatch" in slots:
        impl["moe_dispatch"] = ChunkedDispatch()
    return impl


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _load(model) -> tuple[str, object]:
    """(the model's label, what the estimator takes): a shipped config name, an HF config dict, or a
    folder holding config.json (or the config.json itself)."""
    from pathlib import Path

    from bumblebee import hf_io
    from bumblebee.models import NAMED
    if isinstance(model, dict):
        return model.get("model_type", "model"), model
    if not isinstance(model, str):
        raise ValueError(f"model must be a shipped config name, an HF config folder or dict, got {model!r}")
    if model in NAMED:
        return model, model
    path = Path(model)
    if path.name == "config.json" and path.is_file():
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a shipped config ({', '.join(sorted(NAMED))}) nor a folder "
                         f"with config.json")
    return model, hf_io.read_config(path)


def rule_cp(seq_len: int, gpus: int, max_tokens_per_gpu: int = MAX_TOKENS_PER_GPU) -> int:
    """The smallest CP dividing the GPUs (and seq_len into 2 x CP chunks) that leaves each GPU at most
    `max_tokens_per_gpu` tokens of the sequence; the largest such CP where none does."""
    valid = [c for c in _divisors(gpus) if seq_len % (2 * c) == 0] or [1]
    return next((c for c in valid if seq_len / c <= max_tokens_per_gpu), valid[-1])


def rule_ep(gpus: int, experts: int) -> int:
    """EP for the MoE weights: the largest size up to one node that divides the GPUs and the experts."""
    if not experts:
        return 1
    return max(e for e in _divisors(gpus) if e <= NODE_GPUS and experts % e == 0)


def _candidates(seq_len, gpus, ep, cps, family, slots):
    """Layouts in the order the recipe prefers them (see the module docstring)."""
    exchanges = EXCHANGES if family in ("gqa", "hybrid") else EXCHANGES[:1]  # MLA's exchange is its own
    keeps = (True, False) if {"attention", "linear_attention"} & set(slots) else (True,)
    for cp in cps:
        for keep in keeps:
            for exchange in (exchanges if cp > 1 else EXCHANGES[:1]):
                yield Layout(dp=gpus // cp, cp=cp, ep=ep, exchange=exchange, keep=keep)


def _check(config, layout: Layout, seq_len: int, budget: int, slots, mixed_precision: str) -> Check:
    par = memory.Parallel(dp=layout.gpus, cp=layout.cp, ep=layout.ep, cp_exchange=layout.exchange, seq_len=seq_len,
                          mixed_precision=mixed_precision,
                          attention_keep_bytes=SDPA.recompute_keep_bytes if layout.keep else 0)
    est = memory.estimate(config, par)
    terms = {t: int(getattr(est, t)) for t in TERMS}
    # not in the estimator: the DeltaNet rule's outputs kept through the recompute (one rank only)
    terms["linear_attention_keep"] = (FLAConfig.recompute_keep_bytes if "linear_attention" in slots
                                      and layout.keep and layout.cp == 1 else 0)
    peak = est.peak + terms["linear_attention_keep"]
    return Check(layout=layout, seq_len=seq_len, peak=int(peak), fits=peak <= budget, terms=terms)


def _search(config, seq_len, gpus, ep, cps, family, slots, budget, mixed_precision):
    """(every Check tried at seq_len, the first that fits or None)."""
    tried = []
    for layout in _candidates(seq_len, gpus, ep, cps, family, slots):
        if seq_len % (2 * layout.cp):
            continue
        tried.append(_check(config, layout, seq_len, budget, slots, mixed_precision))
        if tried[-1].fits:
            return tuple(tried), tried[-1]
    return tuple(tried), None


def plan(model, *, gpus: int, seq_len: int, gpu: str | None = "h100", gpu_memory_gib: float | None = None,
         headroom: float = 0.1, cp: int | None = None, ep: int | None = None,
         max_tokens_per_gpu: int = MAX_TOKENS_PER_GPU, mixed_precision: str = "bf16") -> Recipe:
    """The recipe's layout for `model` on `gpus` GPUs at `seq_len` tokens a sequence (see the module
    docstring). GPU memory: `gpu_memory_gib`, else that of `gpu` ("h100", "h200"). `cp`: check that
    size alone; `ep`: use that EP instead of the rule's."""
    _positive_int("gpus", gpus)
    _positive_int("seq_len", seq_len)
    _positive_int("max_tokens_per_gpu", max_tokens_per_gpu)
    if gpu_memory_gib is None:
        if gpu not in GPU_MEMORY:
            raise ValueError(f"gpu {gpu!r} unknown; accepted: {sorted(GPU_MEMORY)} (or give gpu_memory_gib)")
        memory_bytes = GPU_MEMORY[gpu]
    elif isinstance(gpu_memory_gib, bool) or not isinstance(gpu_memory_gib, (int, float)) or not gpu_memory_gib > 0:
        raise ValueError(f"gpu_memory_gib must be a number > 0, got {gpu_memory_gib!r}")
    else:
        memory_bytes = int(gpu_memory_gib * GIB)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    if mixed_precision not in memory._BYTES:
        raise ValueError(f"mixed_precision {mixed_precision!r} not supported; accepted: {sorted(memory._BYTES)}")
    label, config = _load(model)
    model_cfg = memory._model_on_meta(config)[1]
    family = memory._family(model_cfg)
    from bumblebee.models import slots_used
    slots = tuple(slots_used(config))
    experts = memory._num_experts(model_cfg)
    if cp is not None:
        _positive_int("cp", cp)
        if gpus % cp:
            raise ValueError(f"cp={cp} must divide gpus={gpus} (the mesh is dp x cp)")
        if seq_len % (2 * cp):
            raise ValueError(f"cp={cp}: seq_len={seq_len} must be divisible by 2 x cp = {2 * cp} (pad the sequence)")
    if ep is None:
        ep = rule_ep(gpus, experts)
    else:
        _positive_int("ep", ep)
        if ep > 1 and not experts:
            raise ValueError(f"ep={ep} given, but {label} has no experts")
        if gpus % ep or (experts and experts % ep):
            raise ValueError(f"ep={ep} must divide gpus={gpus} and the model's {experts} experts")
    budget = int(memory_bytes * (1 - headroom))
    want = rule_cp(seq_len, gpus, max_tokens_per_gpu)

    def cps_at(length):
        if cp is not None:
            return [cp]
        first = rule_cp(length, gpus, max_tokens_per_gpu)
        ds = _divisors(gpus)
        return [first] + [c for c in ds if c > first] + [c for c in reversed(ds) if c < first]

    def search(length):
        return _search(config, length, gpus, ep, cps_at(length), family, slots, budget, mixed_precision)

    checks, chosen = search(seq_len)
    recipe = Recipe(model=label, gpus=gpus, seq_len=seq_len, gpu_memory=memory_bytes, headroom=float(headroom),
                    max_tokens_per_gpu=max_tokens_per_gpu, rule_cp=want, forced_cp=cp, slots=slots, checks=checks,
                    chosen=chosen)
    if chosen is not None:
        return recipe
    step = math.lcm(STEP, 2 * (cp or gpus))
    longest, longest_next = _longest(search, seq_len, step)
    return replace(recipe, longest=longest, longest_next=longest_next, step=step)


def _longest(search, seq_len: int, step: int):
    """(the Check at the longest multiple of `step` below seq_len where a layout fits, the next
    multiple, where none does): a bisection keeping fits(lo) and not fits(hi), so the bracket holds."""
    lo, hi, best = 0, -(-seq_len // step), None  # in steps; seq_len did not fit
    while hi * step != seq_len and (found := search(hi * step)[1]) is not None:  # rounded up past seq_len
        lo, best, hi = hi, found, hi + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = search(mid * step)[1]
        if found is not None:
            lo, best = mid, found
        else:
            hi = mid
    return best, hi * step



# ---- output ----------------------------------------------------------------------------------------

def _gib(x: int) -> str:
    return f"{x / GIB:.1f}"


def _describe(layout: Layout, slots) -> str:
    parts = [f"dp={layout.dp} x cp={layout.cp}"]
    if "moe_dispatch" in slots:
        parts.append(f"ep={layout.ep}")
    if layout.cp > 1:
        parts.append(f"exchange={layout.exchange}")
    if {"attention", "linear_attention"} & set(slots):
        parts.append("outputs kept through the recompute" if layout.keep else "nothing kept through the recompute")
    return ", ".join(parts)


def _table(r: Recipe) -> str:
    head = (f"{r.model} on {r.gpus} GPUs x {_gib(r.gpu_memory)} GiB (budget {_gib(r.budget)} GiB a GPU after "
            f"{r.headroom:.0%} headroom), {r.seq_len} tokens a sequence; FSDP2, full recompute, linear_ce")
    rule = (f"cp {r.forced_cp} (forced; the rule's: {r.rule_cp})" if r.forced_cp else
            f"the rule (at most {r.max_tokens_per_gpu} tokens a GPU): cp {r.rule_cp}")
    lines = [head, rule, f"{'cp':>3} {'dp':>3} {'ep':>3} {'exchange':<9} {'keep':<4} {'tokens/GPU':>10} "
             f"{'static':>7} {'acts':>6} {'cp_buf':>6} {'peak':>7}  GiB"]
    for c in r.checks + ((r.longest,) if r.longest else ()):
        lo, t = c.layout, c.terms
        note = "fits" if c.fits else "over"
        if c is r.chosen:
            note += "  <- the recipe"
        elif c is r.longest:
            note += f"  <- at {c.seq_len} tokens"
        lines.append(f"{lo.cp:>3} {lo.dp:>3} {lo.ep:>3} {lo.exchange if lo.cp > 1 else '-':<9} "
                     f"{'yes' if lo.keep else 'no':<4} {c.seq_len // lo.cp:>10} {_gib(t['static']):>7} "
                     f"{_gib(t['activations']):>6} {_gib(t['cp_buffers']):>6} {_gib(c.peak):>7}  {note}")
    if any(c.terms["linear_attention_keep"] for c in r.checks):
        lines.append(f"(peak at cp 1 with keep: the estimator's plus linear_attention's whole "
                     f"{_gib(FLAConfig.recompute_keep_bytes)} GiB keep budget, which it does not model)")
    if r.fits:
        lines.append(f"fits: {_describe(r.chosen.layout, r.slots)}; peak {_gib(r.chosen.peak)} of {_gib(r.budget)} GiB")
    else:
        what = f"cp={r.forced_cp} does not fit" if r.forced_cp else "no layout fits"  # the longest: at that cp too
        lines.append(f"{what} {r.seq_len} tokens on {r.gpus} GPUs within {_gib(r.budget)} GiB a GPU")
        if r.longest:
            lines.append(f"longest that fits: {r.longest.seq_len} tokens ({_describe(r.longest.layout, r.slots)}; peak "
                         f"{_gib(r.longest.peak)} GiB); {r.longest_next} does not")
        else:
            lines.append(f"not even {r.longest_next} tokens fit: the state alone is "
                         f"{_gib(r.checks[0].terms['static'])} GiB a GPU (more GPUs)")
    return "\n".join(lines)


def _short(config) -> str:
    """A config's constructor call with the fields that differ from their defaults (`SDPA()`)."""
    changed = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
               if getattr(config, f.name) != f.default]
    return f"{type(config).__name__}({', '.join(changed)})"


def _snippet(r: Recipe) -> str:
    """Python that builds the recipe's layout on every rank (torchrun), or "" when no length fits."""
    c = r.built
    if c is None:
        return ""
    lo, impl = c.layout, r.impl()
    moe = "moe_dispatch" in r.slots
    imports = sorted({f"from {type(v).__module__} import {type(v).__name__}" for v in impl.values()})
    if lo.cp > 1:
        imports.append("from bumblebee.primitives import context_parallel as cp")
    if moe:
        imports.append("from bumblebee.models.moe import update_router_bias")
    if lo.ep > 1:
        imports.append("from bumblebee.parallelize import shard_experts")
    fit = "fits" if r.fits else f"does not fit {r.seq_len}; this is the longest that does"
    out = [f"# bumblebee recipe {r.model}: {r.gpus} GPUs x {_gib(r.gpu_memory)} GiB, {c.seq_len} tokens a sequence "
           f"({fit})",
           f"# {_describe(lo, r.slots)}; FSDP2; estimated peak {_gib(c.peak)} of {_gib(r.budget)} GiB a GPU",
           "import torch", "from torch.distributed.device_mesh import init_device_mesh", "",
           "import bumblebee as bb", "from bumblebee import registry", *imports, "",
           "IMPL = {", *[f"    {s!r}: {_short(v)}," for s, v in impl.items()], "}",
           f"DP, CP, EP = {lo.dp}, {lo.cp}, {lo.ep}", f"SEQ_LEN = {c.seq_len}", "", "",
           'def setup(hf_dir, device_type="cuda", *, lr=1e-5, mixed_precision="bf16"):',
           '    """Every rank, after torch.distributed.init_process_group (torchrun --nproc_per_node=DP*CP):',
           '    (model, training state, cp group or None)."""',
           "    model = bb.models.from_pretrained(hf_dir, IMPL, dtype=torch.float32, device=device_type).train()",
           "    model.set_recompute(True)"]
    if lo.ep == 1:
        out += ["    ep_mesh = None"]
    else:
        out += ['    ep_mesh = init_device_mesh(device_type, (DP * CP // EP, EP), mesh_dim_names=("efsdp", "ep"))',
                '    shard_experts(model, ep_mesh["ep"].get_group())']
    if lo.cp > 1:
        out += ["    mesh = cp.model.mesh(device_type, DP, CP)", '    cp_group = mesh["cp"].get_group()',
                f"    cp.apply(model, cp_group, cp.ContextParallel(exchange={lo.exchange!r}))",
                "    data_mesh = cp.model.data_mesh(mesh)"]
    else:
        out += ["    cp_group = None", '    data_mesh = init_device_mesh(device_type, (DP,), mesh_dim_names=("dp",))']
    out += ['    state = registry.resolve("state_sharding", "fsdp2")(model, data_mesh, lr=lr, mixed_precision=mixed_precision,',
            "                                                        ep_mesh=ep_mesh, reshard_after_forward=True)",
            "    return model, state, cp_group", "", "",
            "def step(model, state, cp_group, input_ids, labels=None):",
            '    """One optimizer step on a [B, SEQ_LEN] batch (every rank of a cp group passes the same one)."""']
    if lo.cp > 1:
        out += ['    depths = len(model.mtp.layers) if hasattr(model, "mtp") else 0',
                "    shard = cp.shard_batch(input_ids, labels, cp_group, mtp_depths=depths)",
                '    loss = cp.loss(model, shard, grads="mean")  # FSDP2 averages over dp x cp']
    else:
        out += ["    loss = model(input_ids, labels=input_ids if labels is None else labels).loss"]
    out += ["    loss.backward()", "    state.step()", "    state.zero_grad()"]
    if moe:
        out += ["    update_router_bias(model, group=state.group)  # aux-free routers: every rank's loads"]
    out += ["    return loss.detach()", ""]
    return "\n".join(out)
