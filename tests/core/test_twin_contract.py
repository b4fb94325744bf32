"""The twin contract for every registered pair: same signature, same state_dict, and the same
function within a tolerance stated relative to PyTorch's own float32 error against a float64 run
(the twin in float64 is the reference; the twin in float32 measures PyTorch's error; the primitive
runs in float32). Functional slots: one call, outputs and input gradients. Module slots: the twin's
state_dict loaded into the primitive, outputs, input and parameter gradients. state_sharding: a few
optimizer steps of each twin on a one-rank mesh, losses and parameter updates.

A primitive never runs its twin's code, so the contract compares two implementations: on these
inputs (fresh random values, odd shapes, every output a sum or product of many terms) two
implementations that round differently cannot agree on every bit, and the test fails when every
floating output and gradient of the primitive is bitwise the twin's fp32 run. Integer outputs
(indices, counts) are left out: two honest implementations give the same ones; so are the slots
that only copy or place their inputs (`SAME_BITS_BY_DESIGN` in tests/contract_cases.py, with why)."""
import contextlib
import copy
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bumblebee import models, registry
from tests.contract_cases import CASES, SAME_BITS_BY_DESIGN, OneRankSteps

ROOT = Path(__file__).resolve().parents[2]

PAIRS = [(slot, impl.name, impl.twin) for slot, impls in registry.slots().items()
         for impl in impls.values() if impl.kind == "primitive"]


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return copy.deepcopy(x).to(dtype) if isinstance(x, torch.nn.Module) else x


def _outputs(fn, args, kwargs, grad_idx, dtype, params=()):
    """Outputs, then the gradients of the inputs in grad_idx and of `params` (name, tensor) pairs."""
    args = [a.to(dtype).requires_grad_(i in grad_idx) if a.is_floating_point() else a
            for i, a in enumerate(args)]
    out = fn(*args, **{k: _cast(v, dtype) for k, v in kwargs.items()})
    outs = out if isinstance(out, tuple) else (out,)
    # the same upstream gradients in every dtype: drawn in float64, then cast
    g = torch.Generator().manual_seed(7)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
                for o in outs if o.is_floating_point())
    wrt = [args[i] for i in grad_idx] + [p for _, p in params]
    grads = torch.autograd.grad(total, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if d is None else d for w, d in zip(wrt, grads)]
    return [o.detach() for o in outs] + grads


def _assert_within_torch_error(ref, torch_run, ours, labels):
    assert len(ref) == len(torch_run) == len(ours) == len(labels)
    for r, t, o, label in zip(ref, torch_run, ours, labels):
        if not r.is_floating_point():  # indices, counts: equal
            assert torch.equal(o, r), label
            continue
        assert o.shape == r.shape, (label, o.shape, r.shape)
        scale = r.norm().item() + 1e-30
        e_torch = (t.double() - r).norm().item() / scale
        e_ours = (o.double() - r).norm().item() / scale
        assert e_ours <= 4 * e_torch + 1e-6, (label, e_ours, e_torch)


def _assert_not_the_twins_bits(torch_run, ours, labels, pair):
    """At least one floating output or gradient differs from the twin's fp32 run in some bit (equal
    floats are fine one by one: a gradient that is a pure copy, zeros of an unused input)."""
    floats = [(label, o, t) for o, t, label in zip(ours, torch_run, labels) if o.is_floating_point()]
    assert floats, f"{pair}: no floating output or gradient to compare"
    assert any(not torch.equal(o, t) for _, o, t in floats), (
        f"{pair}: every floating output and gradient ({', '.join(label for label, _, _ in floats)}) is bitwise "
        "the twin's: the primitive runs the twin's arithmetic (a primitive computes with its own algorithm)")


def test_every_slot_has_a_contract_case():
    assert set(registry.slots()) <= set(CASES), f"add a case to tests/contract_cases.py for {set(registry.slots()) - set(CASES)}"


def test_every_primitive_names_a_registered_baseline_twin():
    assert PAIRS, "no primitive registered"
    for slot, name, twin in PAIRS:
        assert twin is not None, f"{slot}/{name} has no twin"
        assert registry.get(slot, twin).kind == "baseline"


@pytest.mark.parametrize("slot,name,twin", PAIRS)
def test_same_signature(slot, name, twin):
    a, b = registry.resolve(slot, name), registry.resolve(slot, twin)
    assert inspect.signature(a) == inspect.signature(b)  # a class: its constructor's, a bound one's without the config


@pytest.mark.parametrize("slot,name,twin", PAIRS)
@pytest.mark.parametrize("seed", [0, 1])
def test_same_function(slot, name, twin, seed, tmp_path):
    prim, base = registry.resolve(slot, name), registry.resolve(slot, twin)
    if hasattr(CASES[slot], "check_pair"):  # twins that run across ranks check themselves (RanksPair)
        if seed:
            pytest.skip("one seed: the ranks build their own weights")
        return CASES[slot].check_pair(name, twin, tmp_path)
    if isinstance(CASES[slot], OneRankSteps):
        if seed:
            pytest.skip("one seed: every step draws fresh batches")
        return _same_training_steps(CASES[slot], prim, base)
    _same_function(slot, name, prim, base, seed)


