"""Context parallelism's CUDA paths on one GPU (bf16; `pytest -m gpu`): what the CPU suite cannot run.

- the fused blocks (`kernels.block_forward` / `block_backward`, SDPA's cuDNN kernel and, with cuDNN's
  SDPA backend off, its flash kernel; grouped-query blocks with their own key heads) and the ring and the all-gather at CP = 1 (the same block
  schedules, no exchange) on each, unpacked and packed (per document piece), against float64;
- MLA's cp forward at CP = 1, both exchanges (DeepSeek-V3's head dims, q/k 192 and v 128), against
  the `mla` slot's layer;
- gated DeltaNet's `fla_rule` (fla's kernel with an entering state, its final state and their
  gradients) against `torch_rule` (the torch chunked rule), unpacked and packed, and the whole
  cp rule on fla against it; the halo conv on fla's conv against the fp32 halo path.
Tolerances: bf16 paths within 4x the error of a plain bf16 SDPA call (the same kernels' class) plus a
floor; fla in fp32 against torch fp32 by relative norm (fla's dots may use TF32).
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bumblebee.primitives.context_parallel import flash, layout
from bumblebee.primitives.context_parallel.gdn import fla_rule, gated_delta_rule, torch_rule

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _attention_ref(q, k, v, scale, causal, cu_seqlens=None):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if cu_seqlens is not None:  # block-diagonal: each query's own document only
            starts = layout.doc_starts(cu_seqlens, s.shape[-1], s.device)
            allowed &= starts[None, :] == starts[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _kernel(name):
    """The block kernel `name` selected as a user selects SDPA's: cuDNN by default, flash with it off."""
    if name == "cudnn" and not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN is not available")
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if name == "flash" else contextlib.nullcontext()


def _grads(fn, leaves, w):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    (out.float() * w).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def _close(got, ref64, plain, floor=1e-3):
    for a, b, c in zip(got, ref64, plain):
        err, own = (a.double() - b).abs().max().item(), (c.double() - b).abs().max().item()
        assert err <= 4 * own + floor * b.abs().max().item(), (err, own)


@cuda
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [128, 256])
def test_block_forward_and_backward(causal, D, kernel):
    g = torch.Generator(device="cuda").manual_seed(D)
    q, k, v, do = (torch.randn(1, 4, 1000, D, device="cuda", generator=g) for _ in range(4))
    scale = D ** -0.5
    o64, lse64 = _attention_ref(*(t.double() for t in (q, k, v)), scale, causal)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    with _kernel(kernel):
        o, lse, aux = flash.block_forward(qb, kb, vb, causal, scale)
        dq, dk, dv = flash.block_backward(do.bfloat16(), qb, kb, vb, o, lse, causal, scale, aux)
    assert aux[0] == kernel and lse.shape == lse64.shape
    assert (lse.double() - lse64).abs().max().item() < 0.05
    ref = _grads(lambda *t: _attention_ref(*t, scale, causal)[0], [t.double() for t in (q, k, v)], do.double())
    plain = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal, scale=scale), [qb, kb, vb], do)
    _close([o.float(), dq.float(), dk.float(), dv.float()], ref, plain)


@cuda
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [128, 256])
def test_grouped_blocks_keep_the_key_heads(causal, D, kernel):
    """8 query heads on 2 key/value heads: each kernel gets the key heads as they are where it takes the
    grouped shape (`aux[1]`, the repeat factor, 1), and dK/dV come back with the key heads either way."""
    g = torch.Generator(device="cuda").manual_seed(D + causal)
    q, do = (torch.randn(1, 8, 1000, D, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 1000, D, device="cuda", generator=g) for _ in range(2))
    scale = D ** -0.5
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    with _kernel(kernel):
        o, lse, aux = flash.block_forward(qb, kb, vb, causal, scale)
        dq, dk, dv = flash.block_backward(do.bfloat16(), qb, kb, vb, o, lse, causal, scale, aux)
    assert aux[0] == kernel and aux[1] in (1, 4) and dk.shape == k.shape and dv.shape == v.shape
    print(f"{kernel} D={D} causal={causal}: repeat factor {aux[1]}")  # 1: the grouped kernel ran
    ref = _grads(lambda *t: _attention_ref(*t, scale, causal)[0], [t.double() for t in (q, k, v)], do.double())
    plain = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal, scale=scale, enable_gqa=True),
                   [qb, kb, vb], do)
    _close([o.float(), dq.float(), dk.float(), dv.float()], ref, plain)


