"""The executor's copy programs (copies.py) on a Qwen3-MoE-like layout, one process, no wire: a
trainer's exported shards (our fused experts) packed and committed into a vLLM-style engine's
w13 / w2 / qkv_proj / gate_up targets. The program-driven pack/commit uses far fewer copy calls
than there are entries and writes exactly what the per-entry path and the engine's own
`load_weights` write; a trainer exporting fresh tensors gets rebuilt (never stale) programs."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from bumblebee.primitives.weight_transfer import copies, make_plan
from bumblebee.primitives.weight_transfer.boxes import box_shape
from bumblebee.primitives.weight_transfer.execute import Mover, read_from
from bumblebee.primitives.weight_transfer.spec import SenderSpecs, sender_spec
from bumblebee.runtime import export
from tests.primitives.weight_transfer_engines import VllmStyleEngine, vllm_spec

HF = {**models.NAMED["qwen3-moe-tiny"], "num_experts": 32}


def _setup(budget):
    model = models.build(HF, seed=0)
    shards = list(export.export_weight_shards(model, None))
    spec, manifest, local = sender_spec(0, shards)
    rspec, _ = vllm_spec(manifest, HF)
    plan = make_plan([spec], {1: rspec}, manifest, budget_bytes=budget)
    return shards, local, plan, manifest


def _garbage(params):
    return {n: torch.full_like(t, float("nan")) for n, t in params.items()}


def _transfer(plan, local, targets, send=None, recv=None):
    """Pack every message, hand its bytes to the receiver's staging, commit."""
    send = send or Mover(plan, 0, None, transactional=True, device="cpu")
    recv = recv or Mover(plan, 1, None, transactional=True, device="cpu")
    read = read_from(local)
    ident = copies.identity(read.tensors)
    for key in sorted(send.msgs):
        recv.recv_slice(key).copy_(send.pack(key, read, ident))
    recv.commit(targets)
    return send, recv


class _Count:
    def __init__(self, monkeypatch):
        self.copy, self.foreach = 0, 0
        copy_, foreach = torch.Tensor.copy_, torch._foreach_copy_

        def counted_copy(t, *a, **k):
            self.copy += 1
            return copy_(t, *a, **k)

        def counted_foreach(*a, **k):
            self.foreach += 1
            return foreach(*a, **k)
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        monkeypatch.setattr(torch, "_foreach_copy_", counted_foreach)


@pytest.mark.parametrize("budget", [1 << 30, 48 << 10])  # one round; many rounds (experts cut over messages)
def test_programs_merge_copies_and_write_what_load_weights_writes(budget, monkeypatch):
    shards, local, plan, manifest = _setup(budget)
    entries = len(plan.entries)
    assert entries > 3 * 2 * HF["num_experts"]  # every expert's gate/up/down, both layers

    # reference 1: the engine's own loader over the full HF tensors (one trainer: shards are whole)
    ref = VllmStyleEngine(manifest, HF)
    ref.load_weights((s.name, s.tensor) for s in shards)
    # reference 2: the per-entry path (one view and one strided copy per entry and write)
    per_entry = _garbage(ref.params)
    read = read_from(local)
    for e in plan.entries:
        for t, st, off in e.writes:
            per_entry[t].as_strided(box_shape(e.box), st, off).copy_(read(e))

    eng = VllmStyleEngine(manifest, HF)
    targets = _garbage(eng.params)
    count = _Count(monkeypatch)
    send, recv = _transfer(plan, local, targets)
    calls = count.copy + count.foreach
    # the sender's packs + the receiver's commit, against >= 2 copies per entry on the per-entry path
    launches = sum(p.launches for c in (send, recv) for e in c.programs.entries for p in e[1].values())
    assert calls == launches + len(send.msgs)  # the test's own hand-over: one copy per message
    assert launches * 8 <= 2 * entries, (launches, entries)
    for n, t in targets.items():
        assert torch.equal(t.view(torch.uint8), ref.params[n].view(torch.uint8)), n
        assert torch.equal(t.view(torch.uint8), per_entry[n].view(torch.uint8)), n

    # a second update over the same tensors reuses the programs; new values arrive bitwise
    with torch.no_grad():
        for s in shards:
            s.tensor.add_(1.0)
    builds = send.programs.builds, recv.programs.builds
    _transfer(plan, local, targets, send, recv)
    assert (send.programs.builds, recv.programs.builds) == builds
    ref.load_weights((s.name, s.tensor) for s in shards)
    for n, t in targets.items():
        assert torch.equal(t, ref.params[n]), n


def test_fresh_source_tensors_rebuild_never_stale():
    shards, local, plan, manifest = _setup(1 << 30)
    eng = VllmStyleEngine(manifest, HF)
    send, recv = _transfer(plan, local, eng.params)
    before = send.programs.builds
    # the trainer's export casts into new tensors each step (same names, boxes, shapes)
    fresh = {k: t.clone() * 2 for k, t in local.items()}
    _transfer(plan, fresh, eng.params, send, recv)
    assert send.programs.builds > before and send.programs.volatile  # rebuilt, and no longer kept
    assert send.programs.entries == []
    ref = VllmStyleEngine(manifest, HF)
    ref.load_weights((n, t) for (n, _), t in fresh.items())
    for n, t in eng.params.items():
        assert torch.equal(t, ref.params[n]), n