@pytest.mark.parametrize("slot,name,twin", [p for p in PAIRS if p[0] in CASES and p[0] not in SAME_BITS_BY_DESIGN])
def test_a_twin_in_its_primitives_place_fails(slot, name, twin):
    """The bitwise check catches a primitive that runs its twin's arithmetic: here the twin itself."""
    base = registry.resolve(slot, twin)
    with pytest.raises(AssertionError, match="bitwise the twin's"):
        _same_function(slot, name, base, base, 0)


def _same_function(slot, name, prim, base, seed):
    if registry.is_module(prim):
        return _same_module_function(slot, prim, base, seed)
    args, kwargs, grad_idx = CASES.get(f"{slot}/{name}", CASES[slot])(torch.Generator().manual_seed(seed))
    ref = _outputs(base, args, kwargs, grad_idx, torch.float64)
    torch_run = _outputs(base, args, kwargs, grad_idx, torch.float32)
    ours = _outputs(prim, args, kwargs, grad_idx, torch.float32)
    labels = [f"output {i}" for i in range(len(ref) - len(grad_idx))] + [f"grad of arg {i}" for i in grad_idx]
    _assert_within_torch_error(ref, torch_run, ours, labels)
    if slot not in SAME_BITS_BY_DESIGN:
        _assert_not_the_twins_bits(torch_run, ours, labels, f"{slot}/{name}")


# ---- module slots: the twin's weights in both -----------------------------------------------------

def _build(cls, slot, seed):
    """The module from its "<slot>.init" arguments, under its own seed (the global RNG left as it was),
    every parameter moved off its initial value (ones, zeros) so that none is compared at a trivial point."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        args, kwargs = CASES[slot + ".init"](torch.Generator().manual_seed(seed))
        module = cls(*args, **kwargs)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return module


def _same_module_function(slot, prim_cls, base_cls, seed):
    base = _build(base_cls, slot, seed)
    prim = _build(prim_cls, slot, seed + 100)
    prim.load_state_dict(base.state_dict())  # strict: the same keys and shapes
    names = [n for n, _ in base.named_parameters()]
    assert names, f"{slot}: a module slot without parameters"
    args, kwargs, grad_idx = CASES[slot](torch.Generator().manual_seed(seed))

    def run(module, dtype):
        module = copy.deepcopy(module).to(dtype)
        params = dict(module.named_parameters())
        return _outputs(module, args, kwargs, grad_idx, dtype, [(n, params[n]) for n in names])

    ref, torch_run, ours = run(base, torch.float64), run(base, torch.float32), run(prim, torch.float32)
    n_out = len(ref) - len(grad_idx) - len(names)
    labels = ([f"output {i}" for i in range(n_out)] + [f"grad of arg {i}" for i in grad_idx]
              + [f"grad of {n}" for n in names])
    _assert_within_torch_error(ref, torch_run, ours, labels)
    if slot not in SAME_BITS_BY_DESIGN:
        _assert_not_the_twins_bits(torch_run, ours, labels, slot)


# ---- state_sharding: optimizer steps on a one-rank mesh ------------------------------------------

@contextlib.contextmanager
def _one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def _plain_steps(case, batches, dtype):
    """Plain torch: the model in `dtype`, AdamW and clip_grad_norm_; (losses, final weights)."""
    model = models.build(case.model, seed=0).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), **case.hp)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_steps(case, batches, fn, mesh):
    state = fn(models.build(case.model, seed=0), mesh, mixed_precision="fp32", grad_clip=case.grad_clip, **case.hp)
    losses = []
    for ids in batches:
        loss = state.model(ids, labels=ids).loss
        loss.backward()
        ok, _, _ = state.step()
        assert ok, state.skip_reason
        state.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), state.full_state_dict(torch.float32)


def _same_training_steps(case, prim, base):
    assert (ROOT / case.tests).is_file(), f"{case.tests} does not exist"
    vocab = models.build(case.model, seed=0).config.vocab_size
    batches = case.batches(torch.Generator().manual_seed(0), vocab)
    initial = models.build(case.model, seed=0).state_dict()
    ref, torch_run = _plain_steps(case, batches, torch.float64), _plain_steps(case, batches, torch.float32)
    with _one_rank_mesh() as mesh:
        runs = [_sharded_steps(case, batches, fn, mesh) for fn in (prim, base)]
    names = sorted(initial)
    assert all(sorted(weights) == names for _, weights in runs), "the twins' weights differ in names"

    def flat(run):  # the losses, and every weight's update (its initial value would hide the update's error)
        losses, weights = run
        return [losses] + [weights[n].double() - initial[n].double() for n in names]

    labels = ["losses"] + [f"update of {n}" for n in names]
    for run in runs:
        _assert_within_torch_error(flat(ref), flat(torch_run), flat(run), labels)
