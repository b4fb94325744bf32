"""Receiver layout inference (primitives/weight_transfer/infer.py): specs recovered from the
engine's own load_weights equal hand-written ones for a vLLM-style engine and for transformers'
model, replay load_weights bit for bit (Qwen3.5's in_proj_qkvz / conv, DeepSeek-V3's fused
kv_a_proj_with_mqa, a bf16 engine fed fp32), loaders that compute are refused naming the tensor and
the operation, and the cache never serves a stale layout."""
from __future__ import annotations

import pytest
import torch

from bumblebee import models
from bumblebee.primitives.weight_transfer import LayoutCache, LayoutError, infer_layout
from bumblebee.primitives.weight_transfer.spec import Piece, manifest_of
from bumblebee.runtime import export
from tests.primitives.weight_transfer_engines import HFReceiver, VllmStyleEngine, vllm_spec

ODD_VOCAB = {**models.NAMED["qwen3-moe-tiny"], "vocab_size": 1000}


def _full(config, seed=0):
    m = models.build(config, seed=seed)
    return {k: v.clone() for k, v in export.export_weights(m, None, bucket_bytes=1 << 30)}


def _manifest(full):
    return manifest_of((n, t.shape, t.dtype) for n, t in full.items())


def _pieces(spec, name):
    return [p for p in spec.pieces if p.hf_name == name]


def test_vllm_style_spec_equals_hand_written():
    full = _full(ODD_VOCAB)
    man = _manifest(full)
    eng = VllmStyleEngine(man, ODD_VOCAB, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    spec = infer_layout(eng.load_weights, eng.params, man, key="tp1/2-ep1/2")
    a = "model.layers.0.self_attn"
    qkv = f"{a}.qkv_proj.weight"
    # q rows 32..63 of 64 (4 heads x 16 / TP 2), then k and v rows 16..31 of 32 each, stacked
    assert _pieces(spec, f"{a}.q_proj.weight") == [Piece(f"{a}.q_proj.weight", ((32, 1, 32), (0, 1, 64)), qkv, (64, 1), 0)]
    assert _pieces(spec, f"{a}.k_proj.weight") == [Piece(f"{a}.k_proj.weight", ((16, 1, 16), (0, 1, 64)), qkv, (64, 1), 32 * 64)]
    assert _pieces(spec, f"{a}.v_proj.weight") == [Piece(f"{a}.v_proj.weight", ((16, 1, 16), (0, 1, 64)), qkv, (64, 1), 48 * 64)]
    # row parallel: columns 32..63
    o = f"{a}.o_proj.weight"
    assert _pieces(spec, o) == [Piece(o, ((0, 1, 64), (32, 1, 32)), o, (32, 1), 0)]
    # vocabulary padded to 2 x 512 rows: rank 1 keeps rows 512..999, its last 24 rows are padding
    e = "model.embed_tokens.weight"
    assert _pieces(spec, e) == [Piece(e, ((512, 1, 488), (0, 1, 64)), e, (64, 1), 0)]
    # EP rank 1 of 2 holds experts 4..7: expert 5's gate and up land in w13[1], down in w2[1]
    x = "model.layers.1.mlp.experts"
    assert _pieces(spec, f"{x}.5.gate_proj.weight") == [
        Piece(f"{x}.5.gate_proj.weight", ((0, 1, 32), (0, 1, 64)), f"{x}.w13_weight", (64, 1), 64 * 64)]
    assert _pieces(spec, f"{x}.5.up_proj.weight") == [
        Piece(f"{x}.5.up_proj.weight", ((0, 1, 32), (0, 1, 64)), f"{x}.w13_weight", (64, 1), 64 * 64 + 32 * 64)]
    assert _pieces(spec, f"{x}.5.down_proj.weight") == [
        Piece(f"{x}.5.down_proj.weight", ((0, 1, 64), (0, 1, 32)), f"{x}.w2_weight", (32, 1), 64 * 32)]
    assert _pieces(spec, f"{x}.2.down_proj.weight") == []  # EP rank 0's expert: never sent here
    # renamed and replicated
    n = "model.layers.0.post_attention_layernorm.weight"
    assert _pieces(spec, n) == [Piece(n, ((0, 1, 64),), "model.layers.0.pre_mlp_norm.weight", (1,), 0)]
    # and the whole spec replays the loader on the real checkpoint
    ref = VllmStyleEngine(man, ODD_VOCAB, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    ref.load_weights(iter(full.items()))
    spec.apply(full, eng.params)
    for k in ref.params:
        assert torch.equal(eng.params[k], ref.params[k]), k


@pytest.mark.parametrize("name,kw", [("qwen3-tiny", dict(tp_rank=3, tp_size=4)),  # 2 KV heads over TP 4: replicas
                                     ("deepseek-v3-tiny", dict(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2))])
def test_inferred_spec_equals_the_hand_written_one_whole(name, kw):
    man = _manifest(_full(name))
    eng = VllmStyleEngine(man, models.NAMED[name], **kw)
    got = infer_layout(eng.load_weights, eng.params, man, verify=False)
    want, _ = vllm_spec(man, models.NAMED[name], **kw)
    assert sorted(got.pieces, key=repr) == sorted(want.pieces, key=repr)


def test_transformers_model_spec_is_identity():
    import transformers
    cfg = dict(models.NAMED["qwen3-tiny"])
    cfg.pop("model_type")
    rec = HFReceiver(transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg)))
    full = _full("qwen3-tiny")
    man = _manifest(full)
    spec = infer_layout(rec.load_weights, rec.params, man)
    want = [Piece(n, tuple((0, 1, s) for s in shape), n, tuple(torch.empty(shape).stride()), 0) for n, shape, _ in man]
    assert sorted(spec.pieces, key=lambda p: p.hf_name) == sorted(want, key=lambda p: p.hf_name)


