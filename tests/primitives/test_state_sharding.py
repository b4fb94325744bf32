"""state_sharding: FSDP2 and ZeRO-1 against a single-process reference on 1, 2 and 4 gloo ranks.

Each multi-rank scenario runs once per module (a spawn costs seconds on a 2-core CPU): a 2-rank
run trains both twins for 10 steps (dense, tied, Qwen3-MoE, Qwen3.5-MoE with a [1, D] parameter
sharded unevenly, EP = 2 with Qwen3-MoE, Qwen3.5-MoE and DeepSeek-V3 with MTP, bf16), saves
checkpoints, exports HF weights, resumes and skips a non-finite step; a 4-rank run trains both
twins (EP = 2 x efsdp = 2 too, and a vocabulary 4 does not divide) and loads the 2-rank checkpoints (resharding, and across twins); a
1-rank run loads them again (2 -> 1, EP = 2 -> EP = 1) and checks the refusals (another model,
half-written, crash mid-save).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee import checkpoint, models, registry
from tests.limits import PROCESS_GROUP_TIMEOUT
from tests.ranks import free_port, leave_group

CFG, MOE, TIED, Q35, ODD, DSV3 = ("qwen3-tiny", "qwen3-moe-tiny", "tied", "qwen3.5-moe-tiny", "odd-vocab",
                                  "deepseek-v3-mtp-tiny")
MODELS = {CFG: CFG, MOE: MOE, TIED: {**models.NAMED[CFG], "tie_word_embeddings": True}, Q35: Q35,
          ODD: {**models.NAMED[CFG], "vocab_size": 1022},  # 4 ranks: rows 256, 256, 256, 254
          DSV3: {**models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1}}  # MLA, aux-free router, MTP
STEPS, SAVE_AT, B, T = 10, 5, 4, 13
# Adam's eps sits above float32's rounding of these gradients. At 1e-8 an entry whose gradient is
# rounding noise (|g| ~ 1e-9) moves by +-lr a step whichever way its rounding went, so two correct runs
# that sum in different orders part by lr-sized weights (6.1e-4 in the loss at step 7 with vocabulary
# 1022, one process whole vs two micro-batches). At 1e-6 a rounding-level gradient difference stays a
# rounding-level update, and every run is held to float32's own error against float64 (_close).
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
CLIP = 1.0  # the tiny model's grad norm starts near 2: clipping is active in early steps
VARIANTS = {  # name -> (implementation, recompute, reshard_after_forward, model)
    "fsdp2": ("fsdp2", False, True, CFG),
    "fsdp2_recompute": ("fsdp2", True, False, CFG),
    "zero1": ("zero1", False, True, CFG),
    "moe_fsdp2": ("fsdp2", True, True, MOE),
    "moe_zero1": ("zero1", False, True, MOE),
    "tied_fsdp2": ("fsdp2", False, True, TIED),
    "tied_zero1": ("zero1", False, True, TIED),
    # shared_expert_gate.weight is [1, D]: rank 0 holds the row, rank 1 an empty shard
    "q35moe_fsdp2": ("fsdp2", True, True, Q35),
    "q35moe_zero1": ("zero1", False, True, Q35),
}


def batches(vocab: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (B, T), generator=g) for _ in range(steps)]


def reference(steps: int = STEPS, config: str = CFG, device: str = "cpu"):
    """Single process, plain torch AdamW and clip_grad_norm_, fp32: losses, norms, zero counts, final
    weights; and float32's own error on each, against the same run in float64 (`_with_error`). A run on
    CUDA is held to a reference on CUDA: its kernels sum in other orders, and float32's error there is
    what the CPU's error does not measure. The weights' error is the larger of the whole batch's and of
    the batch summed as two ranks split it (`_split_error`)."""
    ref64 = _run_reference(steps, config, torch.float64, device)
    ref = _with_error(_run_reference(steps, config, torch.float32, device), ref64)
    return _split_error(ref, _run_reference(steps, config, torch.float32, device, parts=2))


def _run_reference(steps, config, dtype, device="cpu", parts=1):
    """`parts` > 1: each batch's gradient summed from that many equal row blocks, each block's mean loss
    weighted by its share, in the order ranks that split the batch sum it, and the clip applied as a
    float32 divisor, as fused AdamW takes it (`common/state_sharding.py:_clipped_step`)."""
    model = models.build(MODELS[config], seed=0, dtype=dtype, device=device)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, **HP)
    out = {"loss": [], "norm": [], "zeros": []}
    for ids in batches(model.config.vocab_size, steps):
        ids = ids.to(device)
        if parts == 1:
            loss = model(ids, labels=ids).loss
            loss.backward()
        else:
            losses = [model(block, labels=block).loss / parts for block in ids.chunk(parts)]
            for block_loss in losses:
                block_loss.backward()
            loss = sum(losses)
        out["zeros"].append(int(sum((p.grad == 0).sum() for p in params)))
        if parts == 1:
            out["norm"].append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))  # the norm, gradients untouched
            coef = min(1.0, CLIP / (norm + 1e-6))
            if coef < 1.0:
                divisor = torch.full((), 1.0 / coef, dtype=torch.float32, device=device)
                torch._foreach_div_([p.grad for p in params], divisor)
            out["norm"].append(norm)
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
    out["state"] = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
                    for k, v in model.state_dict().items()}
    if dtype == torch.float64:
        out["state64"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return out


def _with_error(ref, ref64):
    """`ref` with float32's error against float64: per step the largest error on the loss and the grad
    norm so far (rounding differences grow with the steps, they do not shrink), per tensor the largest
    error on the final weights."""
    for key in ("loss", "norm"):
        errs = [abs(a - b) for a, b in zip(ref[key], ref64[key])]
        ref[f"{key}_err"] = [max(errs[:i + 1]) for i in range(len(errs))]
        ref[f"{key}64"] = ref64[key]
    ref["state_err"] = {k: float((v.double() - ref64["state64"][k]).abs().max()) for k, v in ref["state"].items()
                        if v.is_floating_point()}
    ref["state64"] = ref64["state64"]
    return ref


def _split_error(ref, split):
    """Per tensor, float32's largest weight error over two orders: the whole batch clipped by a factor
    (`ref`), and two row blocks clipped by a divisor (`split`). A run on two CUDA ranks (NCCL's
    reduce-scatter, fused AdamW taking the clip as its grad_scale) ended 1.0e-5 from the whole-batch reference in q_proj, 8.7x that reference's
    own largest error: Adam turns a rounding-level gradient difference into up to lr x |dg| / eps a step
    (3e-3 x 1e-9 / 1e-6 = 3e-6), so one order's largest error is a poor sample of another's."""
    for k, v in split["state"].items():
        if v.is_floating_point():
            err = float((v.double() - ref["state64"][k]).abs().max())
            ref["state_err"][k] = max(ref["state_err"][k], err)
    return ref


# ---- multi-rank harness -------------------------------------------------------------------------


def _worker(rank, world, port, scenario, out_dir, module, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,), mesh_dim_names=("dp",))
        import importlib
        result = getattr(importlib.import_module(module), scenario)(mesh, Path(out_dir))
        torch.save(result, Path(out_dir) / f"{scenario}-{world}-{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def spawn(world: int, scenario: str, out_dir: Path, module: str = __name__, backend: str = "gloo") -> list:
    """Run `module.scenario(mesh, out_dir)` on `world` ranks; every rank's return value."""
    mp.spawn(_worker, args=(world, free_port(), scenario, str(out_dir), module, backend), nprocs=world, join=True)
    return [torch.load(out_dir / f"{scenario}-{world}-{r}.pt", weights_only=False) for r in range(world)]


