"""FlashAttention 4 core (kernels/attention_fa4.py) and FlashMLA on it.

GPU cases need flash-attn-4 installed (skipped otherwise): the op against an fp32 reference within
3x the error of SDPA (its own backend choice) on the same bf16 inputs, dense and packed; torch.library's
opcheck of the custom ops; the lean MLA backward keeps FA4's outputs instead of rerunning it.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from bumblebee.kernels import attention_fa4 as fa4
from bumblebee.primitives import mla
from bumblebee.primitives.attention import SDPA
from bumblebee.primitives.mla import FlashMLAConfig

from .test_mla import _Ops, backward_ops, make_pair, rel_err, rope_inputs, with_options


def test_lean_policy_keeps_fa4_outputs():
    op = torch.ops.bumblebee.fa4_causal_fwd.default
    assert mla._keep_attention_outputs(None, op) == CheckpointPolicy.MUST_SAVE
    assert mla._keep_attention_outputs(None, torch.ops.bumblebee.fa4_causal_bwd.default) != CheckpointPolicy.MUST_SAVE
    assert mla._keep_attention_outputs(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_not_available_on_cpu_or_fp32():
    q = torch.randn(1, 4, 2, 192)
    assert not fa4.available(q, q[..., :128])
    assert not fa4.available(q.double(), q[..., :128].double())


@pytest.mark.parametrize("dims,sm90,sm100", [((128, 128), True, True), ((192, 128), True, True),
                                             ((256, 256), True, False), ((24, 16), False, True),
                                             ((16, 16), False, True), ((136, 136), False, False)])
def test_head_dims_served_forward_and_backward(monkeypatch, dims, sm90, sm100):
    """SM90 serves the head dims its backward builds for (FA3's; v head dim 16 failed to build on an
    H200), SM100 its own range; the capability and the installed package are stand-ins here."""
    monkeypatch.setattr(fa4, "_interface", lambda: object())
    for major, want in ((9, sm90), (10, sm100), (8, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
        assert fa4.supports(torch.device("cuda"), torch.bfloat16, *dims) is want, (major, dims)


def _fa4_cuda():
    return torch.cuda.is_available() and fa4.available(torch.empty(1, 1, 1, 192, device="cuda", dtype=torch.bfloat16),
                                                       torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))


needs_fa4 = pytest.mark.skipif(not _fa4_cuda(), reason="flash-attn-4 not installed or no Hopper/Blackwell GPU")


def _reference(q, k, v, scale, segments):
    """fp32 causal attention per segment; q/k/v [N, H, d] (float) -> [N, H, e]."""
    outs = []
    for a, b in segments:
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, t, d]: cuDNN needs 4 dims
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("lengths", [(300,), (100, 1, 257, 64)])
def test_fa4_core_within_torch_bf16_error(lengths):
    torch.manual_seed(0)
    N, H, scale = sum(lengths), 8, 0.11
    segments = [(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(len(lengths))]
    q, k = (torch.randn(N, H, 192, device="cuda") for _ in "qk")
    kv = torch.randn(N, H, 320, device="cuda")  # v is a strided slice, as the MLA projection writes it
    do = torch.randn(N, H, 128, device="cuda")

    def run(fn, dtype):
        qq, kk, kvv = (t.detach().to(dtype).requires_grad_() for t in (q, k, kv))
        o = fn(qq, kk, kvv[..., 192:])
        o.backward(do.to(dtype))
        return [o.float(), qq.grad.float(), kk.grad.float(), kvv.grad[..., 192:].float()]

    cu = torch.tensor([0] + [b for _, b in segments], device="cuda", dtype=torch.int32)
    longest = max(lengths)
    if len(lengths) == 1:
        ours = run(lambda a, b, c: fa4.causal_attention(a[None], b[None], c[None], scale)[0], torch.bfloat16)
    else:
        ours = run(lambda a, b, c: fa4.causal_attention(a, b, c, scale, cu_seqlens=cu, max_seqlen=longest),
                   torch.bfloat16)
    ref = run(lambda a, b, c: _reference(a, b, c, scale, segments), torch.float32)
    torch_bf16 = run(lambda a, b, c: _reference(a, b, c, scale, segments), torch.bfloat16)  # SDPA's own pick
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, torch_bf16):
        assert rel_err(o, r) <= 3 * rel_err(t, r) + 1e-3, (name, rel_err(o, r), rel_err(t, r))


@pytest.mark.gpu
@needs_fa4
def test_fa4_custom_ops_opcheck():
    q, k = (torch.randn(1, 128, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
    v = torch.randn(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(fa4.fa4_causal_fwd, (q, k, v, None, 0, 0.1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("packed", [False, True])
def test_flash_mla_on_fa4_matches_sdpa_and_never_reruns_attention(packed):
    kw = dict(dim=512, n_heads=16, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    # FA4 against SDPA's per-sequence calls
    _, on_fa4 = make_pair(torch.bfloat16, "cuda", seed=3, config=FlashMLAConfig(varlen=False), **kw)
    layers = {"on": on_fa4, "off": with_options(on_fa4, fa4="off")}
    B, T = (1, 700) if packed else (2, 333)
    cu = torch.tensor([0, 300, 301, 700], device="cuda", dtype=torch.int32) if packed else None
    pos = torch.cat([torch.arange(n) for n in (300, 1, 399)])[None] if packed else None
    cos, sin = rope_inputs(B, T, 64, torch.bfloat16, "cuda", positions=pos)
    x = torch.randn(B, T, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    out = {}
    for backend in ("off", "on"):
        for mode in ("lean", "recompute"):
            out[backend, mode], ops = backward_ops(layers[backend], x, cos, sin, cu, g, mode)
            if backend == "on":
                fwd = [op for op in ops if "fa4_causal_fwd" in op]
                bwd = [op for op in ops if "fa4_causal_bwd" in op]
                assert len(fwd) == (1 if mode == "recompute" else 0) and len(bwd) == 1, ops
    for mode in ("lean", "recompute"):
        for a, b in zip(out["on", mode], out["off", mode]):
            assert rel_err(a, b) < 2e-2


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_slot_on_fa4_within_torch_bf16_error(head_dim, packed):
    """The `attention` slot's primitive takes FA4 for head dims up to 128 (GQA 8:2, [B, H, T, D]
    inputs) and for packed batches at any head dim (one varlen launch), SDPA otherwise; either way
    within 3x the error of SDPA's bf16 against float64."""
    from bumblebee.primitives import attention
    from bumblebee.registry import resolve
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 700, head_dim, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, 700, head_dim, device="cuda", generator=g) for _ in "kv")
    do = torch.randn(2, 8, 700, head_dim, device="cuda", generator=g)
    cu = torch.tensor([0, 300, 301, 1400], device="cuda", dtype=torch.int32) if packed else None

    def run(dtype, fa4_option="auto"):  # the bf16 reference without FA4: one SDPA call per sequence
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with _Ops() as seen:
            o = resolve("attention", SDPA(fa4=fa4_option, varlen=False))(*leaves, cu_seqlens=cu)
            o.backward(do.to(dtype))
        return [o.detach()] + [t.grad for t in leaves], [op for op in seen.ops if "fa4_causal" in op]

    exact, _ = run(torch.float64, "off")
    ours, fa4_ops = run(torch.bfloat16)
    torch_bf16, _ = run(torch.bfloat16, "off")
    assert len(fa4_ops) == (2 if packed or head_dim <= attention.FA4_MAX_HEAD_DIM else 0), fa4_ops
    for a, t, r in zip(ours, torch_bf16, exact):
        assert rel_err(a, r) <= 3 * rel_err(t, r) + 1e-3, (rel_err(a, r), rel_err(t, r))


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("fused_rope", [True, False])
def test_flash_mla_under_autocast(fused_rope):
    """fp32 parameters under bf16 autocast: with the fused Q/K assembly q/k/v arrive in bf16 and FA4
    runs; with the torch RoPE (fp32 cos/sin promote q/k) the layer falls back to SDPA instead of
    handing FA4 mixed dtypes. Either way the output is within 3x the twin's own autocast error."""
    kw = dict(dim=512, n_heads=16, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    base, prim = make_pair(torch.float32, "cuda", seed=5, config=FlashMLAConfig(fused_rope=fused_rope), **kw)
    cos, sin = rope_inputs(1, 300, 64, torch.float32, "cuda")
    x = torch.randn(1, 300, 512, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16), _Ops() as seen:
        y = prim(x, cos, sin)
        y.float().sum().backward()
    fa4_fwd = [op for op in seen.ops if "fa4_causal_fwd" in op]
    assert len(fa4_fwd) == (1 if fused_rope else 0), fa4_fwd
    exact = base(x, cos, sin).detach()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch_bf16 = base(x, cos, sin).detach()  # the twin under the same autocast: torch's own error
    assert rel_err(y.float(), exact) <= 3 * rel_err(torch_bf16.float(), exact) + 1e-3