@pytest.mark.parametrize("name,tp_rank,ep", [("qwen3.5-moe-tiny", 1, False), ("deepseek-v3-tiny", 0, True)])
def test_fused_layouts_replay_load_weights(name, tp_rank, ep):
    """Qwen3.5's in_proj_qkvz (q, k, v each split over TP: three boxes of one HF tensor) and conv1d,
    DeepSeek-V3's fused_qkv_a_proj (q_a_proj and kv_a_proj_with_mqa stacked, replicated)."""
    full = _full(name)
    man = _manifest(full)
    kw = dict(tp_rank=tp_rank, tp_size=2, ep_rank=tp_rank if ep else 0, ep_size=2 if ep else 1)
    eng, ref = VllmStyleEngine(man, models.NAMED[name], **kw), VllmStyleEngine(man, models.NAMED[name], **kw)
    spec = infer_layout(eng.load_weights, eng.params, man)  # verify=True: checked against a real call
    ref.load_weights(iter(full.items()))
    spec.apply(full, eng.params)
    for k in ref.params:
        assert torch.equal(eng.params[k], ref.params[k]), k
    if name.startswith("qwen3.5"):
        qkv = _pieces(spec, "model.layers.0.linear_attn.in_proj_qkv.weight")
        assert [p.box[0] for p in qkv] == [(8, 1, 8), (24, 1, 8), (56, 1, 24)]  # q, k, v halves of rank 1
    else:
        kv = _pieces(spec, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
        assert kv == [Piece(kv[0].hf_name, ((0, 1, 40), (0, 1, 64)), "model.layers.0.self_attn.fused_qkv_a_proj.weight",
                            (64, 1), 48 * 64)]


def test_bf16_engine_fed_fp32_is_a_cast():
    full = _full("qwen3-tiny")
    man = _manifest(full)
    eng = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=0, tp_size=2, dtype=torch.bfloat16)
    ref = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=0, tp_size=2, dtype=torch.bfloat16)
    spec = infer_layout(eng.load_weights, eng.params, man)
    ref.load_weights(iter(full.items()))
    spec.apply(full, eng.params)
    assert all(torch.equal(eng.params[k], ref.params[k]) for k in ref.params)


