"""The `linear_attention` slot (gated DeltaNet): the twin's chunked rule and the primitive's torch path
(fla's algorithm: blocked triangular solve, state scan, output pass) against the recurrent oracle,
packed sequences against separate ones, the layer's twins against each other and against
transformers' torch path, bad input; on the GPU, flash-linear-attention against the twin in bf16 at 4K-32K (on Hopper with
Triton < 3.7.1, fla's backward with kernels/linear_attention_gdn_backward.py in place of its refused kernel)."""
import pytest
import torch
import torch.nn.functional as F

from bumblebee import registry
from bumblebee.baselines.linear_attention import (ChunkedGatedDeltaNet, causal_conv1d_silu,
                                                  chunked_gated_delta_rule, recurrent_gated_delta_rule)
from bumblebee.primitives.linear_attention import FLAConfig, FLAGatedDeltaNet, fla_backward_ok, fla_ops
from bumblebee.primitives.linear_attention_torch import (causal_conv1d_silu_taps, chunk_gated_delta_rule_torch,
                                                         solve_tril)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rule_inputs(g, B, T, H, HV, Dk, Dv, dtype=torch.float64, device="cpu"):
    q = torch.randn(B, T, H, Dk, generator=g)
    k = torch.randn(B, T, H, Dk, generator=g)
    v = torch.randn(B, T, HV, Dv, generator=g)
    decay = -F.softplus(torch.randn(B, T, HV, generator=g)) * torch.rand(HV, generator=g) * 2  # log decay <= 0
    beta = torch.rand(B, T, HV, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize("B,T,H,HV,Dk,Dv,chunk", [(2, 77, 2, 4, 8, 6, 16), (1, 130, 1, 3, 5, 7, 64),
                                                  (3, 9, 2, 2, 4, 4, 64), (1, 64, 3, 6, 6, 5, 32)])
def test_chunked_equals_recurrent(B, T, H, HV, Dk, Dv, chunk):
    inputs = rule_inputs(torch.Generator().manual_seed(T), B, T, H, HV, Dk, Dv)
    want = recurrent_gated_delta_rule(*inputs)
    got = chunked_gated_delta_rule(*inputs, chunk_size=chunk)
    assert got.shape == (B, T, HV, Dv)
    assert rel_err(got, want) < 1e-12


def test_chunked_gradients_equal_recurrent():
    inputs = [t.requires_grad_() for t in rule_inputs(torch.Generator().manual_seed(1), 2, 41, 2, 4, 6, 5)]
    w = torch.randn(2, 41, 4, 5, dtype=torch.float64)
    ga = torch.autograd.grad((chunked_gated_delta_rule(*inputs, chunk_size=16) * w).sum(), inputs)
    gb = torch.autograd.grad((recurrent_gated_delta_rule(*inputs) * w).sum(), inputs)
    for a, b in zip(ga, gb):
        assert rel_err(a, b) < 1e-10


def test_chunked_fp32_error_is_torch_sized():
    """fp32 chunked vs the fp64 oracle: within a few times the error of the fp32 recurrent form."""
    inputs = rule_inputs(torch.Generator().manual_seed(2), 1, 200, 2, 4, 16, 16)
    ref = recurrent_gated_delta_rule(*inputs)
    e_rec = rel_err(recurrent_gated_delta_rule(*[t.float() for t in inputs]), ref)
    e_chunk = rel_err(chunked_gated_delta_rule(*[t.float() for t in inputs]), ref)
    assert e_chunk <= 8 * e_rec + 1e-6, (e_chunk, e_rec)


@pytest.mark.parametrize("rule", [recurrent_gated_delta_rule, chunked_gated_delta_rule])
def test_packed_equals_separate(rule):
    B, T = 2, 50
    inputs = rule_inputs(torch.Generator().manual_seed(3), B, T, 2, 4, 6, 5)
    cu = torch.tensor([0, 7, 71, 72, 100])
    got = rule(*inputs, cu_seqlens=cu)
    flat = [t.reshape(B * T, *t.shape[2:])[None] for t in inputs]
    want = torch.cat([rule(*(t[:, a:b] for t in flat)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert got.shape == inputs[2].shape
    assert rel_err(got.reshape(want.shape), want) < 1e-13


def test_causal_conv_packed_resets_at_sequence_starts():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 30, 10, generator=g, dtype=torch.float64)
    w = torch.randn(10, 4, generator=g, dtype=torch.float64)
    cu = [0, 3, 41, 60]
    got = causal_conv1d_silu(x, w, torch.tensor(cu)).reshape(60, 10)
    flat = x.reshape(1, 60, 10)
    want = torch.cat([causal_conv1d_silu(flat[:, a:b], w)[0] for a, b in zip(cu, cu[1:])])
    assert rel_err(got, want) < 1e-14
    # against torch's own padded conv (transformers' formulation)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=10)[..., :30]).transpose(1, 2)
    assert rel_err(causal_conv1d_silu(x, w), ref) < 1e-14


def _pair(seed=0, **kw):
    args = dict(hidden_size=24, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel_size=3)
    args.update(kw)
    pos = [args.pop(k) for k in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    torch.manual_seed(seed)
    twin = ChunkedGatedDeltaNet(*pos, **args)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    prim = FLAGatedDeltaNet(FLAConfig(), *pos, **args)
    prim.load_state_dict(twin.state_dict())
    return prim, twin


def test_layer_twins_agree_and_match_transformers_torch_path():
    """Both implementations (the primitive on its CPU path) and transformers' Qwen3_5GatedDeltaNet."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("transformers >= 5.2 needed")
    prim, twin = _pair(conv_kernel_size=4)
    x = torch.randn(2, 70, 24)
    a, b = prim(x), twin(x)
    with torch.no_grad():
        want = _pair(conv_kernel_size=4)[1].double()(x.double())
    assert rel_err(a, want) < 1e-5 and rel_err(b, want) < 1e-5  # two algorithms, each at fp32's error
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    cfg = transformers.Qwen3_5TextConfig(hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4,
                                         linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                         num_hidden_layers=1, layer_types=["linear_attention"])
    ref = m.Qwen3_5GatedDeltaNet(cfg, 0)
    ref.load_state_dict(twin.state_dict())
    if getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", None) is None or fla_ops() is None:
        with torch.no_grad():
            assert rel_err(b, ref(x)) < 1e-5


def test_layer_gradients_twins_agree():
    """Both layers' gradients in fp32 against the twin's in float64: within a few times the twin's own
    fp32 error (the primitive's CPU path is fla's algorithm, not the twin's)."""
    prim, twin = _pair(1)
    x = torch.randn(2, 37, 24, requires_grad=True)
    w = torch.randn(2, 37, 24)
    ga = torch.autograd.grad((prim(x) * w).sum(), [x, *prim.parameters()])
    gb = torch.autograd.grad((twin(x) * w).sum(), [x, *twin.parameters()])
    ref = _pair(1)[1].double()
    x64 = x.detach().double().requires_grad_()
    gr = torch.autograd.grad((ref(x64) * w.double()).sum(), [x64, *ref.parameters()])
    for a, b, r in zip(ga, gb, gr):
        assert rel_err(a, r) <= 4 * rel_err(b, r) + 1e-6, (rel_err(a, r), rel_err(b, r))


@pytest.mark.parametrize("B,T,H,HV,Dk,Dv", [(2, 77, 2, 4, 8, 6), (1, 130, 1, 3, 5, 7), (3, 9, 2, 2, 4, 4),
                                            (1, 128, 3, 6, 6, 5)])
def test_primitive_torch_path_equals_recurrent(B, T, H, HV, Dk, Dv):
    """fla's algorithm in torch (chunks of 64, key heads broadcast to value heads, scale on the output)
    in float64 against the token-by-token oracle, output and gradients."""
    inputs = [t.requires_grad_() for t in rule_inputs(torch.Generator().manual_seed(T + HV), B, T, H, HV, Dk, Dv)]
    got = chunk_gated_delta_rule_torch(*inputs, scale=Dk ** -0.5)
    want = recurrent_gated_delta_rule(*inputs)
    assert got.shape == (B, T, HV, Dv) and got.dtype == torch.float64
    assert rel_err(got, want) < 1e-12
    w = torch.randn(got.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * w).sum(), inputs), torch.autograd.grad((want * w).sum(), inputs)):
        assert rel_err(a, b) < 1e-10


def test_primitive_torch_path_packed_and_fp32():
    B, T = 2, 50
    inputs = rule_inputs(torch.Generator().manual_seed(3), B, T, 2, 4, 6, 5)
    cu = torch.tensor([0, 7, 71, 72, 100])
    got = chunk_gated_delta_rule_torch(*inputs, scale=6 ** -0.5, cu_seqlens=cu)
    assert rel_err(got, recurrent_gated_delta_rule(*inputs, cu_seqlens=cu)) < 1e-12
    inputs = rule_inputs(torch.Generator().manual_seed(2), 1, 200, 2, 4, 16, 16)
    ref = recurrent_gated_delta_rule(*inputs)
    e_rec = rel_err(recurrent_gated_delta_rule(*[t.float() for t in inputs]), ref)
    got = chunk_gated_delta_rule_torch(*[t.float() for t in inputs], scale=0.25)
    assert got.dtype == torch.float32 and rel_err(got, ref) <= 8 * e_rec + 1e-6


def test_blocked_triangular_solve_inverts():
    A = (torch.randn(3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 0.3).tril(-1)
    eye = torch.eye(64, dtype=torch.float64)
    assert (solve_tril(A) @ (eye + A) - eye).abs().max() < 1e-12


def test_primitive_conv_equals_twin_conv():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 30, 10, generator=g, dtype=torch.float64)
    w = torch.randn(10, 4, generator=g, dtype=torch.float64)
    for cu in (None, torch.tensor([0, 3, 41, 60])):
        assert rel_err(causal_conv1d_silu_taps(x, w, cu), causal_conv1d_silu(x, w, cu)) < 1e-14


def test_layer_packed_equals_padded_rows():
    _, twin = _pair(2)
    twin.double()
    seqs = [torch.randn(n, 24, dtype=torch.float64) for n in (11, 66, 3)]
    cu = torch.tensor([0, 11, 77, 80])
    got = twin(torch.cat(seqs)[None], cu_seqlens=cu)[0]
    want = torch.cat([twin(s[None])[0] for s in seqs])
    assert rel_err(got, want) < 1e-12
    # padded rows: right padding never reaches back into a sequence's tokens
    padded = torch.zeros(3, 66, 24, dtype=torch.float64)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    out = twin(padded)
    assert rel_err(torch.cat([out[i, :len(s)] for i, s in enumerate(seqs)]), want) < 1e-12


@pytest.mark.parametrize("cls", [ChunkedGatedDeltaNet, registry.resolve("linear_attention", "fla")])
def test_bad_input(cls):
    with pytest.raises(ValueError, match="must divide value heads"):
        cls(24, 3, 4, 8, 6)
    with pytest.raises(ValueError, match="conv_kernel_size"):
        cls(24, 2, 4, 8, 6, conv_kernel_size=5)
    with pytest.raises(ValueError, match="conv_kernel_size"):
        cls(24, 2, 4, 8, 6, conv_kernel_size=1)
    layer = cls(24, 2, 4, 8, 6)
    x = torch.randn(2, 10, 24)
    for cu in ([0, 5, 19], [0, 12, 10, 20], [3, 20], [0, 20.0], [[0, 20]]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            layer(x, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="key heads"):
        chunked_gated_delta_rule(*rule_inputs(torch.Generator().manual_seed(0), 1, 5, 3, 4, 4, 4))


# ---- GPU: flash-linear-attention against the twin, bf16 ----------------------------------------

def _gpu_pair(seed, dtype=torch.bfloat16):
    # Qwen3.5-35B-A3B's DeltaNet heads (16 key, 32 value, 128 dims) on a narrower model width
    prim, twin = _pair(seed, hidden_size=1024, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                       conv_kernel_size=4)
    with torch.no_grad():
        for m in (prim, twin):
            for name, p in m.named_parameters():
                if p.dim() == 2 and "proj" in name:
                    p.mul_(1 / (3 * p.shape[1] ** 0.5))  # unit-scale activations
    ref = ChunkedGatedDeltaNet(1024, 16, 32, 128, 128, conv_kernel_size=4)
    ref.load_state_dict(twin.state_dict())
    return prim.cuda().to(dtype), twin.cuda().to(dtype), ref.cuda().double()


def _run(layer, x, w, cu=None):
    x = x.detach().clone().requires_grad_()
    out = layer(x, cu_seqlens=cu)
    names = ["in_proj_qkv.weight", "conv1d.weight", "A_log", "dt_bias", "in_proj_a.weight", "out_proj.weight"]
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((out.double() * w).sum(), [x] + [params[n] for n in names])
    return [out.detach()] + [g.detach() for g in grads]


def _assert_fla_backward():
    """On Hopper with Triton in [3.4, 3.7.1) fla refuses its own gated dq/dk/dw/dg kernel: these tests then
    run kernels/linear_attention_gdn_backward.py inside fla's backward, and must not skip."""
    from bumblebee.primitives import linear_attention as la
    assert fla_backward_ok(), "fla's gated backward is neither usable nor replaced here"
    assert not la.fla_refuses_gated_backward() or la.DQKWG_HOOK, "refused by fla, and our kernel is not installed"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [4096, 16384, 32768])
def test_fla_matches_twin_bf16_gpu(T):
    assert fla_ops() is not None, "flash-linear-attention must import on the GPU machine"
    _assert_fla_backward()
    prim, twin, ref = _gpu_pair(T)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(1, T, 1024, device="cuda", generator=g)
    w = torch.randn(1, T, 1024, device="cuda", generator=g, dtype=torch.float64)
    want = _run(ref, x.double(), w)
    torch.cuda.empty_cache()
    ours = _run(prim, x.bfloat16(), w)
    base = _run(twin, x.bfloat16(), w)
    for i, (o, b, r) in enumerate(zip(ours, base, want)):
        e_ours, e_twin = rel_err(o, r), rel_err(b, r)
        assert e_ours <= 4 * e_twin + 5e-2, (i, e_ours, e_twin)  # a wrong head map or reset gives O(1)


@pytest.mark.gpu
@gpu
def test_fla_packed_matches_twin_bf16_gpu():
    assert fla_ops() is not None
    _assert_fla_backward()
    prim, twin, ref = _gpu_pair(5)
    cu = torch.tensor([0, 1000, 1001, 5000, 8192], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 4096, 1024, device="cuda", generator=g)
    w = torch.randn(2, 4096, 1024, device="cuda", generator=g, dtype=torch.float64)
    want = _run(ref, x.double(), w, cu)
    ours = _run(prim, x.bfloat16(), w, cu)
    base = _run(twin, x.bfloat16(), w, cu)
    for i, (o, b, r) in enumerate(zip(ours, base, want)):
        e_ours, e_twin = rel_err(o, r), rel_err(b, r)
        assert e_ours <= 4 * e_twin + 5e-2, (i, e_ours, e_twin)  # a wrong head map or reset gives O(1)
    # and the state really restarts: the packed output equals each sequence run alone (fla alone)
    flat = x.bfloat16().reshape(1, 8192, 1024)
    with torch.no_grad():
        alone = torch.cat([prim(flat[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
        packed = prim(x.bfloat16(), cu_seqlens=cu).reshape(1, 8192, 1024)
    assert rel_err(packed, alone) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_fla_forward_matches_twin_bf16_gpu(packed):
    """Forward only (rollout log-probs): runs wherever fla imports, whatever its backward's state."""
    assert fla_ops() is not None
    prim, twin, ref = _gpu_pair(7)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2, 4096, 1024, device="cuda", generator=g)
    cu = torch.tensor([0, 1000, 1001, 5000, 8192], device="cuda") if packed else None
    with torch.no_grad():
        want = ref(x.double(), cu_seqlens=cu)
        ours, base = prim(x.bfloat16(), cu_seqlens=cu), twin(x.bfloat16(), cu_seqlens=cu)
    e_ours, e_twin = rel_err(ours, want), rel_err(base, want)
    assert e_ours <= 4 * e_twin + 1e-2, (e_ours, e_twin)


@pytest.mark.gpu
@gpu
def test_qwen3_5_moe_model_fla_vs_twin_gpu():
    import bumblebee as bb
    # the layer tests' head layout and dtype: fla's kernels are then already tuned (a new layout or
    # dtype autotunes every kernel again, minutes on a fresh machine)
    config = {**bb.models.NAMED["qwen3.5-moe-tiny"], "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128}
    ids = torch.randint(0, 1024, (2, 300), device="cuda")
    _assert_fla_backward()
    losses, norms = [], []
    for impl in ("fla", "torch_chunked"):
        model = bb.models.build(config, impl={"linear_attention": impl}, seed=0, device="cuda", dtype=torch.bfloat16)
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item())
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1]), losses  # bf16 both ways
    assert abs(norms[0] - norms[1]) < 5e-2 * abs(norms[1]), norms


def test_our_fla_backend_scope_covers_our_rules_backward_only():
    """The dq/dk/dw/dg kernel installed into fla serves only calls made while the backward is inside one
    of our layers' rule (`ours()`); any other backward in the process, before or after, is not ours."""
    from bumblebee.primitives import linear_attention as la

    seen = []

    class Probe(torch.autograd.Function):  # stands in for fla's rule: records the scope its backward sees
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, grad):
            seen.append(la.ours())
            return grad, grad

    x, y = (torch.randn(3, 5, requires_grad=True) for _ in range(2))
    out = la.scoped(Probe.apply, x.exp(), y)
    (Probe.apply(out, out) * 2).sum().backward()  # a Probe outside the scope, after it, and one inside
    assert seen == [False, True] and not la.ours()
    torch.testing.assert_close(y.grad, torch.ones_like(y) * 4)  # the marks are identities
    with torch.no_grad():
        assert la.scoped(Probe.apply, x, y).grad_fn is None
