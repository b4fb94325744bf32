"""Inputs for the generic twin-contract test: one case builder per slot.

A case builder takes (generator) and returns (args, kwargs, grad_inputs): floating tensors in
float32 on the CPU; the test reruns them in float64 as the reference (floating tensors and modules
among the keyword arguments are cast too). A module slot adds "<slot>.init", its constructor
arguments; the test loads the twin's state_dict into the primitive. A slot applied to a whole model
(state_sharding) is a `OneRankSteps`. A registered slot without a case here fails the contract
test, so every new slot brings one. A pair whose signature differs from the slot's other pairs
(the softmax router beside the aux-free one) has its own case under "<slot>/<primitive>".
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


def softmax_router_case(g):
    T, E = 37, 60
    return (torch.randn(T, E, generator=g) * 2,), {"top_k": 6, "norm_topk_prob": True}, (0,)


class SwiGLUExpertsCase:
    """Duck-typed experts for the moe_dispatch case: SwiGLU weights as plain tensors, cast to the
    input's dtype on use (so the float64 reference runs in float64). No `ep_group`: one rank. The
    chunked primitive's multi-rank behaviour (EP = 2 and 4 over gloo) is checked against the same
    twin by tests/primitives/test_moe_dispatch.py."""

    grouped_mm = "never"
    ep_group = None

    def __init__(self, g, E, D, I):
        self.gate_up_proj = torch.randn(E, 2 * I, D, generator=g) * 0.3
        self.down_proj = torch.randn(E, D, I, generator=g) * 0.3

    def __call__(self, x_MD, tokens_per_expert_E):
        outs = []
        for e, x_e in enumerate(x_MD.split(tokens_per_expert_E.tolist())):
            gate, up = (x_e @ self.gate_up_proj[e].to(x_MD.dtype).T).chunk(2, dim=-1)
            outs.append((torch.nn.functional.silu(gate) * up) @ self.down_proj[e].to(x_MD.dtype).T)
        return torch.cat(outs)


def moe_dispatch_case(g):
    N, D, E, K, I = 29, 12, 5, 2, 7
    x = torch.randn(N, D, generator=g)
    w = torch.rand(N, K, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    # experts and num_experts as keywords: the harness casts only tensor arguments
    return (x, w, idx), {"experts": SwiGLUExpertsCase(g, E, D, I), "num_experts": E, "chunks": 3}, (0, 1)


def mla_case(g):
    B, T, D, R = 2, 11, 24, 4
    x = torch.randn(B, T, D, generator=g)
    angles = torch.arange(T)[:, None] * torch.rand(R // 2, generator=g)
    cos, sin = (f(torch.cat([angles, angles], -1)).expand(B, T, R) for f in (torch.cos, torch.sin))
    return (x, cos, sin), {}, (0,)


def mla_init(g):
    return (24, 3), dict(q_lora_rank=10, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


class _MTPDepth(torch.nn.Module):
    """A minimal MTP depth module (the model supplies the real ones): combine, block, head norm."""

    def __init__(self, dim):
        super().__init__()
        self.eh_proj = torch.nn.Linear(2 * dim, dim, bias=False)
        self.block = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, emb, h, run_block):
        return run_block(self.block, self.eh_proj(torch.cat([emb, h], dim=-1)))

    def head_norm(self, h):
        return self.norm(h)


def _run_block(block, x):
    return block(x)


def mtp_case(g):
    B, T, D, V = 2, 9, 8, 31
    hidden = torch.randn(B, T, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100
    embed = torch.nn.Embedding(V, D)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, D, generator=g))
    head_weight = torch.randn(V, D, generator=g) * 0.3
    # loss_fn left at its default (None): the primitive's own depth loss (linear_ce), the twin's
    # materialized logits; tests/primitives/test_mtp.py passes the model's loss slot
    return (hidden, ids, labels), {"embed": embed, "head_weight": head_weight, "run_block": _run_block}, (0,)


def mtp_init(g):
    return ([_MTPDepth(8), _MTPDepth(8)],), dict(loss_scale=0.3)


def linear_attention_case(g):
    B, T, D = 2, 70, 24  # T crosses a 64-token chunk
    return (torch.randn(B, T, D, generator=g),), {}, (0,)


def linear_attention_init(g):
    return (24, 2, 4, 8, 6), dict(conv_kernel_size=3)


class OneRankSteps:
    """A slot applied to a whole model on a device mesh (state_sharding): the contract test trains
    `model` for `steps` optimizer steps with each twin on a one-rank gloo mesh (fp32) and compares
    the losses and the parameter updates with plain torch AdamW and clipping run in float64, within
    a few times the same plain run's float32 error. Several ranks, expert parallel and checkpoints:
    `tests`."""

    def __init__(self, model: str, tests: str, *, steps=3, batch=2, seq=13, grad_clip=1.0,
                 hp=(("lr", 3e-3), ("betas", (0.9, 0.95)), ("eps", 1e-8), ("weight_decay", 0.1))):
        self.model, self.tests, self.steps, self.batch, self.seq = model, tests, steps, batch, seq
        self.grad_clip, self.hp = grad_clip, dict(hp)

    def batches(self, g, vocab: int):
        return [torch.randint(0, vocab, (self.batch, self.seq), generator=g) for _ in range(self.steps)]


# Slots whose primitive and twin legitimately give the same bits: they copy or place their inputs and
# have no arithmetic of their own. The contract test's bitwise check (every other primitive differs from
# its twin's fp32 run somewhere) skips them.
SAME_BITS_BY_DESIGN = {
    "state_sharding": "places parameters and optimizer state: the arithmetic (the model, torch's AdamW) is "
                      "the same code in both, and one rank gives the same bits",
    "weight_transfer": "moves weights between ranks: copies",
}

class RanksPair:
    """A slot whose twins run across processes (weight_transfer: trainer ranks to rollout ranks): the
    contract test calls `check(name, twin, out_dir)` ("module.function"), which spawns the ranks and
    asserts that both twins give the same result; the slot's other tests: `tests`."""

    def __init__(self, check: str, tests: str):
        self.check, self.tests = check, tests

    def check_pair(self, name: str, twin: str, out_dir) -> None:
        import importlib
        module, fn = self.check.rsplit(".", 1)
        getattr(importlib.import_module(module), fn)(name, twin, out_dir)


CASES = {
    "router": router_case,
    "router/softmax_fused": softmax_router_case,
    "moe_dispatch": moe_dispatch_case,
    "attention": attention_case,
    "cross_entropy": cross_entropy_case,
    "state_sharding": OneRankSteps("qwen3-tiny", "tests/primitives/test_state_sharding.py"),
    # module slots: forward inputs, and constructor arguments under "<slot>.init"
    "mla": mla_case,
    "mla.init": mla_init,
    "mtp": mtp_case,
    "mtp.init": mtp_init,
    "linear_attention": linear_attention_case,
    "linear_attention.init": linear_attention_init,
    "weight_transfer": RanksPair("tests.primitives.test_weight_transfer_ranks.contract",
                                 "tests/primitives/test_weight_transfer_ranks.py"),
}
