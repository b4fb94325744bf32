"""Typed implementation options: choosing, string parsing, binding and recording through the registry."""
import dataclasses
import inspect

import pytest

from bumblebee import models, registry
from bumblebee.options import Bound
from bumblebee.primitives.attention import SDPA, sdpa_attention
from bumblebee.primitives.cross_entropy import LinearCE, linear_cross_entropy
from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig


def test_a_name_a_string_and_an_instance_choose_the_same_way():
    assert registry.choose("cross_entropy", "linear_ce")[1] == LinearCE()
    assert registry.choose("cross_entropy", None)[1] == LinearCE()  # the slot's default
    impl, config = registry.choose("cross_entropy", "linear_ce:path=lean, budget_bytes=2GiB,chunk_columns=none")
    assert impl.name == "linear_ce" and config == LinearCE(path="lean", budget_bytes=2 << 30)
    assert registry.choose("cross_entropy", LinearCE(path="lean"))[1] == LinearCE(path="lean")
    assert registry.choose("cross_entropy", "linear_ce:grad_in_forward_rows=512,workspace_bytes=64MiB")[1] \
        == LinearCE(grad_in_forward_rows=512, workspace_bytes=64 << 20)
    twin = registry.get("cross_entropy", "materialized_ce")
    assert registry.choose("cross_entropy", "materialized_ce") == (twin, None)


@pytest.mark.parametrize("slot,choice,err,msg", [
    ("cross_entropy", "linear_ce:path=fast", ValueError,
     r"LinearCE.path must be one of 'auto', 'grad_in_forward', 'lean'; got 'fast'"),
    ("cross_entropy", "linear_ce:budget_gib=2", ValueError,
     r"linear_ce has no option 'budget_gib'; accepted: path, budget_bytes"),
    ("cross_entropy", "linear_ce:budget_bytes=2GB", ValueError,
     r"LinearCE.budget_bytes takes an integer \(optionally with KiB"),
    ("cross_entropy", "linear_ce:chunk_columns=0", ValueError,
     r"LinearCE.chunk_columns must be None or an int >= 1; got 0"),
    ("cross_entropy", "linear_ce:lean", ValueError, r"linear_ce options are field=value, got 'lean'"),
    ("cross_entropy", "materialized_ce:path=lean", ValueError,
     r"'materialized_ce' of slot 'cross_entropy' takes no options"),
    ("cross_entropy", "fused_ce:path=lean", ValueError,
     r"unknown implementation 'fused_ce' .* accepted: \['linear_ce'"),
    ("cross_entropy", 3, TypeError, r"slot 'cross_entropy' takes an implementation name or a config instance"),
    ("attention", "sdpa:fa4=fast", ValueError, r"SDPA.fa4 must be one of 'auto', 'on', 'off'; got 'fast'"),
    ("attention", "sdpa:varlen=maybe", ValueError, r"SDPA.varlen takes true or false \(or on/off\), got 'maybe'"),
    ("attention", "sdpa:lean_backward=off", ValueError, r"sdpa has no option 'lean_backward'; accepted: fa4, varlen"),
    ("mla", "flash:fused_rope=2", ValueError, r"FlashMLAConfig.fused_rope takes true or false"),
    ("mla", "flash:fa4=on", ValueError, r"FlashMLAConfig.fa4 must be one of 'auto', 'off'; got 'on'"),
    ("attention", FlashMLAConfig(), ValueError, r"unknown implementation 'flash' for slot 'attention'"),
])
def test_bad_choices_say_what_is_accepted(slot, choice, err, msg):
    with pytest.raises(err, match=msg):
        registry.choose(slot, choice)


def test_a_config_of_another_slot_is_refused():
    with pytest.raises(ValueError, match="unknown implementation 'linear_ce' for slot 'attention'"):
        registry.choose("attention", LinearCE())


def test_resolve_binds_the_config_and_keeps_the_twins_signature():
    fn = registry.resolve("cross_entropy", "linear_ce:path=lean")
    assert isinstance(fn, Bound) and fn.config == LinearCE(path="lean")
    twin = registry.resolve("cross_entropy", "materialized_ce")
    assert inspect.signature(fn) == inspect.signature(twin) == inspect.signature(linear_cross_entropy)
    assert linear_cross_entropy.config == LinearCE()  # a direct call runs the defaults


