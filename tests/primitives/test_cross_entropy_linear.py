"""linear_cross_entropy against a float64 reference: options, reductions, ignore patterns, entropy,
vocab parallelism on gloo ranks, the Triton kernels under TRITON_INTERPRET=1, bad input, GPU dtypes."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.baselines.cross_entropy import materialized_cross_entropy
from bumblebee.options import Bound
from bumblebee.primitives import cross_entropy as lce
from bumblebee.primitives.cross_entropy import LinearCE, linear_cross_entropy, linear_cross_entropy_with
from tests.limits import SUBPROCESS_TIMEOUT_S
from tests.ranks import leave_group

N, H, V = 45, 23, 101  # V prime; N, H not multiples of any block


def reference(hidden, weight, labels, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss_scale=0.0, temperature=1.0, return_entropy=False):
    """Textbook formulas in float64 on the full logits (independent of both implementations)."""
    z = (hidden.double() @ weight.double().t()) / temperature
    valid = labels != ignore_index
    logp = torch.log_softmax(z, dim=-1)
    nll = -logp.gather(1, labels.clamp(min=0).long()[:, None])[:, 0]
    loss = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    loss = loss + z_loss_scale * torch.logsumexp(z, -1).square()
    loss = torch.where(valid, loss, 0.0)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum().clamp(min=1)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    return (loss, ent) if return_entropy else loss


def make(n=N, h=H, v=V, dtype=torch.float32, device="cpu", ignore_every=4, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**30, ())))
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * h ** -0.5 * 3).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, labels.to(device), g


def run(fn, hidden, weight, labels, g, **kw):
    """Loss (+ entropy), then a backward through random upstream weights; returns outputs + grads."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = fn(h, w, labels, **kw)
    loss, ent = out if kw.get("return_entropy") else (out, None)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (), generator=g)))
    up = torch.randn(loss.shape, generator=gen, dtype=torch.float64).to(loss.device)
    total = (loss * up).sum()
    if ent is not None:
        total = total + (ent * torch.randn(ent.shape, generator=gen, dtype=torch.float64)
                         .to(ent.device)).sum()
    total.backward()
    outs = [loss.detach(), h.grad, w.grad] + ([] if ent is None else [ent.detach()])
    return [o.double().cpu() for o in outs]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_close(got, ref, base=None, k=4.0, floor=1e-6):
    """Relative error <= k x the error of plain PyTorch (the twin) in the same dtype + a floor."""
    for i, (x, r) in enumerate(zip(got, ref)):
        assert torch.isfinite(x).all(), f"output {i} holds NaN/inf"
        limit = floor + (k * rel(base[i], r) if base is not None else 0.0)
        assert rel(x, r) <= limit, f"output {i}: rel err {rel(x, r):.3g} > {limit:.3g}"


def configured(**options):
    """linear_cross_entropy with these options, as the registry hands it to a model."""
    return Bound(linear_cross_entropy_with, LinearCE(**options))


@pytest.fixture(params=[None, 13], ids=["auto_chunk", "chunk13"])
def lean(request):
    """The lean path (vocabulary chunks), with the automatic chunk width and a fixed one."""
    return configured(path="lean", chunk_columns=request.param)


