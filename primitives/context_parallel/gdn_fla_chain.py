"""fla's zigzag chain pass with a rank's two parts summarized at once (`ContextParallel.fla_concurrent_parts`)
and, on request, the transition maps from our kernel (`ContextParallel.fla_transition`).

Under fla 0.6's zigzag context a rank holds two parts of the sequence. Before the plain rule, the
forward summarizes each part as an affine state map (`chunk_cp_fwd_h`: a scan over every chunk of
the part, at the state's width plus the transition's), all-gathers the maps and composes the chain;
the backward does the same for the state gradients (`chunk_cp_bwd_dh`). fla launches the two
parts' scans one after the other on one stream. Each scan is sequential over its chunks with one
program per (column block, value head), 128 for Qwen3.5's 32 heads of 128, so one scan leaves most
of an H100/H200 idle, and a rank that holds neither the first nor the last part pays two scan
lengths. Here the two scans run at once on two CUDA streams: the same kernels on the same inputs
into separate outputs, then the same gather and merges as fla's, so the result equals fla's bit for
bit (`tests/primitives/test_context_parallel_fla_gpu.py`). Measured on H200s: 2-5% off the layer, as
the summaries' transition programs fill an SM each. Those programs compose [K, K] transforms in
tf32x3 (28 of a CP = 2 rank's 71 ms at 128K); with `fla_transition` other than "fla" fla's kernel
runs over the state columns only and `kernels/context_parallel_gdn_transition.py` writes the map
(bf16: 6.6x faster forward over a 32K part), as extra calls at once where the parts are. Both options
are on by default (`fla_transition="bf16x2"`): the layer at 128K goes from 0.68 to 0.85 of the ideal
speed-up at CP = 2 and from 0.61 to 0.76 at CP = 4 on H200s.

fla's gated delta rule calls the two pre-process functions through its module's names
(`fla.ops.gated_delta_rule.chunk`). `install()` rebinds those names once to dispatchers that take
the contexts registered here (`register`: the contexts our layers built with either option on) and
hand every other call, with its arguments untouched, to fla's own function (so does a call with a
keyword this file does not know: a newer fla's).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
import torch.distributed as dist

_MINE: dict[int, tuple] = {}  # id(context) -> (weak ref to the context, its ChainPass): the contexts served here
_FLA: dict[str, object] = {}   # fla's own pre-process functions, by name (filled by install)
# storage address -> the forward's buffer of [entering states | its two parts' transition maps] (`_kept_maps`)
_KEPT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True)
class ChainPass:
    """How a registered context's chain passes run: `concurrent_parts` (the two parts' scans at once)
    and `transition` ("fla": fla's own summary kernels; "fp32" / "bf16x2" / "bf16": fla's kernel for
    the state columns and `kernels/context_parallel_gdn_transition.py` for the transition map, at that
    precision)."""
    concurrent_parts: bool = False
    transition: str = "fla"


def register(context, chain_pass: ChainPass) -> None:
    """Route `context`'s chain passes through this module (kept until the context is collected)."""
    key = id(context)
    _MINE[key] = (weakref.ref(context, lambda _: _MINE.pop(key, None)), chain_pass)


def pass_of(context) -> ChainPass | None:
    """The ChainPass `context` was registered with (None: not registered, fla's own path)."""
    got = _MINE.get(id(context)) if context is not None else None
    return got[1] if got is not None and got[0]() is context else None


def is_mine(context) -> bool:
    return pass_of(context) is not None


def at_once(calls, device: torch.device) -> None:
    """Run each call, the first on the current stream and the others each on a side stream (CUDA);
    the current stream continues after all of them. Elsewhere they run in turn."""
    if device.type != "cuda" or len(calls) < 2:
        for call in calls:
            call()
        return
    main = torch.cuda.current_stream(device)
    sides = _side_streams(device, len(calls) - 1)
    try:
        for side, call in zip(sides, calls[1:]):
            side.wait_stream(main)  # inputs made on the current stream are ready
            with torch.cuda.stream(side):
                call()
        calls[0]()
    finally:  # also when a call raised: nothing later on the current stream overtakes a side stream
        for side in sides:
            main.wait_stream(side)  # outputs were allocated on the current stream, which now waits


