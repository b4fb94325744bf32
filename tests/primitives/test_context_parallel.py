"""Context parallelism against the same layer on the full sequence on one rank (fp32, gloo, CPU).

Layout (no ranks): shard / unshard, positions, targets shifted on the full sequence, bad input; the
dispatch (one process): packed rows run the fused kernels, one flash block per document piece.
Layers at CP = 2 and 4 (one spawn of 4 ranks): causal GQA attention (ratios 1, 4, 8; all-gather and
ring on the fused kernels in fp32 and float64, the ring's masked form in fp32; unpacked with B = 2,
and packed with one-token documents, documents that do not divide by 2 x CP, start on chunk edges,
span chunks and ranks), the exchanges between projections (weight gradients; packed), gated
DeltaNet (state passing across 2 x CP chunks, a chunk longer than the rule's 64-token block, conv
halo, packed); MLA in test_context_parallel_mla.py. Every rank's outputs and input gradients
at its own positions, and the sum of its
parameter gradients over ranks, lie within 4x the fp32 single-rank layer's own error against
float64 plus 8 ulps (float64 runs: the same scaled by eps64 / eps32); input gradients off the
rank's positions are zero. The attention reference takes its softmax in float64 (the eager twin,
the fp32 run, in fp32).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from bumblebee.baselines.attention import eager_attention
from bumblebee.baselines.linear_attention import ChunkedGatedDeltaNet
from bumblebee.primitives.context_parallel import layout
from bumblebee.primitives.context_parallel.attention import EXCHANGES, masked_ring
from bumblebee.primitives.context_parallel.gdn import gdn_forward
from bumblebee.primitives.linear_attention_torch import causal_conv1d_silu_taps
from tests.primitives.context_parallel_ranks import compare_module, cp_groups, error, error64, spawn, within

PACKED = torch.tensor([0, 5, 6, 30, 31, 48])  # one-token documents at 5 and 30; 48 tokens
# documents starting on chunk edges (12 at CP = 2 and 4), a one-token one there, one at the row's end
PACKED_EDGES = torch.tensor([0, 12, 13, 25, 47, 48])
LONG = torch.tensor([0, 1, 100, 288])  # chunks of 72 (CP = 2) or 36 (CP = 4) tokens


# ---- the layout, on one process ----------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip(cp):
    x = torch.arange(2 * 24).view(2, 24)
    pieces = [layout.shard(x, cp, r) for r in range(cp)]
    assert torch.equal(layout.unshard(pieces), x)
    L = 24 // (2 * cp)
    for r, p in enumerate(pieces):  # chunk r, then chunk 2 CP - 1 - r
        assert torch.equal(p[0], torch.cat([x[0, r * L:(r + 1) * L], x[0, (2 * cp - 1 - r) * L:(2 * cp - r) * L]]))


def test_shard_batch_positions_and_targets_cross_chunk_boundaries():
    ids = torch.arange(100, 148)[None]
    shards = [layout.shard_batch(ids, None, None, cu_seqlens=PACKED) for _ in range(1)]
    s = shards[0]
    assert s.count == 48 - 5  # one target fewer per document
    starts = [0] * 5 + [5] + [6] * 24 + [30] + [31] * 17
    assert s.position_ids[0].tolist() == [t - a for t, a in zip(range(48), starts)]
    want = [ids[0, t + 1].item() if t + 1 < 48 and starts[t + 1] == starts[t] else -100 for t in range(48)]
    assert s.targets[0].tolist() == want


def test_packed_rows_shard_as_one_stream_with_targets_shifted_per_row():
    """B = 2 packed (the models' convention: cu_seqlens over the B*T tokens, a document across the row
    end): one stream of 48 tokens, positions across the row end, no target for a row's last token."""
    ids = torch.arange(100, 148).view(2, 24)
    two, one = (layout.shard_batch(x, None, None, cu_seqlens=PACKED) for x in (ids, ids.reshape(1, 48)))
    assert two.input_ids.shape == (1, 48) and torch.equal(two.input_ids, one.input_ids)
    assert torch.equal(two.position_ids, one.position_ids) and two.position_ids[0, 24].item() == 24 - 6
    want = one.targets.clone()
    want[0, 23] = -100  # the document 6..29 crosses the row end: token 23 is row 0's last
    assert torch.equal(two.targets, want) and two.count == one.count - 1


