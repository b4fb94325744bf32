"""Layout inference by tracing: the engine's `load_weights` runs once on meta probes, and every
copy from a probe into a target is read off the two tensors' metadata.

A probe is an empty meta tensor of the HF tensor's shape (no memory, no values). A torch function
mode watches every torch call the loader makes. View operations (narrow, slicing, transpose,
reshape, chunk, ...) run on meta, so a probe's view keeps its storage offset and strides, which
name exactly which elements of the contiguous HF tensor it shows; a target's view likewise names
where it writes. `dst.copy_(src)` (or `dst[i] = src`) is then not run but recorded: the box of the
HF tensor that `src` shows and `dst`'s strides and offset in its target are a `Piece`. Cost: the
loader's own Python plus a few microseconds per torch call, no element is touched, so a 30B-element
engine whose parameters live on meta (or on never-touched host memory) is traced in seconds.

What the trace cannot read off metadata makes its tensor "impure", and the caller infers those
tensors by value probes instead (`infer._probe`): a copy out of a new storage (clone, cat, stack,
a dtype cast, a contiguous copy), a broadcast, a view across HF dimensions that is no box, a write
into a non-target buffer, or two writes onto one target element. A write into a target that no
probe feeds (a fill, a scale in place), a loader that raises on meta probes, or two targets sharing
one storage make the whole trace unusable (`Untraceable`): the caller falls back to value probes
for everything. Operations that compute on a probe are refused as in the value path (`_ALLOWED`).

Each HF tensor also gets a signature: the operations applied to its probe (names, shapes, strides,
dtypes; not storage offsets) and the structure of its pieces. Tensors with one signature ran the
same torch code with different offsets, so one representative per signature checked bitwise
against a real load covers the rest (infer.py's docstring states the argument).
"""
from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

from bumblebee.primitives.weight_transfer.spec import Piece, dtype_of

_WRITES = {"copy_", "__setitem__"}
_MOVES = {"to", "cpu", "cuda", "pin_memory"}  # device moves keep every element: the probe itself
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad"}
_INPLACE_EXTRA = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                  "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


class Untraceable(Exception):
    """The loader does something the trace cannot follow: infer by value probes instead."""


