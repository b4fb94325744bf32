"""The runtime's operations against references computed from the model's materialized logits in
float64: token log-probs and entropy (plain and packed batches), the policy losses' gradients, the
normalization across ranks, the optimizer step with router biases, checkpoints and export."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bumblebee import models, registry
from bumblebee.runtime import Batch, Runtime
from tests.primitives.test_state_sharding import spawn

B, T = 3, 11


def _model(name, ce="linear_ce"):
    return models.build(name, impl={"cross_entropy": ce}, seed=0, dtype=torch.float64)


def _ids(model, seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, t), generator=g)


def _reference(model, ids, temperature=1.0):
    """Token-aligned log-probs and entropies [B, T] from the full logits (0 at each first token),
    differentiable when grad is enabled."""
    logp_all = (model(ids).logits.double() / temperature).log_softmax(-1)
    lp = F.pad(logp_all[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    ent = F.pad(-(logp_all.exp() * logp_all).sum(-1)[:, :-1], (1, 0))
    return lp, ent


@pytest.mark.parametrize("name", ["qwen3-tiny", "deepseek-v3-tiny", "qwen3.5-moe-tiny"])
@pytest.mark.parametrize("ce", ["linear_ce", "materialized_ce"])
def test_logprobs_and_entropy_match_logits(name, ce):
    model = _model(name, ce)
    ids = _ids(model)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.7
    out = Runtime(model).forward(Batch(ids, loss_mask=mask), temperature=0.7, entropy=True)
    with torch.no_grad():
        lp, ent = _reference(model, ids, temperature=0.7)
    trained = mask.clone()
    trained[:, 0] = False
    assert torch.equal(out.trained, trained)
    torch.testing.assert_close(out.log_probs, torch.where(trained, lp, 0), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, torch.where(trained, ent, 0), rtol=1e-10, atol=1e-10)


def test_packed_batch_equals_its_sequences_alone():
    model = _model("qwen3-tiny")
    a, b = _ids(model, 1, 1, 7), _ids(model, 2, 1, 5)
    rt = Runtime(model)
    packed = rt.forward(Batch(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 7, 12])))
    alone = torch.cat([rt.forward(Batch(a)).log_probs, rt.forward(Batch(b)).log_probs], 1)
    assert packed.log_probs[0, 7] == 0  # the second sequence's first token has no prefix
    torch.testing.assert_close(packed.log_probs, alone, rtol=1e-10, atol=1e-10)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_cross_entropy_with_mean_weights_is_the_model_loss():
    model = _model("qwen3-tiny")
    ids = _ids(model)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False  # a prompt
    model(ids, labels=ids.masked_fill(~mask, -100)).loss.backward()
    want = _grads(model)
    model.zero_grad()
    n = int(mask[:, 1:].sum())
    out = Runtime(model).forward_backward(Batch(ids, loss_mask=mask, weights=torch.full(ids.shape, 1.0 / n,
                                                                                         dtype=torch.float64)))
    assert out.metrics["tokens"] == n
    for k, g in _grads(model).items():
        torch.testing.assert_close(g, want[k], rtol=1e-9, atol=1e-12, msg=k)


def _policy_reference(lp, w, adv, old, loss, clip, ent, coef):
    ratio = torch.exp(lp - old)
    if loss == "importance_sampling":
        per = -ratio * adv
    else:  # the PPO objective as written: min of the unclipped and clipped surrogates
        per = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip[0], 1 + clip[1]) * adv)
    return (w * per).sum() - coef * (w * ent).sum()


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo"])
def test_policy_gradient_losses_against_logits(loss):
    model = _model("deepseek-v3-tiny")
    ids = _ids(model)
    g = torch.Generator().manual_seed(3)
    w = torch.rand(ids.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0, _ = _reference(model, ids)
    old = lp0 + 0.3 * torch.randn(ids.shape, generator=g, dtype=torch.float64)  # ratios well outside the clip
    clip = (0.2, 0.28)
    lp, ent = _reference(model, ids)  # materialized logits, autograd, in float64
    wt = w.clone()
    wt[:, 0] = 0
    ref_loss = _policy_reference(lp, wt, adv, old, loss, clip, ent, 0.01)
    ref_loss.backward()
    want = _grads(model)
    model.zero_grad()
    out = Runtime(model).forward_backward(Batch(ids, weights=w, advantages=adv, sampler_logprobs=old), loss,
                                          clip=clip, entropy_coef=0.01)
    assert out.loss == pytest.approx(ref_loss.item(), rel=1e-10)
    if loss == "ppo":
        assert 0 < out.metrics["clip_fraction"] < 1
    for k, gr in _grads(model).items():
        torch.testing.assert_close(gr, want[k], rtol=1e-8, atol=1e-12, msg=k)


def test_forward_keeps_no_graph_and_no_router_counts():
    model = _model("deepseek-v3-tiny")
    rt = Runtime(model)
    out = rt.forward(Batch(_ids(model)))
    assert not out.log_probs.requires_grad and not _grads(model)
    from bumblebee.models import moe
    assert all(r.tokens_per_expert is None for r in moe.routers(model).values())


def test_bad_input():
    model = _model("qwen3-tiny")
    rt, ids = Runtime(model), _ids(model)
    with pytest.raises(ValueError, match="batch.advantages"):
        rt.forward_backward(Batch(ids, sampler_logprobs=torch.zeros(ids.shape, dtype=torch.float64)), "ppo")
    with pytest.raises(ValueError, match=r"batch.weights must be a \[B, T\]"):
        rt.forward(Batch(ids, weights=torch.ones(B, T + 1)))
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        rt.forward(Batch(ids, loss_mask=torch.ones(B, T)))
    with pytest.raises(ValueError, match="loss must be one of"):
        rt.forward_backward(Batch(ids), "dpo")
    with pytest.raises(ValueError, match="needs a state"):
        rt.optim_step()
    with pytest.raises(ValueError, match="temperature"):
        rt.forward(Batch(ids), temperature=0.0)
    for empty in (ids[:0], ids[:, :0]):  # an empty batch: refused up front, not deep in a reshape
        with pytest.raises(ValueError, match=r"batch.input_ids is an empty batch of shape"):
            rt.forward_backward(Batch(empty))
    for coef in ("kl_coef", "entropy_coef"):  # a NaN coefficient would make every gradient NaN
        with pytest.raises(ValueError, match=f"{coef} must be a finite number, got nan"):
            rt.forward_backward(Batch(ids), **{coef: float("nan")})
    assert not _grads(model)
    for export in (rt.export_weights, rt.export_weight_shards):  # refused at the call, before any gather
        with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype .* got torch.int32"):
            export(dtype=torch.int32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="Runtime.to: device must hold data .* got 'meta'"):
        rt.to("meta")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_policy_loss_refuses_a_coefficient_that_is_not_finite():
    from bumblebee.runtime import losses
    lp = torch.zeros(2, 3, dtype=torch.float64)
    for coef in ("kl_coef", "entropy_coef"):
        with pytest.raises(ValueError, match=f"{coef} must be a finite number, got inf"):
            losses.policy_loss("cross_entropy", lp, torch.ones_like(lp), **{coef: float("inf")})


# ---- two gloo ranks under a sharded state ------------------------------------------------------------

STEPS, LR = 3, 1e-2
# Adam's eps above the gradients' float32 rounding: at 1e-8 a rounding-noise gradient entry moves by
# +-LR a step, and the two layouts' later losses and norms part by more than rounding
# (tests/primitives/test_state_sharding.py: HP)
EPS = 1e-6


def _batch(model, step):
    ids = _ids(model, seed=10 + step, b=4)
    g = torch.Generator().manual_seed(20 + step)
    adv = torch.randn(ids.shape, generator=g)
    return ids, adv


FOREIGN = {"rt-ckpt/README.md": "# run notes\n", "rt-ckpt/sub/keep.txt": "keep",
           "rt-hf/tokenizer.json": "{}", "rt-hf/sub/chat_template.jinja": "{{ messages }}"}


def _snapshot(state):
    """Every tensor a step could change, this rank's part: masters, Adam moments and step counts,
    compute parameters, buffers (router biases), the step counter."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
    sd = state.state_dict()
    out = {f"{part}.{k}": local(v) for part in ("model", "optim", "buffers") for k, v in sd.get(part, {}).items()}
    out.update({f"param.{k}": local(p) for k, p in state.model.named_parameters()})
    out.update({f"adam_step.{i}": st["step"].clone() for i, st in enumerate(state.optimizer.state.values())})
    out["steps"] = torch.tensor(state.steps)
    return out


