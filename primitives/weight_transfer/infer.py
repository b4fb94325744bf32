"""Receiver layout inference from the engine's own `load_weights(iterable of (hf_name, full tensor))`.

Default path (`trace=True`): the loader runs once on meta probes under a torch function mode
(`trace.py`): every copy from a view of a probe into a view of a target is read off the two
views' storage offsets and strides as a `Piece`; no element is touched, so it costs seconds at 30B
scale and the targets may live on meta. Tensors the trace cannot follow (a copy out of a new
storage such as cat or a cast) are value-probed alone (below); a loader the trace cannot follow at
all (a fill of a target, a failure on meta) is value-probed whole.

Verification of a traced spec is complete for everything the loader does through torch: the mode
sees every torch call it makes, on probes and on targets; any operation that computes on a probe
is refused on the spot, naming the tensor and the operation, whichever layer it hides in; any
write into a target other than a copy from a probe leaves the trace. Tensors whose traced
operations agree in everything but storage offsets (names, shapes, strides, dtypes, the order of
calls; in practice: every layer, every expert of one projection) ran the same torch code, and the
pieces are read off each one's own offsets by the same rule; so one representative per such
signature is checked bitwise against a real `load_weights` call on random values (with every
value-probed tensor), which confirms the rule and the absence of effects the trace cannot see for
that code. What the argument leaves out: writes that bypass torch (ctypes on `data_ptr`, numpy
on a view taken before the call) made for some tensors only; `trace=False` checks every tensor.

Reference path (`trace=False`) and the value probes: the loader runs on probe tensors whose values
are digits of each element's global index (every HF tensor's elements numbered one after another,
plus one so that 0 marks "not written"). A digit is a small integer, exact in every float dtype
involved (8 bits a pass for bfloat16, 11 for float16, 24 for float32), so copies, slicing,
stacking, transposes and casts between float dtypes all keep it; a few passes give the whole
index. Reading the targets back gives, for every element, which element of which HF tensor landed
there; runs of those are fitted as strided boxes (`_fit`). While the loader runs, the probes are a
tensor subclass that admits only data movement: any other operation on a probe raises
`LayoutError` naming the HF tensor and the operation. The spec is then checked against a real
`load_weights` call on random tensors for the whole manifest.

Specs are cached by a digest of the manifest, the targets' layout, the loader's code and the
caller's key; a cache hit is verified again (the trace compared piece by piece plus the
representatives' check, or the full check), so a changed layout is never served from a stale
entry. The targets are restored after inference (only those it wrote are copied aside).
"""
from __future__ import annotations

import inspect
import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

from bumblebee.primitives.weight_transfer.boxes import Box, view
from bumblebee.primitives.weight_transfer.spec import Piece, ReceiverSpec, digest, dtype_name, dtype_of
from bumblebee.primitives.weight_transfer.trace import Trace, Untraceable, clashing


class LayoutError(ValueError):
    """A loader whose effect is not slicing, stacking, transposing or casting, or a spec that does
    not replay it."""


# data movement and metadata: what a loader may do to a probe
_ALLOWED = set("""
copy_ __getitem__ __setitem__ __get__ narrow view reshape view_as reshape_as t transpose permute movedim
swapaxes swapdims contiguous clone detach detach_ to type float half bfloat16 double cpu cuda cat concat
concatenate stack hstack vstack chunk split split_with_sizes tensor_split unbind squeeze unsqueeze flatten
unflatten expand expand_as select index_select as_strided size dim ndimension numel nelement stride
is_contiguous storage_offset data_ptr element_size is_floating_point is_complex get_device __len__ __iter__
__format__ __repr__ __hash__ new_empty new_zeros new_ones new_full empty_like zeros_like ones_like item
tolist requires_grad_ pin_memory untyped_storage __reduce_ex__ __deepcopy__
""".split())
_WRITES = {"copy_", "__setitem__"}  # their result is the destination, never a probe


class _Probe(torch.Tensor):
    hf_name: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        probes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Probe)]
        hf = getattr(probes[0], "hf_name", "?") if probes else "?"
        if name not in _ALLOWED:
            raise LayoutError(f"load_weights applies {name!r} to {hf!r}: a loader may only slice, stack, "
                              "transpose or cast (no scaling, quantizing or adding inputs together)")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in _WRITES or name == "__get__" and not isinstance(out, torch.Tensor):
            return out

        def wrap(o):
            if isinstance(o, torch.Tensor) and not isinstance(o, _Probe):
                o = o.as_subclass(_Probe)
                o.hf_name = hf
            return o
        return tree_map(wrap, out)