def test_targets_are_shifted_before_sharding():
    """A chunk's last token predicts the next chunk's first token, held by another rank."""
    ids = torch.arange(16)[None]
    targets = layout.next_token_targets(ids, layout.doc_starts(None, 16, ids.device))
    for r in range(2):
        local_ids, local_t = layout.shard(ids, 2, r), layout.shard(targets, 2, r)
        assert torch.equal(local_t[0, :3], local_ids[0, 1:4])  # inside chunk r
        assert local_t[0, 3].item() == (4 * r + 4 if r == 0 else 8)  # the next chunk's first token
    assert targets[0, -1].item() == -100


def test_bad_layout_input_names_the_argument():
    with pytest.raises(ValueError, match="T=30 must be divisible by 2 x CP = 4"):
        layout.check_cp(30, 2)
    with pytest.raises(ValueError, match="mtp_depths under context parallelism needs one packed row"):
        layout.shard_batch(torch.zeros(2, 8, dtype=torch.long), None, None, cu_seqlens=torch.tensor([0, 3, 16]),
                           mtp_depths=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layout.make_batch(None, 8, torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="CPBatch"):
        EXCHANGES["allgather"](*(torch.zeros(1, 2, 8, 4) for _ in range(3)), scale=1.0, batch=None)
    from bumblebee.primitives.context_parallel.model import ContextParallel
    with pytest.raises(ValueError, match="allgather_block_keys"):
        ContextParallel(allgather_block_keys=-1)
    with pytest.raises(ValueError, match="ContextParallel.deltanet must be one of 'auto', 'maps', 'fla'"):
        ContextParallel(deltanet="ring")


def test_deltanet_on_fla_names_why_it_cannot_run_on_cpu():
    """ContextParallel(deltanet="fla") on a CPU tensor: a clear error naming the option and the reason
    (fla's CP kernels need CUDA), not a silent fall-back to the maps."""
    batch = layout.make_batch(None, 8)
    layer = ChunkedGatedDeltaNet(32, 2, 4, 8, 8)
    with pytest.raises(RuntimeError, match=r"deltanet='fla'.*need CUDA"):
        gdn_forward(layer, torch.zeros(1, 8, 32), batch, deltanet="fla")
    with pytest.raises(ValueError, match="deltanet must be one of"):
        gdn_forward(layer, torch.zeros(1, 8, 32), batch, deltanet="widened")
    from bumblebee.primitives.context_parallel.gdn_fla import why_not_fla_cp
    assert "at most 256 a head, got 512" in why_not_fla_cp(torch.zeros(1, 8, 32), 512)


def test_deltanet_auto_takes_the_maps_where_fla_cannot_run():
    """The default (`auto`) on a CPU tensor is the maps, to the bit; on CUDA with fla 0.6 it is fla's
    CP kernels (test_context_parallel_fla_gpu.py)."""
    from bumblebee.primitives.context_parallel.model import ContextParallel
    assert ContextParallel().deltanet == "auto"
    batch = layout.make_batch(None, 16)
    torch.manual_seed(0)
    layer = ChunkedGatedDeltaNet(32, 2, 4, 8, 8)
    x = torch.randn(1, 16, 32)
    assert torch.equal(gdn_forward(layer, x, batch), gdn_forward(layer, x, batch, deltanet="maps"))


def test_deltanet_auto_takes_fla_only_for_what_fla_takes(monkeypatch):
    """Where fla's CP kernels serve the input (faked here), `auto` hands them the layer, unless the
    caller gave the maps' own conv (`row_conv`): then the maps run."""
    from bumblebee.primitives.context_parallel import gdn_fla
    monkeypatch.setattr(gdn_fla, "why_not_fla_cp", lambda x, head_k_dim=None: None)
    monkeypatch.setattr(gdn_fla, "fla_cp_forward", lambda layer, x, batch, concurrent, transition: "fla")
    torch.manual_seed(0)
    layer = ChunkedGatedDeltaNet(32, 2, 4, 8, 8)
    assert gdn_forward(layer, torch.randn(1, 16, 32), layout.make_batch(None, 16)) == "fla"
    own_conv = layout.make_batch(None, 16)
    assert isinstance(gdn_forward(layer, torch.randn(1, 16, 32), own_conv, row_conv=_torch_row_conv), torch.Tensor)


def _torch_row_conv(x_RnC, weight_CW):
    """SiLU(depthwise causal conv) of rows [R, n, C] in torch: the maps' `row_conv` argument."""
    W = weight_CW.shape[-1]
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x_RnC.transpose(1, 2), (W - 1, 0)), weight_CW[:, None],
                                   groups=weight_CW.shape[0])
    return torch.nn.functional.silu(y).transpose(1, 2)


