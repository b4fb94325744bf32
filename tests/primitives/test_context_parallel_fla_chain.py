"""`primitives/context_parallel/gdn_fla_chain.py` on CPU: which calls it takes, and `at_once`'s order.
Its numbers (fla's kernels) are checked on GPUs by test_context_parallel_fla_gpu.py (concurrent
against serial, and both against float64) and on CPU by Triton's interpreter
(benchmarks/context_parallel/probes/probe_fla_cp_interpreter.py)."""
from __future__ import annotations

import gc
import pytest
import torch

from bumblebee.primitives.context_parallel import ContextParallel
from bumblebee.primitives.context_parallel import gdn_fla_chain as chain


class _Context:
    """What the dispatchers read of fla's FLACPContext (a plain dataclass: weakly referenceable)."""

    def __init__(self):
        self.group, self.layout = object(), "zigzag"


def _context():
    return _Context()


def test_register_routes_only_live_registered_contexts():
    mine, other = _context(), _context()
    chain.register(mine)
    assert chain.is_mine(mine) and not chain.is_mine(other) and not chain.is_mine(None)
    key = id(mine)
    del mine
    gc.collect()
    assert key not in chain._MINE  # a collected context leaves no entry (a later object may reuse its id)


@pytest.fixture
def fla_functions(monkeypatch):
    """fla's two pre-process functions stood in by recorders (fla is not installed on CPU)."""
    calls = []
    monkeypatch.setitem(chain._FLA, "fwd", lambda **kw: calls.append(("fwd", kw)) or "fla fwd")
    monkeypatch.setitem(chain._FLA, "bwd", lambda **kw: calls.append(("bwd", kw)) or "fla bwd")
    return calls


def test_calls_it_does_not_take_reach_fla_untouched(fla_functions):
    k = torch.zeros(1, 8, 2, 16)
    unregistered = _context()
    assert chain._fwd_pre_process(k=k, w=k, u=k, cu_seqlens=None, context=unregistered) == "fla fwd"
    assert chain._bwd_pre_process(q=k, k=k, w=k, do=k, dv=k, scale=0.5, context=None) == "fla bwd"
    mine = _context()
    chain.register(mine)
    # registered, but a case fla serves itself: CUDA graphs, a given state, another layout, a wide key
    assert chain._fwd_pre_process(k=k, w=k, u=k, context=mine, use_graph=True) == "fla fwd"
    assert chain._fwd_pre_process(k=k, w=k, u=k, context=mine, initial_state=k) == "fla fwd"
    assert chain._bwd_pre_process(q=k, k=k, w=k, do=k, dv=k, context=mine, dht=k) == "fla bwd"
    mine.layout = "contiguous"
    assert chain._fwd_pre_process(k=k, w=k, u=k, context=mine) == "fla fwd"
    mine.layout = "zigzag"
    wide = torch.zeros(1, 8, 2, 512)
    assert chain._bwd_pre_process(q=wide, k=wide, w=wide, do=k, dv=k, context=mine) == "fla bwd"
    assert len(fla_functions) == 7
    name, kw = fla_functions[0]
    assert name == "fwd" and kw["context"] is unregistered and kw["k"] is k and kw["chunk_size"] == 64


def test_at_once_runs_every_call_in_order_off_cuda():
    seen = []
    chain.at_once([lambda i=i: seen.append(i) for i in range(3)], torch.device("cpu"))
    assert seen == [0, 1, 2]
    chain.at_once([], torch.device("cpu"))


def test_option_is_a_bool():
    assert ContextParallel().fla_concurrent_parts is False  # on once measured on GPUs
    with pytest.raises(ValueError, match="fla_concurrent_parts must be a bool"):
        ContextParallel(fla_concurrent_parts="yes")
