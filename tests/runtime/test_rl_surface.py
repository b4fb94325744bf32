"""The runtime's RL surface in one process: micro-batching (padded and packed), the KL estimators
and aggregation modes against references on the materialized logits in float64, caller loss
functions, router replay, schedules against transformers', modes, offload bookkeeping, weight
export against save_pretrained, and bad input. Multi-rank cases: tests/runtime/test_rl_ranks.py."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from bumblebee.runtime import Batch, LRSchedule, Runtime, aggregate, kl_penalty
from tests.runtime.test_runtime import _grads, _reference


def _model(name="qwen3-moe-tiny"):
    return models.build(name, seed=0, dtype=torch.float64)


def _data(model, b=4, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    noise = [0.3 * torch.randn(b, t, generator=g, dtype=torch.float64) for _ in range(2)]
    return ids, mask, adv, noise


def _packed(batch: Batch, cu) -> Batch:
    flat = {k: (getattr(batch, k).reshape(1, -1) if getattr(batch, k) is not None else None)
            for k in ("input_ids", "loss_mask", "advantages", "sampler_logprobs", "ref_logprobs")}
    return Batch(**flat, cu_seqlens=torch.tensor(cu))


def _kl_ref(lp, ref, name):
    d = lp - ref
    if name in ("kl", "k1"):
        return d
    if name in ("mse", "k2"):
        return d * d / 2
    return torch.exp(-d) + d - 1  # k3 (no clamp reached at these values)


def _agg_ref(x, mask, mode):
    """verl's agg_loss on one global batch: masked token mean, or per-row sums / means averaged over
    rows with a trained token."""
    m = mask.to(x.dtype)
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    rows = m.sum(-1) > 0
    per = (x * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per = per / m.sum(-1).clamp_min(1)
    return per[rows].sum() / rows.sum()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl", ["k1", "mse", "low_var_kl"])
def test_ppo_with_kl_and_aggregation_against_logits(mode, kl):
    model = _model()
    ids, mask, adv, (n1, n2) = _data(model)
    with torch.no_grad():
        lp0, _ = _reference(model, ids)
    old, ref = lp0 + n1, lp0 + n2
    lp, ent = _reference(model, ids)
    trained = mask.clone()
    trained[:, 0] = False
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    per = pg + 0.1 * _kl_ref(lp, ref, kl) - 0.01 * ent
    want_loss = _agg_ref(per, trained, mode)
    want_loss.backward()
    want = _grads(model)
    model.zero_grad()
    batch = Batch(ids, loss_mask=mask, advantages=adv, sampler_logprobs=old, ref_logprobs=ref)
    for mbt in (None, 18, 9):  # 1, 2 and 4 micro-batches
        out = Runtime(model).forward_backward(batch, "ppo", clip=(0.2, 0.28), kl_coef=0.1, kl_penalty=kl,
                                              entropy_coef=0.01, loss_agg_mode=mode, micro_batch_tokens=mbt)
        assert out.loss == pytest.approx(want_loss.item(), rel=1e-9)
        assert out.metrics["tokens"] == int(trained.sum()) and "kl" in out.metrics
        for k, g in _grads(model).items():
            torch.testing.assert_close(g, want[k], rtol=1e-8, atol=1e-12, msg=f"{mbt} {k}")
        model.zero_grad()


def test_kl_estimators_and_aggregate_directly():
    g = torch.Generator().manual_seed(5)
    lp, ref = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3, -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    for name in ("kl", "k1", "mse", "k2", "low_var_kl", "k3"):
        torch.testing.assert_close(kl_penalty(lp, ref, name), _kl_ref(lp, ref, name), rtol=1e-12, atol=1e-12)
    far = kl_penalty(torch.zeros(1), torch.full((1,), 50.0), "k3")  # verl's guards: log-ratio and value clamped
    assert far.item() == 10.0
    from bumblebee.runtime import Norm
    x, mask = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.rand(3, 7, generator=g) < 0.6
    seq = torch.arange(3)[:, None].expand(3, 7)
    rows = int((mask.sum(-1) > 0).sum())
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        got = aggregate(x, torch.ones_like(x), mask, mode, Norm(int(mask.sum()), rows, seq))
        torch.testing.assert_close(got, _agg_ref(x, mask, mode), rtol=1e-12, atol=1e-12)


def test_packed_micro_batches_give_one_gradient():
    model = _model("deepseek-v3-tiny")
    ids, mask, adv, (n1, _) = _data(model, b=1, t=41)
    cu = [0, 5, 13, 20, 33, 41]
    batch = Batch(ids, loss_mask=mask, advantages=adv, sampler_logprobs=n1 - 2, cu_seqlens=torch.tensor(cu))
    rt, got = Runtime(model), {}
    for mbt in (None, 21, 13):
        out = rt.forward_backward(batch, "importance_sampling", loss_agg_mode="seq-mean-token-mean",
                                  micro_batch_tokens=mbt, entropy=True)
        got[mbt] = (_grads(model), out)
        model.zero_grad()
    for mbt in (21, 13):
        torch.testing.assert_close(got[mbt][1].log_probs, got[None][1].log_probs, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[mbt][1].entropy, got[None][1].entropy, rtol=1e-10, atol=1e-12)
        for k, g in got[None][0].items():
            torch.testing.assert_close(got[mbt][0][k], g, rtol=1e-9, atol=1e-12, msg=k)


def test_caller_loss_fn_equals_the_named_loss():
    model = _model()
    ids, mask, adv, (n1, _) = _data(model)
    batch = Batch(ids, loss_mask=mask, advantages=adv, sampler_logprobs=n1)
    rt = Runtime(model)
    named = rt.forward_backward(batch, "importance_sampling", loss_agg_mode="token-mean", micro_batch_tokens=18)
    want = _grads(model)
    model.zero_grad()
    seen = []

    def loss_fn(model_output, data, dp_group):
        seen.append((data.micro_batch, data.micro_batches, dp_group))
        lp, b = model_output["log_probs"], data.batch
        term = -torch.exp(lp - b.sampler_logprobs) * b.advantages
        return aggregate(term, torch.ones_like(term), data.trained, "token-mean", data.norm), {"n": 1}

    out = rt.forward_backward(batch, loss_fn, micro_batch_tokens=18)
    assert seen == [(0, 2, None), (1, 2, None)] and out.metrics == {"n": [1, 1]}
    assert out.loss == pytest.approx(named.loss, rel=1e-12)
    for k, g in _grads(model).items():
        torch.testing.assert_close(g, want[k], rtol=1e-12, atol=1e-14, msg=k)


def test_routed_experts_are_recorded_and_replayed():
    model = _model()
    ids, *_ = _data(model)
    rt = Runtime(model)
    rec = rt.forward(Batch(ids), return_routed_experts=True, micro_batch_tokens=18)
    assert rec.routed_experts.shape == (4, 9, 2, 2)
    from bumblebee.models import moe
    with torch.no_grad():  # other router weights: fresh routing differs, replay keeps the experts
        for r in moe.routers(model).values():
            r.weight.add_(torch.randn_like(r.weight))
    fresh = rt.forward(Batch(ids), return_routed_experts=True)
    replayed = rt.forward(Batch(ids, routed_experts=rec.routed_experts), return_routed_experts=True)
    assert not torch.equal(fresh.routed_experts, rec.routed_experts)
    assert torch.equal(replayed.routed_experts, rec.routed_experts)
    assert all(r.mode is None for r in moe.routers(model).values())  # routers left as found
    with pytest.raises(ValueError, match=r"routed_experts must be \[B, T, layers=2, k=2\]"):
        rt.forward(Batch(ids, routed_experts=rec.routed_experts[:, :, :1]))


@pytest.mark.parametrize("kind", ["linear_warmup", "linear", "cosine"])
def test_schedules_match_transformers(kind):
    import transformers
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    if kind == "linear_warmup":
        ref, ours = transformers.get_constant_schedule_with_warmup(opt, 3), LRSchedule(kind, warmup_steps=3)
    elif kind == "linear":
        ref, ours = transformers.get_linear_schedule_with_warmup(opt, 3, 11), LRSchedule(kind, 3, 11)
    else:
        ref = transformers.get_cosine_with_min_lr_schedule_with_warmup(opt, 3, 11, min_lr_rate=0.1)
        ours = LRSchedule(kind, 3, 11, min_lr_ratio=0.1)
    for step in range(12):  # to total_steps (beyond it ours holds the last value, transformers cycles on)
        assert 2.0 * ours.factor(step) == pytest.approx(ref.get_last_lr()[0], rel=1e-12, abs=1e-15), step
        opt.step()
        ref.step()


def test_modes_are_restored():
    model = _model("qwen3-tiny").eval()
    rt = Runtime(model)
    with rt.train_mode():
        assert all(m.training for m in model.modules())
        with rt.eval_mode():
            assert not any(m.training for m in model.modules())
        assert model.training
    assert not any(m.training for m in model.modules())


def test_offload_round_trip_without_state():
    model = _model("qwen3-tiny")
    ids, mask, *_ = _data(model)
    rt = Runtime(model)
    rt.forward_backward(Batch(ids, loss_mask=mask))
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    rt.to("cpu", copy=True, model=True, grad=False)  # parameters on new storage, gradients kept aside
    assert all(p.data_ptr() != ptrs[n] for n, p in model.named_parameters())
    rt.to("cpu", copy=True, model=False, grad=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n


EXPORTED = {  # MLA, aux-free routers (fp32 biases), MTP depths: the export holds copies of embedding and head
    "deepseek-v3-mtp": {**models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1},
    "qwen3.5-moe": "qwen3.5-moe-tiny",  # renamed MTP keys, shared expert gate
    "qwen3-tied": {**models.NAMED["qwen3-tiny"], "tie_word_embeddings": True},  # the head stored once
}


@pytest.mark.parametrize("name", EXPORTED)
def test_export_equals_save_pretrained(tmp_path, name):
    from safetensors.torch import load_file
    model = models.build(EXPORTED[name], seed=0)
    rt = Runtime(model)
    rt.save_weights(tmp_path)
    want = load_file(tmp_path / "model.safetensors")
    got = dict(rt.export_weights(bucket_bytes=50_000))
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for s in rt.export_weight_shards():
        assert s.shape == tuple(want[s.name].shape) and torch.equal(want[s.name][s.slices], s.tensor), s.name


def test_bad_input():
    model = _model()
    ids, *_ = _data(model)
    rt = Runtime(model)
    with pytest.raises(ValueError, match=r"micro_batch_tokens=8 is smaller than the batch's longest sequence \(9"):
        rt.forward_backward(Batch(ids), micro_batch_tokens=8)
    with pytest.raises(ValueError, match="micro_batch_tokens must be an int > 0"):
        rt.forward(Batch(ids), micro_batch_tokens=0)
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        rt.forward_backward(Batch(ids), "ppo", kl_penalty="k4")
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        rt.forward_backward(Batch(ids), loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match="kl_coef > 0 needs batch.ref_logprobs"):
        rt.forward_backward(Batch(ids), kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_fn must be a loss name"):
        rt.forward_backward(Batch(ids), 3)
    with pytest.raises(ValueError, match="batch.routed_experts must be an int"):
        rt.forward(Batch(ids, routed_experts=torch.zeros(4, 9, 2)))
    with pytest.raises(ValueError, match="LRSchedule 'cosine' needs total_steps"):
        LRSchedule("cosine", warmup_steps=3)
    with pytest.raises(ValueError, match="LRSchedule name must be one of"):
        LRSchedule("step")
    with pytest.raises(ValueError, match="bucket_bytes must be an int > 0"):
        next(rt.export_weights(bucket_bytes=0))
    dense = Runtime(_model("qwen3-tiny"))
    with pytest.raises(ValueError, match="has no MoE router"):
        dense.forward(Batch(ids), return_routed_experts=True)