@functools.lru_cache(maxsize=None)
def _side_streams_cached(index: int, n: int):
    return tuple(torch.cuda.Stream(device=index) for _ in range(n))


def _side_streams(device: torch.device, n: int):
    return _side_streams_cached(device.index if device.index is not None else torch.cuda.current_device(), n)


def _takes(context, k, use_graph) -> bool:
    """Whether this module serves the call; fla's own function keeps every other case (and its checks)."""
    return (is_mine(context) and context.group is not None and context.layout == "zigzag" and not use_graph
            and k.shape[-1] <= 256)


def _fwd_pre_process(*, k, w, u, g=None, gk=None, bg=None, v=None, chunk_size=64, state_v_first=False,
                     cu_seqlens=None, initial_state=None, context=None, use_graph=False, **newer):
    """fla's `chunk_gated_delta_rule_fwd_h_pre_process` for a zigzag context: each part's map of
    its last segment (skipped for the chain's last part), both at once; every rank's maps gathered
    in chain order (fronts ascending, backs descending); each part's entering state merged from the
    maps before it (none for the chain's first part). Returns the entering states [N, HV, K, V]."""
    if not _takes(context, k, use_graph) or initial_state is not None or newer:
        return _FLA["fwd"](k=k, w=w, u=u, g=g, gk=gk, bg=bg, v=v, chunk_size=chunk_size, state_v_first=state_v_first,
                           cu_seqlens=cu_seqlens, initial_state=initial_state, context=context, use_graph=use_graph,
                           **newer)
    HV, V, K, N, front = u.shape[2], u.shape[3], k.shape[-1], len(cu_seqlens) - 1, context.front_num_seqs
    maps = k.new_zeros(2, HV, K, V + K, dtype=torch.float32)
    how = pass_of(context)
    ours = how.transition != "fla" and g is not None and gk is None and bg is None and v is None
    mapped, n_state = _mapped(context), N * HV * K * V
    keep = ours and any(mapped)  # the backward's maps are these transposed: kept with the entering states
    buf = k.new_zeros(n_state + (2 * HV * K * K if keep else 0), dtype=torch.float32)
    entering = buf[:n_state].view(N, HV, *((V, K) if state_v_first else (K, V)))
    last_segments = (cu_seqlens[front - 1:front + 1], cu_seqlens[-2:])
    calls = []
    for i, (seg, last) in enumerate(zip(last_segments, context.is_last_by_part)):
        if not last:
            calls += _fwd_summary(k=k, w=w, u=u, g=g, gk=gk, bg=bg, v=v, hm=maps[i], seg=seg, chunk_size=chunk_size,
                                  transition=how.transition if ours else None, map_too=mapped[i])
    _run(calls, how, k.device)
    if keep:
        buf[n_state:].view(2, HV, K, K).copy_(maps[..., V:])
        _KEPT[buf.untyped_storage().data_ptr()] = buf
    _merge(maps, context, skip=context.is_first_by_part, targets=(entering[0], entering[front]),
           ranks_before=context.pre_num_ranks_by_part, state_v_first=state_v_first, forward=True)
    return entering


