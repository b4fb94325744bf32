"""MTP: the lean primitive (through the cross_entropy slot) against the materialized twin and a
float64 reference of the formulation, packed sequences, another model's depth layout (the seam
Qwen3.5's MTP uses), bad input, and no logits held with linear_ce."""
import pytest
import torch
import torch.nn as nn

from bumblebee import registry
from bumblebee.baselines.mtp import MaterializedMTP
from bumblebee.primitives.mtp import LeanMTP

D, V = 16, 53


class Block(nn.Module):
    """A causal token mixer (prefix mean) + MLP: enough to carry information along the sequence."""

    def __init__(self, dim):
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x, segment_ids=None):
        n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return x + torch.tanh(self.mlp(self.mix(x.cumsum(1) / n)))


class DeepSeekDepth(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.enorm, self.hnorm, self.norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = Block(dim)

    def forward(self, emb, h, run_block):
        return run_block(self.block, self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1)))

    def head_norm(self, h):
        return self.norm(h)


class Qwen35Depth(nn.Module):
    """Qwen3.5's layout: fc on cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)], layers, norm."""

    def __init__(self, dim):
        super().__init__()
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layers = nn.ModuleList([Block(dim)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, emb, h, run_block):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h)], -1))
        for layer in self.layers:
            x = run_block(layer, x)
        return x

    def head_norm(self, h):
        return self.norm(h)


