"""MLA: the SDPA primitive (lean backward on and off) against the naive twin, forward and gradients,
padded and packed batches, saved-activation size of the lean backward (alone and inside the models'
full recompute), bad input; bf16 on the GPU."""
import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from bumblebee import recompute

from bumblebee.baselines.mla import NaiveMLA
from bumblebee import registry
from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig


def make_pair(dtype=torch.float64, device="cpu", seed=0, config=FlashMLAConfig(), **kw):
    """(twin, primitive with `config`), the same random weights."""
    args = dict(dim=40, n_heads=5, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6,
                v_head_dim=10, softmax_scale=0.23)
    args.update(kw)
    torch.manual_seed(seed)
    base = NaiveMLA(**args)
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name or "bias" in name else 0.15)
    prim = FlashMLA(config, **args)
    prim.load_state_dict(base.state_dict())
    return base.to(device, dtype), prim.to(device, dtype)


def with_options(prim, **options):
    """A FlashMLA with prim's weights, dtype and device, its options changed (fixed at construction)."""
    args = dict(q_lora_rank=prim.q_lora_rank, kv_lora_rank=prim.kv_lora_rank, qk_nope_head_dim=prim.nope,
                qk_rope_head_dim=prim.rope_dim, v_head_dim=prim.v_dim, softmax_scale=prim.softmax_scale,
                rope_interleave=prim.rope_interleave, bias=prim.o_proj.bias is not None)
    w = prim.o_proj.weight
    with torch.device(w.device):
        other = FlashMLA(dataclasses.replace(prim.options, **options), prim.dim, prim.n_heads, **args)
    other.load_state_dict(prim.state_dict())
    return other.to(w.dtype)


def rope_inputs(B, T, R, dtype=torch.float64, device="cpu", positions=None):
    pos = torch.arange(T).expand(B, T) if positions is None else positions.cpu()
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2).double() / R))
    f = pos[..., None].double() * inv
    emb = torch.cat([f, f], -1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def run(m, x, cos, sin, cu=None, g=None):
    x = x.detach().clone().requires_grad_(True)
    y = m(x, cos, sin, cu)
    g = torch.randn_like(y) if g is None else g
    grads = torch.autograd.grad((y * g).sum(), [x] + list(m.parameters()))
    return [y.detach()] + list(grads), g


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(base, prim, x, cos, sin, cu=None, tol=1e-5):
    want, g = run(base, x, cos, sin, cu)
    got, _ = run(prim, x, cos, sin, cu, g)
    names = ["out", "x"] + [n for n, _ in base.named_parameters()]
    for n, a, b in zip(names, got, want):
        assert rel_err(a, b) < tol, (n, rel_err(a, b))


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None}, {"rope_interleave": False, "bias": True}])
def test_primitive_matches_twin_fp32(lean, variant):
    base, prim = make_pair(torch.float32, config=FlashMLAConfig(lean_backward=lean), **variant)
    B, T = 3, 17  # a padded batch: several rows, odd length
    x = torch.randn(B, T, 40)
    cos, sin = rope_inputs(B, T, 6, torch.float32)
    compare(base, prim, x, cos, sin)


@pytest.mark.parametrize("lean", [True, False])
def test_pad_v_matches_twin(lean):
    # v zero-padded to the q/k head dim inside SDPA
    base, prim = make_pair(torch.float32, seed=5, config=FlashMLAConfig(lean_backward=lean, pad_v=True))
    x = torch.randn(2, 11, 40)
    cos, sin = rope_inputs(2, 11, 6, torch.float32)
    compare(base, prim, x, cos, sin)
    cu = torch.tensor([0, 3, 14, 22])
    compare(base, prim, x, cos, sin, cu)


def test_fp32_error_within_torch_error_of_float64_reference():
    base64, prim64 = make_pair(torch.float64, seed=1)
    base32, prim32 = make_pair(torch.float32, seed=1)
    x = torch.randn(2, 13, 40, dtype=torch.float64)
    cos, sin = rope_inputs(2, 13, 6)
    ref, g = run(base64, x, cos, sin)
    torch_out, _ = run(base32, x.float(), cos.float(), sin.float(), g=g.float())
    ours, _ = run(prim32, x.float(), cos.float(), sin.float(), g=g.float())
    for r, t, o in zip(ref, torch_out, ours):
        assert rel_err(o, r) <= 4 * rel_err(t, r) + 1e-6