OPTIONS = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.1),
    dict(z_loss_scale=1e-3, reduction="sum"),
    dict(temperature=0.7, reduction="none"),
    dict(return_entropy=True, reduction="none", temperature=1.3),
    dict(return_entropy=True, label_smoothing=0.2, z_loss_scale=1e-2, temperature=2.0),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_float64_reference(opts, lean):
    hidden, weight, labels, g = make()
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **opts)
    got = run(lean, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    base = run(materialized_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    assert_close(got, ref, base, k=8.0, floor=1e-5)


@pytest.mark.parametrize("opts", [dict(), dict(reduction="sum", label_smoothing=0.1, z_loss_scale=1e-3,
                                                temperature=0.8)], ids=["mean", "sum-all"])
@pytest.mark.parametrize("pattern", ["some", "all"])
def test_grad_in_forward_variant(opts, pattern):
    """The 6NHV variant (gradients in the forward) computes the same function."""
    hidden, weight, labels, g = make()
    if pattern == "all":
        labels[:] = -100
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **opts)
    gif = configured(path="grad_in_forward", grad_in_forward_rows=16)
    got = run(gif, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    if pattern == "all":
        assert all(torch.isfinite(x).all() and x.abs().max() == 0 for x in got)
    else:
        assert_close(got, ref, floor=1e-5)


@pytest.mark.parametrize("budget", ["fits", "too_small"])
def test_auto_path_follows_the_workspace_budget(budget):
    """The default takes the 6NHV variant when its workspace fits the budget, the lean path otherwise;
    either way the same function."""
    hidden, weight, labels, g = make()
    need = lce.grad_in_forward_workspace_bytes(hidden.shape[0], weight.shape[0], hidden.shape[1])
    config = LinearCE(budget_bytes=need if budget == "fits" else need - 1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    assert lce._grad_in_forward(h, w, "mean", False, config) == (budget == "fits")
    assert not lce._grad_in_forward(h, w, "none", False, config)
    assert not lce._grad_in_forward(h, w, "mean", True, config)
    with torch.no_grad():
        assert not lce._grad_in_forward(h, w, "mean", False, config)
    assert not lce._grad_in_forward(hidden, weight, "mean", False, config)  # nothing needs a gradient
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed))
    got = run(Bound(linear_cross_entropy_with, config), hidden, weight, labels, torch.Generator().manual_seed(seed))
    base = run(materialized_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed))
    assert_close(got, ref, base, k=8.0, floor=1e-5)


@pytest.mark.parametrize("path", lce.PATHS)
@pytest.mark.parametrize("opts", [dict(), dict(reduction="sum", label_smoothing=0.1, z_loss_scale=1e-3)],
                         ids=["mean", "sum-all"])
