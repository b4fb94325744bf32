"""Qwen3.5 (dense and MoE) against transformers: logits, loss, gradients for several layer patterns,
partial-rotary factors and key/value head ratios; the plain and the hub (multimodal) checkpoint
layouts, the MTP head through the `mtp` slot, our save -> transformers load, round trip; packed
sequences; bad input.

transformers switches its gated-DeltaNet to flash-linear-attention whenever that imports; the
modeling modules are imported here with fla hidden, so the reference is its torch path."""
import json
import logging
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bumblebee as bb

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers >= 5.2 needed for Qwen3.5", allow_module_level=True)

DENSE = {
    # every 2nd layer full, half the head rotated, 2 query heads per key head, 2 value heads per key head
    "interval2_rot050_gqa2": dict(num_hidden_layers=4, full_attention_interval=2, partial_rotary_factor=0.5,
                                  num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                  linear_num_value_heads=4),
    # explicit pattern, a quarter rotated, MQA, 3 value heads per key head, conv width 3, odd sizes
    "pattern_rot025_mqa": dict(layer_types=["full_attention", "linear_attention", "linear_attention",
                                            "full_attention", "linear_attention"], partial_rotary_factor=0.25,
                               num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=1,
                               linear_num_value_heads=3, linear_conv_kernel_dim=3, hidden_size=40,
                               intermediate_size=71, vocab_size=331, head_dim=16),
    # full rotation, MHA, one value head per key head, conv width 2, tied embeddings
    "linear_heavy_rot1_tied": dict(layer_types=["linear_attention"] * 3 + ["full_attention"],
                                   partial_rotary_factor=1.0, num_attention_heads=2, num_key_value_heads=2,
                                   linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=2,
                                   tie_word_embeddings=True),
}
MOE = {
    "top2": dict(num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, full_attention_interval=4),
    "top3_odd": dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=19,
                     shared_expert_intermediate_size=23, hidden_size=40, vocab_size=331, partial_rotary_factor=0.5,
                     layer_types=["linear_attention", "full_attention", "linear_attention"], num_key_value_heads=1),
}


@pytest.fixture(scope="module")
def hf():
    """transformers' Qwen3.5 modeling modules on their torch path (flash-linear-attention hidden)."""
    names = ["transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"]
    saved = {k: sys.modules.pop(k) for k in list(sys.modules)
             if k == "fla" or k.startswith("fla.") or k in names}
    sys.modules["fla"] = None  # import fla -> ImportError while the modeling modules bind their kernels
    try:
        import importlib
        mods = [importlib.import_module(n) for n in names]
    finally:
        del sys.modules["fla"]
        sys.modules.update({k: v for k, v in saved.items() if k not in names})
    yield mods
    for n in names:  # leave the next importer its own choice
        sys.modules.pop(n, None)


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms off their init, real decays, a router with a spread
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _kw(overrides):
    kw = dict(vocab_size=257, hidden_size=48, intermediate_size=83, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=10,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(overrides)
    if "partial_rotary_factor" in kw:
        kw["rope_parameters"] = {**kw["rope_parameters"], "partial_rotary_factor": kw.pop("partial_rotary_factor")}
    if "layer_types" in kw:
        kw["num_hidden_layers"] = len(kw["layer_types"])
    return kw


def hf_dense(hf, seed, **overrides):
    kw = _kw(overrides)
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**kw)
    config._attn_implementation = "eager"
    return _randomize(hf[0].Qwen3_5ForCausalLM(config).float().eval(), seed)


def hf_moe(hf, seed, **overrides):
    kw = _kw({"moe_intermediate_size": 29, "shared_expert_intermediate_size": 37, "router_aux_loss_coef": 0.01,
              **overrides})
    kw.pop("intermediate_size")
    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**kw)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return _randomize(hf[1].Qwen3_5MoeForCausalLM(config).float().eval(), seed)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("case", sorted(DENSE))
@pytest.mark.parametrize("impl", ["torch_chunked", "fla"])
def test_dense_hf_save_our_load_logits_match(hf, case, impl, tmp_path):
    ref = hf_dense(hf, len(case), **DENSE[case])
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, impl={"attention": "eager", "linear_attention": impl},
                                     dtype=torch.float32)
    assert type(ours).__name__ == "Qwen3_5ForCausalLM" and not hasattr(ours, "mtp")
    ids = torch.randint(0, ref.config.vocab_size, (2, 83))  # > one 64-token chunk
    want, got = _logits(ref, ids), _logits(ours, ids)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("case", sorted(MOE))