class _Transforming(VllmStyleEngine):
    def __init__(self, man, how):
        super().__init__(man, models.NAMED["qwen3-tiny"])
        self.how = how

    def load_weights(self, weights):
        items = list(weights)
        if self.how == "scale":
            items = [(n, w * 2 if n == "model.norm.weight" else w) for n, w in items]
        elif self.how == "add":
            d = dict(items)
            d["model.layers.0.mlp.gate_proj.weight"] = d["model.layers.0.mlp.gate_proj.weight"] + d[
                "model.layers.0.mlp.up_proj.weight"]
            items = list(d.items())
        elif self.how == "quantize":
            items = [(n, (w / 0.5).round() if n == "lm_head.weight" else w) for n, w in items]
        super().load_weights(iter(items))
        if self.how == "scale_in_place":  # after the copy, on the parameter itself: no probe in sight
            self.params["model.norm.weight"].mul_(3)


@pytest.mark.parametrize("how,op,tensor", [("scale", "mul", "model.norm.weight"),
                                           ("add", "add", "model.layers.0.mlp.gate_proj.weight"),
                                           ("quantize", "div", "lm_head.weight"),
                                           ("scale_in_place", None, "model.norm.weight")])
def test_loaders_that_compute_are_refused(how, op, tensor):
    man = _manifest(_full("qwen3-tiny"))
    eng = _Transforming(man, how)
    before = {k: v.clone() for k, v in eng.params.items()}
    with pytest.raises(LayoutError) as e:
        infer_layout(eng.load_weights, eng.params, man)
    assert tensor in str(e.value) and (op is None or repr(op) in str(e.value)), str(e.value)
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())  # targets restored


def test_cache_is_keyed_by_layout_and_never_stale():
    full = _full("qwen3-tiny")
    man = _manifest(full)
    cache, calls = LayoutCache(), []

    def counted(eng):
        def load(w):
            calls.append(1)
            return eng.load_weights(w)
        return load

    r0 = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=0, tp_size=2)
    r1 = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=1, tp_size=2)
    s0 = infer_layout(counted(r0), r0.params, man, key="k", cache=cache)
    assert len(calls) == 2  # one traced call on meta probes, one check of the representatives
    assert infer_layout(counted(r0), r0.params, man, key="k", cache=cache) == s0
    assert cache.hits == 1 and len(calls) == 4  # a hit: the trace again (compared) and the check
    # rank 1 under the same key: the same shapes and code, another layout; the check refuses the
    # cached spec and the layout is inferred again
    s1 = infer_layout(counted(r1), r1.params, man, key="k", cache=cache)
    assert s1 != s0 and cache.misses == 2
    ref = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=1, tp_size=2)
    ref.load_weights(iter(full.items()))
    s1.apply(full, r1.params)
    assert all(torch.equal(r1.params[k], ref.params[k]) for k in ref.params)


def test_given_spec_is_checked_by_one_call_and_a_wrong_one_refused():
    man = _manifest(_full("qwen3-tiny"))
    cfg = models.NAMED["qwen3-tiny"]
    eng = VllmStyleEngine(man, cfg, tp_rank=1, tp_size=2)
    calls = []

    def load(w):
        calls.append(1)
        return eng.load_weights(w)
    before = {k: v.clone() for k, v in eng.params.items()}
    want, _ = vllm_spec(man, cfg, tp_rank=1, tp_size=2)
    assert infer_layout(load, eng.params, man, given=want) is want and len(calls) == 1  # no probe passes
    wrong, _ = vllm_spec(man, cfg, tp_rank=0, tp_size=2)  # rank 0's slices into rank 1's engine
    with pytest.raises(LayoutError, match="replaying the spec differs"):
        infer_layout(load, eng.params, man, given=wrong)
    with pytest.raises(LayoutError, match="another manifest"):
        infer_layout(load, eng.params, man[::-1], given=want)
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())  # targets restored
