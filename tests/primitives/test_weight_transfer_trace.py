"""Layout inference by tracing (primitives/weight_transfer/trace.py): the traced spec equals the
value-probed one (infer_layout(trace=False), the reference path) for every receiver of the suite;
a numeric transform hidden in one non-representative layer is still refused; tensors the trace
cannot follow are value-probed; targets on meta or never-touched memory work; a cached spec whose
loader changed in one layer is dropped."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from bumblebee.primitives.weight_transfer import LayoutCache, LayoutError, infer_layout
from bumblebee.primitives.weight_transfer.infer import _ALLOWED, _representatives
from bumblebee.primitives.weight_transfer.spec import manifest_of
from bumblebee.primitives.weight_transfer.trace import Trace
from bumblebee.runtime import export
from tests.primitives.weight_transfer_engines import HFReceiver, VllmStyleEngine, vllm_spec


def _manifest(name):
    """The HF tensors of the named tiny model, from a model built on meta (no weights needed)."""
    hf = models.NAMED[name]
    cls = models._model_class(hf)
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf(hf), None)
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    return manifest_of((h, size, torch.float32) for lst in export.hf_layout(model, shapes).values()
                       for h, size, *_ in lst)


def _counted(load, calls):
    def counted(w):
        calls.append(1)
        return load(w)
    return counted


@pytest.mark.parametrize("name,kw,dtype", [
    ("qwen3-tiny", dict(tp_rank=3, tp_size=4), torch.bfloat16),  # replicated KV heads
    ("deepseek-v3-tiny", dict(tp_rank=1, tp_size=2, ep_rank=0, ep_size=2), torch.float32),
    ("qwen3.5-moe-tiny", dict(), torch.float32)])  # in_proj_qkv's q, k, v copied apart: joined into one box
def test_traced_spec_equals_the_value_probed_one(name, kw, dtype):
    man = _manifest(name)
    eng = VllmStyleEngine(man, models.NAMED[name], dtype=dtype, **kw)
    before = {k: v.clone() for k, v in eng.params.items()}
    fast = infer_layout(eng.load_weights, eng.params, man)
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())  # targets restored
    assert fast == infer_layout(eng.load_weights, eng.params, man, trace=False, verify=False)
    tr = Trace(eng.params, man, _ALLOWED, LayoutError).run(eng.load_weights)
    assert not tr.impure and len(_representatives(tr)) < len(man) // 2  # layers and experts share signatures


def test_transformers_model_traced_equals_value_probed():
    import transformers
    cfg = dict(models.NAMED["qwen3-tiny"])
    cfg.pop("model_type")
    rec = HFReceiver(transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg)))
    man = manifest_of((n, tuple(p.shape), p.dtype) for n, p in rec.params.items())
    want = infer_layout(rec.load_weights, rec.params, man, trace=False, verify=False)
    assert infer_layout(rec.load_weights, rec.params, man) == want


class _OneLayerTransforms(VllmStyleEngine):
    """A vLLM-style loader that computes on one tensor of the last layer only (never the first
    tensor of its signature, so never a representative)."""

    def __init__(self, man, how, layer):
        super().__init__(man, models.NAMED["qwen3-moe-tiny"])
        self.how, self.hit = how, f"model.layers.{layer}.mlp.experts.5.down_proj.weight"

    def load_weights(self, weights):
        def gen():
            for n, w in weights:
                if n == self.hit and self.how == "scale":
                    w = w * 2
                elif n == self.hit and self.how == "add":
                    w = w + w  # two inputs into one element
                yield n, w
        super().load_weights(gen())
        if self.how == "scale_target":
            self.params[self.hit.replace("5.down_proj.weight", "w2_weight")][5].mul_(3)


@pytest.mark.parametrize("how,op", [("scale", "mul"), ("scale_target", None), ("add", "add")])
def test_transform_in_a_non_representative_layer_is_refused(how, op):
    man = _manifest("qwen3-moe-tiny")
    layers = models.NAMED["qwen3-moe-tiny"]["num_hidden_layers"]
    eng = _OneLayerTransforms(man, how, layers - 1)
    before = {k: v.clone() for k, v in eng.params.items()}
    with pytest.raises(LayoutError) as e:
        infer_layout(eng.load_weights, eng.params, man)
    msg = str(e.value)
    assert op is None or (eng.hit in msg and repr(op) in msg), msg
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())  # targets restored


class _Stacking(VllmStyleEngine):
    """gate and up concatenated by the loader before one copy (a new storage): not traceable,
    so those tensors are value-probed; everything else stays traced."""

    def load_weights(self, weights):
        held = {}
        rest = []
        for n, w in weights:
            if ".mlp.gate_proj." in n or ".mlp.up_proj." in n:
                held[n] = w
            else:
                rest.append((n, w))
        super().load_weights(iter(rest))
        for n in [n for n in held if ".gate_proj." in n]:
            fused = self.params[n.replace("gate_proj", "gate_up_proj")]
            fused.data.copy_(torch.cat([held[n], held[n.replace("gate_proj", "up_proj")]]))


def test_untraceable_tensors_are_value_probed():
    man = _manifest("qwen3-tiny")
    eng = _Stacking(man, models.NAMED["qwen3-tiny"])
    for t in eng.params.values():
        t.normal_()  # prior values the checks must compare against and give back
    before = {k: v.clone() for k, v in eng.params.items()}
    calls = []
    fast = infer_layout(_counted(eng.load_weights, calls), eng.params, man)
    n_fast = len(calls)
    assert fast == infer_layout(eng.load_weights, eng.params, man, trace=False)  # checked too
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())
    tr = Trace(eng.params, man, _ALLOWED, LayoutError).run(eng.load_weights)
    assert {man[i][0] for i in tr.impure} == {n for n, *_ in man if ".gate_proj." in n or ".up_proj." in n}
    assert n_fast == 3  # the trace, one digit pass (this subset's indices fit fp32's 24 bits), the check


def test_meta_and_untouched_targets():
    """An engine on meta is traced without a value (verify needs values and says so); an engine on
    empty host memory gets the same spec, checked, and its untouched pages are not cloned."""
    man = _manifest("qwen3-moe-tiny")
    cfg, kw = models.NAMED["qwen3-moe-tiny"], dict(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    meta = VllmStyleEngine(man, cfg, device="meta", **kw)
    with pytest.raises(ValueError, match="verify=False"):
        infer_layout(meta.load_weights, meta.params, man)
    got = infer_layout(meta.load_weights, meta.params, man, verify=False)
    want, _ = vllm_spec(man, cfg, **kw)
    assert sorted(got.pieces, key=repr) == sorted(want.pieces, key=repr)
    real = VllmStyleEngine(man, cfg, **kw)
    assert infer_layout(real.load_weights, real.params, man).pieces == got.pieces


def test_cached_spec_dropped_when_one_layer_moves():
    man = _manifest("qwen3-moe-tiny")
    cfg = models.NAMED["qwen3-moe-tiny"]
    eng = VllmStyleEngine(man, cfg, tp_rank=1, tp_size=2)
    cache = LayoutCache()
    spec = infer_layout(eng.load_weights, eng.params, man, key="k", cache=cache)

    class Moved(VllmStyleEngine):  # the last layer's o_proj columns taken from rank 0's half
        def _row_loader(self, param, w):
            if "layers.1." in getattr(self, "_now", ""):
                return param.data.copy_(w.narrow(1, 0, param.shape[1]))
            return super()._row_loader(param, w)

        def load_weights(self, weights):
            def gen():
                for n, w in weights:
                    self._now = n
                    yield n, w
            return super().load_weights(gen())
    moved = Moved(man, cfg, tp_rank=1, tp_size=2)
    again = infer_layout(moved.load_weights, moved.params, man, key="k", cache=cache)
    assert cache.hits == 0 and cache.misses == 2 and again != spec
    assert again == infer_layout(moved.load_weights, moved.params, man, trace=False, verify=False)