def test_moe_logits_loss_and_aux_loss_match(hf, case, tmp_path):
    ref = hf_moe(hf, 11 + len(case), **MOE[case])
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, impl={"attention": "eager"}, dtype=torch.float32)
    assert type(ours).__name__ == "Qwen3_5MoeForCausalLM"
    ids = torch.randint(0, ref.config.vocab_size, (2, 71))
    labels = ids.clone()
    labels[0, :9] = -100
    assert rel_err(_logits(ours, ids), _logits(ref, ids)) < 1e-5
    with torch.no_grad():
        want = ref(ids, labels=labels, output_router_logits=True)
        got = ours(ids, labels=labels, output_router_logits=True)
    assert len(got.router_logits) == ref.config.num_hidden_layers
    assert abs(got.aux_loss.item() - want.aux_loss.item()) < 1e-5 * want.aux_loss.item()
    assert abs(got.loss.item() - want.loss.item()) < 1e-5 * want.loss.item()


def test_dense_loss_and_gradients_match(hf, tmp_path):
    ref = hf_dense(hf, 5, **DENSE["interval2_rot050_gqa2"]).train()
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (2, 70))
    labels = ids.clone()
    labels[1, :11] = -100
    want, got = ref(ids, labels=labels).loss, ours(ids, labels=labels).loss
    assert abs(got.item() - want.item()) < 1e-5 * want.item()
    want.backward()
    got.backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) < 1e-4, name


def _fuse_experts(state):
    """Per-expert keys -> transformers' fused [E, 2I, D] / [E, D, I] tensors (a hub checkpoint may hold either)."""
    import re
    out, groups = {}, {}
    for k, v in state.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    for prefix, ts in groups.items():
        E = 1 + max(e for e, _ in ts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([ts[(e, "gate")], ts[(e, "up")]]) for e in range(E)])
        out[f"{prefix}.down_proj"] = torch.stack([ts[(e, "down")] for e in range(E)])
    return out