def test_sender_specs_reuse_only_an_unchanged_layout_and_hold_no_tensor():
    import dataclasses
    shards = list(export.export_weight_shards(models.build(HF, seed=0), None))
    specs = SenderSpecs()

    def same(got, want):
        assert got[:2] == want[:2] and list(got[2]) == list(want[2])
        assert all(got[2][k] is t for k, t in want[2].items())
    same(specs(0, iter(shards)), sender_spec(0, shards))
    fresh = [dataclasses.replace(s, tensor=s.tensor.clone()) for s in shards]  # a new step's export
    same(specs(0, fresh), sender_spec(0, fresh))  # reused: the new tensors, the same spec
    assert all(not isinstance(v, torch.Tensor) for v in specs._last)
    # any change in what sender_spec reads makes a new spec
    for change in ({"offsets": (1,) + tuple(shards[0].offsets[1:]), "shape": (shards[0].shape[0] + 1,)
                    + tuple(shards[0].shape[1:])}, {"tensor": shards[0].tensor.half()}, {"replicated": True},
                   {"name": "other"}):
        moved = [dataclasses.replace(shards[0], **change)] + shards[1:]
        same(specs(0, moved), sender_spec(0, moved))
        same(specs(0, shards), sender_spec(0, shards))
    assert specs(1, shards)[0].rank == 1


def test_build_merges_only_adjacent_same_dtype_and_keeps_strided_and_casts():
    src = torch.arange(24, dtype=torch.float32)
    dst = torch.zeros(24, dtype=torch.float32)
    cast = torch.zeros(4, dtype=torch.float64)
    strided = torch.zeros(4, 2)
    pairs = [(dst[0:4], src[0:4]), (dst[4:10], src[4:10]),  # adjacent on both sides: one run
             (dst[12:16], src[10:14]),  # a gap in dst: a new run
             (cast, src[14:18]),  # a cast: its own copy
             (strided.t(), src[16:24].view(2, 4))]  # a strided destination: its own copy
    prog = copies.build(pairs)
    assert prog.pairs == 5 and sum(len(ds) for ds, _ in prog.groups) == 2 and len(prog.strided) == 2 and prog.launches == 3
    prog.run()
    assert torch.equal(dst[:10], src[:10]) and torch.equal(dst[12:16], src[10:14]) and not dst[10:12].any()
    assert torch.equal(cast, src[14:18].double()) and torch.equal(strided.t(), src[16:24].view(2, 4))
    with pytest.raises(ValueError, match="size"):
        copies.ProgramCache(0)


def test_short_runs_move_as_the_widest_words_in_one_copy_per_word_size():
    """Non-adjacent runs (a TP 2 receiver's expert half-rows) go through one multi-tensor copy per word
    size, each run viewed as the widest words its length and addresses allow; bytes land exactly."""
    src = torch.arange(4096, dtype=torch.uint8).repeat(64)
    dst = torch.zeros_like(src)
    pairs = [(dst[i * 2048:(i + 1) * 2048 - 1024], src[i * 2048 + 512:i * 2048 + 1536]) for i in range(64)]
    pairs += [(dst[131072 + 1:131072 + 8], src[3:10]),  # odd length, odd offsets: bytes
              (dst[131072 + 12:131072 + 16], src[20:24]),  # 4 bytes at 4-aligned offsets: int32
              (dst[131072 + 18:131072 + 20], src[30:32])]  # 2 bytes: int16
    ref = dst.clone()
    for d, s in pairs:
        ref[d.storage_offset():d.storage_offset() + d.numel()] = s
    prog = copies.build(pairs)
    assert prog.launches == 4 and not prog.strided  # int64, uint8, int32, int16 groups
    assert {ds[0].dtype for ds, _ in prog.groups} == {torch.int64, torch.int32, torch.int16, torch.uint8}
    assert sum(len(ds) for ds, _ in prog.groups) == len(pairs)
    prog.run()
    assert torch.equal(dst, ref)


def test_runs_at_least_alone_bytes_long_get_their_own_copy():
    n = copies._ALONE_BYTES
    src, dst = torch.arange(n + 64, dtype=torch.uint8), torch.zeros(n + 64, dtype=torch.uint8)
    prog = copies.build([(dst[:n], src[:n]), (dst[n + 8:n + 16], src[n + 16:n + 24])])
    assert len(prog.strided) == 1 and prog.strided[0][0].numel() == n and prog.launches == 2
    prog.run()
    assert torch.equal(dst[:n], src[:n]) and torch.equal(dst[n + 8:n + 16], src[n + 16:n + 24])
