"""`primitives/context_parallel/gdn_fla_chain.py` on CPU: the calls it hands to fla, what it asks of
fla's kernels for a zigzag context (segments, outputs, merges, chain order; fla stood in by recorders),
and `at_once`'s order. Its numbers (fla's kernels) are checked on GPUs by
test_context_parallel_fla_gpu.py (concurrent against serial, both against float64) and on CPU by
Triton's interpreter (benchmarks/context_parallel/probes/probe_fla_cp_interpreter.py)."""
from __future__ import annotations

import gc
import sys
import types
import pytest
import torch

from bumblebee.primitives.context_parallel import ContextParallel
from bumblebee.primitives.context_parallel import gdn_fla_chain as chain

CONCURRENT = chain.ChainPass(concurrent_parts=True)


class _Context:
    """What the dispatchers read of fla's FLACPContext (a plain dataclass: weakly referenceable)."""

    def __init__(self):
        self.group, self.layout = object(), "zigzag"


def _context():
    return _Context()


def test_register_routes_only_live_registered_contexts():
    mine, other = _context(), _context()
    chain.register(mine, CONCURRENT)
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
    chain.register(mine, CONCURRENT)
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
    assert ContextParallel().fla_concurrent_parts is True  # measured: 2-5% off fla's own order (NOTES.md)
    with pytest.raises(ValueError, match="fla_concurrent_parts must be a bool"):
        ContextParallel(fla_concurrent_parts="yes")


