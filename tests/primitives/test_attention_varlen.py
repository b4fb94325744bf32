"""Packed attention without FA4 (kernels/attention_varlen.py): PyTorch's FlashAttention 2 varlen kernel in
one launch, in the `attention` slot and in FlashMLA.

CPU: when the kernel is taken (CUDA, 16-bit, head dims) and when it is worth it (short sequences on
average). GPU: the slot (GQA, head dims 128 and 256, uneven lengths down to 1 token) within 3x the
error of one SDPA call per sequence against float64; FlashMLA (v head dim 128 padded to 192) matches
its per-sequence path, and its lean backward keeps the varlen op's outputs instead of rerunning it.
"""
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from bumblebee.kernels import attention_varlen as varlen
from bumblebee.primitives import attention, mla
from bumblebee.primitives.attention import SDPA
from bumblebee.primitives.mla import FlashMLAConfig
from bumblebee.registry import resolve

from .test_mla import _Ops, backward_ops, make_pair, rel_err, rope_inputs, with_options

LENGTHS = (37, 300, 1, 1024, 686)  # mean 410 tokens: the varlen kernel is worth it


def test_not_supported_on_cpu_or_fp32_or_wide_v():
    q = torch.randn(10, 4, 64)
    assert not varlen.supports(q, q, q)
    if torch.cuda.is_available():
        c = q.cuda()
        assert not varlen.supports(c, c, c)  # fp32
        h = c.bfloat16()
        assert varlen.supports(h, h, h[..., :32]) and not varlen.supports(h[..., :32], h[..., :32], h)


def test_worthwhile_only_for_short_sequences():
    m = varlen.MAX_MEAN_LENGTH
    assert varlen.worthwhile(64 * 512, 64) and varlen.worthwhile(m * 3 - 1, 3)
    assert not varlen.worthwhile(m * 3, 3) and not varlen.worthwhile(16 * 65536, 16)


def test_lean_policy_keeps_varlen_outputs():
    op = torch.ops.bumblebee.varlen_causal_fwd.default
    assert mla._keep_attention_outputs(None, op) == CheckpointPolicy.MUST_SAVE
    assert mla._keep_attention_outputs(None, torch.ops.bumblebee.varlen_causal_bwd.default) != CheckpointPolicy.MUST_SAVE


def _varlen_ops(ops):
    return [op for op in ops if op.startswith("bumblebee.varlen_causal")]


@pytest.mark.gpu
def test_varlen_custom_ops_opcheck():
    q, k = (torch.randn(300, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
    v = torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 100, 101, 300], device="cuda", dtype=torch.int32)
    torch.library.opcheck(varlen.varlen_causal_fwd, (q, k, v, cu, 199, 0.1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_attention_slot_varlen_within_torch_bf16_error(head_dim):
    N = sum(LENGTHS)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, N, head_dim, device="cuda", generator=g)
    k, v = (torch.randn(1, 2, N, head_dim, device="cuda", generator=g) for _ in "kv")
    do = torch.randn(1, 8, N, head_dim, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.int32)

    def run(dtype, varlen_on):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with _Ops() as seen:
            o = resolve("attention", SDPA(fa4="off", varlen=varlen_on))(*leaves, cu_seqlens=cu)
            o.backward(do.to(dtype))
        return [o.detach()] + [t.grad for t in leaves], _varlen_ops(seen.ops)

    exact, _ = run(torch.float64, False)
    ours, ops = run(torch.bfloat16, True)
    per_sequence, none = run(torch.bfloat16, False)
    assert len(ops) == 2 and not none, (ops, none)  # one forward, one backward launch
    for a, t, r in zip(ours, per_sequence, exact):
        assert rel_err(a, r) <= 3 * rel_err(t, r) + 1e-3, (rel_err(a, r), rel_err(t, r))


@pytest.mark.gpu
def test_attention_slot_long_sequences_stay_per_sequence():
    n = varlen.MAX_MEAN_LENGTH
    q = torch.randn(1, 4, 2 * n, 64, device="cuda", dtype=torch.bfloat16)
    with _Ops() as seen:
        attention.sdpa_attention_with(SDPA(fa4="off"), q, q[:, :2], q[:, :2],
                                      cu_seqlens=torch.tensor([0, n, 2 * n], device="cuda"))
    assert not _varlen_ops(seen.ops)


@pytest.mark.gpu
def test_flash_mla_varlen_matches_per_sequence_and_never_reruns_attention():
    kw = dict(dim=512, n_heads=16, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    _, varlen_layer = make_pair(torch.bfloat16, "cuda", seed=3, config=FlashMLAConfig(fa4="off"), **kw)
    layers = {"on": varlen_layer, "off": with_options(varlen_layer, varlen=False)}
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cos, sin = rope_inputs(1, T, 64, torch.bfloat16, "cuda", positions=pos)
    x = torch.randn(1, T, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    out = {}
    for switch in ("off", "on"):
        for mode in ("lean", "recompute"):
            out[switch, mode], seen = backward_ops(layers[switch], x, cos, sin, cu, g, mode)
            ops = _varlen_ops(seen)
            fwd = [op for op in ops if "fwd" in op]
            if switch == "on":  # the backward reruns the forward only inside the models' full recompute
                assert len(fwd) == (1 if mode == "recompute" else 0) and len(ops) - len(fwd) == 1, ops
            else:
                assert not ops
    for mode in ("lean", "recompute"):
        for a, b in zip(out["on", mode], out["off", mode]):
            assert rel_err(a, b) < 2e-2