def runtime_runs(mesh, out: Path):
    """DeepSeek-V3 (aux-free routers) on two ranks, each with half of every batch: global-mean IS loss
    (weights = 1 / global token count), optimizer steps, checkpoint, resume, export; an optimizer
    step without gradient on both twins; saves next to other files and onto a regular file."""
    from bumblebee.models import moe
    n, r = mesh.size(), mesh.get_local_rank()

    def make(seed, impl="fsdp2"):
        model = models.build("deepseek-v3-tiny", seed=seed)
        state = registry.resolve("state_sharding", impl)(model, mesh, lr=LR, eps=EPS, mixed_precision="fp32",
                                                         grad_clip=None)
        return Runtime(model, state, router_bias_rate=0.05)

    def step(rt, i):
        ids, adv = _batch(rt.model, i)
        half = slice(r * 4 // n, (r + 1) * 4 // n)
        w = torch.full(ids[half].shape, 1.0 / (ids.shape[0] * (ids.shape[1] - 1)))
        old = rt.forward(Batch(ids[half])).log_probs
        rt.forward_backward(Batch(ids[half], weights=w, advantages=adv[half], sampler_logprobs=old),
                            "importance_sampling")
        return rt.optim_step()

    def skip(rt):
        before = _snapshot(rt.state)
        got = rt.optim_step()  # no forward_backward since the last step
        after = _snapshot(rt.state)
        return {"out": got, "changed": [k for k in before if not torch.equal(before[k], after[k])]}

    rt = make(0)
    res = {"steps": [], "loads": [], "weights_before": []}
    for i in range(STEPS):  # each step's weights and router biases, and the loads that moved the biases
        res["weights_before"].append(rt.state.full_state_dict(torch.float32))
        res["steps"].append(step(rt, i))
        res["loads"].append({k: x.last_load.clone() for k, x in moe.routers(rt.model).items()})
    res["weights"] = rt.state.full_state_dict(torch.float32)  # after STEPS steps, biases included
    rt.save_state(out / "rt-ckpt")
    rt.save_weights(out / "rt-hf")
    res["no_grad"] = {"fsdp2": skip(rt)}
    res["continued"] = step(rt, STEPS)  # equal to the resumed run's only if the skip changed nothing
    resumed = make(9)
    resumed.load_state(out / "rt-ckpt")
    res["resumed"] = step(resumed, STEPS)
    other = make(0, "zero1")
    step(other, 0)  # moments and a step count that a wrongly applied step would move
    res["no_grad"]["zero1"] = skip(other)
    res["no_grad"]["zero1"]["next"] = step(other, 1)  # the ranks still agree on every collective
    res["has_routers"] = bool(moe.routers(rt.model))
    res["refused"] = {}
    for op in ("save_state", "save_weights"):
        try:
            getattr(rt, op)(out / "rt-file")
        except ValueError as e:
            res["refused"][op] = str(e)
    return res


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime")
    for rel, text in FOREIGN.items():  # files of others in the folders the runtime saves into
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    (out / "rt-file").write_text("a file, not a folder")
    return spawn(2, "runtime_runs", out, module=__name__), out


# A token's top-k choice this close to a tie (in sigmoid score + bias, group scores included) may go
# either way between two layouts of the same batch: far above float32's rounding of the scores between
# layouts (measured in _router_loads_follow_the_batch), far below the gaps between random scores.
TIE = 1e-4


def _routing_gap(logits_NE, bias_E, router):
    """Per token: the smallest gap, in float64, between a kept and a dropped candidate of its
    group-limited top-k (the k-th and (k+1)-th groups by group score, then experts among kept groups)."""
    s_NE = torch.sigmoid(logits_NE.double()) + bias_E.double()
    n, e = s_NE.shape
    gaps = []
    if router.n_group > 1:
        group_NG = s_NE.view(n, router.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        top = group_NG.sort(dim=-1, descending=True)[0]
        gaps.append(top[:, router.topk_group - 1] - top[:, router.topk_group])
        kept_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, group_NG.topk(router.topk_group)[1], True)
        s_NE = s_NE.masked_fill(~kept_NG.repeat_interleave(e // router.n_group, dim=1), float("-inf"))
    top = s_NE.sort(dim=-1, descending=True)[0]
    gaps.append(top[:, router.top_k - 1] - top[:, router.top_k])
    return torch.stack(gaps).min(0)[0]


def _router_loads_follow_the_batch(runs, i):
    """Step i of the two ranks: each router's all-reduced load is that of the whole batch under the
    weights and biases the ranks held before the step, recomputed here in one process half by half, as
    the ranks split it; only a token within TIE of a tie may count for another expert (2 entries each)."""
    from bumblebee.models import moe
    loads = runs[0]["loads"][i]
    for rank in runs[1:]:  # all-reduced integer counts: the same on every rank
        assert all(torch.equal(rank["loads"][i][k], v) for k, v in loads.items()), i
    model = models.build("deepseek-v3-tiny", seed=0)
    model.load_state_dict(runs[0]["weights_before"][i])
    routers = moe.routers(model)
    seen = []  # per forward: {router: logits}

    def keep(k):
        def hook(mod, args, out):  # returns None: the output stays the router's own
            seen[-1].setdefault(k, out[0].detach())
        return hook
    hooks = [r.register_forward_hook(keep(k)) for k, r in routers.items()]
    rt = Runtime(model)
    ids, adv = _batch(model, i)
    try:
        for half in (slice(0, 2), slice(2, 4)):
            w = torch.full(ids[half].shape, 1.0 / (ids.shape[0] * (ids.shape[1] - 1)))
            seen.append({})
            old = rt.forward(Batch(ids[half])).log_probs
            seen.append({})
            rt.forward_backward(Batch(ids[half], weights=w, advantages=adv[half], sampler_logprobs=old),
                                "importance_sampling")
        counts = {k: r.tokens_per_expert for k, r in routers.items()}
        seen.append({})
        with torch.no_grad():
            model(ids)  # the whole batch at once: how far the layout alone moves the router logits
    finally:
        for h in hooks:
            h.remove()
    halves, whole = seen[:-1], seen[-1]
    for k, r in routers.items():
        ours = counts[k] if counts[k] is not None else torch.zeros_like(loads[k])
        counted = (halves[1], halves[3])  # the forwards of forward_backward, which count tokens
        ties = sum(int((_routing_gap(f[k], r.e_score_correction_bias, r) < TIE).sum()) for f in counted if k in f)
        if k in whole:
            layout = (torch.cat([halves[0][k], halves[2][k]]) - whole[k]).abs().max().item()
            assert layout < TIE / 10, (k, layout)  # TIE covers the rounding with room to spare
        assert (loads[k] - ours).abs().sum() <= 2 * ties, (i, k, loads[k], ours, ties)


def test_two_ranks_follow_one_process(two):
    runs, _ = two
    from bumblebee.models import moe
    for i in range(STEPS):
        _router_loads_follow_the_batch(runs, i)
    model = models.build("deepseek-v3-tiny", seed=0)  # one process, whole batches, plain AdamW, no sharding
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    rt = Runtime(model, router_bias_rate=0.05)
    for i in range(STEPS):
        ids, adv = _batch(model, i)
        w = torch.full(ids.shape, 1.0 / (ids.shape[0] * (ids.shape[1] - 1)))
        old = rt.forward(Batch(ids)).log_probs
        rt.forward_backward(Batch(ids, weights=w, advantages=adv, sampler_logprobs=old), "importance_sampling")
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
        for rank in runs:
            assert rank["steps"][i]["applied"]
            assert rank["steps"][i]["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), i
        opt.step()
        opt.zero_grad()
        # the loads the ranks moved their biases by (checked against the batch above): the biases here
        # are then the ranks' to the bit, and both sides route alike
        for k, r in moe.routers(model).items():
            r.apply_load(runs[0]["loads"][i][k], rate=0.05)
    want = model.state_dict()
    got = runs[0]["weights"]
    assert set(got) == set(want)
    for k in got:  # the ranks gathered the same full tensors
        assert all(torch.equal(rank["weights"][k], got[k]) for rank in runs[1:]), k
    for k, v in want.items():
        if k.endswith("e_score_correction_bias"):
            # rate * sign(mean load - load) summed in float32 from the same integer loads: bit for bit
            assert torch.equal(got[k], v), k
            # the runtime skips MTP depths: their routers see no tokens
            assert (got[k].abs().max() > 0) == (not k.startswith("mtp.")), k
        else:
            # the same math with fp32 sums in another order (two half batches, gloo). Adam divides by
            # sqrt(v): an entry whose gradient is rounding noise can move by up to lr a step either
            # way (2.4e-4 seen on one entry of 32768 with the chunked dispatch), so: almost every entry
            # within 2e-4, and none beyond what LR * STEPS of Adam can move it
            far = ((got[k] - v).abs() > 2e-4 + 1e-4 * v.abs()).float().mean()
            assert far <= 1e-3 and (got[k] - v).abs().max() <= 2 * LR * STEPS, (k, float(far))


def test_resume_and_export(two):
    runs, out = two
    for rank in runs:
        assert rank["resumed"]["grad_norm"] == rank["continued"]["grad_norm"]
    loaded = models.from_pretrained(out / "rt-hf").state_dict()
    want = runs[0]["weights"]  # what the state held when it exported: the values, not only the names
    assert set(loaded) == set(want) and any(k.endswith("e_score_correction_bias") for k in loaded)
    for k, v in want.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("impl", ["fsdp2", "zero1"])
def test_optim_step_without_gradient_changes_nothing(two, impl):
    runs, _ = two
    for rank in runs:
        res = rank["no_grad"][impl]
        assert res["out"]["applied"] is False and res["out"]["skipped"] == "no gradient"
        assert res["changed"] == []  # weights, Adam state, step counter, router biases: bitwise
        if impl == "zero1":
            assert res["next"]["applied"] and res["next"]["step"] == 2


def test_saves_keep_other_files_and_refuse_a_file(two):
    runs, out = two
    for rel, text in FOREIGN.items():
        assert (out / rel).read_text() == text, rel
    assert (out / "rt-file").read_text() == "a file, not a folder"
    for rank in runs:
        assert "checkpoint path" in rank["refused"]["save_state"]
        assert "save_pretrained path" in rank["refused"]["save_weights"]
        for msg in rank["refused"].values():
            assert "rt-file exists and is not a folder" in msg


def _runtime(mesh, impl="fsdp2", seed=0, **kw):
    model = models.build("deepseek-v3-tiny", seed=seed)
    state = registry.resolve("state_sharding", impl)(model, mesh, lr=LR, mixed_precision="fp32", grad_clip=None)
    return Runtime(model, state, router_bias_rate=0.05, **kw)


def _train(rt, i, trained=True):
    """An importance-sampling step on this rank's half of batch i; `trained=False`: no token of it trained."""
    n, r = rt.state.mesh.size(), rt.state.mesh.get_local_rank()
    ids, adv = _batch(rt.model, i)
    half = slice(r * 4 // n, (r + 1) * 4 // n)
    batch = Batch(ids[half], loss_mask=torch.full(ids[half].shape, trained), advantages=adv[half],
                  sampler_logprobs=rt.forward(Batch(ids[half])).log_probs)
    rt.forward_backward(batch, "importance_sampling", loss_agg_mode="token-mean")
    return rt.optim_step()


def untrained_and_schedules(mesh, out: Path):
    """Both twins: a step after a batch that trains no token on any rank, then on one rank only; a
    second Runtime built on a state in learning-rate warm-up, and a resume of it."""
    from bumblebee.models import moe
    from bumblebee.runtime import LRSchedule
    r = mesh.get_local_rank()
    res = {}
    for impl in ("fsdp2", "zero1"):
        rt = _runtime(mesh, impl)
        got = {"first": _train(rt, 0)}  # moments that a wrongly applied step would move the weights by
        before = _snapshot(rt.state)
        got["none"] = _train(rt, 1, trained=False)
        after = _snapshot(rt.state)
        got["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
        got["counts_left"] = [n for n, x in moe.routers(rt.model).items() if x.tokens_per_expert is not None]
        got["one"] = _train(rt, 2, trained=r == 0)  # a token trained somewhere: every rank steps
        got["next"] = _train(rt, 3)  # the ranks still agree on every collective
        res[impl] = got
    sched = LRSchedule("linear_warmup", warmup_steps=4)
    first = _runtime(mesh, lr_schedule=sched)
    lrs = [first.hyperparameters()["lr"]]  # 0: the warm-up's first step
    _train(first, 0)
    lrs.append(first.lr_scheduler_step())
    second = Runtime(first.model, first.state, lr_schedule=sched)  # built while the optimizer's lr is LR / 4
    lrs.append(second.hyperparameters()["lr"])
    _train(second, 1)
    lrs.append(second.lr_scheduler_step())
    second.save_state(out / "lr-ckpt")
    resumed = _runtime(mesh, seed=5, lr_schedule=sched)
    resumed.load_state(out / "lr-ckpt")
    lrs += [resumed.hyperparameters()["lr"], resumed.lr_scheduler_step()]
    res["lrs"] = lrs
    return res


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    return spawn(2, "untrained_and_schedules", tmp_path_factory.mktemp("untrained"), module=__name__)


@pytest.mark.parametrize("impl", ["fsdp2", "zero1"])
def test_a_batch_that_trains_no_token_takes_no_step(untrained, impl):
    for rank in untrained:
        res = rank[impl]
        assert res["first"]["applied"] and res["first"]["step"] == 1
        assert res["none"]["applied"] is False and res["none"]["skipped"] == "no trained token"
        assert res["none"]["step"] == 1 and res["changed"] == []  # weights, moments, step counts, router biases
        assert res["counts_left"] == []  # its router counts do not move the biases at the next step
        assert res["one"]["applied"] and res["one"]["step"] == 2
        assert res["next"]["applied"] and res["next"]["step"] == 3


def test_a_runtime_built_during_warmup_keeps_the_base_learning_rate(untrained):
    # warm-up over 4 steps: lr 0, LR / 4 (first Runtime), LR / 4 (the second, built then), LR / 2,
    # and after a save and a load into a fresh state, LR / 2 and 3 LR / 4
    for rank in untrained:
        assert rank["lrs"] == pytest.approx([0.0, LR / 4, LR / 4, LR / 2, LR / 2, 3 * LR / 4], rel=1e-12)
