"""MLA under context parallelism against the single-rank MLA layer (gloo, CPU; one 4-rank spawn).

The layer has DeepSeek-V3-tiny's dimensions; the single-rank layer is the `mla` slot's default
(`FlashMLA`, one SDPA call over the whole sequence, per document when packed). At CP = 4 and CP = 2,
for both exchanges (`latent`: the all-gathered latent and roped key, expanded a key chunk at a time; `heads`:
the all-gathered expanded K/V), unpacked (B = 2) and packed (documents of 1 and 5 tokens, shorter
than one chunk; with and without a query LoRA), in fp32 and float64: every rank's output and input
gradient at its positions, and every parameter gradient summed over the ranks, within 4x the fp32
single-rank layer's own error against float64 plus 8 ulps (float64: that scaled by eps64 / eps32).

The wire: with DeepSeek-V3's own attention dimensions, the tensors handed to the collectives (forward
all-gathers, backward reductions) are counted: the latent exchange moves far fewer bytes than the
heads and `auto` picks it; a bf16 layer's exchanges are bf16 both ways. The saved-for-backward bytes
of the latent exchange (counted by saved_tensors_hooks) grow with T by the gathered latent only: no
key's expanded K/V is kept (`mla_blocks.py` recomputes them per key chunk in the backward).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from bumblebee import models
from bumblebee.primitives.context_parallel import flash, layout
from bumblebee.primitives.context_parallel.mla import choose, mla_forward, wire_numbers
from bumblebee.primitives.context_parallel.model import ContextParallel
from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig
from tests.primitives.context_parallel_ranks import compare_module, cp_groups, error, error64, spawn, within

PACKED = torch.tensor([0, 5, 6, 30, 31, 48])  # documents of 5, 1, 24, 1, 17 tokens; chunks of 12 or 6
T = 48


def _dims(name, q_lora="config"):
    cfg = models.NAMED[name]
    return dict(dim=cfg["hidden_size"], n_heads=cfg["num_attention_heads"],
                q_lora_rank=cfg["q_lora_rank"] if q_lora == "config" else q_lora, kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"])


def _layer(dims, dtype=torch.float32):
    dims = dict(dims)
    return FlashMLA(FlashMLAConfig(), dims.pop("dim"), dims.pop("n_heads"), **dims).to(dtype)


def _rope(positions_BT, R):
    freqs = positions_BT[..., None].double() / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _run(layer, fn, x, w):
    """(output, input gradient, parameter gradients) of fn(layer, x) under the loss sum(out * w)."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = fn(layer, x)
    (out * w.to(out.dtype)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _checks(group, refs):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    errors, off = {}, {}
    for q_lora, cu in (("config", None), ("config", PACKED), (None, PACKED)):
        B = 2 if cu is None else 1
        dims = _dims("deepseek-v3-tiny", q_lora)
        batch = layout.make_batch(group, T, cu)
        idx = batch.index
        cos, sin = _rope((torch.arange(T) - batch.all_starts).expand(B, T), dims["qk_rope_head_dim"])
        g = torch.Generator().manual_seed(5)
        x, w = (torch.randn(B, T, dims["dim"], generator=g, dtype=torch.float64) for _ in range(2))
        key = f"q_lora={q_lora} packed={cu is not None}"
        if key not in refs:  # the single-rank runs do not depend on CP: once per process
            torch.manual_seed(3)
            state = _layer(dims, torch.float64).state_dict()
            runs = {}
            for dtype in (torch.float64, torch.float32):
                layer = _layer(dims, dtype)
                layer.load_state_dict(state)
                runs[dtype] = _run(layer, lambda m, t: m(t, cos.to(t.dtype), sin.to(t.dtype), cu_seqlens=cu),
                                   x.to(dtype), w)
            refs[key] = state, runs
        state, runs = refs[key]
        for dtype in (torch.float32, torch.float64):
            layer = _layer(dims, dtype)
            layer.load_state_dict(state)
            for exchange in ("latent", "heads"):
                def local(m, t):
                    return mla_forward(m, layout.shard(t, cp, rank), cos[:, idx].to(dtype), sin[:, idx].to(dtype),
                                       batch, exchange=exchange)
                got = _run(layer, local, x.to(dtype), layout.shard(w, cp, rank))
                assert got[0].dtype == dtype
                compare_module(errors, off, f"{exchange} {dtype} {key}", error if dtype == torch.float32 else error64,
                               group, idx, got, runs[torch.float64], runs[torch.float32])
    return {"errors": errors, "off": off}


@contextlib.contextmanager
def _metered(log: list):
    """Record (collective, dtype, bytes) of every tensor handed to all_gather / all_reduce /
    reduce_scatter (what this rank puts on the wire); the functions are restored on exit."""
    sent_arg = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}
    saved = {n: getattr(dist, n) for n in sent_arg}

    def wrap(name):
        def call(*args, **kw):
            sent = args[sent_arg[name]]
            for t in sent if isinstance(sent, (list, tuple)) else [sent]:
                log.append((name, t.dtype, t.numel() * t.element_size()))
            return saved[name](*args, **kw)
        return call
    for n in sent_arg:
        setattr(dist, n, wrap(n))
    try:
        yield log
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _wire(group, name: str, dtype, dim=None):
    """What each exchange hands to the collectives, forward and backward, for a layer of `name`'s
    attention dimensions in `dtype` (`dim`: a narrower model width, no query LoRA: neither touches
    the exchange, and they keep DeepSeek-V3's layer small)."""
    cp = dist.get_world_size(group)
    dims = _dims(name) if dim is None else {**_dims(name, q_lora=None), "dim": dim}
    torch.manual_seed(0)
    layer = _layer(dims, dtype)
    n = 4 * cp
    batch = layout.make_batch(group, n)
    cos, sin = (t[:, batch.index].to(dtype) for t in _rope(torch.arange(n)[None], dims["qk_rope_head_dim"]))
    x = torch.randn(1, 2 * batch.chunk, dims["dim"], dtype=dtype, requires_grad=True)
    logs = {}
    for exchange in ("latent", "heads", "auto"):
        with _metered(logs.setdefault(exchange, [])):
            mla_forward(layer, x, cos, sin, batch, exchange=exchange).float().square().sum().backward()
    return logs


