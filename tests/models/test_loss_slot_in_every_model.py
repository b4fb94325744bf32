"""Every model's `cross_entropy` slot runs `linear_ce`, and the loss and gradients equal the twin's."""
import pytest
import torch

import bumblebee as bb

TINY = sorted(name for name in bb.models.NAMED if name.endswith("-tiny"))


def test_every_model_type_has_a_tiny_config():
    assert {bb.models.NAMED[n]["model_type"] for n in TINY} == set(bb.models.MODEL_TYPES)


@pytest.mark.parametrize("name", TINY)
def test_linear_ce_equals_materialized_in_the_model(name):
    results = []
    ids = torch.randint(0, bb.models.NAMED[name]["vocab_size"], (2, 23))
    labels = ids.clone()
    labels[1, :5] = -100
    for impl in ("linear_ce", "materialized_ce"):
        model = bb.models.build(name, {"cross_entropy": impl}, seed=3, dtype=torch.float64)
        loss = model(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = results
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-10, atol=1e-12, msg=n)
