"""The training-step peer's gated DeltaNet: `step_stacks.scope_deltanet_rule` runs transformers' rule call
inside our layers' marks, so where fla refuses its gated backward (Hopper, Triton < 3.7.1) fla's registry
hands the peer's backward the same dq/dk/dw/dg kernel as ours. On the CPU transformers' rule is its
torch path: marking it changes no value and no gradient, and the rule's backward runs inside `ours()`."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from bumblebee.primitives import linear_attention as la

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("transformers >= 5.2 needed for Qwen3.5", allow_module_level=True)
if importlib.util.find_spec("fla") is not None:  # transformers then binds fla's rule, which needs a GPU
    pytest.skip("flash-linear-attention is installed: transformers' DeltaNet runs it, not its torch path",
                allow_module_level=True)
_spec = importlib.util.spec_from_file_location(
    "training_step_stacks", Path(__file__).resolve().parents[2] / "benchmarks" / "training_step" / "step_stacks.py")
step_stacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_stacks)

MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"


class _Probe(torch.autograd.Function):
    """Identity on the rule's output that records, in its backward, whether that backward is ours."""
    seen: list[bool] = []

    @staticmethod
    def forward(ctx, o):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(la.ours())
        return grad


def _model(seed=0):
    from bumblebee.models import NAMED
    cfg = {k: v for k, v in NAMED["qwen3.5-moe-tiny"].items() if k != "model_type"}
    cfg.update(mtp_num_hidden_layers=0, output_router_logits=False)
    config = transformers.AutoConfig.for_model("qwen3_5_moe_text", **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_marked_rule_changes_nothing_and_its_backward_is_ours(monkeypatch):
    model = _model()
    module = sys.modules[MODULE]
    torch_rule = module.torch_chunk_gated_delta_rule
    ids = torch.randint(0, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(model, ids)

    def probed(query, key, value, **kwargs):
        out, final = torch_rule(query, key, value, **kwargs)
        return _Probe.apply(out), final
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", probed)  # restored after the test
    assert step_stacks.scope_deltanet_rule(model, la.scoped) == [MODULE]
    assert step_stacks.scope_deltanet_rule(model, la.scoped) == []  # marked once, not twice
    _Probe.seen.clear()
    loss, grads = _loss_and_grads(model, ids)
    linear_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    assert linear_layers > 0 and _Probe.seen == [True] * linear_layers
    assert not la.ours()  # the backward has left every rule
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want.keys() and all(torch.equal(grads[n], want[n]) for n in want)


def test_marked_rule_passes_transformers_keywords_and_the_final_state(monkeypatch):
    """The call transformers makes: g, beta and the rest as keywords; (output, final state) back."""
    module = sys.modules[MODULE]
    got = {}

    def rule(q, k, v, *, g, beta, **kwargs):
        got.update(kwargs)
        return q * v.sum() + g.sum() + beta.sum(), torch.ones(2)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", rule)
    model = _model()
    assert step_stacks.scope_deltanet_rule(model, la.scoped) == [MODULE]
    q, k, v, g, beta = (torch.randn(1, 5, 2, 4, requires_grad=True) for _ in range(5))
    out, final = module.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                     cu_seqlens=None)
    assert got == {"initial_state": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True,
                   "cu_seqlens": None}
    assert torch.equal(final, torch.ones(2))
    assert torch.equal(out, q * v.sum() + g.sum() + beta.sum())
    out.sum().backward()
    assert all(t.grad is not None for t in (q, v, g, beta))


def test_a_transformers_without_the_rule_global_is_refused_by_name(monkeypatch):
    model = _model()
    monkeypatch.delattr(sys.modules[MODULE], "torch_chunk_gated_delta_rule")
    with pytest.raises(RuntimeError, match="torch_chunk_gated_delta_rule"):
        step_stacks.scope_deltanet_rule(model, la.scoped)