def _saved_bytes(fn, params) -> int:
    """Bytes of the storages fn's autograd graph saves for the backward (saved_tensors_hooks on every
    saved tensor, custom Functions' included), each storage once, parameters left out."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:  # a saved tensor is kept alive by the graph: its pointer is unique
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.float().square().sum().backward()  # the graph runs with what it saved
    return sum(seen.values())


def _saved(group, local: int = 8) -> dict:
    """Saved-for-backward bytes of an fp32 layer with DeepSeek-V3's attention dimensions (model width
    16, no query LoRA) on T = local x CP tokens, this rank holding `local` of them, per exchange."""
    cp = dist.get_world_size(group)
    dims = {**_dims("deepseek-v3", q_lora=None), "dim": 16}
    torch.manual_seed(0)
    layer = _layer(dims)
    T = local * cp
    batch = layout.make_batch(group, T)
    cos, sin = (t[:, batch.index].float() for t in _rope(torch.arange(T)[None], dims["qk_rope_head_dim"]))
    x = torch.randn(1, local, dims["dim"], requires_grad=True)
    return {exchange: _saved_bytes(lambda: mla_forward(layer, x, cos, sin, batch, exchange=exchange),
                                   list(layer.parameters()))
            for exchange in ("latent", "heads")}


def scenario(world):
    """CP = 4 over the 4 ranks, then CP = 2 over ranks {0, 1} and {2, 3} (one spawn for both)."""
    out, refs = {}, {}
    for cp, group in cp_groups(world):
        out[cp] = {**_checks(group, refs), "wire": _wire(group, "deepseek-v3", torch.float32, dim=16),
                   "wire_bf16": _wire(group, "deepseek-v3-tiny", torch.bfloat16), "saved": _saved(group)}
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(4, __name__, "scenario", tmp_path_factory.mktemp("cp_mla"))


@pytest.mark.parametrize("cp", [2, 4])
def test_mla_equals_the_single_rank_layer(cp, four_ranks):
    for rank, result in enumerate(four_ranks):
        errors, off = result[cp]["errors"], result[cp]["off"]
        assert len(errors) >= 100 and within(errors) == [], (rank, within(errors))
        assert max(off.values()) == 0.0, f"rank {rank}: an input gradient off its positions"


@pytest.mark.parametrize("cp", [2, 4])
def test_latent_moves_fewer_bytes_than_heads_for_deepseek_v3(cp, four_ranks):
    for rank, result in enumerate(four_ranks):
        wire = result[cp]["wire"]
        total = {name: sum(b for _, _, b in log) for name, log in wire.items()}
        for name, log in wire.items():  # an all-gather forward, its reduction backward
            assert [op for op, _, _ in log][:1] == ["all_gather"] and len(log) >= 2, (name, log)
        assert total["heads"] > 50 * total["latent"], (rank, total)  # 40960 numbers a token against 576
        assert wire["auto"] == wire["latent"], rank


@pytest.mark.parametrize("cp", [2, 4])
def test_exchange_keeps_the_activation_dtype(cp, four_ranks):
    """A bf16 layer (DeepSeek-V3-tiny) puts bf16 on the wire both ways, whichever exchange."""
    for rank, result in enumerate(four_ranks):
        for name, log in result[cp]["wire_bf16"].items():
            assert len(log) >= 2 and {dtype for _, dtype, _ in log} == {torch.bfloat16}, (rank, name, log)


@pytest.mark.parametrize("fused", [True, False])
def test_latent_blocks_at_cp1_equal_the_layer_in_float64(fused, monkeypatch):
    """Both block paths of the latent exchange (flash's op, and the torch scores CUDA runs in fp32,
    forced here) on one rank, packed: output, input and parameter gradients equal the mla layer's."""
    monkeypatch.setattr(flash, "ring_usable", lambda q: fused)
    dims = _dims("deepseek-v3-tiny")
    batch = layout.make_batch(None, T, PACKED)
    cos, sin = _rope((torch.arange(T) - batch.all_starts)[None], dims["qk_rope_head_dim"])
    torch.manual_seed(3)
    layer = _layer(dims, torch.float64)
    x, w = torch.randn(2, 1, T, dims["dim"], dtype=torch.float64)
    want = _run(layer, lambda m, t: m(t, cos, sin, cu_seqlens=PACKED), x, w)
    idx = batch.index
    got = _run(layer, lambda m, t: mla_forward(m, t[:, idx], cos[:, idx], sin[:, idx], batch, exchange="latent"),
               x, w[:, idx])
    torch.testing.assert_close(got[0], want[0][:, idx], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)