def _bwd_pre_process(*, q, k, w, do, dv, g=None, gk=None, bg=None, scale=None, state_v_first=False,
                     cu_seqlens=None, dht=None, initial_state=None, context=None, chunk_size=64, use_graph=False,
                     **newer):
    """fla's `chunk_gated_delta_rule_bwd_dhu_pre_process` for a zigzag context: each part's backward
    map of its first segment (skipped for the chain's first part), both at once; gathered in chain
    order; each part's leaving-state gradient merged from the maps after it. Returns (dht, None)."""
    if not _takes(context, q, use_graph) or dht is not None or newer:
        return _FLA["bwd"](q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk, bg=bg, scale=scale, state_v_first=state_v_first,
                           cu_seqlens=cu_seqlens, dht=dht, initial_state=initial_state, context=context,
                           chunk_size=chunk_size, use_graph=use_graph, **newer)
    HV, V, K, N, front = do.shape[2], do.shape[3], q.shape[-1], len(cu_seqlens) - 1, context.front_num_seqs
    maps = q.new_zeros(2, HV, K, V + K, dtype=torch.float32)
    leaving = q.new_zeros(N, HV, *((V, K) if state_v_first else (K, V)), dtype=torch.float32)
    first_segments = (cu_seqlens[:2], cu_seqlens[front:front + 2])
    how = pass_of(context)
    ours = how.transition != "fla" and g is not None and gk is None and bg is None
    mapped = _mapped(context)
    kept = _kept_maps(initial_state, N * HV * K * V, HV, K) if ours and any(mapped) else None
    calls = []
    for i, (seg, first) in enumerate(zip(first_segments, context.is_first_by_part)):
        if not first:
            calls += _bwd_summary(q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk, bg=bg, scale=scale, dhm=maps[i], seg=seg,
                                  chunk_size=chunk_size, transition=how.transition if ours else None,
                                  map_too=mapped[i], forward_map=None if kept is None else kept[i])
    _run(calls, how, q.device)
    _merge(maps, context, skip=context.is_last_by_part, targets=(leaving[front - 1], leaving[-1]),
           ranks_before=context.post_num_ranks_by_part, state_v_first=state_v_first, forward=False)
    return leaving, None


def _mapped(context) -> list[bool]:
    """Which of the rank's two parts need a transition map: not the chain's first (nothing enters it) nor
    its last (nothing leaves it); the other parts' summaries are their states alone."""
    return [not first and not last for first, last in zip(context.is_first_by_part, context.is_last_by_part)]


def _kept_maps(initial_state, n_state: int, HV: int, K: int):
    """The forward's two transition maps [2, HV, K, K], where fla handed back the entering states this
    module's forward made (unpacked rows: fla keeps them as they are; packed ones it copies), else None."""
    if initial_state is None:
        return None
    buf = _KEPT.get(initial_state.untyped_storage().data_ptr())
    if buf is None or buf.data_ptr() != initial_state.data_ptr() or buf.numel() != n_state + 2 * HV * K * K:
        return None
    return buf[n_state:].view(2, HV, K, K)


def _run(calls, how: ChainPass, device) -> None:
    if how.concurrent_parts:
        at_once(calls, device)
    else:
        for call in calls:
            call()


def _fla_blocks(K: int) -> tuple[int, int]:
    """(BV, BK) as fla's summary wrappers launch its kernels: column block i is a state column block
    below V / BV, a transition one past it."""
    return (32 if K <= 64 else 64), 1 << (K - 1).bit_length()


