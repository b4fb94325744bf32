"""state_sharding: a checkpoint loaded into a state whose model has already run a forward gives the
same forward as a fresh state that loaded it (bitwise: both compute from the same weights in the same
order), on 1 and 2 gloo ranks, FSDP2 and ZeRO-1, untied and tied heads.

FSDP2 keeps a unit's unsharded parameters after a forward that no backward follows (the root unit
always: final norm and head, or the tied embedding; every unit with reshard_after_forward=False),
and the next forward reuses them without a gather: a load that writes the sharded parameters only
would leave that forward on the old weights. The runtime's `forward` (no graph) before `load_state`
is the path RL frameworks take (old log-probs or values, then a resume).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bumblebee import models, registry
from bumblebee.runtime import Batch, Runtime
from tests.primitives.test_state_sharding import spawn

CFG = "qwen3-tiny"
TIED = {**models.NAMED[CFG], "tie_word_embeddings": True}
CASES = {  # name -> (state sharding, reshard_after_forward, model, mixed precision)
    "fsdp2": ("fsdp2", True, CFG, "fp32"),
    "fsdp2_keep": ("fsdp2", False, CFG, "fp32"),  # every unit keeps its gathered parameters
    "fsdp2_bf16": ("fsdp2", True, CFG, "bf16"),
    "tied_fsdp2": ("fsdp2", True, TIED, "fp32"),
    "zero1": ("zero1", True, CFG, "fp32"),
    "tied_zero1": ("zero1", True, TIED, "fp32"),
}
B, T = 2, 9


def _ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _state(case: str, mesh, seed: int):
    impl, raf, config, mp = CASES[case]
    model = models.build(config, impl={"cross_entropy": "materialized_ce"}, seed=seed, device=mesh.device_type)
    return registry.resolve("state_sharding", impl)(model, mesh, lr=1e-2, mixed_precision=mp,
                                                    reshard_after_forward=raf)


@torch.no_grad()
def _logits(state, ids):
    return state.model(ids).logits.detach().clone()


def load_after_forward(mesh, out: Path):
    """Per case: a trained state's checkpoint; a state that ran a forward (model call or the runtime's)
    before loading it, and one that loaded it fresh: the logits of each after the load."""
    n, r = mesh.size(), mesh.get_local_rank()
    res = {}
    for case in CASES:
        trained = _state(case, mesh, seed=0)
        vocab = trained.model.config.vocab_size
        ids = _ids(vocab, seed=1)[r * B // n:(r + 1) * B // n]
        loss = trained.model(ids, labels=ids).loss
        loss.backward()
        trained.step()
        trained.zero_grad()
        ckpt = out / f"ckpt-{case}-{n}"
        trained.save(ckpt)
        probe = _ids(vocab, seed=2)
        got = {"trained": _logits(trained, probe)}
        fresh = _state(case, mesh, seed=9)
        fresh.load(ckpt)
        got["fresh"] = _logits(fresh, probe)
        warm = _state(case, mesh, seed=7)
        got["before"] = _logits(warm, probe)  # leaves FSDP2's gathered parameters in place
        warm.load(ckpt)
        got["after_forward"] = _logits(warm, probe)
        other = _state(case, mesh, seed=5)
        rt = Runtime(other.model, other)
        rt.forward(Batch(probe))
        rt.load_state(ckpt)
        got["after_runtime_forward"] = _logits(other, probe)
        res[case] = got
        # a forward between the backward and the step (a metric, a value): the step moves the masters
        # under the gathered parameters that forward left
        plain, peeked = _state(case, mesh, seed=3), _state(case, mesh, seed=3)
        for state in (plain, peeked):
            state.model(ids, labels=ids).loss.backward()
        _logits(peeked, probe)
        for state in (plain, peeked):
            state.step()
        got["stepped"], got["stepped_after_forward"] = _logits(plain, probe), _logits(peeked, probe)
    return res


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(request, tmp_path_factory):
    return spawn(request.param, "load_after_forward", tmp_path_factory.mktemp("load-after-forward"),
                 module=__name__)


@pytest.mark.parametrize("case", list(CASES))
def test_load_after_a_forward_equals_a_fresh_load(ranks, case):
    for got in (rank[case] for rank in ranks):
        assert not torch.equal(got["before"], got["fresh"])  # the load must change what the forward sees
        assert torch.equal(got["fresh"], got["trained"])
        assert torch.equal(got["after_forward"], got["fresh"])
        assert torch.equal(got["after_runtime_forward"], got["fresh"])


@pytest.mark.parametrize("case", list(CASES))
def test_step_after_a_forward_equals_a_plain_step(ranks, case):
    for got in (rank[case] for rank in ranks):
        assert torch.equal(got["stepped_after_forward"], got["stepped"])