def _apply(variant, *, seed=0, config=None, mixed_precision="fp32", **kw):
    impl, recompute, raf, model_name = VARIANTS[variant]
    mesh = kw.pop("mesh")
    # one-rank dispatch: the variants differ in recompute, and the chunked dispatch's fused recompute
    # rounds in another order than its plain forward (the twins' bitwise agreement below needs one order)
    hf = config or MODELS[model_name]
    hf = models.NAMED[hf] if isinstance(hf, str) else hf
    dispatch = {"moe_dispatch": "local"} if hf.get("num_experts") else None
    model = models.build(config or MODELS[model_name], impl=dispatch, seed=seed,
                         device=mesh.device_type).set_recompute(recompute)
    fn = registry.resolve("state_sharding", impl)
    return fn(model, mesh, mixed_precision=mixed_precision, grad_clip=CLIP, reshard_after_forward=raf, **HP, **kw)


EP_VARIANTS = {  # EP = 2: name -> (state sharding, moe_dispatch, model)
    "moe_ep_fsdp2": ("fsdp2", "all_to_all", MOE),
    "moe_ep_zero1": ("zero1", "all_to_all", MOE),
    # chunked computes the experts from their weights: FSDP2 must still unshard and reduce them
    "moe_ep_chunked_fsdp2": ("fsdp2", "chunked", MOE),
    # Qwen3.5-MoE's MTP block has experts too: they must be sharded over efsdp, not the whole mesh
    "q35_ep_chunked_fsdp2": ("fsdp2", "chunked", Q35),
    "q35_ep_zero1": ("zero1", "chunked", Q35),
    "dsv3_ep_chunked_fsdp2": ("fsdp2", "chunked", DSV3),
}