def test_each_path_chosen_through_the_registry_matches_float64(path, opts):
    """Every path named in a config string computes the float64 reference's loss and gradients,
    and the registry really runs the path it names."""
    from bumblebee import registry

    fn = registry.resolve("cross_entropy", f"linear_ce:path={path},grad_in_forward_rows=16,chunk_columns=13")
    assert fn.config == LinearCE(path=path, grad_in_forward_rows=16, chunk_columns=13)
    hidden, weight, labels, g = make()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    assert lce._grad_in_forward(h, w, "mean", False, fn.config) == (path != "lean")
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **opts)
    got = run(fn, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    base = run(materialized_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    assert_close(got, ref, base, k=8.0, floor=1e-5)


@pytest.mark.parametrize("options,msg", [
    (dict(path="fast"), r"LinearCE.path must be one of 'auto', 'grad_in_forward', 'lean'; got 'fast'"),
    (dict(budget_bytes=-1), r"LinearCE.budget_bytes must be an int >= 0; got -1"),
    (dict(grad_in_forward_rows=0), r"LinearCE.grad_in_forward_rows must be an int >= 1; got 0"),
    (dict(workspace_bytes=1.5), r"LinearCE.workspace_bytes must be an int >= 1; got 1.5"),
    (dict(chunk_columns=True), r"LinearCE.chunk_columns must be None or an int >= 1; got True"),
])
def test_bad_options_name_the_field_and_what_it_accepts(options, msg):
    with pytest.raises(ValueError, match=msg):
        LinearCE(**options)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("pattern", ["none", "all", "head", "random"])
def test_ignore_patterns(reduction, pattern, lean):
    hidden, weight, labels, g = make(ignore_every=0)
    if pattern == "all":
        labels[:] = -100
    elif pattern == "head":
        labels[: N // 2] = -100
    elif pattern == "random":
        labels[torch.rand(N, generator=g) < 0.5] = -100
    seed = int(torch.randint(0, 2**30, (), generator=g))
    kw = dict(reduction=reduction, return_entropy=True)
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **kw)
    got = run(lean, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
    if pattern == "all":
        for x in got:
            assert torch.isfinite(x).all() and x.abs().max() == 0  # 0 loss, 0 entropy, 0 grads
    else:
        assert_close(got, ref, floor=1e-5)


def test_custom_ignore_index_and_int32_labels():
    hidden, weight, labels, g = make(ignore_every=0)
    labels[::3] = 7  # ignore_index inside the vocabulary
    ref = reference(hidden.double(), weight.double(), labels, ignore_index=7)
    got = linear_cross_entropy(hidden, weight, labels.int(), ignore_index=7)
    assert rel(got.double(), ref) < 1e-5


def test_mean_all_ignored_is_zero_without_nan():
    hidden, weight, labels, _ = make()
    labels[:] = -100
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = linear_cross_entropy(h, w, labels)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_float64_inputs_are_exact():
    hidden, weight, labels, g = make(dtype=torch.float64)
    kw = dict(label_smoothing=0.1, z_loss_scale=1e-3, return_entropy=True)
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
    got = run(linear_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
    assert_close(got, ref, floor=1e-12)


def test_workspace_is_chunked():
    """The auto chunk width follows workspace_bytes; results do not depend on it."""
    small = LinearCE(workspace_bytes=N * 4 * 16)  # -> the column minimum, < V
    assert lce._chunk_columns(N, 5000, small) == lce.MIN_CHUNK_COLUMNS
    assert lce._chunk_columns(16384, 151936, LinearCE()) == 2048  # 16384 x 2048 x 4 B = 128 MiB
    assert lce._chunk_columns(16384, 151936, LinearCE(chunk_columns=300)) == 300


def test_registered():
    from bumblebee import registry
    impl = registry.get("cross_entropy", "linear_ce")
    assert impl.obj is linear_cross_entropy_with and impl.config is LinearCE
    assert impl.kind == "primitive" and impl.twin == "materialized_ce"
    assert registry.resolve("cross_entropy", "linear_ce") == linear_cross_entropy  # the defaults


# --- bad input -------------------------------------------------------------------------------

def test_label_out_of_range_names_value():
    hidden, weight, labels, _ = make()
    labels[3] = V + 5
    with pytest.raises(ValueError, match=str(V + 5)):
        linear_cross_entropy(hidden, weight, labels)
    labels[3] = -7
    with pytest.raises(ValueError, match="-7"):
        linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("twin", [False, True], ids=["linear_ce", "materialized_ce"])
@pytest.mark.parametrize("kw,msg", [
    (dict(z_loss_scale=-1e-3), r"z_loss_scale must be a finite number >= 0, got -0.001"),
    (dict(z_loss_scale=float("nan")), r"z_loss_scale must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), r"temperature must be a finite number > 0, got inf"),
    (dict(temperature=float("nan")), r"temperature must be a finite number > 0, got nan"),
    (dict(temperature=0.0), r"temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-2.0), r"temperature must be a finite number > 0, got -2.0"),
])
def test_bad_scales_are_refused_by_both_twins(twin, kw, msg):
    # a negative z-loss scale was ignored and temperature=inf gave the uniform loss, silently
    from bumblebee.baselines.cross_entropy import materialized_cross_entropy

    hidden, weight, labels, _ = make()
    with pytest.raises(ValueError, match=msg):
        (materialized_cross_entropy if twin else linear_cross_entropy)(hidden, weight, labels, **kw)


@pytest.mark.parametrize("case", ["hidden_dim", "dtype", "label_shape", "label_dtype", "reduction", "hidden_rank"])
def test_bad_shapes_and_dtypes(case):
    hidden, weight, labels, _ = make()
    if case == "hidden_dim":
        weight = weight[:, :-1]
    elif case == "dtype":
        weight = weight.double()
    elif case == "label_shape":
        labels = labels[:-1]
    elif case == "label_dtype":
        labels = labels.float()
    elif case == "hidden_rank":
        hidden = hidden[None]
    kw = {"reduction": "avg"} if case == "reduction" else {}
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, labels, **kw)


# --- vocab parallel on gloo ranks ---------------------------------------------------------------

def _vocab_parallel_worker(rank, world, init_file, seed):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)
        hidden, weight, labels, _ = make(seed=seed)
        kw = dict(reduction="none", return_entropy=True, label_smoothing=0.1, z_loss_scale=1e-3,
                  temperature=0.9)
        full = run(linear_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
        bounds = [0, 17, 50, 77, V][: world] + [V]  # uneven shards
        lo, hi = bounds[rank], bounds[rank + 1]
        lean = configured(path="lean", chunk_columns=8)
        shard = run(lambda h, w, y, **k: lean(h, w[lo:hi], y, process_group=dist.group.WORLD, **k),
                    hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
        shard[2] = shard[2][lo:hi]  # the weight grad of this rank's rows (zero elsewhere)
        full[2] = full[2][lo:hi]
        assert_close(shard, full, floor=1e-5)
        # mean reduction (a replicated scalar) too
        lm = linear_cross_entropy(hidden, weight[lo:hi], labels, process_group=dist.group.WORLD)
        assert abs(float(lm) - float(linear_cross_entropy(hidden, weight, labels))) < 1e-5
        gif = configured(path="grad_in_forward", grad_in_forward_rows=16)  # the 6NHV variant, sharded
        kw = dict(label_smoothing=0.1, z_loss_scale=1e-3)
        shard = run(lambda h, w, y, **k: gif(h, w[lo:hi], y, process_group=dist.group.WORLD, **k),
                    hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
        full = run(lean, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
        shard[2], full[2] = shard[2][lo:hi], full[2][lo:hi]
        assert_close(shard, full, floor=1e-5)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_one_rank(world):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_vocab_parallel_worker, args=(world, os.path.join(d, "init"), 1234 + world),
                 nprocs=world, join=True)


# --- the Triton kernels themselves, under the interpreter (float32) -----------------------------

INTERPRETED = textwrap.dedent("""
    import torch
    from bumblebee.kernels import cross_entropy_linear as k
    assert k.INTERPRET and k.triton is not None
    from bumblebee.primitives import cross_entropy as lce
    torch.manual_seed(0)
    n, c = 9, 37
    for ent, smooth in [(True, True), (False, False)]:
        z = torch.randn(n, c) * 3
        lab = torch.randint(-3, c + 3, (n,))
        st = [torch.full((n,), k.NEG_INIT), *torch.rand(4, n).unbind(0)]
        st2 = [s.clone() for s in st]
        k.chunk_stats_(z, lab, *st, 0.8, smooth=smooth, entropy=ent)
        k.chunk_stats_torch_(z, lab, *st2, 0.8, smooth=smooth, entropy=ent)
        for a, b in zip(st, st2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        coef = [torch.randn(n) for _ in range(6)]
        ge, s = (coef[4], coef[5]) if ent else (None, None)
        g = torch.full((n, c), float("nan"))  # poisoned: every element must be written
        k.chunk_grad(z, g, lab, coef[0] + 5, *coef[1:4], ge, s, 0.8)
        g2 = k.chunk_grad_torch(z, torch.empty(n, c), lab, coef[0] + 5, *coef[1:4], ge, s, 0.8)
        torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-5)
    # in place: the fp16 gradient over the first half of each fp32 logit row (as the primitive does)
    z = torch.randn(n, 9000) * 3  # three 4096-column blocks
    coef = [torch.randn(n) for _ in range(6)]
    want = k.chunk_grad_torch(z, torch.empty(n, 9000, dtype=torch.float16), lab, coef[0] + 5,
                            *coef[1:6], 0.8)
    g = lce._grad_view(z, torch.float16)
    assert g.data_ptr() == z.data_ptr() and g.stride(0) == 18000
    k.chunk_grad(z, g, lab, coef[0] + 5, *coef[1:6], 0.8)
    torch.testing.assert_close(g, want, rtol=2e-3, atol=1e-5)
    # the whole primitive with the kernels in the loop, against float64
    h, w = torch.randn(11, 7, requires_grad=True), torch.randn(41, 7, requires_grad=True)
    y = torch.randint(0, 41, (11,)); y[::3] = -100
    up = torch.randn(11)
    kw = dict(label_smoothing=0.1, z_loss_scale=1e-3, temperature=0.9, return_entropy=True,
              reduction="sum")
    loss, ent = lce.linear_cross_entropy_with(lce.LinearCE(chunk_columns=16), h, w, y, **kw)
    (loss + (ent * up).sum()).backward()
    from bumblebee.baselines.cross_entropy import materialized_cross_entropy as m
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss2, ent2 = m(h64, w64, y, **kw)
    (loss2 + (ent2 * up.double()).sum()).backward()
    assert abs(loss.item() - loss2.item()) < 1e-4 * abs(loss2.item())
    torch.testing.assert_close(ent.double(), ent2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    print("INTERPRETED OK")
""")


def test_triton_kernels_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT_S)
    assert r.returncode == 0 and "INTERPRETED OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# --- GPU: bf16 / fp16 against float64, within k x plain PyTorch's own error ---------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", return_entropy=True, temperature=0.8),
                                  dict(label_smoothing=0.1, z_loss_scale=1e-3, reduction="sum")],
                         ids=["mean", "none-entropy", "smooth-zloss"])
def test_gpu_low_precision(dtype, opts):
    hidden, weight, labels, g = make(n=1531, h=517, v=32003, dtype=dtype, device="cuda")
    seed = int(torch.randint(0, 2**30, (), generator=g))
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **opts)
    got = run(linear_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    base = run(materialized_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **opts)
    print(f"\nrel err vs float64 [loss, dH, dW(, entropy)] {dtype} {opts}: linear_ce "
          f"{[f'{rel(x, r):.2e}' for x, r in zip(got, ref)]} twin {[f'{rel(x, r):.2e}' for x, r in zip(base, ref)]}")
    assert_close(got, ref, base, k=2.0, floor=1e-3)


@pytest.mark.gpu
def test_gpu_chunked_all_ignored():
    hidden, weight, labels, g = make(n=777, h=256, v=10007, dtype=torch.bfloat16, device="cuda")
    labels[:] = -100
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = configured(path="lean", chunk_columns=1000)(h, w, labels)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_grad_in_forward_variant(dtype):
    hidden, weight, labels, g = make(n=1531, h=517, v=32003, dtype=dtype, device="cuda")
    seed = int(torch.randint(0, 2**30, (), generator=g))
    kw = dict(label_smoothing=0.1, z_loss_scale=1e-3)
    ref = run(reference, hidden.double(), weight.double(), labels, torch.Generator().manual_seed(seed), **kw)
    gif = configured(path="grad_in_forward", grad_in_forward_rows=500)
    got = run(gif, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
    base = run(materialized_cross_entropy, hidden, weight, labels, torch.Generator().manual_seed(seed), **kw)
    print(f"\nrel err vs float64 [loss, dH, dW] {dtype} 6NHV: linear_ce "
          f"{[f'{rel(x, r):.2e}' for x, r in zip(got, ref)]} twin {[f'{rel(x, r):.2e}' for x, r in zip(base, ref)]}")
    assert_close(got, ref, base, k=2.0, floor=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gradient_over_logits_has_no_race(dtype):
    """The 16-bit gradient written over the fp32 logits equals the one written to its own buffer,
    bit for bit, over repeated launches on fresh data (a missing barrier shows up here)."""
    from bumblebee.kernels import cross_entropy_linear as k
    n, c = 4099, 20011
    for _ in range(4):
        z = torch.randn(n, c, device="cuda") * 4
        lab = torch.randint(-5, c + 5, (n,), device="cuda")
        coef = [torch.randn(n, device="cuda") for _ in range(6)]
        coef[0] = coef[0].abs() + 10  # lse
        want = k.chunk_grad(z, torch.full((n, c), float("nan"), device="cuda", dtype=dtype), lab,
                            *coef, 0.7)
        g = lce._grad_view(z, dtype)
        assert g.data_ptr() == z.data_ptr()
        k.chunk_grad(z, g, lab, *coef, 0.7)
        assert torch.equal(g, want)