def _digit_bits(dtype: torch.dtype) -> int:
    if dtype.is_floating_point:
        return min(24, round(-math.log2(torch.finfo(dtype).eps)) + 1)
    if dtype == torch.bool or dtype.is_complex:
        raise LayoutError(f"cannot probe a {dtype} tensor")
    return min(24, torch.iinfo(dtype).bits - 2)


def _layout_key(load_weights, targets, manifest, key) -> str:
    fn = getattr(load_weights, "__func__", load_weights)
    try:
        code = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__qualname__", repr(fn))
    return digest([manifest, [(n, tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype)) for n, t in targets.items()],
                   code, key])


class LayoutCache:
    """In-process cache of inferred specs, keyed by `_layout_key`."""

    def __init__(self):
        self.specs: dict[str, ReceiverSpec] = {}
        self.hits = self.misses = 0


class _Saved:
    """Targets cloned the first time inference is about to write them, restored at the end: a
    traced inference writes only what its representatives' check touches, not the whole engine."""

    def __init__(self, targets: dict):
        self.targets, self.orig = targets, {}

    def save(self, names) -> None:
        for n in names:
            if n not in self.orig:
                self.orig[n] = self.targets[n].detach().clone()

    def restore(self) -> None:
        for n, t in self.orig.items():
            self.targets[n].copy_(t)


@torch.no_grad()
def infer_layout(load_weights, targets: dict, manifest, *, key: str = "", cache: LayoutCache | None = None,
                 verify: bool = True, seed: int = 0, given: ReceiverSpec | None = None,
                 trace: bool = True) -> ReceiverSpec:
    """The `ReceiverSpec` of `load_weights` writing into `targets` ({name: tensor}: the engine's
    parameters), for the HF tensors of `manifest` (((name, shape, dtype name), ...)). `key` names
    what else decides the layout and is not in the targets' shapes (the engine's TP/EP rank).
    `trace`: read the layout off one loader call on meta probes (`trace.py`), value-probe only the
    tensors the trace cannot follow, and check one representative per signature bitwise (the
    module docstring's argument); False: value-probe every tensor and check every tensor (the
    reference path, minutes at 30B scale). `given`: a spec written by hand from the engine's
    sharding rules, checked by one loader call on random tensors for the whole manifest instead of
    probed. The targets are restored afterwards."""
    if not isinstance(trace, bool) or not isinstance(verify, bool):
        raise ValueError(f"infer_layout: trace and verify must be bools; got trace={trace!r} verify={verify!r}")
    targets = dict(targets)
    lk = _layout_key(load_weights, targets, manifest, key)
    saved = _Saved(targets)
    try:
        if given is not None:
            if tuple(given.manifest) != tuple(manifest):
                raise LayoutError("the given spec was written for another manifest (names, shapes, dtypes or order)")
            saved.save(targets)
            check(given, load_weights, targets, seed=seed, before=saved.orig)
            return given
        if cache is not None and lk in cache.specs:
            spec = cache.specs[lk]
            try:
                _recheck(spec, load_weights, targets, saved, seed=seed, trace=trace)
                cache.hits += 1
                return spec
            except LayoutError:
                del cache.specs[lk]
        spec = _infer(load_weights, targets, manifest, saved, verify=verify, seed=seed, trace=trace)
        if cache is not None:
            cache.misses += 1
            cache.specs[lk] = spec
        return spec
    finally:
        saved.restore()


def _infer(load_weights, targets, manifest, saved, *, verify, seed, trace) -> ReceiverSpec:
    if trace:
        try:
            tr = Trace(targets, manifest, _ALLOWED, LayoutError).run(load_weights)
            spec = _from_trace(tr, load_weights, targets, manifest, saved)
            if verify:
                reps = set(_representatives(tr))
                saved.save({p.target for p in spec.pieces if p.hf_name in reps})
                check(spec, load_weights, targets, seed=seed, only=reps, before=saved.orig)
            return spec
        except Untraceable:
            pass  # value probes for everything below
    saved.save(targets)
    spec = _probe(load_weights, targets, manifest)
    saved.restore()  # the check compares against the prior values
    if verify:
        check(spec, load_weights, targets, seed=seed, before=saved.orig)
    return spec


