"""Inputs for the generic twin-contract test: one case builder per slot.

A case builder takes (generator) and returns (args, kwargs, grad_inputs): floating tensors in
float32 on the CPU; the test reruns them in float64 as the reference. A registered slot without a
builder here fails the contract test, so every new slot brings one.
"""
import torch


def attention_case(g):
    B, H, K, T, D = 2, 6, 2, 13, 8
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, K, K))
    return (q, k, v), {"scale": D ** -0.5}, (0, 1, 2)


def cross_entropy_case(g):
    N, H, V = 37, 24, 101
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    return (hidden, weight, labels), {"label_smoothing": 0.1, "z_loss_scale": 1e-3}, (0, 1)


CASES = {
    "attention": attention_case,
    "cross_entropy": cross_entropy_case,
}
