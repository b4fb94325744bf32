"""Copy programs: a message's per-entry copies (pack: source views -> send buffer; unpack: staged
bytes -> targets) turned, once per plan, into few kernel launches.

An update moves ~800 entries for a 2-layer Qwen3-MoE slice (every expert's gate/up/down is its own
HF tensor); one `copy_` per entry (and a `.contiguous()` before it when a view is strided) costs a
launch plus Python each, which dominated the update's time rather than its bytes. A program:
- merges consecutive pairs whose destinations and sources are both contiguous, of one dtype, and
  each start where the previous ends in the same storage (experts' rows of one fused `w13`, a
  shard's consecutive rows) into one byte copy;
- moves every remaining contiguous, same-dtype pair in one `torch._foreach_copy_` (one
  multi-tensor launch on CUDA) as flat bytes;
- leaves strided or casting pairs to one `copy_` each (no intermediate `.contiguous()`).
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


# Merged runs at least this long are copied one by one: the plain copy kernel moves a large
# contiguous run at full bandwidth in one launch, where the multi-tensor copy (byte-wise, chunked)
# would cut it into many blocks; the multi-tensor copy is for the many small ones.
_ALONE_BYTES = 1 << 20


@dataclass
class Program:
    """`dsts[i].copy_(srcs[i])` for the small flat byte pairs (one multi-tensor copy), then the
    large runs and the strided pairs one `copy_` each."""
    dsts: list
    srcs: list
    strided: list  # [(dst, src)]: large runs and strided or casting pairs
    pairs: int  # the per-entry copies this program stands for

    @property
    def launches(self) -> int:
        """Copy calls per run (the multi-tensor copy counted once)."""
        return (1 if self.dsts else 0) + len(self.strided)

    def run(self) -> None:
        if self.dsts:
            torch._foreach_copy_(self.dsts, self.srcs)
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
    small = [i for i, d in enumerate(dsts) if d.numel() < _ALONE_BYTES]
    large = [(dsts[i], srcs[i]) for i in range(len(dsts)) if dsts[i].numel() >= _ALONE_BYTES]
    return Program([dsts[i] for i in small], [srcs[i] for i in small], large + strided, n)


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
