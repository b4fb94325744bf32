"""Typed implementation options: choosing, string parsing, binding and recording through the registry."""
import dataclasses
import inspect

import pytest

from bumblebee import models, registry
from bumblebee.options import Bound
from bumblebee.primitives.cross_entropy import LinearCE, linear_cross_entropy


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


@pytest.mark.parametrize("choice,err,msg", [
    ("linear_ce:path=fast", ValueError, r"LinearCE.path must be one of 'auto', 'grad_in_forward', 'lean'; got 'fast'"),
    ("linear_ce:budget_gib=2", ValueError, r"linear_ce has no option 'budget_gib'; accepted: path, budget_bytes"),
    ("linear_ce:budget_bytes=2GB", ValueError, r"LinearCE.budget_bytes takes an integer \(optionally with KiB"),
    ("linear_ce:chunk_columns=0", ValueError, r"LinearCE.chunk_columns must be None or an int >= 1; got 0"),
    ("linear_ce:lean", ValueError, r"linear_ce options are field=value, got 'lean'"),
    ("materialized_ce:path=lean", ValueError, r"'materialized_ce' of slot 'cross_entropy' takes no options"),
    ("fused_ce:path=lean", ValueError, r"unknown implementation 'fused_ce' .* accepted: \['linear_ce'"),
    (3, TypeError, r"slot 'cross_entropy' takes an implementation name or a config instance"),
])
def test_bad_choices_say_what_is_accepted(choice, err, msg):
    with pytest.raises(err, match=msg):
        registry.choose("cross_entropy", choice)


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
        "attention": {"impl": "sdpa"}}
    assert models.build("qwen3-tiny").impl_configs()["cross_entropy"]["path"] == "auto"  # defaults too


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