def _key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _tensors(obj, out=None):
    """The tensors in nested tuples, lists and dicts (pytree's flatten costs half the trace)."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class Trace(TorchFunctionMode):
    """Runs `load_weights` over meta probes of `manifest` into `targets`; `pieces[i]`, `impure`,
    `signature[i]` per HF tensor index i after `run()`."""

    def __init__(self, targets: dict, manifest, allowed: set, error):
        super().__init__()
        self.targets, self.manifest, self.allowed, self.error = targets, tuple(manifest), allowed, error
        self.tstore = {}
        for name, t in targets.items():
            if _key(t) in self.tstore:
                raise Untraceable(f"targets {self.tstore[_key(t)]!r} and {name!r} share one storage")
            self.tstore[_key(t)] = name
        self.pstore: dict = {}  # storage -> HF index of the probe it belongs to
        self.tainted: dict = {}  # storage -> HF indices whose elements a non-view op put there
        self.pieces = {i: [] for i in range(len(self.manifest))}
        self.events = {i: [] for i in range(len(self.manifest))}
        self.impure: set = set()
        self.keep = []  # probes stay alive while traced: a storage key is never reused

    def _probes(self):
        for i, (name, shape, dt) in enumerate(self.manifest):
            with torch._C.DisableTorchFunction():  # our own calls are not the loader's
                p = torch.empty(shape, dtype=dtype_of(dt), device="meta")
                self.pstore[_key(p)] = i
            self.keep.append(p)
            yield name, p

    def run(self, load_weights) -> "Trace":
        try:
            with self:
                load_weights(self._probes())
        except Untraceable:
            raise
        except Exception as e:
            if isinstance(e, self.error):
                raise
            raise Untraceable(f"load_weights raised on meta probes: {type(e).__name__}: {e}") from e
        if len(self.keep) < len(self.manifest):
            raise Untraceable("load_weights stopped before taking every tensor")
        self._overlaps()
        self.pieces = {i: merged(ps) for i, ps in self.pieces.items()}
        return self

    # ---- the mode -----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        ins = _tensors((args, kwargs))
        probe_ids = sorted({self.pstore[_key(t)] for t in ins if _key(t) in self.pstore})
        taint = set().union(*[self.tainted[_key(t)] for t in ins if _key(t) in self.tainted])
        if (probe_ids or taint) and name not in self.allowed:
            hf = self.manifest[(probe_ids or sorted(taint))[0]][0]
            raise self.error(f"load_weights applies {name!r} to {hf!r}: a loader may only slice, stack, "
                             "transpose or cast (no scaling, quantizing or adding inputs together)")
        for i in probe_ids:
            self.events[i].append((name, tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype), self._role(t))
                                               for t in ins)))
        if name in _WRITES:
            return self._write(name, args, kwargs, probe_ids, taint)
        out_keys = [_key(t) for t in _tensors(kwargs.get("out"))]
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        inplace = (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES
                   or name in _INPLACE_EXTRA)
        if any(k in self.tstore for k in out_keys) or inplace and dst is not None and _key(dst) in self.tstore:
            raise Untraceable(f"load_weights writes into target {self.tstore.get(_key(dst)) if dst is not None else '?'}"
                              f" with {name!r}, not from a probe")
        if (name in _MOVES and args and (_key(args[0]) in self.pstore or _key(args[0]) in self.tainted)
                and not self._casts(args, kwargs)):
            return args[0]
        out = func(*args, **kwargs)
        if probe_ids or taint:
            fresh = [t for t in _tensors(out) if _key(t) not in self.pstore and _key(t) not in self.tainted]
            if fresh:  # a new storage holding probe elements: follow it by values
                self.impure.update(probe_ids, taint)
                for t in fresh:
                    self.tainted[_key(t)] = set(probe_ids) | taint
        return out

    def _role(self, t):
        k = _key(t)
        return "p" if k in self.pstore else "t" if k in self.tstore else "x" if k in self.tainted else "o"

    @staticmethod
    def _casts(args, kwargs) -> bool:
        src = args[0]
        want = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
        want = want or (other.dtype if other is not None else None)
        return want is not None and want != src.dtype

    def _write(self, name, args, kwargs, probe_ids, taint):
        if name == "copy_":
            dst, src = args[0], args[1] if len(args) > 1 else kwargs["src"]
        else:
            with torch._C.DisableTorchFunction():
                dst = args[0][args[1]]
            src = args[2]
            if _key(args[0]) in self.tstore and _key(dst) != _key(args[0]):
                raise Untraceable(f"load_weights writes into target {self.tstore[_key(args[0])]!r} through an "
                                  "index that is no view")
        done = dst if name == "copy_" else None
        dkey = _key(dst)
        skey = _key(src) if isinstance(src, torch.Tensor) else None
        if dkey in self.pstore:
            raise self.error(f"load_weights writes into the HF tensor {self.manifest[self.pstore[dkey]][0]!r}")
        if skey in self.pstore:
            i = self.pstore[skey]
            if dkey in self.tstore:
                piece = _piece(self.manifest[i], src, dst, self.tstore[dkey], self.targets[self.tstore[dkey]])
                if piece is None:
                    self.impure.add(i)
                elif piece != ():
                    self.pieces[i].append(piece)
            else:  # a staging buffer of the loader's own: its elements are followed by values
                self.impure.add(i)
                self.tainted[dkey] = self.tainted.get(dkey, set()) | {i}
            return done
        if skey in self.tainted:
            self.impure.update(self.tainted[skey])
            if dkey not in self.tstore:
                self.tainted[dkey] = self.tainted.get(dkey, set()) | self.tainted[skey]
            return done
        if dkey in self.tstore:
            raise Untraceable(f"load_weights writes into target {self.tstore[dkey]!r} other than from a probe")
        with torch._C.DisableTorchFunction():  # the loader's own buffers: run as written
            out = args[0].copy_(*args[1:], **kwargs) if name == "copy_" else args[0].__setitem__(*args[1:])
        return out

    def _overlaps(self):
        names = clashing([p for ps in self.pieces.values() for p in ps], self.targets)
        self.impure.update(i for i, (n, _, _) in enumerate(self.manifest) if n in names)

    def signature(self, i: int):
        """What a representative's bitwise check stands for: the ops on the probe, the HF
        tensor's shape and dtype, and its pieces with offsets and target names left out."""
        _, shape, dt = self.manifest[i]
        pieces = tuple(sorted((tuple((st, c) for _, st, c in p.box), p.strides, tuple(self.targets[p.target].shape),
                               str(self.targets[p.target].dtype)) for p in self.pieces[i]))
        return (tuple(shape), dt, tuple(self.events[i]), pieces)