def _from_trace(tr, load_weights, targets, manifest, saved) -> ReceiverSpec:
    """The traced pieces, plus value probes (one loader call per digit, on these tensors only)
    for the tensors the trace could not follow."""
    pieces = [p for i, ps in tr.pieces.items() if i not in tr.impure for p in ps]
    if tr.impure:
        saved.save(targets)  # the value passes zero every target
        pieces += _probe(load_weights, targets, tuple(manifest[i] for i in sorted(tr.impure)), partial=True).pieces
        saved.restore()  # the check compares against the prior values
        if clashing(pieces, targets):
            raise Untraceable("value-probed and traced tensors write one target element")
    return _assemble(manifest, targets, pieces)


def _representatives(tr) -> list[str]:
    """The first tensor of each trace signature, and every value-probed tensor."""
    seen, out = set(), []
    for i, (name, _, _) in enumerate(tr.manifest):
        sig = tr.signature(i)
        if i in tr.impure or sig not in seen:
            seen.add(sig)
            out.append(name)
    return out


def _recheck(spec, load_weights, targets, saved, *, seed, trace) -> None:
    """LayoutError unless a cached `spec` still holds: traced tensors must trace to its pieces,
    representatives and value-probed tensors must replay the loader bitwise. Without a trace (or
    when the loader cannot be traced): one loader call on random tensors for the whole manifest."""
    if trace:
        try:
            tr = Trace(targets, spec.manifest, _ALLOWED, LayoutError).run(load_weights)
        except Untraceable:
            tr = None
        if tr is not None:
            spec.check_targets(targets)
            have: dict = {}
            for p in spec.pieces:
                have.setdefault(p.hf_name, []).append(p)
            for i, (name, _, _) in enumerate(spec.manifest):
                if i not in tr.impure and sorted(tr.pieces[i], key=repr) != sorted(have.get(name, []), key=repr):
                    raise LayoutError(f"{name!r}: the loader now writes it elsewhere than the cached spec says")
            reps = set(_representatives(tr))
            saved.save({p.target for p in spec.pieces if p.hf_name in reps})
            check(spec, load_weights, targets, seed=seed, only=reps, before=saved.orig)
            return
    saved.save(targets)
    check(spec, load_weights, targets, seed=seed, before=saved.orig)


def _assemble(manifest, targets, pieces) -> ReceiverSpec:
    unwritten = sorted(set(targets) - {p.target for p in pieces}, key=list(targets).index)
    if unwritten:
        raise LayoutError(f"targets {unwritten[:3]} receive nothing from the manifest: a tensor the senders do "
                          "not send, or tensors the loader does not load (leave those out of targets)")
    order = {m[0]: i for i, m in enumerate(manifest)}
    pieces = sorted(pieces, key=lambda p: (order[p.hf_name], p.box, p.target, p.offset))
    tspec = tuple((n, tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype)) for n, t in targets.items())
    return ReceiverSpec(tuple(manifest), tspec, tuple(pieces))


def _probes(manifest, bases, shift: int, bits: int):
    mask = (1 << bits) - 1
    for (name, shape, dt), base in zip(manifest, bases):
        ids = torch.arange(base, base + math.prod(shape), dtype=torch.int64)
        p = (((ids >> shift) & mask) + 1).to(dtype_of(dt)).view(shape).as_subclass(_Probe)
        p.hf_name = name
        yield name, p


def _probe(load_weights, targets, manifest, partial: bool = False) -> ReceiverSpec:
    sizes = [math.prod(shape) for _, shape, _ in manifest]
    bases = [0] + list(torch.tensor(sizes, dtype=torch.int64).cumsum(0)[:-1].tolist()) if sizes else []
    total = sum(sizes)
    bits = min([_digit_bits(dtype_of(dt)) for _, _, dt in manifest] + [_digit_bits(t.dtype) for t in targets.values()])
    passes = max(1, math.ceil(math.log2(total + 1) / bits))
    ids = {n: torch.zeros(t.numel(), dtype=torch.int64) for n, t in targets.items()}
    written = {}
    for p in range(passes):
        for t in targets.values():
            t.zero_()
        load_weights(_probes(manifest, bases, p * bits, bits))
        for n, t in targets.items():
            v = t.detach().reshape(-1).to(torch.float64).cpu()
            bad = (v != v.round()) | (v < 0) | (v > (1 << bits))
            if bad.any():
                raise LayoutError(f"target {n!r} holds a value no probe carried ({v[bad][0].item()!r}): the "
                                  "loader transforms values (a scale, a quantization or an add)")
            d = v.to(torch.int64)
            if p == 0:
                written[n] = d > 0
            elif not torch.equal(written[n], d > 0):
                raise LayoutError(f"target {n!r}: the loader writes different elements on each call")
            ids[n] += (d - 1).clamp_min(0) << (p * bits)
    unwritten = [n for n in targets if not bool(written[n].any())]
    if unwritten and not partial:
        raise LayoutError(f"targets {unwritten[:3]} receive nothing from the manifest: a tensor the senders do "
                          "not send, or tensors the loader does not load (leave those out of targets)")
    names = [m[0] for m in manifest]
    base_t = torch.tensor(bases, dtype=torch.int64)
    pieces = []
    for tname, t in targets.items():
        pos = written[tname].nonzero().squeeze(1)
        if not len(pos):
            continue
        g = ids[tname][pos]
        if (g >= total).any():
            raise LayoutError(f"target {tname!r} holds an index beyond the manifest: the loader mixes values")
        which = torch.searchsorted(base_t, g, right=True) - 1
        storage = _storage_offsets(pos, tuple(t.shape), tuple(t.stride()))
        for i in torch.bincount(which).nonzero().squeeze(1).tolist():
            sel = which == i
            flat, dst = g[sel] - bases[i], storage[sel]
            for box, strides, offset in _fit(_unravel(flat, manifest[i][1]), dst):
                pieces.append(Piece(names[i], box, tname, strides, offset))
    order = {n: i for i, n in enumerate(names)}
    pieces.sort(key=lambda p: (order[p.hf_name], p.box, p.target, p.offset))
    tspec = tuple((n, tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype)) for n, t in targets.items())
    return ReceiverSpec(tuple(manifest), tspec, tuple(pieces))