def _hub_checkpoint(ref, path, mtp: dict | None, moe: bool, fused: bool = False):
    """ref's weights in the hub's multimodal layout: model.language_model.*, model.visual.*, mtp.*."""
    path.mkdir()
    ref.save_pretrained(path / "plain")
    with safe_open(path / "plain" / "model.safetensors", "pt") as f:
        state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: f.get_tensor(k)
                 for k in f.keys()}
    state["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    state["model.visual.merger.linear_fc1.bias"] = torch.randn(8)
    state.update(mtp or {})
    if fused:
        state = _fuse_experts(state)
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    text = ref.config.to_dict()
    text["mtp_num_hidden_layers"] = 1 if mtp else 0
    config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1, "hidden_size": 8},
              "tie_word_embeddings": ref.config.tie_word_embeddings}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _mtp_tensors(ours_like, seed):
    """Hub-named mtp.* tensors for a model built like ours_like (random, per-expert MoE keys)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: v for k, v in ours_like.ours_to_hf_state(ours_like.state_dict()).items() if k.startswith("mtp.")}
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in state.items()}


@pytest.mark.parametrize("moe,fused", [(False, False), (True, False), (True, True)])
def test_hub_layout_loads_text_and_mtp_skips_visual(hf, moe, fused, tmp_path, caplog):
    ref = hf_moe(hf, 3, **MOE["top2"]) if moe else hf_dense(hf, 3, **DENSE["interval2_rot050_gqa2"])
    text = ref.config.to_dict()
    text["mtp_num_hidden_layers"] = 1
    like = bb.models.build({**text, "model_type": text["model_type"]}, seed=0)
    mtp = _mtp_tensors(like, 1)
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    path = _hub_checkpoint(ref, tmp_path / "hub", mtp, moe, fused)
    with caplog.at_level(logging.INFO, logger="bumblebee.models.qwen3_5"):
        ours = bb.models.from_pretrained(path, impl={"attention": "eager"}, dtype=torch.float32)
    assert sum("model.visual" in r.getMessage() for r in caplog.records) == 1
    ids = torch.randint(0, ref.config.vocab_size, (2, 37))
    assert rel_err(_logits(ours, ids), _logits(ref, ids)) < 1e-5
    saved = ours.ours_to_hf_state(ours.state_dict())
    mtp = _fuse_experts(mtp) if fused else mtp
    saved = _fuse_experts(saved) if fused else saved
    for k, v in mtp.items():
        assert torch.equal(saved[k], v), k
    labels = ids.clone()
    out = ours(ids, labels=labels)
    assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss)


def test_hub_layout_without_mtp_config_ignores_mtp(hf, tmp_path):
    ref = hf_dense(hf, 4, **DENSE["pattern_rot025_mqa"])
    like = bb.models.build({**ref.config.to_dict(), "mtp_num_hidden_layers": 1}, seed=0)
    path = _hub_checkpoint(ref, tmp_path / "hub", _mtp_tensors(like, 2), False)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    ours = bb.models.from_pretrained(path, dtype=torch.float32)
    assert not hasattr(ours, "mtp")
    ids = torch.randint(0, ref.config.vocab_size, (1, 29))
    assert rel_err(_logits(ours, ids), _logits(ref, ids)) < 1e-5


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_our_save_transformers_load_and_round_trip(hf, name, tmp_path):
    ours = bb.models.build(name, seed=2)
    _randomize(ours, 9)
    assert hasattr(ours, "mtp")
    ours.save_pretrained(tmp_path / "a")
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "mtp.fc.weight" in keys and "mtp.layers.0.input_layernorm.weight" in keys
    assert not any(k.startswith("model.language_model.") for k in keys)
    cls = hf[1].Qwen3_5MoeForCausalLM if "moe" in name else hf[0].Qwen3_5ForCausalLM
    theirs = cls.from_pretrained(tmp_path / "a", attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(0, 1024, (2, 41))
    assert rel_err(_logits(ours, ids), _logits(theirs, ids)) < 1e-5
    back = bb.models.from_pretrained(tmp_path / "a", dtype=torch.float32)
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    labels = ids.clone()
    assert torch.equal(ours(ids, labels=labels).loss, back(ids, labels=labels).loss)


def test_transformers_checkpoint_without_mtp_tensors_initializes_the_head(hf, tmp_path):
    ref = hf_dense(hf, 6, **DENSE["linear_heavy_rot1_tied"])
    ref.config.mtp_num_hidden_layers = 1
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    assert hasattr(ours, "mtp")
    ids = torch.randint(0, ref.config.vocab_size, (2, 21))
    assert rel_err(_logits(ours, ids), _logits(ref, ids)) < 1e-5
    assert torch.isfinite(ours(ids, labels=ids).mtp_loss)


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
@pytest.mark.parametrize("impl", ["torch_chunked", "fla"])
def test_packed_equals_separate_sequences(name, impl):
    config = {**bb.models.NAMED[name], "mtp_num_hidden_layers": 0}
    model = bb.models.build(config, impl={"linear_attention": impl}, seed=1, dtype=torch.float64)
    _randomize(model, 2)
    lengths = [5, 70, 1, 20]
    seqs = [torch.randint(0, 1024, (n,)) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    packed = torch.cat(seqs)[None]
    got = _logits(model, packed, cu_seqlens=cu)[0]
    want = torch.cat([_logits(model, s[None])[0] for s in seqs])
    tol = 1e-7 if "moe" in name else 1e-10  # float64, but routing weights go through an fp32 softmax
    assert rel_err(got, want) < tol
    # the same tokens as a [2, T] batch: the packed stream is the batch's B*T tokens, rows included
    got2 = _logits(model, packed.view(2, -1), cu_seqlens=cu).reshape(-1, got.shape[-1])
    assert rel_err(got2, want) < tol
    # no target crosses a sequence boundary: the packed loss is the token-weighted mean of the parts
    loss = model(packed, labels=packed, cu_seqlens=cu).loss
    parts = [model(s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs if len(s) > 1]
    assert abs(loss.item() - (sum(parts) / sum(n - 1 for n in lengths)).item()) < tol * 10


def test_packed_mtp_runs_and_matches_per_sequence():
    model = bb.models.build("qwen3.5-tiny", seed=1, dtype=torch.float64)
    seqs = [torch.randint(0, 1024, (n,)) for n in (9, 13)]
    cu = torch.tensor([0, 9, 22])
    out = model(torch.cat(seqs)[None], labels=torch.cat(seqs)[None], cu_seqlens=cu)
    parts = [model(s[None], labels=s[None]).mtp_losses[0] * (len(s) - 2) for s in seqs]
    assert abs(out.mtp_losses[0].item() - (sum(parts) / (9 + 13 - 4)).item()) < 1e-9


def test_bad_input():
    model = bb.models.build("qwen3.5-tiny", seed=0)
    ids = torch.randint(0, 1024, (2, 10))
    for cu in ([0, 5, 19], [0, 12, 10, 20], [1, 20], [0, 20.0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(ids, cu_seqlens=torch.tensor(cu))
    cfg = dict(bb.models.NAMED["qwen3.5-tiny"])
    with pytest.raises(ValueError, match="must divide value heads"):
        bb.models.build({**cfg, "linear_num_key_heads": 3, "linear_num_value_heads": 4})
    with pytest.raises(ValueError, match="conv_kernel_size"):
        bb.models.build({**cfg, "linear_conv_kernel_dim": 5})
    with pytest.raises(ValueError, match="layer_types"):
        bb.models.build({**cfg, "layer_types": ["linear_attention", "sliding_attention", "full_attention",
                                                 "full_attention"]})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        bb.models.build({**cfg, "num_key_value_heads": 3})