def _join(a: Piece, b: Piece) -> Piece | None:
    """One piece for `a` then `b` when they are one strided box on both sides (what the value
    path's fit makes of them), else None."""
    if (a.hf_name, a.target) != (b.hf_name, b.target):
        return None
    diff = [k for k in range(len(a.box)) if a.box[k] != b.box[k] or a.strides[k] != b.strides[k]]
    if len(diff) != 1:
        return None
    k = diff[0]
    (s0, st0, c0), (s1, st1, c1) = a.box[k], b.box[k]
    step = st0 if c0 > 1 else st1 if c1 > 1 else s1 - s0
    stride = a.strides[k] if c0 > 1 else b.strides[k] if c1 > 1 else b.offset - a.offset
    if (step <= 0 or stride < 0 or s1 != s0 + c0 * step or b.offset != a.offset + c0 * stride
            or c1 > 1 and (st1, b.strides[k]) != (step, stride) or c0 > 1 and (st0, a.strides[k]) != (step, stride)):
        return None
    box = a.box[:k] + ((s0, step, c0 + c1),) + a.box[k + 1:]
    return Piece(a.hf_name, box, a.target, a.strides[:k] + (stride,) + a.strides[k + 1:], a.offset)


def merged(pieces) -> list:
    """Consecutive copies of one tensor that form one box (q, k and v parts copied one by one into
    adjacent rows) joined, so a traced spec equals the value-probed one."""
    out = []
    for p in sorted(pieces, key=lambda p: (p.target, p.box, p.offset)):
        j = _join(out[-1], p) if out else None
        if j is not None:
            out[-1] = j
        else:
            out.append(p)
    return out


def clashing(pieces, targets: dict) -> set:
    """HF names of pieces that write a target element another piece also writes (the value path
    keeps only the last writer). Offset hulls first; an exact count only where hulls meet."""
    by_target: dict = {}
    for p in pieces:
        hi = p.offset + sum((c - 1) * s for (_, _, c), s in zip(p.box, p.strides))
        by_target.setdefault(p.target, []).append((p.offset, hi, p))
    out = set()
    for tname, spans in by_target.items():
        spans.sort(key=lambda s: s[:2])
        clash, end = False, -1
        for lo, hi, _ in spans:
            clash |= lo <= end
            end = max(end, hi)
        if not clash:
            continue
        t = targets[tname]
        hits = torch.zeros(t.storage_offset() + max(hi for _, hi, _ in spans) + 1, dtype=torch.int32)
        views = [(p, hits.as_strided(tuple(c for _, _, c in p.box), p.strides, t.storage_offset() + p.offset))
                 for _, _, p in spans]
        for _, v in views:
            v.add_(1)
        out.update(p.hf_name for p, v in views if bool((v > 1).any()))
    return out


def _piece(entry, src: torch.Tensor, dst: torch.Tensor, tname: str, target: torch.Tensor):
    """The Piece `dst.copy_(src)` writes (src a view of the HF tensor's contiguous probe, dst a
    view of target `tname`), () when it writes nothing, None when it is not one strided box."""
    hf, shape, dt = entry
    if src.dtype != dtype_of(dt) or dst.dtype != target.dtype or tuple(src.shape) != tuple(dst.shape):
        return None  # a reinterpreting view or a broadcast
    if src.numel() == 0:
        return ()
    cstr = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    rest, start = src.storage_offset(), []
    for c in cstr:
        start.append(rest // c)
        rest %= c
    box = [[s, 1, 1] for s in start]
    strides = [0] * len(shape)
    used = set()
    for n, s, ds in zip(src.shape, src.stride(), dst.stride()):
        if n == 1:
            continue
        if ds == 0 or s == 0:
            return None  # a destination written twice
        k = next((k for k in range(len(shape)) if shape[k] > 1 and s % cstr[k] == 0), None)
        if k is None or k in used or start[k] + (s // cstr[k]) * (n - 1) >= shape[k]:
            return None  # the view walks across HF dimensions: not one box
        used.add(k)
        box[k] = [start[k], s // cstr[k], n]
        strides[k] = ds
    for k in range(len(shape)):
        if box[k][2] == 1:
            box[k][1] = 1
    return Piece(hf, tuple(tuple(b) for b in box), tname, tuple(strides), dst.storage_offset() - target.storage_offset())
