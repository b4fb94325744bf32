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


def router_case(g):
    T, E = 37, 16
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5
    return (logits, bias), {"top_k": 4, "n_group": 4, "topk_group": 2, "scaling_factor": 2.5}, (0,)


def moe_dispatch_case(g):
    N, D, E, K = 29, 12, 5, 2
    x = torch.randn(N, D, generator=g)
    w = torch.rand(N, K, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    experts_w = torch.randn(E, D, D, generator=g) * 0.3

    def experts(x_MD, tokens_per_expert_E):  # a per-expert linear map over contiguous rows
        ends = tokens_per_expert_E.cumsum(0).tolist()
        starts = [0] + ends[:-1]
        return torch.cat([x_MD[s:e] @ experts_w[i].to(x_MD.dtype) for i, (s, e) in enumerate(zip(starts, ends))])

    return (x, w, idx, experts, E), {}, (0, 1)


CASES = {
    "router": router_case,
    "moe_dispatch": moe_dispatch_case,
    "attention": attention_case,
    "cross_entropy": cross_entropy_case,
}