def _unravel(flat: torch.Tensor, shape) -> torch.Tensor:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat = flat // n
    return torch.stack(out[::-1], 1) if out else flat.new_zeros(len(flat), 0)


def _ravel(multi: torch.Tensor) -> torch.Tensor:
    """A sort key of C order for index rows (any sizes: weights from the column maxima)."""
    key = torch.zeros(len(multi), dtype=torch.int64)
    for k in range(multi.shape[1]):
        key = key * (int(multi[:, k].max()) + 1) + multi[:, k]
    return key


def _storage_offsets(flat: torch.Tensor, shape, stride) -> torch.Tensor:
    idx = _unravel(flat, shape)
    return (idx * torch.tensor(stride, dtype=torch.int64)).sum(1) if len(shape) else flat * 0


def _fit_one(multi: torch.Tensor, dst: torch.Tensor):
    """(box, strides, offset) when the indices `multi` [N, d] (any order) are a whole strided box and
    `dst` an affine, non-negative-stride image of it; else None. Masks, no sorting: O(N)."""
    n, d = multi.shape
    box = []
    for k in range(d):
        col = multi[:, k]
        lo, hi = int(col.min()), int(col.max())
        seen = torch.zeros(hi - lo + 1, dtype=torch.bool)
        seen[col - lo] = True
        u = seen.nonzero().squeeze(1)
        step = int(u[1] - u[0]) if len(u) > 1 else 1
        if len(u) > 1 and not bool((u.diff() == step).all()):
            return None
        box.append((lo, step, len(u)))
    if math.prod(c for _, _, c in box) != n:
        return None
    starts = torch.tensor([b[0] for b in box], dtype=torch.int64)
    steps = torch.tensor([b[1] for b in box], dtype=torch.int64)
    idx = (multi - starts) // steps
    cstr = [math.prod(c for _, _, c in box[k + 1:]) for k in range(d)]
    pos = (idx * torch.tensor(cstr, dtype=torch.int64)).sum(1) if d else torch.zeros(n, dtype=torch.int64)
    hit = torch.zeros(n, dtype=torch.bool)
    hit[pos] = True
    if not bool(hit.all()):  # an element twice: not one box
        return None
    by_pos = torch.empty(n, dtype=torch.int64)
    by_pos[pos] = dst
    strides = tuple(int(by_pos[cstr[k]] - by_pos[0]) if box[k][2] > 1 else 0 for k in range(d))
    if any(s < 0 for s in strides):
        return None
    if not torch.equal(by_pos[0] + (idx * torch.tensor(strides, dtype=torch.int64)).sum(1), dst):
        return None
    return tuple(box), strides, int(by_pos[0])


