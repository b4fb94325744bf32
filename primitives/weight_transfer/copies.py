"""Copy programs: a message's per-entry copies (pack: source views -> send buffer; unpack: staged
bytes -> targets) turned, once per plan, into few kernel launches.

An update moves ~800 entries for a 2-layer Qwen3-MoE slice (every expert's gate/up/down is its own
HF tensor); one `copy_` per entry (and a `.contiguous()` before it when a view is strided) costs a
launch plus Python each, which dominated the update's time rather than its bytes. A program:
- merges consecutive pairs whose destinations and sources are both contiguous, of one dtype, and
  each start where the previous ends in the same storage (experts' rows of one fused `w13`, a
  shard's consecutive rows) into one byte copy;
- moves every remaining contiguous, same-dtype pair shorter than `_ALONE_BYTES` in one
  `torch._foreach_copy_` per word size (a multi-tensor launch on CUDA), each pair viewed as the
  widest words (8, 4, 2 or 1 bytes) that its length and both addresses allow: the multi-tensor
  kernel moves a few elements a thread, so byte elements would cap it far below the memory's rate;
- leaves longer runs and strided or casting pairs to one `copy_` each (no intermediate `.contiguous()`).
The bytes written are exactly those of the per-entry copies: merging only joins byte ranges that are
already adjacent on both sides, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s bytes as a 1-D uint8 view when `t` is contiguous (None: strided)."""
    if not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


# Merged runs at least this long are copied one by one: there one launch (~5-10 us of host time)
# costs less than the run's own device time (16 MiB read and written at ~4.8 TB/s: ~7 us). Shorter
# runs go through the multi-tensor copy: at rollout TP 2 each expert's half-rows are 1.5 MiB runs,
# ~800 of them an update, which one `copy_` each made launch-bound.
_ALONE_BYTES = 16 << 20
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _as_words(d: torch.Tensor, s: torch.Tensor):
    """The 1-D byte views `d`, `s` as the widest words their length and both offsets divide."""
    for size, dtype in _WORDS:
        if d.numel() % size == 0 and d.storage_offset() % size == 0 and s.storage_offset() % size == 0 \
                and d.data_ptr() % size == 0 and s.data_ptr() % size == 0:
            return d.view(dtype), s.view(dtype)
    raise AssertionError("a byte view always divides")  # pragma: no cover


@dataclass
class Program:
    """`dsts[i].copy_(srcs[i])` for the short flat pairs (one multi-tensor copy per word size:
    `groups`), then the long runs and the strided pairs one `copy_` each."""
    groups: list  # [(dsts, srcs)], one per word dtype
    strided: list  # [(dst, src)]: long runs and strided or casting pairs
    pairs: int  # the per-entry copies this program stands for

    @property
    def launches(self) -> int:
        """Copy calls per run (each multi-tensor copy counted once)."""
        return len(self.groups) + len(self.strided)

    def run(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs)
        for d, s in self.strided:
            d.copy_(s)


def build(pairs) -> Program:
    """The program of `pairs` [(dst, src)], in order. Adjacent runs are merged by comparing data
    pointers of the tensors given now, so a program is only valid for those very tensors (callers
    key their cache by them)."""
    dsts, srcs, strided, n = [], [], [], 0
    run = None  # [dst bytes, src bytes, dst end ptr, src end ptr, dst storage ptr, src storage ptr]
    for dst, src in pairs:
        n += 1
        db = _flat_bytes(dst) if dst.dtype == src.dtype and dst.shape == src.shape else None
        sb = _flat_bytes(src) if db is not None else None
        if db is None or sb is None:
            strided.append((dst, src))
            continue
        if db.numel() == 0:
            continue
        dp, sp = db.data_ptr(), sb.data_ptr()
        dstor, sstor = dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()
        if run is not None and run[2] == dp and run[3] == sp and run[4] == dstor and run[5] == sstor:
            size = dsts[-1].numel() + db.numel()
            dsts[-1] = dsts[-1].as_strided((size,), (1,), dsts[-1].storage_offset())
            srcs[-1] = srcs[-1].as_strided((size,), (1,), srcs[-1].storage_offset())
        else:
            dsts.append(db)
            srcs.append(sb)
            run = [0, 0, 0, 0, dstor, sstor]
        run[2], run[3] = dp + db.numel(), sp + sb.numel()
    groups, large = {}, []
    for d, s in zip(dsts, srcs):
        if d.numel() >= _ALONE_BYTES:
            large.append((d, s))
            continue
        d, s = _as_words(d, s)
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    return Program(list(groups.values()), large + strided, n)


def identity(tensors) -> tuple:
    """Where each tensor's data is now: (pointer, stride, dtype); shapes are the plan's, checked
    before each update. A cached program keeps the storages it reads and writes alive, so equal
    pointers mean the very same memory (CUDA's unified addresses: unique across devices and the
    host). The device is left out on purpose: reading it costs as much as the rest."""
    return tuple((t.data_ptr(), t.stride(), t.dtype) for t in tensors)


class ProgramCache:
    """Programs per message key, for the last `size` identities of the tensors they were built from
    (checked per update, never assumed). A program holds views of those tensors, so a cache that has
    to evict (the sources change between updates: a trainer whose export casts into fresh tensors
    each step) turns `volatile`: from then on programs are built, run and dropped, so it never keeps
    a past update's tensors alive. The async sender's persistent snapshots (at most three) each keep
    theirs."""

    def __init__(self, size: int = 3):
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"ProgramCache: size must be an int >= 1, got {size!r}")
        self.size, self.entries = size, []  # [(identity, {key: program})], newest last
        self.builds, self.volatile = 0, False

    def get(self, ident, key, make) -> Program:
        if self.volatile:
            self.builds += 1
            return make()
        at = next((i for i, (idn, _) in enumerate(self.entries) if idn == ident), None)
        if at is None:
            if len(self.entries) == self.size:
                self.entries, self.volatile = [], True
                return self.get(ident, key, make)
            self.entries.append((ident, {}))
            at = len(self.entries) - 1
        progs = self.entries[at][1]
        if key not in progs:
            progs[key] = make()
            self.builds += 1
        return progs[key]
