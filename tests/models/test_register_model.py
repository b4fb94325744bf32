"""bumblebee.register_model: a family registered from outside loads, builds and trains like a shipped one."""
import pytest
import torch

import bumblebee as bb
from bumblebee.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


class MyQwen3(Qwen3ForCausalLM):
    """An outside family: Qwen3's layers under another model_type."""


@pytest.fixture(autouse=True)
def _families_restored(monkeypatch):
    """What a test registers leaves with it: the shipped families stay the process's only ones."""
    from bumblebee import model_registry

    for table in ("_FAMILIES", "_BY_TYPE"):
        monkeypatch.setattr(model_registry, table, dict(getattr(model_registry, table)))


def test_registered_family_builds_and_trains(tmp_path):
    assert "my_qwen3" not in bb.models.MODEL_TYPES
    bb.register_model("my_qwen3", MyQwen3, Qwen3Config, hf_model_types=["my_qwen3"])
    assert bb.models.MODEL_TYPES["my_qwen3"] is MyQwen3  # the table is read live: later families are in it
    hf = {**bb.models.NAMED["qwen3-tiny"], "model_type": "my_qwen3"}
    model = bb.models.build(hf, seed=0)
    assert type(model) is MyQwen3
    ids = torch.randint(0, hf["vocab_size"], (2, 9))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert "my_qwen3" in bb.models.describe() and "attention, cross_entropy" in bb.models.describe()


def test_unknown_model_type_lists_the_registered_families():
    with pytest.raises(ValueError, match="registered models: qwen3 \\(qwen3\\).*register_model"):
        bb.models.build({**bb.models.NAMED["qwen3-tiny"], "model_type": "llama"})


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match="already served"):
        bb.register_model("other", MyQwen3, Qwen3Config, hf_model_types=["qwen3"])
    with pytest.raises(TypeError, match="from_hf"):
        bb.register_model("nocfg", MyQwen3, dict, hf_model_types=["nocfg"])
    with pytest.raises(ValueError, match="config_class"):
        from bumblebee.models.qwen3_moe import Qwen3MoeConfig
        bb.register_model("mismatch", MyQwen3, Qwen3MoeConfig, hf_model_types=["mismatch"])


@pytest.mark.parametrize("name, router", [("deepseek-v3-tiny", "aux_free"), ("qwen3-moe-tiny", "softmax_fused")])
def test_impl_configs_record_the_router_each_family_runs(name, router):
    """The router default depends on the family's scoring (sigmoid: aux_free, softmax: softmax_fused):
    the record names the one the model's routers run, not the registry's one default."""
    model = bb.models.build(name)
    assert model.impl_configs()["router"]["impl"] == router
    routes = [m.route for m in model.modules() if hasattr(m, "route")]
    assert routes and all(r is bb.registry.resolve("router", router) for r in routes)