def _fwd_summary(*, k, w, u, g, gk, bg, v, hm, seg, chunk_size, transition, map_too=True):
    """The calls writing one part's forward summary [h_local | M] into hm: fla's `chunk_cp_fwd_h`
    whole (`transition` None), or its kernel over the state columns only (a grid of V / BV column
    blocks: its M programs are the ones past those) beside ours for M (none without `map_too`: M
    stays 0)."""
    if transition is None:
        from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
        return [functools.partial(chunk_cp_fwd_h, k=k, w=w, u=u, hm=hm, g=g, gk=gk, bg=bg, v=v, cu_seqlens=seg,
                                  chunk_size=chunk_size)]
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_kernel_h
    from bumblebee.kernels.context_parallel_gdn_transition import transition_map
    T, H, K = k.shape[1], k.shape[2], k.shape[3]
    HV, V = u.shape[2:]
    BV, BK = _fla_blocks(K)

    def state_columns():
        chunk_cp_fwd_kernel_h[(-(-V // BV), HV)](
            k=k, v=u, w=w, g=g, gk=None, bg=None, u=u, hm=hm, cu_seqlens=seg, T=T, H=H, HV=HV, K=K, V=V,
            BT=chunk_size, BV=BV, BK=BK, MULTI_SEQS=False)
    if not map_too:
        return [state_columns]
    return [state_columns, functools.partial(transition_map, k, w, g, seg, hm[:, :, V:], chunk_size=chunk_size,
                                             reverse=False, precision=transition)]


def _bwd_summary(*, q, k, w, do, dv, g, gk, bg, scale, dhm, seg, chunk_size, transition, map_too=True,
                 forward_map=None):
    """The calls writing one part's backward summary [dh_local | dM] into dhm (as `_fwd_summary`); with our
    transition maps and the part's `forward_map` kept, dM is that map transposed (the backward composes
    the chunks' transposed transforms in reverse order: (A_n ... A_1)^T), not computed again."""
    if transition is None:
        from fla.ops.cp.chunk_bwd import chunk_cp_bwd_dh
        return [functools.partial(chunk_cp_bwd_dh, q=q, k=k, w=w, do=do, dv=dv, dhm=dhm, g=g, gk=gk, bg=bg,
                                  scale=scale, cu_seqlens=seg, chunk_size=chunk_size)]
    from fla.ops.cp.chunk_bwd import chunk_cp_bwd_kernel_dh
    from bumblebee.kernels.context_parallel_gdn_transition import transition_map
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = do.shape[2:]
    BV, BK = _fla_blocks(K)

    def state_columns():
        chunk_cp_bwd_kernel_dh[(-(-V // BV), HV)](
            q=q, k=k, w=w, g=g, gk=None, do=do, dhm=dhm, dv=dv, cu_seqlens=seg, scale=scale, T=T, H=H, HV=HV,
            K=K, V=V, BT=chunk_size, BV=BV, BK=BK, USE_BG=False)
    if not map_too:
        return [state_columns]
    if forward_map is not None:
        return [state_columns, functools.partial(dhm[:, :, V:].copy_, forward_map.transpose(-1, -2))]
    return [state_columns, functools.partial(transition_map, k, w, g, seg, dhm[:, :, V:], chunk_size=chunk_size,
                                             reverse=True, precision=transition)]


def _merge(maps, context, *, skip, targets, ranks_before, state_v_first, forward):
    """All-gather every rank's two maps, order them as the chain runs (rank fronts ascending, then rank
    backs descending) and merge into each part's boundary state the ones before it in that direction."""
    from fla.ops.cp.chunk_merge import chunk_cp_merge
    from fla.ops.cp.comm import all_gather_into_tensor
    rank, world = dist.get_rank(group=context.group), dist.get_world_size(group=context.group)
    gathered, _ = all_gather_into_tensor(maps, group=context.group)
    chain = torch.cat([gathered[:, 0], gathered[:, 1].flip(0)])
    for i in range(2):
        if not skip[i]:
            chunk_cp_merge(h=targets[i], ag_hm=chain, num_ranks=ranks_before[i],
                           rank=rank if i == 0 else 2 * world - 1 - rank, state_v_first=state_v_first,
                           forward=forward, h_seq_idx=None, use_graph=False)


def install() -> None:
    """Rebind fla's gated delta rule's two pre-process names to the dispatchers above (once)."""
    import fla.ops.gated_delta_rule.chunk as rule
    if rule.chunk_gated_delta_rule_fwd_h_pre_process is not _fwd_pre_process:
        _FLA["fwd"] = rule.chunk_gated_delta_rule_fwd_h_pre_process
        rule.chunk_gated_delta_rule_fwd_h_pre_process = _fwd_pre_process
    if rule.chunk_gated_delta_rule_bwd_dhu_pre_process is not _bwd_pre_process:
        _FLA["bwd"] = rule.chunk_gated_delta_rule_bwd_dhu_pre_process
        rule.chunk_gated_delta_rule_bwd_dhu_pre_process = _bwd_pre_process
