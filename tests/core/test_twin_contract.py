"""The twin contract for every registered pair: same signature, same function within a tolerance
stated relative to PyTorch's own float32 error against a float64 run, same state_dict keys."""
import inspect
from pathlib import Path

import pytest
import torch

from bumblebee import registry
from tests.contract_cases import CASES, MultiRank

ROOT = Path(__file__).resolve().parents[2]

PAIRS = [(slot, impl.name, impl.twin) for slot, impls in registry.slots().items()
         for impl in impls.values() if impl.kind == "primitive"]


def _outputs(fn, args, kwargs, grad_idx, dtype):
    args = [a.to(dtype).requires_grad_(i in grad_idx) if a.is_floating_point() else a
            for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    # the same upstream gradients in every dtype: drawn in float64, then cast
    g = torch.Generator().manual_seed(7)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
                for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(total, [args[i] for i in grad_idx])
    return [o.detach() for o in outs] + list(grads)


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
def test_same_function(slot, name, twin, seed):
    prim, base = registry.resolve(slot, name), registry.resolve(slot, twin)
    if registry.is_module(prim):
        pytest.skip("module slots are checked by test_module_state_dicts")
    if isinstance(CASES[slot], MultiRank):
        assert (ROOT / CASES[slot].tests).is_file(), f"{slot}: {CASES[slot].tests} does not exist"
        pytest.skip(f"{slot} runs on a device mesh: checked by {CASES[slot].tests}")
    args, kwargs, grad_idx = CASES[slot](torch.Generator().manual_seed(seed))
    ref = _outputs(base, args, kwargs, grad_idx, torch.float64)
    torch_err = _outputs(base, args, kwargs, grad_idx, torch.float32)
    ours = _outputs(prim, args, kwargs, grad_idx, torch.float32)
    for r, t, o in zip(ref, torch_err, ours):
        if not r.is_floating_point():  # indices, counts: equal
            assert torch.equal(o, r)
            continue
        scale = r.norm().item() + 1e-30
        e_torch = (t.double() - r).norm().item() / scale
        e_ours = (o.double() - r).norm().item() / scale
        assert e_ours <= 4 * e_torch + 1e-6, (e_ours, e_torch)


@pytest.mark.parametrize("slot,name,twin", PAIRS)
def test_module_state_dicts(slot, name, twin):
    prim, base = registry.resolve(slot, name), registry.resolve(slot, twin)
    if not registry.is_module(prim):
        pytest.skip("functional slot: no state")
    args, kwargs = CASES[slot + ".init"](torch.Generator().manual_seed(0))
    a, b = prim(*args, **kwargs), base(*args, **kwargs)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