def setup(depth_cls=DeepSeekDepth, depths=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layers = [depth_cls(D) for _ in range(depths)]
    with torch.no_grad():
        for m in layers:
            for name, p in m.named_parameters():
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    embed = nn.Embedding(V, D)
    head = torch.randn(V, D) * 0.3
    a, b = LeanMTP(layers, loss_scale=0.3), MaterializedMTP(layers, loss_scale=0.3)
    b.load_state_dict(a.state_dict())
    return a.to(dtype), b, embed.to(dtype), head.to(dtype)


def run_block(block, x):
    return block(x)


def ce_slot():
    name = "linear_ce" if "linear_ce" in registry.slots()["cross_entropy"] else "materialized_ce"
    return registry.resolve("cross_entropy", name)


def inputs(B=3, T=14, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[B - 1, min(9, T - 1)] = -100
    return hidden, ids, labels


def grads(mtp, embed, head, hidden, ids, labels, **kw):
    hidden = hidden.clone().requires_grad_(True)
    head = head.clone().requires_grad_(True)
    loss, depths = mtp(hidden, ids, labels, embed=embed, head_weight=head, run_block=run_block, **kw)
    params = [hidden, head, embed.weight] + list(mtp.parameters())
    return loss, depths, torch.autograd.grad(loss, params)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("depth_cls", [DeepSeekDepth, Qwen35Depth])
@pytest.mark.parametrize("packed", [False, True])
def test_lean_matches_materialized(depth_cls, packed):
    lean, mat, embed, head = setup(depth_cls)
    hidden, ids, labels = inputs()
    kw = {}
    if packed:
        kw["segment_ids_BT"] = torch.tensor([[0] * 6 + [1] * 8, [2] * 14, [3] * 3 + [4] * 11])
    la, da, ga = grads(lean, embed, head, hidden, ids, labels, loss_fn=ce_slot(), **kw)
    lb, db, gb = grads(mat, embed, head, hidden, ids, labels, **kw)
    assert rel_err(la, lb) < 1e-5 and rel_err(da, db) < 1e-5
    for x, y in zip(ga, gb):
        assert rel_err(x, y) < 1e-4


def _reference(mtp, embed, head, hidden, ids, labels, segment_ids=None):
    """The formulation in float64, token by token."""
    B, T = ids.shape
    seg = torch.zeros(B, T, dtype=torch.long) if segment_ids is None else segment_ids
    h, losses = hidden.double(), []
    e = embed.weight.double()
    for k, layer in enumerate(mtp.layers, start=1):
        layer = layer.double()
        shifted = torch.stack([torch.stack([e[ids[b, min(t + k, T - 1)]] for t in range(T)]) for b in range(B)])
        h = layer(shifted, h, run_block)
        logits = layer.head_norm(h) @ head.double().T
        total, count = 0.0, 0
        for b in range(B):
            for t in range(T - k - 1):
                if labels[b, t + k + 1] != -100 and seg[b, t + k + 1] == seg[b, t]:
                    total = total - torch.log_softmax(logits[b, t], -1)[labels[b, t + k + 1]]
                    count += 1
        losses.append(total / count)
    return 0.3 / len(losses) * sum(losses), torch.stack(losses)


@pytest.mark.parametrize("impl", ["lean", "materialized"])
def test_matches_float64_reference(impl):
    lean, mat, embed, head = setup(depths=3, seed=2)
    mtp = lean if impl == "lean" else mat
    hidden, ids, labels = inputs(seed=3)
    seg = torch.tensor([[0] * 6 + [1] * 8, [2] * 14, [3] * 3 + [4] * 11])
    with torch.no_grad():
        got, got_d = mtp(hidden, ids, labels, embed=embed, head_weight=head, run_block=run_block,
                         loss_fn=ce_slot(), segment_ids_BT=seg)
        want, want_d = _reference(mtp, embed, head, hidden, ids, labels, seg)
    assert rel_err(got_d, want_d) < 1e-5
    assert abs(got.item() - want.item()) < 1e-5 * want.item()


@pytest.mark.parametrize("cls", [LeanMTP, MaterializedMTP])
def test_bad_input(cls):
    _, _, embed, head = setup()
    mtp = cls([DeepSeekDepth(D) for _ in range(3)])
    hidden, ids, labels = inputs(T=4)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp(hidden, ids, labels, embed=embed, head_weight=head, run_block=run_block)
    hidden, ids, labels = inputs(T=9)
    with pytest.raises(ValueError, match="labels"):
        mtp(hidden, ids, labels[:, :-1], embed=embed, head_weight=head, run_block=run_block)
    with pytest.raises(ValueError, match="segment_ids"):
        mtp(hidden, ids, labels, embed=embed, head_weight=head, run_block=run_block,
            segment_ids_BT=torch.zeros(3, 8, dtype=torch.long))


@pytest.mark.parametrize("loss_fn", ["linear_ce", None])
def test_no_logits_saved_with_linear_ce(loss_fn):
    """With the model's linear_ce slot, and by default (loss_fn=None: linear_ce, the primitive's own
    loss, never the twin's materialized logits): no [B*T, V] tensor is kept, and both give the same loss."""
    lean, _, embed, head = setup()
    hidden, ids, labels = inputs(B=2, T=40)
    sizes = []

    def pack(t):
        sizes.append(tuple(t.shape))
        return t

    fn = registry.resolve("cross_entropy", loss_fn) if loss_fn else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = lean(hidden.requires_grad_(True), ids, labels, embed=embed, head_weight=head.requires_grad_(True),
                       run_block=run_block, loss_fn=fn)
    assert not any(V in s and 80 in s for s in sizes), sizes
    explicit, _ = lean(hidden, ids, labels, embed=embed, head_weight=head, run_block=run_block,
                       loss_fn=registry.resolve("cross_entropy", "linear_ce"))  # the same path: the same bits
    assert torch.equal(loss, explicit)


@pytest.mark.gpu
def test_linear_ce_peak_memory_gpu():
    if "linear_ce" not in registry.slots()["cross_entropy"]:
        pytest.skip("linear_ce not registered")
    dim, vocab, T = 1024, 128_000, 4096
    torch.manual_seed(0)
    layers = [DeepSeekDepth(dim)]
    lean = LeanMTP(layers).cuda().bfloat16()
    mat = MaterializedMTP(layers).cuda().bfloat16()
    embed = nn.Embedding(vocab, dim).cuda().bfloat16()
    head = (torch.randn(vocab, dim, device="cuda") * 0.02).bfloat16().requires_grad_(True)
    hidden = torch.randn(1, T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, vocab, (1, T), device="cuda")
    peaks = {}
    for name, mtp, fn in (("lean", lean, registry.resolve("cross_entropy", "linear_ce")), ("mat", mat, None)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, _ = mtp(hidden, ids, ids, embed=embed, head_weight=head, run_block=run_block, loss_fn=fn)
        loss.backward()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    logits_bytes = T * vocab * 4
    assert peaks["mat"] - peaks["lean"] > logits_bytes, peaks


@pytest.mark.parametrize("loss_fn", [None, "slot"])
def test_every_target_ignored_gives_zero_loss_and_zero_gradients(loss_fn):
    # e.g. a batch whose sequences are shorter than the depth: the twin's loss is 0, not NaN
    lean, mat, embed, head = setup()
    hidden, ids, labels = inputs()
    labels = torch.full_like(labels, -100)
    kw = {"loss_fn": ce_slot()} if loss_fn else {}
    for mtp, extra in ((lean, kw), (mat, {})):
        loss, depths, g = grads(mtp, embed, head, hidden, ids, labels, **extra)
        assert loss.item() == 0 and torch.equal(depths, torch.zeros(2))
        assert all(torch.isfinite(x).all() and not x.any() for x in g)