def test_spec_and_record():
    assert registry.spec("cross_entropy", LinearCE()) == "linear_ce"
    assert registry.spec("cross_entropy", "linear_ce:budget_bytes=1GiB,path=lean") == \
        "linear_ce:path=lean,budget_bytes=1073741824"
    assert registry.choose("cross_entropy", registry.spec("cross_entropy", LinearCE(chunk_columns=9)))[1] \
        == LinearCE(chunk_columns=9)
    assert registry.record("cross_entropy", "linear_ce:path=lean") == \
        {"impl": "linear_ce", **dataclasses.asdict(LinearCE(path="lean"))}
    assert registry.record("attention", "eager") == {"impl": "eager"}


def test_the_model_resolves_once_and_records_its_configs():
    m = models.build("qwen3-tiny", {"cross_entropy": "linear_ce:path=lean", "attention": "eager"})
    assert m.impl["cross_entropy"] == LinearCE(path="lean")  # parsed once, when the model is built
    assert m.loss_fn.config == LinearCE(path="lean")
    assert m.impl_configs() == {"attention": {"impl": "eager"},
                                "cross_entropy": {"impl": "linear_ce", **dataclasses.asdict(LinearCE(path="lean"))}}
    assert models.build("qwen3-tiny", {"cross_entropy": LinearCE(path="lean")}).impl_configs() == m.impl_configs() | {
        "attention": {"impl": "sdpa", **dataclasses.asdict(SDPA())}}
    assert models.build("qwen3-tiny").impl_configs()["cross_entropy"]["path"] == "auto"  # defaults too


@pytest.mark.parametrize("choice", ["sdpa:fa4=off", "sdpa: fa4 = off", SDPA(fa4="off")])
def test_attention_options_from_a_string_or_an_instance(choice):
    impl, config = registry.choose("attention", choice)
    assert impl.name == "sdpa" and config == SDPA(fa4="off", varlen=True)
    assert registry.spec("attention", choice) == "sdpa:fa4=off"
    assert registry.choose("attention", "sdpa")[1] == SDPA()
    assert registry.choose("attention", "sdpa:fa4=on,varlen=false")[1] == SDPA(fa4="on", varlen=False)


def test_the_models_pass_the_attention_and_mla_configs_to_their_layers():
    m = models.build("qwen3-tiny", {"attention": "sdpa:fa4=off,varlen=off"})
    assert {layer.self_attn.attend.config for layer in m.model.layers} == {SDPA(fa4="off", varlen=False)}
    assert m.impl_configs()["attention"] == {"impl": "sdpa", "fa4": "off", "varlen": False,
                                             "recompute_keep_bytes": SDPA.recompute_keep_bytes}
    d = models.build("deepseek-v3-tiny", {"mla": FlashMLAConfig(lean_backward=False, pad_v=True)})
    layers = [mod for mod in d.modules() if isinstance(mod, FlashMLA)]
    assert layers and {mod.options for mod in layers} == {FlashMLAConfig(lean_backward=False, pad_v=True)}
    assert d.impl_configs()["mla"] == {"impl": "flash", **dataclasses.asdict(FlashMLAConfig(lean_backward=False,
                                                                                           pad_v=True))}


def test_a_bound_module_class_keeps_the_twins_constructor():
    flash, naive = registry.resolve("mla", "flash:pad_v=on"), registry.resolve("mla", "naive")
    assert isinstance(flash, Bound) and registry.is_module(flash) and registry.is_module(naive)
    assert inspect.signature(flash) == inspect.signature(naive)
    assert not registry.is_module(sdpa_attention) and sdpa_attention.config == SDPA()


def test_every_config_class_is_frozen_documented_and_listed():
    text = registry.describe()
    for impls in registry.slots().values():
        for impl in impls.values():
            if impl.config is None:
                continue
            assert impl.config.__dataclass_params__.frozen and impl.config.impl_name == impl.name
            for f in dataclasses.fields(impl.config):
                assert f.metadata["doc"] and f"{f.name}={f.default!r}: " in text


def test_register_refuses_a_config_class_that_is_not_frozen_or_undocumented():
    @dataclasses.dataclass
    class Loose:
        impl_name = "x"
        a: int = 1

    with pytest.raises(TypeError, match="frozen dataclass"):
        registry.register("cross_entropy", "x", kind="baseline", config=Loose)

    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        impl_name = "x"
        a: int = 1

    with pytest.raises(TypeError, match="Undocumented.a needs a default and a doc"):
        registry.register("cross_entropy", "x", kind="baseline", config=Undocumented)