def _fit(multi: torch.Tensor, dst: torch.Tensor, sorted_: bool = False) -> list[tuple[Box, tuple, int]]:
    """Strided boxes covering the (index, destination) pairs, sorted by index: the whole set when it
    is one box, else runs along the first dimension that varies, grown by doubling while they fit."""
    one = _fit_one(multi, dst)
    if one is not None:
        return [one]
    if not sorted_:
        order = torch.argsort(_ravel(multi), stable=True)
        multi, dst = multi[order], dst[order]
    varying = [k for k in range(multi.shape[1]) if bool((multi[:, k] != multi[0, k]).any())]
    if not varying:  # one element written to several places: one piece per place
        return [_fit_one(multi[i:i + 1], dst[i:i + 1]) for i in range(len(dst))]
    k = varying[0]
    _, counts = torch.unique_consecutive(multi[:, k], return_counts=True)
    ends = counts.cumsum(0).tolist()
    starts = [0] + ends[:-1]

    def run(i, j):
        return _fit_one(multi[starts[i]:ends[j]], dst[starts[i]:ends[j]])

    out, i, g = [], 0, len(ends)
    while i < g:
        best = run(i, i)
        if best is None:  # one value of dimension k is not one box: split it further
            out += _fit(multi[starts[i]:ends[i]], dst[starts[i]:ends[i]], True)
            i += 1
            continue
        good, bad, span = i, None, 1
        while good < g - 1:  # doubling until a run does not fit, then bisection
            j = min(g - 1, i + span)
            got = run(i, j)
            if got is None:
                bad = j
                break
            good, best, span = j, got, span * 2
        while bad is not None and bad - good > 1:
            mid = (good + bad) // 2
            got = run(i, mid)
            if got is None:
                bad = mid
            else:
                good, best = mid, got
        out.append(best)
        i = good + 1
    return out


def _random(manifest, device, seed):
    """Random HF tensors on `device` (the targets': a GPU draws a 30B slice in milliseconds where
    one host thread takes minutes), one generator per tensor so that any one can be drawn again."""
    for i, (name, shape, dt) in enumerate(manifest):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
        dtype = dtype_of(dt)
        if dtype.is_floating_point:
            draw = dtype if dtype in (torch.float32, torch.float64) else torch.float32
            yield name, torch.randn(shape, generator=gen, dtype=draw, device=device).to(dtype)
        else:
            yield name, torch.randint(-100, 100, shape, generator=gen, device=device).to(dtype)


@torch.no_grad()
def check(spec: ReceiverSpec, load_weights, targets: dict, *, seed: int = 0, only=None, before=None) -> None:
    """LayoutError unless replaying `spec` on random HF tensors gives, bit for bit, what
    `load_weights` makes of them (both onto the same prior target values). `only`: HF names; the
    loader then gets those tensors alone and the targets their pieces write are compared.
    `before`: copies of those targets' prior values, when the caller holds them already.

    No second copy of the targets: after the real call every piece's destination is compared with
    its source (drawn again from its own generator) and then given back its prior values, so a
    target must end equal to its prior values everywhere (what no piece covers was never written)."""
    spec.check_targets(targets)
    manifest, pieces, names = spec.manifest, spec.pieces, list(targets)
    if only is not None:
        only = set(only)
        manifest = tuple(m for m in manifest if m[0] in only)
        pieces = tuple(p for p in pieces if p.hf_name in only)
        names = list(dict.fromkeys(p.target for p in pieces))
    if any(targets[n].device.type == "meta" for n in names):
        raise ValueError("checking a layout needs targets that hold values; meta targets: pass verify=False")
    if before is None:
        before = {n: targets[n].detach().clone() for n in names}
    device = next(iter(targets.values())).device if targets else torch.device("cpu")
    device = device if device.type in ("cpu", "cuda") else torch.device("cpu")
    load_weights(_random(manifest, device, seed))
    by_name: dict = {}
    for p in pieces:
        by_name.setdefault(p.hf_name, []).append(p)
    for name, w in _random(manifest, device, seed):
        for p in by_name.get(name, ()):
            dst = p.dest(targets[p.target])
            want = view(w, p.box).to(dst.dtype)
            if not torch.equal(_bits(dst), _bits(want)):
                i = int((_bits(dst) != _bits(want)).nonzero()[0])
                raise LayoutError(f"target {p.target!r}: replaying the spec differs from load_weights at element {i} "
                                  f"of {name!r}'s piece ({want.reshape(-1)[i].item()!r} vs "
                                  f"{dst.reshape(-1)[i].item()!r}): the loader does more than move values")
            dst.copy_(p.dest(before[p.target]))
    for n in names:
        a, b = _bits(before[n]), _bits(targets[n].detach())
        if not torch.equal(a, b):
            i = int((a != b).nonzero()[0])
            raise LayoutError(f"target {n!r}: load_weights writes element {i}, which the spec leaves alone: the "
                              "loader does more than move values")


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().reshape(-1).view(ints[t.element_size()])
