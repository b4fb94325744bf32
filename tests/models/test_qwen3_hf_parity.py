"""Qwen3 against transformers: HF save -> our load -> logits; our save -> HF load -> logits."""
import json

import pytest
import torch

import bumblebee as bb

transformers = pytest.importorskip("transformers")

CASES = {
    # name: (overrides of a tiny HF Qwen3Config)
    "gqa2_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=True),
    "gqa4_odd": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=1, head_dim=10,
                     intermediate_size=67, vocab_size=331, tie_word_embeddings=False),
    "linear_rope_bias": dict(attention_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": 64}),
}


def hf_model(seed, **overrides):
    kw = dict(vocab_size=257, hidden_size=48, intermediate_size=83, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
              rms_norm_eps=1e-6, attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).float().eval()
    with torch.no_grad():  # norms are initialized to ones; randomize them so they are exercised
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_save_our_load_logits_match(case, tmp_path):
    ref = hf_model(len(case), **CASES[case])
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, impl={"attention": "eager"}, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (2, 37))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5


def test_loss_matches_transformers(tmp_path):
    ref = hf_model(3)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, ref.config.vocab_size, (3, 29))
    labels = ids.clone()
    labels[0, :7] = -100
    ours = bb.models.from_pretrained(tmp_path, impl={"attention": "sdpa"}, dtype=torch.float32)
    want = ref(ids, labels=labels).loss
    got = ours(ids, labels=labels).loss
    assert abs(got.item() - want.item()) < 1e-5 * want.item()


def test_sharded_checkpoint_loads(tmp_path):
    ref = hf_model(4)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (1, 11))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [False, True])
def test_our_save_transformers_load(tmp_path, tied, shard):
    ours = bb.models.build({**bb.models.NAMED["qwen3-tiny"], "tie_word_embeddings": tied}, seed=5)
    ours.save_pretrained(tmp_path, max_shard_bytes=30_000 if shard else 2**30)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ref = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 23))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5
    again = bb.models.from_pretrained(tmp_path)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_old_rope_config_layout(tmp_path):
    ref = hf_model(6, rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"], cfg["rope_scaling"] = 12345.0, None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (1, 19))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_full_recompute_gives_the_same_gradients(name):
    model = bb.models.build(name, seed=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_recompute(True)(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-6, atol=1e-7)