@pytest.mark.parametrize("lean", [True, False])
def test_packed_sequences(lean):
    base, prim = make_pair(torch.float32, seed=2, config=FlashMLAConfig(lean_backward=lean))
    lengths = [4, 11, 1, 7]
    cu = torch.tensor([0, 4, 15, 16, 23], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cos, sin = rope_inputs(1, 23, 6, torch.float32, positions=pos)
    x = torch.randn(1, 23, 40)
    compare(base, prim, x, cos, sin, cu)
    with torch.no_grad():  # packed == each sequence alone
        want = torch.cat([base(x[:, a:b], cos[:, a:b], sin[:, a:b]) for a, b in zip(cu[:-1], cu[1:])], dim=1)
        assert rel_err(prim(x, cos, sin, cu), want) < 1e-5
        assert rel_err(base(x, cos, sin, cu), want) < 1e-5


def test_packed_over_several_rows():
    base, prim = make_pair(torch.float32, seed=3)
    x = torch.randn(2, 9, 40)
    cu = torch.tensor([0, 5, 12, 18])  # sequences cross the row boundary of the [2, 9] batch
    cos, sin = rope_inputs(2, 9, 6, torch.float32)
    compare(base, prim, x, cos, sin, cu)


@pytest.mark.parametrize("options,packed,want", [
    ({}, False, "fa4"), ({}, True, "fa4"), ({"fa4": "off"}, True, "varlen"), ({"fa4": "off"}, False, None),
    ({"fa4": "off", "varlen": False}, True, None), ({"lean_backward": False}, True, "fa4")])
def test_options_pick_the_core(monkeypatch, options, packed, want):
    """On the CPU, with recording stand-ins for the GPU kernels (computing with the eager attention):
    each option choice runs its core, within the twin's float64 agreement; the lean backward reruns
    the stand-in (a plain torch function, not an op the lean region keeps)."""
    from bumblebee.primitives import mla
    from tests.primitives.test_attention_packed import fake_kernel
    calls = []
    monkeypatch.setattr(mla._fa4, "supports", lambda *a: True)
    monkeypatch.setattr(mla._fa4, "available", lambda q, v: True)
    monkeypatch.setattr(mla._fa4, "causal_attention", fake_kernel("fa4", calls))
    monkeypatch.setattr(mla._varlen, "serves", lambda *a: True)
    monkeypatch.setattr(mla._varlen, "causal_attention", fake_kernel("varlen", calls))
    base, prim = make_pair(torch.float64, seed=6, config=FlashMLAConfig(**options))
    x = torch.randn(1, 23, 40, dtype=torch.float64)
    cos, sin = rope_inputs(1, 23, 6)
    cu = torch.tensor([0, 4, 15, 16, 23]) if packed else None
    compare(base, prim, x, cos, sin, cu, tol=1e-6)  # the twin and the stand-ins softmax in fp32
    runs = 2 if prim.options.lean_backward else 1  # forward, and the lean backward's recompute
    assert calls == [want] * runs if want else not calls, calls


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"FlashMLAConfig.fa4 must be one of 'auto', 'off'; got 'on'"):
        FlashMLAConfig(fa4="on")
    with pytest.raises(ValueError, match=r"FlashMLAConfig.lean_backward must be True or False; got 'off'"):
        FlashMLAConfig(lean_backward="off")
    with pytest.raises(TypeError, match="FlashMLA's first argument must be a FlashMLAConfig"):
        FlashMLA({"lean_backward": False}, 40, 5, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
                 qk_rope_head_dim=4, v_head_dim=4)
    assert registry.choose("mla", "flash:lean_backward=off,pad_v=on")[1] == FlashMLAConfig(lean_backward=False,
                                                                                           pad_v=True)
    layer = registry.build("mla", "flash:fused_rope=false", 40, 5, q_lora_rank=None, kv_lora_rank=8,
                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    assert isinstance(layer, FlashMLA) and layer.options == FlashMLAConfig(fused_rope=False)


def _saved_bytes(m, x, cos, sin):
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, cos, sin).sum()
    ptrs = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in m.parameters()}
    return sum(v for (ptr, _), v in seen.items() if ptr not in ptrs)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def backward_ops(prim, x, cos, sin, cu, g, mode):
    """(outputs and gradients, ops the backward dispatched) of `prim` run alone ("lean") or inside the
    models' full recompute ("recompute")."""
    xs = x.clone().requires_grad_()
    y = prim(xs, cos, sin, cu) if mode == "lean" else checkpoint(
        prim, xs, cos, sin, cu, use_reentrant=False, context_fn=recompute.contexts)
    with _Ops() as seen:
        grads = torch.autograd.grad((y * g).sum(), [xs] + list(prim.parameters()))
    return [y.detach()] + list(grads), seen.ops


