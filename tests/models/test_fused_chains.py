"""RMSNorm and RoPE (Qwen3), the zero-centred norm, partial RoPE, output gate and gated norm (Qwen3.5):
compiled on CUDA (bumblebee/fused.py), eager elsewhere; the compiled chains are checked against float64
with the eager ops' own bf16 error as the yardstick."""
import pytest
import torch

from bumblebee.models.components import apply_rope, rms_norm_rope
from bumblebee.models.qwen3_5 import (apply_partial_rope, sigmoid_gated, zero_centered_norm_partial_rope,
                                      zero_centered_rms_norm)
from bumblebee.norms import gated_rms_norm, rms_norm


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _cases(device, dtype):
    g = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**30, ())))
    x = torch.randn(2, 5, 301, 128, device=device, generator=g).to(dtype)  # [B, H, T, D]
    w = (1 + 0.1 * torch.randn(128, device=device, generator=g)).to(dtype)
    pos = torch.arange(301, device=device)[None].expand(2, -1).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=device).float() / 128))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return x, w, cos, sin


def _grads(fn, *args):
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            for a in args]
    out = fn(*args)
    g = torch.Generator(device=out.device).manual_seed(7)
    out.backward(torch.randn(out.shape, device=out.device, generator=g).to(out.dtype))
    return [out] + [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]


def test_cpu_runs_the_eager_ops():
    x, w, cos, sin = _cases("cpu", torch.float32)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6))
    assert torch.equal(apply_rope(x, cos, sin), apply_rope.eager(x, cos, sin))
    x_bthd = x.transpose(1, 2)
    assert torch.equal(rms_norm_rope(x_bthd, w, 1e-6, cos, sin),  # the two eager chains, one after the other
                       apply_rope(rms_norm(x_bthd, w, 1e-6).transpose(1, 2), cos, sin))
    half_cos, half_sin = cos[..., :64], sin[..., :64]  # partial RoPE over half the head
    for fn, args in _qwen3_5_args(x, w, half_cos, half_sin).items():
        assert torch.equal(fn(*args), fn.eager(*args)), fn.__name__
    assert torch.equal(zero_centered_norm_partial_rope(x_bthd, w, 1e-6, half_cos, half_sin),
                       apply_partial_rope(zero_centered_rms_norm(x_bthd, w, 1e-6).transpose(1, 2), half_cos, half_sin))


def _qwen3_5_args(x, w, cos, sin):
    """Each Qwen3.5 chain with its arguments; x [B, H, T, D] as the Qwen3 cases."""
    x_bthd = x.transpose(1, 2)
    return {zero_centered_rms_norm: (x_bthd, w - 1, 1e-6), apply_partial_rope: (x, cos, sin),
            zero_centered_norm_partial_rope: (x_bthd, w - 1, 1e-6, cos, sin), sigmoid_gated: (x, x.flip(-1)),
            gated_rms_norm: (x_bthd, x_bthd.flip(-1), w, 1e-6)}


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["rms_norm", "rope", "rms_norm_rope"])
def test_compiled_chain_within_eager_error(which):
    x, w, cos, sin = _cases("cuda", torch.bfloat16)
    fn = {"rms_norm": rms_norm, "rope": apply_rope, "rms_norm_rope": rms_norm_rope}[which]
    if which == "rms_norm_rope":  # [B, T, H, D] in
        x = x.transpose(1, 2).contiguous()
    args = {"rms_norm": (x, w, 1e-6), "rope": (x, cos, sin), "rms_norm_rope": (x, w, 1e-6, cos, sin)}[which]
    xt = (x.transpose(1, 2).contiguous().transpose(1, 2),) + args[1:]  # a strided view, as the model passes
    for a in (args, xt):
        _assert_within_eager_error(which, fn, a)


def _assert_within_eager_error(which, fn, args):
    """The compiled chain's outputs and gradients against float64, within twice the eager bf16 chain's error."""
    ref = _grads(fn.eager, *[t.double() if isinstance(t, torch.Tensor) else t for t in args])
    eager = _grads(fn.eager, *args)
    got = _grads(fn, *args)
    for i, (g_, e_, r_) in enumerate(zip(got, eager, ref)):
        assert torch.isfinite(g_).all()
        assert _rel(g_, r_) <= 2 * _rel(e_, r_) + 1e-3, (which, i, _rel(g_, r_), _rel(e_, r_))


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["zero_centered_rms_norm", "apply_partial_rope", "zero_centered_norm_partial_rope",
                                   "sigmoid_gated", "gated_rms_norm"])
def test_compiled_qwen3_5_chain_within_eager_error(which):
    x, w, cos, sin = _cases("cuda", torch.bfloat16)
    chains = _qwen3_5_args(x, w, cos[..., :64], sin[..., :64])
    fn = next(f for f in chains if f.__name__ == which)
    _assert_within_eager_error(which, fn, chains[fn])