@pytest.mark.parametrize("block_keys", [0, 1, 3, 7, 100])
@pytest.mark.parametrize("cu", [None, [0, 5, 6, 23, 40]])
def test_gathered_blocks_cover_each_visible_key_once_within_the_block_size(block_keys, cu):
    """The all-gather's blocks (CP = 1: chunks 0 and 1 of one rank): every query row sees each key of
    its document up to itself exactly once, and no all-visible block takes more than block_keys keys."""
    from bumblebee.primitives.context_parallel.flash import _gathered_blocks
    T = 40
    batch = layout.make_batch(None, T, None if cu is None else torch.tensor(cu))
    starts = batch.all_starts.tolist()
    seen = torch.zeros(T, T, dtype=torch.long)  # [query position, key position]
    pos = batch.index.tolist()  # global position of each local row
    for a, b, ka, kb, causal in _gathered_blocks(batch, block_keys):
        assert causal or not block_keys or kb - ka <= block_keys
        for i, row in enumerate(range(a, b)):  # the diagonal block is square, bottom-right causal
            seen[pos[row], ka:ka + i + 1 if causal else kb] += 1
    want = torch.zeros(T, T, dtype=torch.long)
    for q in range(T):
        want[q, starts[q]:q + 1] = 1
    assert torch.equal(seen, want)


# ---- which path runs (one process, CP = 1) ---------------------------------------------------

def test_fused_paths_take_packed_rows(monkeypatch):
    """Packed rows run the fused kernels: the dispatch says so, the masked forms (`_mask`, `_Ring`) are
    never called, and the ring's flash blocks are one per (document piece, key chunk) with a visible key."""
    from types import SimpleNamespace

    from bumblebee.primitives.context_parallel import attention, flash
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # on CPU: every dtype
        q = torch.zeros(1, dtype=dtype)
        assert attention.fused(q, "ring") and attention.fused(q, "allgather")
    for dtype, want in ((torch.float32, False), (torch.bfloat16, True)):  # flash on CUDA takes 16-bit only
        fake = SimpleNamespace(device=torch.device("cuda"), dtype=dtype)
        assert attention.fused(fake, "ring") is want and attention.fused(fake, "allgather")

    def refuse(*_, **__):
        raise AssertionError("the masked path ran")
    monkeypatch.setattr(attention, "_mask", refuse)
    monkeypatch.setattr(attention._Ring, "apply", refuse)
    rows, block_forward = [], flash.block_forward
    monkeypatch.setattr(flash, "block_forward", lambda q, *a: rows.append(q.shape[2]) or block_forward(q, *a))
    batch = layout.make_batch(None, 48, PACKED)  # chunks [0, 24) and [24, 48) on the one rank
    for dtype in (torch.float32, torch.float64):
        q, k, v, w = (t.to(dtype) for t in _inputs([(1, 4, 48, 8), (1, 2, 48, 8), (1, 2, 48, 8), (1, 4, 48, 8)], 1))
        want = _grads_of(lambda *t: _reference(*t, scale=0.3, cu_seqlens=PACKED), (q, k, v), w)
        for exchange in EXCHANGES.values():
            got = _grads_of(lambda *t: exchange(*t, scale=0.3, batch=batch), (q, k, v), w)
            tol = 64 * torch.finfo(dtype).eps
            for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):
                assert (a - b).abs().max() <= tol * b.abs().max()
    # per dtype and exchange (the all-gather's blocks are the ring's): chunk 0's pieces 0:5, 5:6, 6:24
    # (causal), chunk 1's first piece (document 6..29) against chunk 0's keys 6:24, then chunk 1's
    # pieces 24:30, 30:31, 31:48 (causal)
    assert rows == [5, 1, 18, 6, 6, 1, 17] * 4