def test_lean_backward_saves_a_third_or_less_and_never_reruns_attention():
    # DeepSeek-V3's proportions scaled down: many heads, small latents. Equal q/k and v head dims, so
    # that the CPU runs SDPA as one fused op (as cuDNN does on the GPU) rather than the math fallback.
    kw = dict(dim=64, n_heads=32, q_lora_rank=24, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=8, softmax_scale=None)
    _, prim = make_pair(torch.float32, **kw)
    x = torch.randn(1, 64, 64, requires_grad=True)
    cos, sin = rope_inputs(1, 64, 4, torch.float32)
    plain = _saved_bytes(with_options(prim, lean_backward=False), x, cos, sin)
    lean = _saved_bytes(prim, x, cos, sin)
    assert lean <= plain / 3, (lean, plain)
    y = prim(x, cos, sin)
    with _Ops() as seen:
        y.sum().backward()
    attention = [op for op in seen.ops if "scaled_dot_product" in op]
    assert attention and all("backward" in op for op in attention), attention


class _Created(TorchDispatchMode):
    """Weak references to every tensor an op creates: what of it is still alive later."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.made.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), weakref.ref(t)))
        return out

    def alive_bytes(self, *exclude):
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum({p: n for p, n, r in self.made if r() is not None and p not in skip}.values())


@pytest.mark.parametrize("lean", [True, False])
def test_lean_backward_inside_model_recompute(lean):
    """Under the models' full recompute (checkpoint with `recompute.contexts`) the layer's first
    forward keeps nothing but its input (the lean region used to cache attention outputs there);
    the backward runs attention forward once (the recompute) and never a third time; gradients
    equal the call without recompute. The same module twice in a row covers the hand-over order."""
    kw = dict(dim=64, n_heads=32, q_lora_rank=24, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=8, softmax_scale=None)
    _, prim = make_pair(torch.float64, config=FlashMLAConfig(lean_backward=lean), **kw)
    x = torch.randn(1, 64, 64, dtype=torch.float64)
    cos, sin = rope_inputs(1, 64, 4)
    g = torch.randn(1, 64, 64, dtype=torch.float64)

    def grads(wrap):
        xs = x.clone().requires_grad_()
        made = _Created()
        with made:
            y = wrap(wrap(xs))
        held = made.alive_bytes(y)
        with _Ops() as seen:
            out = torch.autograd.grad((y * g).sum(), [xs] + list(prim.parameters()))
        return out, held, [op for op in seen.ops if "scaled_dot_product" in op]

    want, _, _ = grads(lambda t: prim(t, cos, sin))
    got, held, attention = grads(lambda t: checkpoint(prim, t, cos, sin, use_reentrant=False,
                                                      context_fn=recompute.contexts))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-12
    assert held <= x.numel() * 8, held  # the inner layer's output (the outer one's input), nothing else
    assert sum("backward" not in op for op in attention) == 2, attention  # one recompute per call
    assert sum("backward" in op for op in attention) == 2, attention
    assert prim._handover is None


@pytest.mark.parametrize("cls", [NaiveMLA, registry.resolve("mla", "flash")])
def test_bad_input(cls):
    kw = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        cls(16, 2, **{**kw, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="v_head_dim"):
        cls(16, 2, **{**kw, "v_head_dim": 0})
    with pytest.raises(ValueError, match="q_lora_rank"):
        cls(16, 2, **{**kw, "q_lora_rank": -1})
    m = cls(16, 2, **kw)
    x = torch.randn(1, 6, 16)
    cos, sin = rope_inputs(1, 6, 4, torch.float32)
    with pytest.raises(ValueError, match="cos must be"):
        m(x, cos[..., :2], sin)
    with pytest.raises(ValueError, match="dim=16"):
        m(torch.randn(1, 6, 12), cos, sin)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        m(x, cos, sin, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing"):
        m(x, cos, sin, torch.tensor([0, 4, 4, 6]))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D"):
        m(x, cos, sin, torch.tensor([[0, 6]]))


# ---- GPU: bf16, the cuDNN backend, memory ---------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fa4", ["auto", "off"])  # FA4 where installed (else SDPA either way), SDPA
def test_bf16_within_torch_error(lean, packed, fa4):
    kw = dict(dim=256, n_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128)
    base64, _ = make_pair(torch.float64, "cuda", seed=4, **kw)
    base16, prim16 = make_pair(torch.bfloat16, "cuda", seed=4, config=FlashMLAConfig(lean_backward=lean, fa4=fa4),
                               **kw)
    B, T = (1, 301) if packed else (2, 157)
    cu = torch.tensor([0, 100, 101, 301], device="cuda", dtype=torch.int32) if packed else None
    pos = torch.cat([torch.arange(n) for n in (100, 1, 200)])[None] if packed else None
    cos, sin = rope_inputs(B, T, 64, torch.float64, "cuda", positions=pos)
    x = torch.randn(B, T, 256, device="cuda", dtype=torch.float64)
    ref, g = run(base64, x, cos, sin, cu)
    lo = [t.bfloat16() for t in (x, cos, sin)]
    torch_out, _ = run(base16, *lo, cu, g=g.bfloat16())
    ours, _ = run(prim16, *lo, cu, g=g.bfloat16())
    padded, _ = run(with_options(prim16, pad_v=True), *lo, cu, g=g.bfloat16())
    for r, t, o, p in zip(ref, torch_out, ours, padded):
        assert rel_err(o, r) <= 3 * rel_err(t, r) + 2e-3
        assert rel_err(p, r) <= 3 * rel_err(t, r) + 2e-3


@pytest.mark.gpu
def test_per_sequence_gradients_across_packings():
    """SDPA per sequence (FA4 and varlen off) on two packings sharing sequence lengths: finite and
    within 3x the twin's bf16 error (cuDNN's backward graph cache; see packing.per_sequence)."""
    kw = dict(dim=256, n_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128)
    base64, _ = make_pair(torch.float64, "cuda", seed=4, **kw)
    base16, prim16 = make_pair(torch.bfloat16, "cuda", seed=4, config=FlashMLAConfig(fa4="off", varlen=False), **kw)
    for lengths in ((37, 300, 1, 1024, 686), (300, 1, 399)):
        T = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        cos, sin = rope_inputs(1, T, 64, torch.float64, "cuda", positions=pos)
        x = torch.randn(1, T, 256, device="cuda", dtype=torch.float64)
        ref, g = run(base64, x, cos, sin, cu)
        lo = [t.bfloat16() for t in (x, cos, sin)]
        twin, _ = run(base16, *lo, cu, g=g.bfloat16())
        ours, _ = run(prim16, *lo, cu, g=g.bfloat16())
        for r, t, o in zip(ref, twin, ours):
            assert rel_err(o, r) <= 3 * rel_err(t, r) + 2e-3, (lengths, rel_err(o, r), rel_err(t, r))


@pytest.mark.gpu
def test_cudnn_backend_runs_mla_head_dims():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 8, 512, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 512, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # raises if cuDNN refuses these dims
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.sum().backward()
    assert o.shape == (1, 8, 512, 128)


@pytest.mark.gpu
def test_lean_backward_peak_memory_gpu():
    kw = dict(dim=1024, n_heads=32, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    _, lean_layer = make_pair(torch.bfloat16, "cuda", **kw)
    x = torch.randn(1, 4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_inputs(1, 4096, 64, torch.bfloat16, "cuda")
    held = {}
    for lean in (False, True):
        prim = lean_layer if lean else with_options(lean_layer, lean_backward=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = prim(x, cos, sin)
        held[lean] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        y.sum().backward()
        del y
    assert held[True] <= held[False] / 3, held


@pytest.mark.gpu
def test_lean_backward_inside_model_recompute_gpu():
    """cuDNN or FA4, bf16: under the models' full recompute a layer holds nothing but its input after the
    forward (the lean path alone holds latents + attention outputs); gradients as without recompute."""
    kw = dict(dim=1024, n_heads=32, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    _, prim = make_pair(torch.bfloat16, "cuda", **kw)
    x = torch.randn(1, 4096, 1024, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_inputs(1, 4096, 64, torch.bfloat16, "cuda")
    g = torch.randn_like(x)
    out, held = {}, {}
    for mode in ("lean", "recompute"):
        xs = x.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = prim(xs, cos, sin) if mode == "lean" else checkpoint(prim, xs, cos, sin, use_reentrant=False,
                                                                context_fn=recompute.contexts)
        held[mode] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        with _Ops() as seen:
            out[mode] = torch.autograd.grad((y * g).sum(), [xs] + list(prim.parameters()))
        forwards = [op for op in seen.ops if ("scaled_dot_product" in op and "backward" not in op)
                    or "fa4_causal_fwd" in op]
        assert len(forwards) == (1 if mode == "recompute" else 0), forwards
        del y
    assert held["recompute"] <= 0.02 * held["lean"], held
    for a, b in zip(out["recompute"], out["lean"]):
        assert rel_err(a, b) < 1e-2