@cuda
def test_one_token_block_runs_on_flash_under_cudnn():
    """cuDNN's backward refuses s_q = s_kv = 1; once refused, its next call crashed the process."""
    q, k, v = (torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with _kernel("cudnn"):
        o, lse, aux = flash.block_forward(q, k, v, True, 0.125)
        dq, dk, dv = flash.block_backward(torch.ones_like(o), q, k, v, o, lse, True, 0.125, aux)
    assert aux[0] == "flash"
    torch.testing.assert_close(o, v)  # one key: the output is its value
    assert max(dq.abs().max().item(), dk.abs().max().item()) < 1e-2  # softmax over one key is constant
    torch.testing.assert_close(dv, torch.ones_like(dv))


@cuda
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("exchange", ["allgather", "ring", "allgather_blocks"])
def test_fused_paths_at_cp1_equal_causal_attention(exchange, packed, kernel):
    """Packed: a one-token document, one ending on the chunk edge (1024), one shorter than a chunk.
    allgather_blocks: the earlier keys in blocks of at most 300 (uneven, down to a few keys)."""
    T, H, K, D = 2048, 8, 2, 128
    cu = torch.tensor([0, 1, 700, 1024, 1500, 2048]) if packed else None
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, w = (torch.randn(1, h, T, D, device="cuda", generator=g) for h in (H, K, K, H))
    batch = layout.make_batch(None, T, cu, "cuda")
    fn = {"allgather": flash.allgather_dense, "ring": flash.ring_dense,
          "allgather_blocks": functools.partial(flash.allgather_dense, block_keys=300)}[exchange]
    with _kernel(kernel):
        got = _grads(lambda *t: fn(*t, scale=D ** -0.5, batch=batch), [t.bfloat16() for t in (q, k, v)], w)
    ref = _grads(lambda *t: _attention_ref(*t, D ** -0.5, True, cu)[0], [t.double() for t in (q, k, v)], w.double())
    pos, starts = torch.arange(T, device="cuda"), batch.all_starts  # SDPA as a user calls it, in bf16
    mask = dict(attn_mask=(pos[None] <= pos[:, None]) & (starts[None] == starts[:, None])) if packed else \
        dict(is_causal=True)
    plain = _grads(lambda *t: F.scaled_dot_product_attention(*t, scale=D ** -0.5, enable_gqa=True, **mask),
                   [t.bfloat16() for t in (q, k, v)], w)
    _close(got, ref, plain)


def _gdn_inputs(B, T, H, HV, Dk, Dv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, T, H, Dk, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, T, HV, Dv, device="cuda", generator=g)
    gate = -torch.rand(B, T, HV, device="cuda", generator=g) * 0.5
    beta = torch.rand(B, T, HV, device="cuda", generator=g)
    return q, k, v, gate, beta


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@cuda
@pytest.mark.parametrize("packed", [False, True])
def test_fla_rule_with_state_equals_torch_rule(packed):
    from bumblebee.primitives.linear_attention import fla_falls_back
    if fla_falls_back(torch.device("cuda"), torch.float32) is not None:
        pytest.skip("flash-linear-attention does not serve here")
    B, T, H, HV, Dk, Dv = (1, 300, 2, 4, 64, 96) if packed else (2, 200, 2, 4, 64, 96)
    inputs = _gdn_inputs(B, T, H, HV, Dk, Dv, 3)
    cu = torch.tensor([0, 1, 130, 300], device="cuda") if packed else None
    N = 3 if packed else B
    h0 = torch.randn(N, HV, Dk, Dv, device="cuda") * 0.1
    outs = []
    for rule in (fla_rule, torch_rule):
        leaves = [t.clone().requires_grad_() for t in (*inputs, h0)]
        o, h = rule(*leaves[:5], scale=Dk ** -0.5, initial_state=leaves[5], cu_seqlens=cu)
        ((o * 0.5).sum() + (h * 0.25).sum()).backward()
        outs.append([o, h] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        assert _rel(a, b) < 5e-3


@cuda
@pytest.mark.parametrize("packed", [False, True])
def test_cp_rule_on_fla_equals_torch(packed):
    """The whole cp rule at CP = 1 (two chunks, the widened values and the [0 | I] state) on fla and in torch.
    Dv = 32 widens to 96, the value width of the test above, so fla's and our autotuned kernels reuse its
    tuning: a new width costs fla's cold autotuning again (> 3 minutes on an H200, fp32)."""
    from bumblebee.primitives.linear_attention import fla_falls_back
    if fla_falls_back(torch.device("cuda"), torch.float32) is not None:
        pytest.skip("flash-linear-attention does not serve here")
    B, T = (1, 256) if packed else (2, 256)
    cu = torch.tensor([0, 1, 100, 140, 256]) if packed else None
    batch = layout.make_batch(None, T, cu, "cuda")
    inputs = _gdn_inputs(B, T, 2, 4, 64, 32, 4)
    outs = []
    for rule in (fla_rule, torch_rule):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o = gated_delta_rule(*leaves, scale=0.125, batch=batch, rule=rule)
        o.sum().backward()
        outs.append([o] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        assert _rel(a, b) < 5e-3


@cuda
def test_halo_conv_rows_on_fla_equals_the_fp32_halo_conv():
    """An unpacked shard's conv on fla's `causal_conv1d` (bf16, rows [halo | chunk]) at CP = 1 against the
    fp32 halo path in float64; the fp32 path's own bf16 run gives the error scale. Output and input gradient."""
    from bumblebee.primitives.context_parallel import gdn
    from bumblebee.primitives.linear_attention import fla_falls_back
    if fla_falls_back(torch.device("cuda"), torch.bfloat16) is not None:
        pytest.skip("flash-linear-attention does not serve here")
    B, T, C, W = 2, 256, 64, 4
    batch = layout.make_batch(None, T, None, "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    x, wo = (torch.randn(B, T, C, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(C, W, device="cuda", generator=g) * 0.3
    ref = _grads(lambda t: gdn.halo_conv_silu(t, w.double(), batch) * wo, [x.double()], 1.0)
    plain = _grads(lambda t: gdn.halo_conv_silu(t, w, batch) * wo, [x.bfloat16()], 1.0)
    got = _grads(lambda t: gdn.halo_conv_rows(t, w, batch, gdn._fla_conv_silu) * wo, [x.bfloat16()], 1.0)
    _close(got, ref, plain)


@cuda
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("exchange", ["latent", "heads"])
def test_mla_at_cp1_equals_the_mla_layer(exchange, packed):
    """MLA's cp forward at CP = 1 in bf16 (DeepSeek-V3's head dims: q/k 192, v 128; latent: flash blocks
    with v zero-padded to 192, heads: SDPA with a lower-right causal mask per piece) against the `mla`
    slot's layer in float64; its own bf16 run gives the error scale. Output, input gradient and kv_b_proj's
    gradient."""
    from bumblebee.primitives.context_parallel.mla import mla_forward
    from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig
    T, dim = 1024, 256
    cu = torch.tensor([0, 1, 300, 512, 700, 1024]) if packed else None
    torch.manual_seed(0)
    ref = FlashMLA(FlashMLAConfig(fa4="off", fused_rope=False), dim, 8, q_lora_rank=None, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128).cuda().double()
    batch = layout.make_batch(None, T, cu, "cuda")
    pos = (torch.arange(T, device="cuda") - batch.all_starts)[None].double()
    freqs = pos[..., None] / 10000 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float64) / 64)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    g = torch.Generator(device="cuda").manual_seed(2)
    x, w = (torch.randn(1, T, dim, device="cuda", generator=g) for _ in range(2))

    def run(fn, dtype):
        layer = FlashMLA(ref.options, dim, 8, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128).cuda().to(dtype)
        layer.load_state_dict(ref.state_dict())
        out = _grads(lambda t: fn(layer, t, cos.to(dtype), sin.to(dtype)), [x.to(dtype)], w.to(dtype))
        return out + [layer.kv_b_proj.weight.grad.float()]

    got = run(lambda m, t, c, s: mla_forward(m, t, c, s, batch, exchange=exchange), torch.bfloat16)
    full = lambda m, t, c, s: m(t, c, s, cu_seqlens=cu)  # noqa: E731
    _close(got, run(full, torch.float64), run(full, torch.bfloat16))