# ---- the memory estimator's cp size (tools/memory.py) -----------------------------------------

def _slice(name, layers):
    from bumblebee import models
    cfg = {**models.NAMED[name], "num_hidden_layers": layers}
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


def test_estimator_divides_sequence_terms_by_cp_and_adds_the_exchange():
    from bumblebee.tools import memory
    cfg, T = _slice("qwen3-30b-a3b", 4), 131072
    one = memory.estimate(cfg, memory.Parallel(dp=4, ep=4, seq_len=T // 4))  # a quarter of the sequence, no cp
    for exchange in ("allgather", "ring"):
        cp = memory.estimate(cfg, memory.Parallel(dp=4, ep=4, cp=4, cp_exchange=exchange, seq_len=T))
        assert cp.static == one.static and cp.counts["tokens"] == T // 4
        for term in ("activations", "mtp_activations", "loss_buffers", "moe_dispatch"):
            assert getattr(cp, term) == getattr(one, term), term
        assert cp.cp_buffers > 0 and cp.peak >= one.peak + cp.cp_buffers - 1
    # all-gather's buffers grow with the whole sequence; the ring's with one rank's share of it
    H, K, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gather = memory.estimate(cfg, memory.Parallel(dp=4, ep=4, cp=4, seq_len=T)).cp_buffers
    # bf16 gathered K/V and their fp32 gradients; a block's 64K keys repeated to H heads, their bf16
    # gradients and one fp32 gradient to fold
    assert gather == T * (2 + 4) * 2 * K * dh + 65536 * (4 * 2 + 4) * H * dh
    whole = memory.estimate(cfg, memory.Parallel(dp=4, ep=4, cp=4, seq_len=T, cp_block_keys=0)).cp_buffers
    assert whole == T * (2 + 4) * 2 * K * dh + T * (4 * 2 + 4) * H * dh > gather  # one block of all T keys
    assert memory.estimate(cfg, memory.Parallel(dp=8, ep=4, cp=8, seq_len=T)).cp_buffers == gather
    ring = [memory.estimate(cfg, memory.Parallel(dp=8, ep=4, cp=c, cp_exchange="ring", seq_len=T)).cp_buffers
            for c in (4, 8)]
    assert ring[1] * 2 == ring[0] < gather
    assert memory.estimate(cfg, memory.Parallel(dp=4, ep=4, seq_len=T)).cp_buffers == 0


def test_estimator_cp_lowers_the_peak_of_attention_families():
    """GQA, hybrid and MLA models (MLA's latent exchange keeps the gathered latent and expands one key
    chunk at a time, so its buffers shrink with cp like the rest)."""
    from bumblebee.tools import memory
    for name, layers in (("qwen3-30b-a3b", 4), ("qwen3.5-35b-a3b", 4), ("qwen3-8b", 4), ("deepseek-v3", 4)):
        peaks = [memory.estimate(_slice(name, layers), memory.Parallel(dp=4, cp=cp, seq_len=131072)).peak
                 for cp in (1, 2, 4)]
        assert peaks[0] > peaks[1] > peaks[2], (name, peaks)
    text = memory.table(_slice("qwen3.5-35b-a3b", 4), memory.Parallel(dp=4, ep=4, cp=4, seq_len=131072))
    assert "cp=4" in text and "tokens/rank=1x32768" in text and "cp_buffers" in text


def test_estimator_refuses_a_bad_cp():
    from bumblebee.tools import memory
    with pytest.raises(ValueError, match="cp must be a positive int dividing dp"):
        memory.estimate("qwen3-tiny", memory.Parallel(dp=4, cp=3))
    with pytest.raises(ValueError, match="2 x cp = 8"):
        memory.estimate("qwen3-tiny", memory.Parallel(dp=4, cp=4, seq_len=100))
    with pytest.raises(ValueError, match="cp_exchange"):
        memory.estimate("qwen3-tiny", memory.Parallel(dp=2, cp=2, cp_exchange="a2a"))
    with pytest.raises(ValueError, match="cp_deltanet"):
        memory.estimate("qwen3-tiny", memory.Parallel(dp=2, cp=2, cp_deltanet="widened"))


def test_estimator_deltanet_on_fla_drops_the_maps_widening():
    """Qwen3.5 under cp: fla's CP kernels carry no widened values and no fp32 conv copies, only the
    chain's maps (per layer); a model without DeltaNet layers does not change."""
    from bumblebee.tools import memory
    cfg, T = _slice("qwen3.5-35b-a3b", 4), 131072
    maps, fla = (memory.estimate(cfg, memory.Parallel(dp=4, cp=4, seq_len=T, cp_deltanet=m)) for m in ("maps", "fla"))
    one = memory.estimate(cfg, memory.Parallel(dp=4, seq_len=T // 4))  # a quarter of the sequence, no cp
    assert maps.peak > fla.peak >= one.peak  # full recompute: the layer's extra lives at its backward
    dense = _slice("qwen3-30b-a3b", 4)
    assert memory.estimate(dense, memory.Parallel(dp=4, cp=4, seq_len=T, cp_deltanet="fla")).peak == \
        memory.estimate(dense, memory.Parallel(dp=4, cp=4, seq_len=T)).peak



def test_estimator_maps_keep_fp32_conv_copies_off_cuda_only():
    """The maps' conv: on CUDA the halo rows run fla's conv in the compute dtype (`halo_conv_rows`), so
    no fp32 copy of the conv's input and output ([T / cp, C] each) lives at the layer's backward;
    elsewhere (`halo_conv_silu`) both do. Norms uncompiled on both devices, so only the conv differs."""
    from bumblebee.tools import memory
    cfg, T, cp = _slice("qwen3.5-35b-a3b", 4), 131072, 4
    est = {d: memory.estimate(cfg, memory.Parallel(dp=4, cp=cp, seq_len=T, device=d, compiled_norms=False))
           for d in ("cuda", "cpu")}
    conv = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    assert est["cpu"].layer_working - est["cuda"].layer_working == 2 * 4 * conv * (T // cp)

# ---- the layers at CP = 2 and 4 ----------------------------------------------------------------

def _inputs(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _grads_of(fn, leaves, w):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    (out * w.to(out.dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _reference(q, k, v, *, scale, cu_seqlens):
    """Causal GQA attention with the whole softmax in the inputs' dtype (float64: the float64
    reference; the eager twin takes its softmax in fp32)."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    starts = layout.doc_starts(cu_seqlens, T, q.device)
    pos = torch.arange(T)
    s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~((pos[None, :] <= pos[:, None]) & (pos[None, :] >= starts[:, None])), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(G, 1)


def _attend_full(cu):
    """The single-rank attention: the float64 reference, and in fp32 the eager twin (PyTorch's own error)."""
    def attend(q, k, v, scale):
        fn = _reference if q.dtype == torch.float64 else eager_attention
        return fn(q, k, v, scale=scale, cu_seqlens=cu)
    return attend


def _attention_checks(group, errors, off, refs):
    """Every exchange (fp32 and float64 inputs; the ring's masked form in fp32) on q, k, v against the
    single-rank attention: outputs, input gradients at this rank's positions, zero gradient off them."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    H, D, T = 8, 8, 48
    paths = {**EXCHANGES, "masked_ring": masked_ring,  # and the all-gather's earlier keys cut into blocks of 5
             "allgather block_keys=5": functools.partial(EXCHANGES["allgather"], block_keys=5)}
    for kv in (8, 2, 1):  # GQA ratios 1, 4, 8
        for cu in (None, PACKED, PACKED_EDGES):
            B = 2 if cu is None else 1
            q, k, v, w = _inputs([(B, H, T, D), (B, kv, T, D), (B, kv, T, D), (B, H, T, D)], seed=kv)
            ref = lambda *t: _attend_full(cu)(*t, scale=0.3)  # noqa: E731
            key = f"attention kv={kv} packed={_name(cu)}"
            if key not in refs:  # the single-rank runs do not depend on CP: once per process
                refs[key] = (*_grads_of(ref, (q, k, v), w), *_grads_of(ref, [t.float() for t in (q, k, v)], w))
            o64, g64, o32, g32 = refs[key]
            batch = layout.make_batch(group, T, cu)
            idx = batch.index
            for name, exchange in paths.items():
                for dtype in (torch.float32, torch.float64):
                    if name == "masked_ring" and dtype == torch.float64:
                        continue  # float64 is the fused paths' case (the masked one computes as before)
                    def cp_fn(*full):
                        return exchange(*(layout.shard(t, cp, rank, dim=2) for t in full), scale=0.3, batch=batch)
                    o, grads = _grads_of(cp_fn, [t.to(dtype) for t in (q, k, v)], layout.shard(w, cp, rank, dim=2))
                    assert o.dtype == dtype
                    rule = error if dtype == torch.float32 else error64
                    case = f"attention {name} {dtype} kv={kv} packed={_name(cu)}"
                    errors[f"{case} out"] = rule(o, o64[:, :, idx], o32[:, :, idx])
                    for n, g, a, b in zip("qkv", grads, g64, g32):
                        errors[f"{case} d{n}"] = rule(g[:, :, idx], a[:, :, idx], b[:, :, idx])
                        g = g.clone()
                        g[:, :, idx] = 0
                        off[f"{case} d{n}"] = g.abs().max().item()


class _Projected(torch.nn.Module):
    """Attention between projections (q, k, v, o; GQA 4 / 2), so weight gradients are checked too."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.shape = (heads, kv_heads, head_dim)
        self.q, self.o = torch.nn.Linear(dim, heads * head_dim), torch.nn.Linear(heads * head_dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)

    def forward(self, x_BTD, attend):
        (H, K, D), (B, T, _) = self.shape, x_BTD.shape
        q = self.q(x_BTD).view(B, T, H, D).transpose(1, 2)
        k, v = self.kv(x_BTD).view(B, T, 2 * K, D).transpose(1, 2).split(K, dim=1)
        return self.o(attend(q, k, v, 0.3).transpose(1, 2).reshape(B, T, H * D))


def _projected_checks(group, errors, off, refs):
    """Both exchanges inside a projected layer, packed: outputs, input and weight gradients."""
    for cu in (PACKED, PACKED_EDGES):
        batch = layout.make_batch(group, 48, cu)
        for name, exchange in EXCHANGES.items():
            torch.manual_seed(11)
            _module_checks(group, errors, off, refs, f"projected {name} packed={_name(cu)}", _twins(_Projected),
                           lambda layer, t: layer(t, _attend_full(cu)),
                           lambda layer, t: layer(t, lambda q, k, v, s: exchange(q, k, v, scale=s, batch=batch)),
                           *_inputs([(1, 48, 32), (1, 48, 32)], seed=12), batch.index)


def _name(cu):
    return "no" if cu is None else "-".join(map(str, cu.tolist()))


def _module_checks(group, errors, off, refs, case, layers, full, local, x, w, idx):
    """A module (float64 and fp32 copies in `layers`) whole on one rank (`full(layer, x)`) against this
    rank's cp form (`local(layer, x_shard)`): output and input gradient at idx, parameter gradients
    summed over the group; the input gradient off idx in `off`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layer64, layer32 = layers
    if case not in refs:  # the single-rank runs do not depend on CP: once per process
        refs[case] = (*_grads_of(lambda t: full(layer64, t), [x], w),
                      *_grads_of(lambda t: full(layer32, t), [x.float()], w),
                      {n: p.grad for n, p in layer64.named_parameters()},
                      {n: p.grad.clone() for n, p in layer32.named_parameters()})
        layer32.zero_grad()
    o64, (gx64,), o32, (gx32,), p64, p32 = refs[case]
    o, (gx,) = _grads_of(lambda t: local(layer32, layout.shard(t, cp, rank)), [x.float()], layout.shard(w, cp, rank))
    compare_module(errors, off, case, error, group, idx, (o, gx, {n: p.grad for n, p in layer32.named_parameters()}),
                   (o64, gx64, p64), (o32, gx32, p32))


def _twins(cls, *args, **kw):
    layer64 = cls(*args, **kw).double()
    layer32 = cls(*args, **kw)
    layer32.load_state_dict(layer64.state_dict())
    return layer64, layer32


def _gdn_checks(group, errors, off, refs):
    for T, cu in ((48, None), (48, PACKED), (288, LONG)):
        B = 2 if cu is None else 1
        torch.manual_seed(T)
        batch = layout.make_batch(group, T, cu)
        _module_checks(group, errors, off, refs, f"gdn T={T} packed={cu is not None}",
                       _twins(ChunkedGatedDeltaNet, 32, 2, 4, 8, 8),  # 2 key heads, 4 value heads
                       lambda layer, t: layer(t, cu_seqlens=cu), lambda layer, t: gdn_forward(layer, t, batch),
                       *_inputs([(B, T, 32), (B, T, 32)], seed=T), batch.index)
        if cu is None:  # the rows path fla's conv takes on CUDA, here with the torch conv in its place
            _module_checks(group, errors, off, refs, f"gdn T={T} conv rows",
                           _twins(ChunkedGatedDeltaNet, 32, 2, 4, 8, 8),
                           lambda layer, t: layer(t, cu_seqlens=cu),
                           lambda layer, t: gdn_forward(layer, t, batch, row_conv=causal_conv1d_silu_taps),
                           *_inputs([(B, T, 32), (B, T, 32)], seed=T), batch.index)


def layers(world):
    """CP = 4 over the 4 ranks, then CP = 2 over ranks {0, 1} and {2, 3} (one spawn for both)."""
    out, refs = {}, {}
    for cp, group in cp_groups(world):
        errors, off = {}, {}
        _attention_checks(group, errors, off, refs)
        _projected_checks(group, errors, off, refs)
        _gdn_checks(group, errors, off, refs)
        out[cp] = {"errors": errors, "off": off}
    from tests.primitives.test_context_parallel_model import fsdp_dp2_cp2, fsdp_ep  # models on the same 4 ranks
    out["dp2_cp2"] = fsdp_dp2_cp2(world)
    out["ep"] = fsdp_ep(world)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(4, __name__, "layers", tmp_path_factory.mktemp("cp"))


def test_fsdp2_over_dp2_cp2_equals_one_rank(four_ranks):
    """Qwen3 under FSDP2 over the (dp = 2, cp = 2) mesh, each dp pair its own sequence, over three AdamW
    steps (tests/primitives/test_context_parallel_model.py `fsdp_dp2_cp2`)."""
    for rank, result in enumerate(four_ranks):
        assert len(result["dp2_cp2"]) > 5
        assert within(result["dp2_cp2"]) == [], f"rank {rank}"


@pytest.mark.parametrize("ep", ["dp", "cp"])
def test_fsdp2_with_ep_mesh_beside_cp_equals_one_rank(ep, four_ranks):
    """Qwen3-MoE (load-balancing loss on) under FSDP2 over (dp = 2, cp = 2) with `ep_mesh`, experts
    split over 2 ranks along dp or along cp, over three AdamW steps: losses, grad norms, weights
    (tests/primitives/test_context_parallel_model.py `fsdp_ep`)."""
    for rank, result in enumerate(four_ranks):
        mine = {k: v for k, v in result["ep"].items() if k.startswith(f"dp2_cp2 ep over {ep} ")}
        assert len(mine) > 5 and any("experts" in k for k in mine)
        assert within(mine) == [], f"rank {rank}"


@pytest.mark.parametrize("cp", [2, 4])
def test_layers_equal_the_single_rank_layer(cp, four_ranks):
    for rank, result in enumerate(four_ranks):
        result = result[cp]
        assert len(result["errors"]) >= 60
        assert within(result["errors"]) == [], f"rank {rank} of CP = {cp}"
        assert max(result["off"].values()) == 0.0, f"rank {rank} of CP = {cp}: gradient off its positions"


def test_grouped_blocks_on_cpu_repeat_and_sum_the_key_heads(monkeypatch):
    """The CPU twin gets K/V repeated to the query heads and gives dK/dV back with the key heads (the sum
    over each group of the repeated call's); a grouped shape a CUDA kernel refused is not tried again."""
    from bumblebee.primitives.context_parallel import kernels
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 8, 40, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    o, lse, aux = kernels.block_forward(q, k, v, True, 0.25)
    dq, dk, dv = kernels.block_backward(do, q, k, v, o, lse, True, 0.25, aux)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    o_r, lse_r, aux_r = kernels.block_forward(q, kr, vr, True, 0.25)
    dq_r, dk_r, dv_r = kernels.block_backward(do, q, kr, vr, o_r, lse_r, True, 0.25, aux_r)
    assert aux[:2] == ("cpu", 4) and aux_r[:2] == ("cpu", 1) and dk.shape == k.shape and dv.shape == v.shape
    assert torch.equal(o, o_r) and torch.equal(dq, dq_r)
    torch.testing.assert_close(dk, dk_r.unflatten(1, (2, 4)).sum(2))
    torch.testing.assert_close(dv, dv_r.unflatten(1, (2, 4)).sum(2))
    monkeypatch.setattr(kernels, "_GROUPED_REFUSED", set())
    assert kernels._tries("cudnn", q, k, True) == (1, 4) and kernels._tries("cudnn", q, kr, True) == (1,)
    kernels._refused("cudnn", q, k, True, 1)
    assert kernels._tries("cudnn", q, k, True) == (4,) and kernels._tries("flash", q, k, True) == (1, 4)


def test_a_refused_grouped_backward_runs_on_the_repeated_heads(monkeypatch):
    """A CUDA kernel whose grouped backward is refused (played here by the CPU op behind a fake flash
    backward that refuses fewer key heads) reruns it on the repeated heads, from the same o and lse, and
    the shape is not tried grouped again."""
    from types import SimpleNamespace

    from bumblebee.primitives.context_parallel import kernels
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(1, 8, 24, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(2))
    o, lse, aux = kernels.block_forward(q, k, v, True, 0.25)
    want = kernels.block_backward(do, q, k, v, o, lse, True, 0.25, aux)
    heads, cpu_backward = [], torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def flash_backward(do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, p, causal, seed, offset, scale):
        heads.append(k.shape[1])
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("grouped backward refused")
        return cpu_backward(do, q, k, v, o, lse, p, causal, scale=scale)
    monkeypatch.setattr(kernels, "aten", SimpleNamespace(_scaled_dot_product_flash_attention_backward=flash_backward))
    monkeypatch.setattr(kernels, "_GROUPED_REFUSED", set())
    got = kernels.block_backward(do, q, k, v, o, lse, True, 0.25, ("flash", 1, None, None, None, None, None, None))
    assert heads == [2, 8] and kernels._tries("flash", q, k, True) == (4,)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
