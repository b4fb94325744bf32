"""Plan properties over random layouts (fixed seeds): deterministic whatever the order of its
inputs, every destination element written exactly once, bytes on the wire equal to the bytes the
receivers keep (HEADER_BYTES = 0), no rank over the budget in a round, replicated tensors spread
over the senders, and the plan replayed in memory (sender views -> receiver targets) gives what
each receiver's spec makes of the full tensors."""
from __future__ import annotations

import random

import pytest
import torch

from bumblebee.primitives.weight_transfer import HEADER_BYTES, make_plan
from bumblebee.primitives.weight_transfer.boxes import box_numel, box_shape, full_box, view
from bumblebee.primitives.weight_transfer.execute import read_from
from bumblebee.primitives.weight_transfer.spec import Piece, ReceiverSpec, SenderSpec, dtype_of

DTYPES = ("float32", "bfloat16", "float16")


def _layout(rng: random.Random):
    """(manifest, full tensors, sender specs, their local tensors, receiver specs, receiver targets)."""
    n_send, n_recv = rng.randint(1, 4), rng.randint(1, 4)
    manifest, full = [], {}
    for i in range(rng.randint(1, 6)):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        dt = rng.choice(DTYPES)
        manifest.append((f"t{i}", shape, dt))
        full[f"t{i}"] = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype_of(dt))
    boxes = {r: [] for r in range(n_send)}
    for name, shape, _ in manifest:
        kind = rng.choice(("replicated", "dim0", "dim0_twice"))
        if kind == "replicated":
            for r in boxes:
                boxes[r].append((name, full_box(shape), True))
            continue
        cuts = sorted({0, shape[0], *(rng.randint(0, shape[0]) for _ in range(n_send - 1))})
        spans = list(zip(cuts, cuts[1:]))
        for j, (a, b) in enumerate(spans):  # dim0_twice: every shard also held by a second rank
            for r in {j % n_send, (j + 1) % n_send} if kind == "dim0_twice" else {j % n_send}:
                boxes[r].append((name, ((a, 1, b - a),) + full_box(shape[1:]), False))
    senders = [SenderSpec(r + 100, tuple(b)) for r, b in boxes.items()]
    local = {r + 100: {(n, b): view(full[n], b) for n, b, _ in bs} for r, bs in boxes.items()}
    receivers, targets = {}, {}
    for r in range(n_recv):
        pieces, tg = [], {}
        for name, shape, dt in manifest:
            if rng.random() < 0.2:
                continue  # this receiver keeps none of it
            box = []
            for n in shape:  # a random strided slice on every dimension
                step = rng.choice((1, 1, 2))
                start = rng.randint(0, n - 1)
                box.append((start, step, rng.randint(1, (n - 1 - start) // step + 1)))
            box = tuple(box)
            for copy in range(rng.choice((1, 1, 2))):  # a tied weight: one piece, two targets
                tname = f"{name}.{copy}"
                t = torch.full(box_shape(box), -7.0, dtype=dtype_of(rng.choice(DTYPES)))
                tg[tname] = t
                pieces.append(Piece(name, box, tname, t.stride(), 0))
        receivers[r] = ReceiverSpec(tuple(manifest), tuple((n, tuple(t.shape), t.stride(), str(t.dtype)) for n, t in tg.items()),
                                    tuple(pieces))
        targets[r] = tg
    return manifest, full, senders, local, receivers, targets


@pytest.mark.parametrize("seed", range(40))
def test_plan_properties(seed):
    rng = random.Random(seed)
    manifest, full, senders, local, receivers, targets = _layout(rng)
    budget = rng.choice((16, 64, 256, 4096))
    plan = make_plan(senders, receivers, manifest, budget_bytes=budget)
    shuffled = senders[::-1]
    again = make_plan(shuffled, dict(reversed(list(receivers.items()))), manifest, budget_bytes=budget)
    assert again.digest == plan.digest and again == plan  # deterministic

    size = {n: dtype_of(dt).itemsize for n, _, dt in manifest}
    need = sum(box_numel(b) * size[n] for spec in receivers.values() for n, b in {(p.hf_name, p.box) for p in spec.pieces})
    assert plan.total_bytes + HEADER_BYTES * len({(e.round, e.src, e.dst) for e in plan.entries}) == need
    assert sum(plan.bytes_received().values()) == need
    assert plan.round_peak() <= budget

    # exactly one writer per destination element, and only where the spec writes
    for dst, spec in receivers.items():
        count = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in targets[dst].items()}
        for e in plan.entries:
            if e.dst == dst:
                for t, st, off in e.writes:
                    count[t].as_strided(box_shape(e.box), st, off).add_(1)
        for n, c in count.items():
            assert bool((c == 1).all()), (seed, dst, n)  # each test target is exactly its piece

    # replay in memory: sender views -> receiver targets == the spec applied to the full tensors
    reads = {s: read_from(loc) for s, loc in local.items()}
    for e in plan.entries:
        got = reads[e.src](e)
        for t, st, off in e.writes:
            tt = targets[e.dst][t]
            tt.as_strided(box_shape(e.box), st, off).copy_(got)
    for dst, spec in receivers.items():
        want = {n: torch.full_like(t, -7.0) for n, t in targets[dst].items()}
        spec.apply(full, want)
        for n in want:
            assert torch.equal(targets[dst][n], want[n]), (seed, dst, n)


def test_replicated_tensors_are_spread_over_senders():
    manifest = [(f"w{i}", (16, 8), "float32") for i in range(12)]
    senders = [SenderSpec(r, tuple((n, full_box(s), True) for n, s, _ in manifest)) for r in range(4)]
    receivers = {10 + r: ReceiverSpec(tuple(manifest), (), tuple(Piece(n, full_box(s), n, (8, 1), 0) for n, s, _ in manifest))
                 for r in range(3)}
    plan = make_plan(senders, receivers, manifest, budget_bytes=1 << 20)
    sent = plan.bytes_sent()
    assert sorted(sent) == [0, 1, 2, 3] and max(sent.values()) - min(sent.values()) <= 16 * 8 * 4
    # every receiver gets each tensor once, from one sender
    for r in receivers:
        assert sorted(e.hf_name for e in plan.entries if e.dst == r) == sorted(n for n, _, _ in manifest)


def test_uncovered_need_and_bad_budget_raise():
    manifest = [("w", (8, 4), "float32")]
    senders = [SenderSpec(0, (("w", ((0, 1, 4), (0, 1, 4)), False),))]  # rows 4..7 held by nobody
    receivers = {1: ReceiverSpec(tuple(manifest), (), (Piece("w", full_box((8, 4)), "w", (4, 1), 0),))}
    with pytest.raises(ValueError, match="'w'"):
        make_plan(senders, receivers, manifest, budget_bytes=1024)
    with pytest.raises(ValueError, match="budget_bytes"):
        make_plan(senders, receivers, manifest, budget_bytes=0)
    missing = {1: ReceiverSpec(tuple(manifest), (), (Piece("v", full_box((8, 4)), "v", (4, 1), 0),))}
    with pytest.raises(ValueError, match="'v'.*no sender"):
        make_plan(senders, missing, manifest, budget_bytes=1024)


def test_simulated_benchmark_runs(monkeypatch):
    """benchmarks/weight_transfer/bench.py's simulation on a tiny model, in this process (its full run
    is the committed results/simulated.json)."""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path
    monkeypatch.setattr(sys, "path", list(sys.path))  # the bench puts benchmarks/ first: undone after
    path = Path(__file__).resolve().parents[2] / "benchmarks/weight_transfer/bench.py"
    spec = importlib.util.spec_from_file_location("weight_transfer_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.simulate(argparse.Namespace(model="qwen3-moe-tiny", layers=1, sim_trainers=2, max_ranks=8,
                                             budget_bytes=256 << 20))["rows"]
    for r in rows:  # p2p never moves more than the twin, and the twin's rollout rank gets the whole model
        assert r["p2p_bytes"] <= r["broadcast_bytes"] and r["p2p_bytes_per_rollout_rank"] <= r["broadcast_bytes_per_rollout_rank"] * 1.5
    assert max(r["broadcast_over_p2p"] for r in rows if r["rollout_tp"] == 2) > 1.9


@pytest.mark.parametrize("bad", [0, 3, "2", True])
def test_send_buffers_is_one_or_two(bad):
    from bumblebee.primitives.weight_transfer import P2PTransfer
    with pytest.raises(ValueError, match="send_buffers"):
        P2PTransfer(send_buffers=bad)