class _Launch:
    """A Triton kernel stood in: `kernel[grid](**kw)` records (grid, kw) under `name`."""

    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def __getitem__(self, grid):
        return lambda **kw: self.rec.setdefault(self.name, []).append((grid, kw))


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's chain kernels and all-gather stood in by recorders; rank r's gathered maps are its own + r."""
    rec = {"fwd": [], "bwd": [], "merge": []}

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    for name in ("fla", "fla.ops", "fla.ops.cp"):
        module(name)
    module("fla.ops.cp.chunk_fwd", chunk_cp_fwd_h=lambda **kw: rec["fwd"].append(kw),
           chunk_cp_fwd_kernel_h=_Launch(rec, "fwd kernel"))
    module("fla.ops.cp.chunk_bwd", chunk_cp_bwd_dh=lambda **kw: rec["bwd"].append(kw),
           chunk_cp_bwd_kernel_dh=_Launch(rec, "bwd kernel"))
    module("fla.ops.cp.chunk_merge", chunk_cp_merge=lambda **kw: rec["merge"].append(kw))

    def gather(t, group):
        return torch.stack([t + r for r in range(rec["world"])]), None
    module("fla.ops.cp.comm", all_gather_into_tensor=gather)

    def at(rank, world):
        rec.update(world=world)
        monkeypatch.setattr(chain.dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(chain.dist, "get_world_size", lambda group=None: world)
    rec["at"] = at
    return rec


def _zigzag(first, last, before, after):
    ctx = _Context()
    ctx.front_num_seqs, ctx.is_first_by_part, ctx.is_last_by_part = 1, first, last
    ctx.pre_num_ranks_by_part, ctx.post_num_ranks_by_part = before, after
    chain.register(ctx, CONCURRENT)
    return ctx


def _same(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_a_middle_rank_summarizes_both_parts_and_merges_both(fake_fla):
    """CP = 2, rank 1: chunks 1 (front) and 2 (back) of the chain 0..3, neither first nor last."""
    fake_fla["at"](1, 2)
    L, HV, K = 4, 2, 8
    k = torch.zeros(1, 2 * L, 1, K)
    u = torch.zeros(1, 2 * L, HV, K)
    cu = torch.tensor([0, L, 2 * L])
    ctx = _zigzag((False, False), (False, False), (1, 2), (2, 1))
    entering = chain._fwd_pre_process(k=k, w=k, u=u, g=None, cu_seqlens=cu, context=ctx)
    assert entering.shape == (2, HV, K, K) and entering.dtype == torch.float32
    calls = fake_fla["fwd"]
    assert [c["cu_seqlens"].tolist() for c in calls] == [[0, L], [L, 2 * L]]  # each part's last segment
    assert calls[0]["hm"].data_ptr() != calls[1]["hm"].data_ptr()
    merges = fake_fla["merge"]
    assert [(m["num_ranks"], m["rank"], m["forward"]) for m in merges] == [(1, 1, True), (2, 2, True)]
    assert _same(merges[0]["h"], entering[0]) and _same(merges[1]["h"], entering[1])
    # chain order: rank fronts ascending, then rank backs descending (the gathered maps are + rank)
    assert merges[0]["ag_hm"][:, 0, 0, 0].tolist() == [0, 1, 1, 0]
    leaving, none = chain._bwd_pre_process(q=k, k=k, w=k, do=u, dv=u, scale=0.5, cu_seqlens=cu, context=ctx)
    assert none is None and leaving.shape == (2, HV, K, K)
    assert [c["cu_seqlens"].tolist() for c in fake_fla["bwd"]] == [[0, L], [L, 2 * L]]  # first segments
    back = merges[2:]
    assert [(m["num_ranks"], m["rank"], m["forward"]) for m in back] == [(2, 1, False), (1, 2, False)]
    assert _same(back[0]["h"], leaving[0]) and _same(back[1]["h"], leaving[1])


def test_rank_0_skips_the_chain_ends(fake_fla):
    """CP = 2, rank 0: chunks 0 (the chain's first) and 3 (its last): one summary each way, one merge."""
    fake_fla["at"](0, 2)
    k, u, cu = torch.zeros(1, 8, 1, 8), torch.zeros(1, 8, 2, 8), torch.tensor([0, 4, 8])
    ctx = _zigzag((True, False), (False, True), (0, 3), (3, 0))
    chain._fwd_pre_process(k=k, w=k, u=u, cu_seqlens=cu, context=ctx)
    assert [c["cu_seqlens"].tolist() for c in fake_fla["fwd"]] == [[0, 4]]  # the last part has no successor
    assert [(m["num_ranks"], m["rank"]) for m in fake_fla["merge"]] == [(3, 3)]  # the first part, no predecessor
    chain._bwd_pre_process(q=k, k=k, w=k, do=u, dv=u, cu_seqlens=cu, context=ctx)
    assert [c["cu_seqlens"].tolist() for c in fake_fla["bwd"]] == [[4, 8]]
    assert [(m["num_ranks"], m["rank"]) for m in fake_fla["merge"][1:]] == [(3, 0)]


def test_a_keyword_it_does_not_know_goes_to_fla(fla_functions):
    mine = _context()
    chain.register(mine, CONCURRENT)
    k = torch.zeros(1, 8, 2, 16)
    assert chain._fwd_pre_process(k=k, w=k, u=k, context=mine, newer_option=1) == "fla fwd"
    assert fla_functions[0][1]["newer_option"] == 1


@pytest.mark.parametrize("concurrent", [False, True])
def test_our_transition_maps_beside_flas_state_columns(fake_fla, concurrent):
    """fla_transition="fp32": fla's summary kernel launched over the state columns only (V / BV blocks
    of its grid), our transition map (kernels/context_parallel_gdn_transition.py, its torch path here) in the columns
    past V of the same summary, forward and backward, for each part that exports one."""
    from bumblebee.kernels.context_parallel_gdn_transition import transition_torch
    fake_fla["at"](1, 2)
    L, H, HV, K, V = 70, 1, 2, 16, 128  # V = four of fla's 32-wide column blocks (its blocks at K <= 64)
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, 2 * L, H, K, generator=gen), dim=-1)
    w = 0.5 * torch.randn(1, 2 * L, HV, K, generator=gen) / K ** 0.5
    g = -torch.rand(1, 2 * L, HV, generator=gen).cumsum(1) * 0.1
    u, cu = torch.randn(1, 2 * L, HV, V, generator=gen), torch.tensor([0, L, 2 * L])
    ctx = _zigzag((False, False), (False, False), (1, 2), (2, 1))
    chain.register(ctx, chain.ChainPass(concurrent, "fp32"))
    chain._fwd_pre_process(k=k, w=w, u=u, g=g, cu_seqlens=cu, context=ctx, chunk_size=64)
    launches = fake_fla["fwd kernel"]
    assert fake_fla["fwd"] == [] and [grid for grid, _ in launches] == [(4, HV), (4, HV)]
    assert [kw["cu_seqlens"].tolist() for _, kw in launches] == [[0, L], [L, 2 * L]]
    gathered = fake_fla["merge"][0]["ag_hm"]  # chain order: rank 0's front, rank 1's front, ...; + rank
    for part, seg in enumerate(([0, L], [L, 2 * L])):
        want = transition_torch(k, w, g, torch.tensor(seg), chunk_size=64)
        got = gathered[1 if part == 0 else 2][..., V:] - 1  # rank 1's maps, less the stand-in gather's + 1
        assert torch.allclose(got, want, atol=1e-6), part
    chain._bwd_pre_process(q=k, k=k, w=w, do=u, dv=u, g=g, scale=0.5, cu_seqlens=cu, context=ctx, chunk_size=64)
    assert fake_fla["bwd"] == [] and len(fake_fla["bwd kernel"]) == 2
    back = fake_fla["merge"][2]["ag_hm"]
    for part, seg in enumerate(([0, L], [L, 2 * L])):
        want = transition_torch(k, w, g, torch.tensor(seg), chunk_size=64, reverse=True)
        assert torch.allclose(back[1 if part == 0 else 2][..., V:] - 1, want, atol=1e-6), part


