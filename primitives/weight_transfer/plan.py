"""The planner: sender boxes x receiver pieces -> a deterministic list of point-to-point copies.

For each HF tensor the senders' boxes cut it into cells (the grid of every box edge); a cell is
held by one sender (a shard) or by several (a replicated tensor, or replicas of a shard). Every
receiver piece is intersected with the cells, and each part is read from exactly one holder: the
one with the fewest bytes assigned so far (ties: the lowest rank), so replicated tensors are sent
once per receiver and spread over the senders. A piece that several targets of one receiver take
(a tied weight) travels once and is written to each. Parts larger than the budget are cut along
their outer dimension; parts are then packed first-fit into rounds in which no rank sends plus
receives more than `budget_bytes`. No header travels with the data: both sides derive the same plan
from the same specs, so the bytes on the wire are exactly the bytes the receivers keep.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from bumblebee.primitives.weight_transfer.boxes import box_numel, intersect, shift_dst, split
from bumblebee.primitives.weight_transfer.spec import ReceiverSpec, SenderSpec, digest, dtype_of

HEADER_BYTES = 0  # per message on the wire; the control plane (store keys) is ~100 bytes per rank per update


@dataclass(frozen=True)
class Entry:
    src: int
    dst: int
    hf_name: str
    box: tuple
    writes: tuple  # ((target, strides, offset), ...) on the receiver
    nbytes: int
    round: int = -1


@dataclass(frozen=True)
class Plan:
    entries: tuple
    rounds: int
    budget_bytes: int
    dtypes: dict  # hf name -> wire dtype name

    @property
    def digest(self) -> str:
        return digest([(e.src, e.dst, e.hf_name, e.box, e.writes, e.round) for e in self.entries])

    def messages(self, rank: int):
        """{(round, src, dst): [entries in order]} of the messages `rank` takes part in."""
        out: dict = {}
        for e in self.entries:
            if rank in (e.src, e.dst):
                out.setdefault((e.round, e.src, e.dst), []).append(e)
        return out

    def bytes_sent(self) -> dict:
        out: dict = {}
        for e in self.entries:
            out[e.src] = out.get(e.src, 0) + e.nbytes
        return out

    def bytes_received(self) -> dict:
        out: dict = {}
        for e in self.entries:
            out[e.dst] = out.get(e.dst, 0) + e.nbytes
        return out

    def round_peak(self) -> int:
        """The most bytes one rank sends plus receives in one round."""
        use: dict = {}
        for e in self.entries:
            for r in {e.src, e.dst}:
                use[(e.round, r)] = use.get((e.round, r), 0) + e.nbytes
        return max(use.values(), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def _cells(holders):
    """[(lo, hi, [(rank, replicated)])] of a tensor's grid: the boxes' edges on every dimension."""
    ndim = len(holders[0][1])
    cuts = [sorted({b[k][0] for _, b, _ in holders} | {b[k][0] + b[k][2] for _, b, _ in holders})
            for k in range(ndim)]
    out = []
    for idx in itertools.product(*[range(len(c) - 1) for c in cuts]):
        lo = tuple(cuts[k][i] for k, i in enumerate(idx))
        hi = tuple(cuts[k][i + 1] for k, i in enumerate(idx))
        who = [r for r, b, _ in holders
               if all(b[k][0] <= lo[k] and hi[k] <= b[k][0] + b[k][2] for k in range(ndim))]
        if who:
            out.append((lo, hi, sorted(set(who))))
    return out


def make_plan(senders: list[SenderSpec], receivers: dict, manifest, *, budget_bytes: int) -> Plan:
    """The plan moving, to every receiver rank ({rank: ReceiverSpec}), the pieces it keeps, from the
    `senders`; `manifest` ((hf name, shape, dtype name), ...) gives each tensor's wire dtype."""
    if not (isinstance(budget_bytes, int) and budget_bytes > 0):
        raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
    shapes = {n: tuple(s) for n, s, _ in manifest}
    itemsize = {n: dtype_of(dt).itemsize for n, _, dt in manifest}
    holders: dict = {}
    for s in sorted(senders, key=lambda s: s.rank):
        for name, box, replicated in s.boxes:
            holders.setdefault(name, []).append((s.rank, box, replicated))
    cells = {n: _cells(h) for n, h in holders.items()}
    load = {s.rank: 0 for s in senders}
    parts = []
    for dst in sorted(receivers):
        spec: ReceiverSpec = receivers[dst]
        grouped: dict = {}
        for p in spec.pieces:
            grouped.setdefault((p.hf_name, p.box), []).append((p.target, p.strides, p.offset))
        for (name, box), writes in grouped.items():
            if name not in cells:
                raise ValueError(f"receiver rank {dst} needs {name!r}, which no sender holds")
            if name in shapes and any(s + (c - 1) * st >= n for (s, st, c), n in zip(box, shapes[name])):
                raise ValueError(f"receiver rank {dst}: {name!r} box {box} falls outside {shapes[name]}")
            for lo, hi, who in cells[name]:
                got = intersect(box, lo, hi)
                if got is None:
                    continue
                first, sub = got
                nbytes = box_numel(sub) * itemsize[name]
                src = min(who, key=lambda r: (load[r], r))
                load[src] += nbytes
                w = tuple((t, st, shift_dst(off, st, first)) for t, st, off in writes)
                parts.append(Entry(src, dst, name, sub, w, nbytes))
    missing = _uncovered(receivers, parts)
    if missing:
        raise ValueError(f"no sender holds {missing}")
    entries = tuple(_rounds(parts, budget_bytes, itemsize))
    rounds = 1 + max((e.round for e in entries), default=-1)
    return Plan(entries, rounds, budget_bytes, {n: dt for n, _, dt in manifest})


def _uncovered(receivers, parts) -> str | None:
    """What a receiver needs that no sender's box covers (the parts fall short of its pieces)."""
    want: dict = {}
    for dst, spec in receivers.items():
        for name, box in {(p.hf_name, p.box) for p in spec.pieces}:
            want[(dst, name)] = want.get((dst, name), 0) + box_numel(box)
    for e in parts:
        want[(e.dst, e.hf_name)] -= box_numel(e.box)
    short = sorted(k for k, n in want.items() if n > 0)
    return f"all of {short[0][1]!r} that receiver rank {short[0][0]} needs" if short else None


def _rounds(parts, budget, itemsize):
    """Parts cut to fit the budget, then first-fit into rounds (deterministic: plan order)."""
    cut = []
    for e in parts:
        limit = max(1, budget // (2 * itemsize[e.hf_name]))  # a part must fit a rank that both sends and receives
        for first, sub in split(e.box, limit):
            w = tuple((t, st, shift_dst(off, st, first)) for t, st, off in e.writes)
            cut.append(Entry(e.src, e.dst, e.hf_name, sub, w, box_numel(sub) * itemsize[e.hf_name]))
    used: list[dict] = []
    start: dict = {}  # per rank: rounds before this one are full for it
    out = []
    for e in cut:
        r = max(start.get(e.src, 0), start.get(e.dst, 0))
        while r < len(used) and (used[r].get(e.src, 0) + e.nbytes > budget
                                 or used[r].get(e.dst, 0) + e.nbytes > budget):
            r += 1
        if r == len(used):
            used.append({})
        for k in {e.src, e.dst}:
            used[r][k] = used[r].get(k, 0) + e.nbytes
        out.append(Entry(e.src, e.dst, e.hf_name, e.box, e.writes, e.nbytes, r))
    out.sort(key=lambda e: e.round)  # stable: plan order within a round
    return out