def test_choose_picks_the_smaller_wire_and_refuses_unknown_names():
    big = _layer(_dims("deepseek-v3-tiny"))  # 4 heads x (24 + 16) = 160 numbers a token vs 32 + 8
    assert wire_numbers(big) == {"latent": 40, "heads": 160} and choose(big, "auto") == "latent"
    narrow = _layer(dict(dim=16, n_heads=1, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=4,
                         qk_rope_head_dim=2, v_head_dim=4))  # one head, a wide latent: 10 vs 66
    assert choose(narrow, "auto") == "heads" and choose(narrow, "latent") == "latent"
    with pytest.raises(ValueError, match="exchange must be one of"):
        choose(big, "ring")
    with pytest.raises(ValueError, match="mla_exchange"):
        ContextParallel(mla_exchange="expanded")


def test_latent_saves_the_gathered_latent_not_the_expanded_keys(four_ranks):
    """Rank 0 (its later chunk the last: it sees every key) holds 8 tokens at CP = 2 (T = 16) and at
    CP = 4 (T = 32). Counted from the tensors the graph saves: the latent exchange grows by about the
    gathered latent (r + R numbers a key, and its gather index), far below one key's expanded K/V
    (H x (qk + v)), which the heads exchange does keep; at CP = 4 it saves well under the heads-expanded
    K/V of all T keys."""
    cfg = models.NAMED["deepseek-v3"]
    latent = 4 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])  # fp32 bytes a key
    heads = 4 * cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    small, big = four_ranks[0][2]["saved"], four_ranks[0][4]["saved"]
    per_key = {name: (big[name] - small[name]) / 16 for name in big}
    assert 0 < per_key["latent"] < min(2 * latent, heads / 50), per_key
    assert per_key["heads"] >= heads, per_key
    assert big["latent"] < 0.5 * 32 * heads, (big, 32 * heads)