def test_other_gates_keep_flas_summary(fake_fla):
    """A call with per-key gates (gk) or no gate: fla's whole summary kernel, whatever the option."""
    fake_fla["at"](1, 2)
    k, u, cu = torch.zeros(1, 8, 1, 8), torch.zeros(1, 8, 2, 8), torch.tensor([0, 4, 8])
    ctx = _zigzag((False, False), (False, False), (1, 2), (2, 1))
    chain.register(ctx, chain.ChainPass(False, "bf16"))
    chain._fwd_pre_process(k=k, w=k, u=u, g=None, cu_seqlens=cu, context=ctx)
    chain._fwd_pre_process(k=k, w=k, u=u, g=u[..., 0], gk=k, cu_seqlens=cu, context=ctx)
    assert len(fake_fla["fwd"]) == 4 and "fwd kernel" not in fake_fla


def test_transition_option_is_checked():
    assert ContextParallel().fla_transition == "bf16x2"  # measured: 0.85 against fla's 0.68 (128K, CP = 2)
    with pytest.raises(ValueError, match="fla_transition must be one of"):
        ContextParallel(fla_transition="tf32")


def _counted_maps(monkeypatch):
    """Our transition kernel's calls (its torch path here), counted by direction."""
    from bumblebee.kernels import context_parallel_gdn_transition as kernel
    made, real = [], kernel.transition_map

    def counted(*args, reverse=False, **kw):
        made.append("reverse" if reverse else "forward")
        return real(*args, reverse=reverse, **kw)
    monkeypatch.setattr(kernel, "transition_map", counted)
    return made


def _chain_passes(fake_fla, monkeypatch, rank, zigzag, transition, hand_back=lambda t: t, L=70, V=128):
    """One forward and one backward pre-process on `rank` of CP = 2 with our maps at `transition`, fla handing
    the backward `hand_back` of the forward's entering states: (the inputs, the transition calls each way)."""
    made = _counted_maps(monkeypatch)
    fake_fla["at"](rank, 2)
    gen = torch.Generator().manual_seed(1)
    k = torch.nn.functional.normalize(torch.randn(1, 2 * L, 1, 16, generator=gen), dim=-1)
    w = 0.5 * torch.randn(1, 2 * L, 2, 16, generator=gen) / 4
    g = -torch.rand(1, 2 * L, 2, generator=gen).cumsum(1) * 0.1
    u, cu = torch.randn(1, 2 * L, 2, V, generator=gen), torch.tensor([0, L, 2 * L])
    ctx = _zigzag(*zigzag)
    chain.register(ctx, chain.ChainPass(False, transition))
    entering = chain._fwd_pre_process(k=k, w=w, u=u, g=g, cu_seqlens=cu, context=ctx, chunk_size=64)
    forward = list(made)
    chain._bwd_pre_process(q=k, k=k, w=w, do=u, dv=u, g=g, scale=0.5, cu_seqlens=cu, context=ctx, chunk_size=64,
                           initial_state=hand_back(entering))
    return (k, w, g), forward, made[len(forward):]


@pytest.mark.parametrize("copied", [False, True])
def test_the_backward_transposes_the_forwards_maps(fake_fla, monkeypatch, copied):
    """A middle rank's backward takes each part's map as the forward's transposed, found through the entering
    states fla hands back (unpacked rows: the forward's own tensor), with no transition call; entering states
    fla copied (packed rows) leave the backward computing its maps. Either way they equal the reverse map."""
    from bumblebee.kernels.context_parallel_gdn_transition import transition_torch
    L, V, middle = 70, 128, ((False, False), (False, False), (1, 2), (2, 1))
    hand_back = (lambda t: t.clone()) if copied else (lambda t: t)
    (k, w, g), forward, backward = _chain_passes(fake_fla, monkeypatch, 1, middle, "fp32", hand_back)
    assert forward == ["forward", "forward"] and backward == (["reverse", "reverse"] if copied else [])
    back = fake_fla["merge"][2]["ag_hm"]
    for part, seg in enumerate(([0, L], [L, 2 * L])):
        want = transition_torch(k, w, g, torch.tensor(seg), chunk_size=64, reverse=True)
        assert torch.allclose(back[1 if part == 0 else 2][..., V:] - 1, want, atol=1e-6), part


def test_the_chain_ends_get_no_maps(fake_fla, monkeypatch):
    """Rank 0 holds the chain's first part (nothing enters it: no forward map) and its last (nothing leaves
    it: no backward map); each still gets its state columns."""
    ends = ((True, False), (False, True), (0, 3), (3, 0))
    _, forward, backward = _chain_passes(fake_fla, monkeypatch, 0, ends, "bf16x2")
    assert forward == [] and backward == []
    assert len(fake_fla["fwd kernel"]) == 1 and len(fake_fla["bwd kernel"]) == 1  # the state columns
    assert fake_fla["merge"][0]["ag_hm"][0][..., 128:].eq(0).all()  # rank 0's first part: M left 0 (+ rank 0)