def _apply_ep(variant, mesh, ep_mesh, seed=0):
    from bumblebee.models import moe
    from bumblebee.parallelize import shard_experts
    impl, dispatch, name = EP_VARIANTS[variant]
    model = models.build(MODELS[name], impl={"moe_dispatch": dispatch}, seed=seed, device=mesh.device_type)
    shard_experts(model, ep_mesh["ep"].get_group())
    model.set_recompute(dispatch == "chunked")  # as the composed step runs it: the collectives repeat
    for block in model.modules():  # two chunks, as "auto" picks at long context (these batches are short)
        if isinstance(block, moe.MoEBlock):
            block.dispatch_chunks = (1, 2)
    fn = registry.resolve("state_sharding", impl)
    return fn(model, mesh, ep_mesh=ep_mesh, mixed_precision="fp32", grad_clip=CLIP, **HP)


def _ep_runs(mesh, out: Path, res: dict) -> None:
    """EP = 2 (efsdp = world / 2): train both twins; the 2-rank run saves, the others load it."""
    from torch.distributed.device_mesh import init_device_mesh
    ep_mesh = init_device_mesh(mesh.device_type, (mesh.size() // 2, 2), mesh_dim_names=("efsdp", "ep"))
    for variant in EP_VARIANTS:
        state = _apply_ep(variant, mesh, ep_mesh)
        first = _train(state, mesh, SAVE_AT)
        if mesh.size() == 2:
            state.save(out / f"ckpt-{variant}")
        rest = _train(state, mesh, STEPS, start=SAVE_AT)
        res[variant] = {k: first[k] + rest[k] for k in first}
    if mesh.size() == 4:  # 2 ranks x EP 2 -> 4 ranks x EP 2 (efsdp 2), across twins
        state = _apply_ep("moe_ep_zero1", mesh, ep_mesh, seed=3)
        state.load(out / "ckpt-moe_ep_fsdp2")
        res["load-moe_ep-into-zero1"] = _train(state, mesh, STEPS, start=SAVE_AT)


def _train(state, mesh, steps, *, start=0, nan_step=None):
    """Steps start..steps-1 on this rank's slice of each global batch; the global mean loss."""
    n, r = mesh.size(), mesh.get_local_rank()
    out = {"loss": [], "norm": [], "zeros": [], "ok": []}
    for i, ids in enumerate(batches(state.model.config.vocab_size, steps)):
        if i < start:
            continue
        local = ids[r * (B // n):(r + 1) * (B // n)].to(mesh.device_type)
        loss = state.model(local, labels=local).loss
        if i == nan_step and r == n - 1:
            loss = loss * float("nan")  # one rank's gradient goes non-finite: every rank must skip
        loss.backward()
        ok, norm, zeros = state.step()
        state.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["loss"].append(mean.item() / n)
        out["norm"].append(norm)
        out["zeros"].append(zeros)
        out["ok"].append(ok)
    return out


def _full(state):
    return {k: v.clone() for k, v in state.full_state_dict(torch.float32).items()}


def router_bias_runs(mesh, out: Path):
    """DeepSeek-V3's auxiliary-loss-free router biases move every step: they must travel with the
    training checkpoint and the HF export of both twins."""
    from bumblebee.models import moe
    n, r = mesh.size(), mesh.get_local_rank()

    def make(impl, seed):
        model = models.build(MODELS[DSV3], seed=seed, device=mesh.device_type)
        return registry.resolve("state_sharding", impl)(model, mesh, mixed_precision="fp32", grad_clip=CLIP,
                                                        reshard_after_forward=True, **HP)

    def run(state, steps, start=0):
        losses = []
        for i, ids in enumerate(batches(state.model.config.vocab_size, steps)):
            if i >= start:
                local = ids[r * (B // n):(r + 1) * (B // n)].to(mesh.device_type)
                loss = state.model(local, labels=local).loss
                loss.backward()
                state.step()
                state.zero_grad()
                moe.update_router_bias(state.model, rate=0.05, group=mesh.get_group())
                losses.append(loss.item())
        return losses

    def biases(model):
        return {k: v.detach().clone() for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")}

    res = {}
    for impl in ("fsdp2", "zero1"):
        state = make(impl, seed=0)
        run(state, 3)
        state.save(out / f"ckpt-dsv3-{impl}")
        saved = biases(state.model)
        full = state.full_state_dict(torch.float32)  # collective: before the rank-0 checks
        state.model.save_pretrained(out / f"hf-dsv3-{impl}")
        continued = run(state, 6, start=3)
        resumed = make(impl, seed=5)
        resumed.load(out / f"ckpt-dsv3-{impl}")
        restored = biases(resumed.model)
        res[impl] = {"saved": saved, "restored": restored, "continued": continued,
                     "resumed": run(resumed, 6, start=3)}
        without = make(impl, seed=5)  # the same checkpoint, biases zeroed after loading: routing differs
        without.load(out / f"ckpt-dsv3-{impl}")
        for b in biases(without.model):
            without.model.get_buffer(b).zero_()
        res[impl]["resumed_without_biases"] = run(without, 6, start=3)
        if r == 0:
            loaded = models.from_pretrained(out / f"hf-dsv3-{impl}")
            res[impl]["export_diff"] = {k: (v - full[k]).abs().max().item() for k, v in loaded.state_dict().items()}
            res[impl]["export_missing"] = sorted(set(full) - set(loaded.state_dict()))
    return res


def two_ranks(mesh, out: Path):
    res = {}
    for variant in VARIANTS:
        state = _apply(variant, mesh=mesh)
        first = _train(state, mesh, SAVE_AT)
        state.save(out / f"ckpt-{variant}")
        rest = _train(state, mesh, STEPS, start=SAVE_AT)
        res[variant] = {k: first[k] + rest[k] for k in first}
        res[variant]["final"] = _full(state)
        if variant in ("fsdp2", "moe_fsdp2", "tied_fsdp2"):
            state.model.save_pretrained(out / f"hf-{variant}")  # HF export from the sharded state
        resumed = _apply(variant, mesh=mesh, seed=7)
        resumed.load(out / f"ckpt-{variant}")
        res[variant]["resumed"] = _train(resumed, mesh, STEPS, start=SAVE_AT)
    _ep_runs(mesh, out, res)
    res["bf16"] = bf16_runs(mesh, out)
    for impl in ("fsdp2", "zero1"):
        res[f"nan-{impl}"] = _train(_apply(impl, mesh=mesh), mesh, 3, nan_step=0)
    return res


def four_ranks(mesh, out: Path):
    res = {}
    for variant in ("fsdp2", "zero1"):
        res[variant] = _train(_apply(variant, mesh=mesh), mesh, STEPS)
    for variant, ckpt in (("fsdp2", "fsdp2"), ("zero1", "fsdp2"), ("fsdp2", "zero1")):
        state = _apply(variant, mesh=mesh, seed=3)
        state.load(out / f"ckpt-{ckpt}")
        res[f"load-{ckpt}-into-{variant}"] = _train(state, mesh, STEPS, start=SAVE_AT)
    _ep_runs(mesh, out, res)
    for variant in ("fsdp2", "zero1"):  # 4 does not divide the vocabulary: uneven shards
        res[f"odd-{variant}"] = _train(_apply(variant, mesh=mesh, config=MODELS[ODD]), mesh, STEPS)
    return res


def one_rank(mesh, out: Path):
    res = {}
    for ckpt in ("fsdp2", "zero1"):
        state = _apply("fsdp2", mesh=mesh, seed=5)
        state.load(out / f"ckpt-{ckpt}")
        res[f"load-{ckpt}"] = _train(state, mesh, STEPS, start=SAVE_AT)
    state = _apply("moe_fsdp2", mesh=mesh, seed=5)  # EP = 2 on 2 ranks -> EP = 1 on 1 rank
    state.load(out / "ckpt-moe_ep_fsdp2")
    res["load-moe_ep"] = _train(state, mesh, STEPS, start=SAVE_AT)
    other = {**models.NAMED[CFG], "num_hidden_layers": 3}
    state = _apply("zero1", mesh=mesh, config=other)
    try:
        state.load(out / "ckpt-fsdp2")
    except ValueError as e:
        res["mismatch"] = str(e)
    (out / "half").mkdir()
    (out / "half" / ".metadata").write_bytes(b"")
    state = _apply("fsdp2", mesh=mesh)
    try:
        state.load(out / "half")
    except ValueError as e:
        res["half"] = str(e)
    # crash mid-save, after every DCP file is written but before the json's commit: the previous
    # checkpoint stays current and the new data folder is removed (tests/core/test_checkpoint.py has more)
    import types
    state.save(out / "crash")
    res["crash_saved"] = _full(state)
    before = sorted(p.name for p in (out / "crash").iterdir())
    _train(state, mesh, 2)
    real_dcp, real_shutil = checkpoint.dcp, checkpoint.shutil

    def save_then_crash(*a, **kw):
        real_dcp.save(*a, **kw)
        raise RuntimeError("simulated crash after the DCP files")
    checkpoint.dcp = types.SimpleNamespace(save=save_then_crash, load=real_dcp.load)
    try:
        state.save(out / "crash")
    except RuntimeError as e:
        res["crash"] = str(e)
    finally:
        checkpoint.dcp = real_dcp
    res["crash_listing"] = (before, sorted(p.name for p in (out / "crash").iterdir()))
    fresh = _apply("fsdp2", mesh=mesh, seed=9)
    fresh.load(out / "crash")
    res["crash_loaded"] = _full(fresh)

    # crash after the commit, before the previous data folder is removed: the new checkpoint is current
    def crash(*a, **kw):
        raise RuntimeError("simulated crash after the commit")
    checkpoint.shutil = types.SimpleNamespace(rmtree=crash)
    try:
        state.save(out / "crash")
    except RuntimeError as e:
        res["crash2"] = str(e)
    finally:
        checkpoint.shutil = real_shutil
    fresh = _apply("fsdp2", mesh=mesh, seed=11)
    fresh.load(out / "crash")
    res["crash2_saved"], res["crash2_loaded"] = _full(state), _full(fresh)
    state.save(out / "crash")  # the next save completes and removes the leftover
    res["crash_after"] = sorted(p.name for p in (out / "crash").iterdir() if not p.name.startswith("dcp-"))
    res["crash_after_data"] = len([p for p in (out / "crash").iterdir() if p.name.startswith("dcp-")])
    from torch.distributed.device_mesh import init_device_mesh
    ep_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("efsdp", "ep"))
    for key, ep in (("ep_mesh", ep_mesh), ("ep_mesh_1d", mesh)):
        try:
            _apply("fsdp2", mesh=mesh, ep_mesh=ep)
        except ValueError as e:
            res[key] = str(e)
    res["freed"] = {}
    for variant in ("fsdp2", "zero1"):  # a discarded state frees the model (no uncollectable cycle)
        import gc
        import weakref
        state = _apply(variant, mesh=mesh)
        _train(state, mesh, 1)
        alive = weakref.ref(state.model)
        del state
        gc.collect()
        res["freed"][variant] = alive() is None
    return res


def bf16_runs(mesh, out: Path):
    """bf16 compute (FSDP2's MixedPrecisionPolicy; ZeRO-1's bf16 params), fp32 masters."""
    res = {}
    # q35moe_fsdp2: recompute, an MTP block in the root unit, RoPE tables in the compute dtype. Not on
    # CUDA, where its fla kernels autotune for minutes (the composed-step benchmark runs it there)
    extra = ("q35moe_fsdp2",) if mesh.device_type == "cpu" else ()
    for variant in ("fsdp2", "zero1", "moe_fsdp2") + extra:
        state = _apply(variant, mesh=mesh, mixed_precision="bf16")
        res[variant] = _train(state, mesh, SAVE_AT)
        state.save(out / f"bf16-{mesh.device_type}-{variant}")
        fresh = _apply(variant, mesh=mesh, mixed_precision="bf16", seed=4)
        fresh.load(out / f"bf16-{mesh.device_type}-{variant}")
        a, b = _full(state), _full(fresh)
        res[variant]["reloaded_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    return res


def fp32_cuda_runs(mesh, out: Path):
    """fp32 on CUDA: fused AdamW, which takes the clip as its grad_scale (CPU runs scale the gradients
    first); the final full weights for the reference comparison."""
    res = {}
    for variant in ("fsdp2", "zero1"):
        state = _apply(variant, mesh=mesh)
        assert state.optimizer.defaults.get("fused"), "fused AdamW is the CUDA path under test"
        res[variant] = _train(state, mesh, STEPS)
        res[variant]["final"] = {k: v.cpu() for k, v in _full(state).items()}
        res[variant]["grad_scale_left"] = hasattr(state.optimizer, "grad_scale")
    return res


# ---- fixtures: one spawn per world size -------------------------------------------------------------

@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def refs(ref):
    return {CFG: ref, MOE: reference(config=MOE), TIED: reference(config=TIED), Q35: reference(config=Q35),
            ODD: reference(config=ODD), DSV3: reference(config=DSV3)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("state_sharding")


@pytest.fixture(scope="module")
def two(workdir):
    return spawn(2, "two_ranks", workdir)


@pytest.fixture(scope="module")
def router_bias(workdir):
    return spawn(2, "router_bias_runs", workdir)


@pytest.fixture(scope="module")
def four(workdir, two):
    return spawn(4, "four_ranks", workdir)


@pytest.fixture(scope="module")
def one(workdir, two):
    return spawn(1, "one_rank", workdir)


def _zeros_close(run, ref):
    """Zero gradient entries per step. Most are structural (embedding rows of tokens not in the batch,
    experts no token chose) and equal in any layout; an entry whose gradient cancels to exactly zero
    in one summation order and not in another may add or remove a few (62529 vs 62528 seen), so the
    counts agree within 0.1%: miscounting a shard's padding or a whole tensor is far beyond that."""
    assert len(run["zeros"]) == len(ref["zeros"])
    for i, (a, b) in enumerate(zip(run["zeros"], ref["zeros"])):
        assert abs(a - b) <= max(2, 1e-3 * b), f"step {i}: {a} zero gradient entries vs reference {b}"


# A run that sums in another order than the float32 reference may differ from it by its own float32
# error plus the reference's: K times the reference's error against float64, plus ULPS float32 ulps of
# the value (a single sum's rounding when the two runs happen to round alike against float64).
K, ULPS, EPS32 = 4, 8, torch.finfo(torch.float32).eps


def _close(run, ref, start=0):
    for key in ("loss", "norm"):
        for i, a in enumerate(run[key]):
            b, err, exact = ref[key][start + i], ref[f"{key}_err"][start + i], ref[f"{key}64"][start + i]
            tol = K * err + ULPS * EPS32 * abs(exact)
            assert abs(a - b) <= tol, f"step {start + i}: {key} {a} vs reference {b} (float64 {exact}, tolerance {tol:.2e})"
    assert len(run["loss"]) == len(ref["loss"]) - start


def _weights_close(state, ref):
    """Final weights: within K times the reference's per-tensor float32 error plus ULPS ulps of each entry.
    Twice K: a tensor's largest error is one sample of its entries' errors (the runs' own largest
    entries were within 0.7 K of this bound when checked with micro-batching)."""
    for k, v in state.items():
        if not v.is_floating_point():
            continue
        err = 2 * K * ref["state_err"][k] + ULPS * EPS32 * ref["state64"][k].abs()
        diff = (v.double() - ref["state"][k].double()).abs()
        assert bool((diff <= err).all()), f"{k}: {float(diff.max()):.2e} from the reference, beyond float32's error"


# ---- tests --------------------------------------------------------------------------------------------

def test_reference_clips(ref):
    assert max(ref["norm"]) > CLIP, "the clipping path is not exercised"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_match_reference(two, refs, variant):
    ref = refs[VARIANTS[variant][3]]
    for rank in two:
        run = rank[variant]
        _close(run, ref)
        assert all(run["ok"])
        _zeros_close(run, ref)
    _weights_close(two[0][variant]["final"], ref)  # the twins themselves agree bit for bit (below)


def test_uneven_shards_twins_agree_bitwise(two):
    a, b = two[0]["q35moe_fsdp2"]["final"], two[0]["q35moe_zero1"]["final"]
    assert tuple(a["model.layers.0.mlp.shared_expert_gate.weight"].shape) == (1, 64)  # rank 1's shard is empty
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("variant", ["fsdp2", "zero1"])
def test_four_ranks_match_reference(four, ref, variant):
    for rank in four:
        _close(rank[variant], ref)
        _zeros_close(rank[variant], ref)


@pytest.mark.parametrize("variant", list(EP_VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_reference(two, four, refs, variant, world):
    ref = refs[EP_VARIANTS[variant][2]]
    for rank in (two if world == 2 else four):
        _close(rank[variant], ref)
        _zeros_close(rank[variant], ref)


@pytest.mark.parametrize("key,world", [("load-moe_ep-into-zero1", 4), ("load-moe_ep", 1)])
def test_expert_parallel_checkpoint_reshards(four, one, refs, key, world):
    _close((four if world == 4 else one)[0][key], refs[MOE], start=SAVE_AT)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_is_bit_exact(two, variant):
    for rank in two:
        assert rank[variant]["resumed"]["loss"] == rank[variant]["loss"][SAVE_AT:]
        assert rank[variant]["resumed"]["norm"] == rank[variant]["norm"][SAVE_AT:]


@pytest.mark.parametrize("key", ["load-fsdp2-into-fsdp2", "load-fsdp2-into-zero1", "load-zero1-into-fsdp2"])
def test_reshard_two_to_four(four, ref, key):
    _close(four[0][key], ref, start=SAVE_AT)


@pytest.mark.parametrize("ckpt", ["fsdp2", "zero1"])
def test_reshard_two_to_one(one, ref, ckpt):
    _close(one[0][f"load-{ckpt}"], ref, start=SAVE_AT)


@pytest.mark.parametrize("impl", ["fsdp2", "zero1"])
def test_non_finite_gradient_skips_the_update_on_every_rank(two, impl):
    for rank in two:
        run = rank[f"nan-{impl}"]
        assert run["ok"] == [False, True, True]
        assert run["norm"][0] != run["norm"][0]  # NaN
    # the skipped step left the weights untouched: step 1's loss is the initial model's on batch 1
    model = models.build(CFG, seed=0)
    ids = batches(model.config.vocab_size, 2)[1]
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    assert two[0][f"nan-{impl}"]["loss"][1] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("variant", ["fsdp2", "moe_fsdp2", "tied_fsdp2"])
def test_hf_export_from_sharded_state(two, workdir, refs, variant):
    ref = refs[VARIANTS[variant][3]]
    _weights_close(models.from_pretrained(workdir / f"hf-{variant}").state_dict(), ref)


@pytest.mark.parametrize("impl", ["fsdp2", "zero1"])
def test_router_biases_travel_with_checkpoint_and_export(router_bias, impl):
    for rank in router_bias:
        res = rank[impl]
        assert res["saved"] and all(b.abs().max() > 0 for b in res["saved"].values()), "the biases never moved"
        for k, v in res["saved"].items():
            assert torch.equal(res["restored"][k], v), k
        assert res["resumed"] == res["continued"]  # bit-exact resume, routing included
        assert res["resumed_without_biases"] != res["continued"], "the biases do not change routing here"
    res = router_bias[0][impl]
    assert res["export_missing"] == []
    biases = [k for k in res["export_diff"] if k.endswith("e_score_correction_bias")]
    assert len(biases) == len(router_bias[0][impl]["saved"])
    assert max(res["export_diff"].values()) == 0.0, {k: v for k, v in res["export_diff"].items() if v}


def test_hf_export_loads_in_transformers(two, workdir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(workdir / "hf-fsdp2", attn_implementation="eager")
    ours = models.from_pretrained(workdir / "hf-fsdp2")
    ids = batches(ours.config.vocab_size, 1)[0]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=1e-4, rtol=1e-4)


def test_checkpoint_of_another_model_is_refused(one):
    msg = one[0]["mismatch"]
    assert "does not match" in msg and "model.layers.2" in msg and "25 parameters" in msg


@pytest.mark.parametrize("variant", ["fsdp2", "zero1"])
def test_discarded_state_frees_the_model(one, variant):
    assert one[0]["freed"][variant]


def test_half_written_checkpoint_is_refused(one):
    assert "incomplete" in one[0]["half"]


def test_crash_mid_save_keeps_the_previous_checkpoint(one):
    res = one[0]
    assert "simulated crash" in res["crash"] and "simulated crash" in res["crash2"]
    assert res["crash_listing"][0] == res["crash_listing"][1]  # nothing left behind
    for k, v in res["crash_saved"].items():
        assert torch.equal(res["crash_loaded"][k], v), k
    for k, v in res["crash2_saved"].items():  # committed before the crash: the new checkpoint loads
        assert torch.equal(res["crash2_loaded"][k], v), k
    assert res["crash_after"] == [checkpoint.MARKER] and res["crash_after_data"] == 1


@pytest.mark.parametrize("variant", ["fsdp2", "zero1"])
def test_mesh_that_does_not_divide_shards_unevenly(four, refs, variant):
    for rank in four:
        _close(rank[f"odd-{variant}"], refs[ODD])
        _zeros_close(rank[f"odd-{variant}"], refs[ODD])


def test_ep_mesh_on_a_dense_model_is_refused(one):
    assert "has no experts" in one[0]["ep_mesh"]
    assert "2-D DeviceMesh with dims ('efsdp', 'ep')" in one[0]["ep_mesh_1d"]


def test_bad_arguments():
    fn = registry.resolve("state_sharding", "fsdp2")
    model = models.build(CFG, seed=0)
    for kw, word in [({"mixed_precision": "fp8"}, "fp8"), ({"optimizer": "sgd"}, "sgd"),
                     ({"grad_clip": -1.0}, "grad_clip")]:
        with pytest.raises(ValueError, match=word):
            fn(model, _FakeMesh(), lr=1e-3, **kw)
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        fn(model, None, lr=1e-3)
    moe = models.build(MOE, seed=0)
    with pytest.raises(ValueError, match="ep_mesh of size 3 does not divide the model's 8 experts"):
        fn(moe, _FakeMesh(3), lr=1e-3, ep_mesh=_FakeMesh(efsdp=1, ep=3))
    with pytest.raises(ValueError, match="ep_mesh covers 4 ranks but mesh covers 2"):
        fn(moe, _FakeMesh(2), lr=1e-3, ep_mesh=_FakeMesh(efsdp=2, ep=2))
    with pytest.raises(ValueError, match="each rank should hold 4 of 8 experts, but the model's expert modules hold"):
        fn(moe, _FakeMesh(2), lr=1e-3, ep_mesh=_FakeMesh(efsdp=1, ep=2))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="parameter scale is a scalar"):
        fn(model, _FakeMesh(), lr=1e-3)


class _FakeMesh:
    """Enough of a DeviceMesh for argument checks that fail before any collective."""

    def __init__(self, n=None, **dims):
        self.dims = dims or {"dp": n or 2}
        self.mesh_dim_names, self.ndim = tuple(self.dims), len(self.dims)

    def size(self):
        return math.prod(self.dims.values())

    def __getitem__(self, name):
        return _FakeMesh(self.dims[name])


def _check_bf16(runs, refs):
    for variant, run in runs.items():
        ref = refs[VARIANTS[variant][3]]
        assert all(run["ok"]) and run["reloaded_equal"], variant
        for a, b in zip(run["loss"], ref["loss"]):
            assert abs(a - b) <= 2e-2 * abs(b), (variant, a, b)  # bf16 compute vs fp32 reference


def test_bf16_mixed_precision(two, refs):
    for rank in two:
        _check_bf16(rank["bf16"], refs)
        # same bf16 compute and fp32 reductions: the twins agree far closer than bf16 to fp32
        for a, b in zip(rank["bf16"]["fsdp2"]["loss"], rank["bf16"]["zero1"]["loss"]):
            assert abs(a - b) <= 1e-5


@pytest.mark.gpu
def test_bf16_on_cuda(workdir, refs):
    world = min(torch.cuda.device_count(), 2)
    for rank in spawn(world, "bf16_runs", workdir, backend="nccl"):
        _check_bf16(rank, refs)


@pytest.mark.gpu
def test_fp32_on_cuda_clips_inside_fused_adamw(workdir):
    """The clipped steps on CUDA (coefficient < 1 early on: test_reference_clips) match plain AdamW after
    clip_grad_norm_ on CUDA, within that reference's float32 error against float64 on CUDA: losses,
    norms and final weights, as the CPU runs do against the CPU reference."""
    ref = reference(device="cuda")
    world = min(torch.cuda.device_count(), 2)
    for rank in spawn(world, "fp32_cuda_runs", workdir, backend="nccl"):
        for variant, run in rank.items():
            assert all(run["ok"]) and not run["grad_scale_left"], variant
            _close(run, ref)
            _weights_close(run["final"], ref)
