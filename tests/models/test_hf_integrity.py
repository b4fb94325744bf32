"""Loading an HF checkpoint is never silently wrong: corrupt bytes in a safetensors file are caught by
the sha256 that save_pretrained records per tensor (naming file and tensor), NaN/inf weights are
refused on request, a checkpoint of transformers (no checksums) still loads, a tied config with its
own different head keeps it as transformers does, and freshly initialized MTP weights are named."""
import json
import struct
import warnings

import pytest
import torch
from safetensors import safe_open

import bumblebee as bb
from bumblebee import hf_io, integrity

UNTIED = {**bb.models.NAMED["qwen3-tiny"], "tie_word_embeddings": False}
VICTIM = "model.layers.0.mlp.down_proj.weight"


def _data_range(file, name):
    """(start, end) byte offsets of tensor `name`'s data in the safetensors `file`."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def _overwrite(file, offset, data):
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_the_header_records_each_tensors_sha256(tmp_path):
    model = bb.models.build("qwen3-tiny", seed=1)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / hf_io.SINGLE, "pt") as f:
        sums = json.loads(f.metadata()[integrity.CHECKSUMS])
        assert set(sums) == set(f.keys())
        assert sums[VICTIM] == integrity.tensor_sha256(f.get_tensor(VICTIM))
    state = model.state_dict()
    assert sums[VICTIM] == integrity.tensor_sha256(state[VICTIM])  # the bytes in memory, before the write


@pytest.mark.parametrize("name,victim,parts", [
    ("qwen3-tiny", VICTIM, 1), ("qwen3-tiny", VICTIM, 3),
    ("qwen3-moe-tiny", "model.layers.1.mlp.experts.2.up_proj.weight", 2)])  # one of a fused tensor's sources
def test_0xff_bytes_in_a_tensor_are_caught_naming_the_file_and_the_tensor(tmp_path, name, victim, parts):
    model = bb.models.build(name, seed=1)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(tmp_path, max_shard_bytes=size // parts)
    loaded = bb.models.from_pretrained(tmp_path).state_dict()  # intact: verified and equal
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    file = hf_io._weight_files(tmp_path)[victim]
    start, end = _data_range(file, victim)
    _overwrite(file, (start + end) // 2, b"\xff" * 8)  # NaN in float32 and bfloat16 alike
    with pytest.raises(ValueError, match=rf"{file.name}: tensor {victim} does not match the sha256"):
        bb.models.from_pretrained(tmp_path)


def test_check_finite_refuses_nan_weights_that_match_their_checksums(tmp_path):
    model = bb.models.build("qwen3-tiny", seed=1)
    with torch.no_grad():
        model.get_parameter(VICTIM)[3, 5] = float("nan")
    model.save_pretrained(tmp_path)
    loaded = bb.models.from_pretrained(tmp_path)  # off by default: the bytes are what was saved
    assert torch.isnan(loaded.get_parameter(VICTIM)).any()
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor {VICTIM} holds NaN or inf"):
        bb.models.from_pretrained(tmp_path, check_finite=True)


def test_a_checkpoint_without_checksums_loads_unverified(tmp_path, caplog):
    """transformers' save_pretrained records no checksums: nothing to verify, the load goes on (and
    says so in an info line)."""
    transformers = pytest.importorskip("transformers")
    ours = bb.models.build("qwen3-tiny", seed=1)
    ours.save_pretrained(tmp_path / "ours")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / hf_io.SINGLE, "pt") as f:
        assert integrity.CHECKSUMS not in (f.metadata() or {})
    with caplog.at_level("INFO", logger="bumblebee.hf_io"):
        loaded = bb.models.from_pretrained(tmp_path / "hf", check_finite=True).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ours.state_dict().items())
    assert "model.safetensors record no checksums (not written by save_pretrained)" in caplog.text


def test_corrupt_json_files_are_reported_as_corrupt_naming_the_file(tmp_path):
    bb.models.build("qwen3-tiny", seed=1).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2,')
    with pytest.raises(ValueError, match=r"generation_config.json is not valid JSON: .* line 1"):
        bb.models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"model_type": "qwen3"\xff}')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        bb.models.from_pretrained(tmp_path)


def test_a_tied_config_with_a_different_head_keeps_it_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = bb.models.build(UNTIED, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.warns(UserWarning, match="holds both with different values, so they are NOT tied"):
        ours = bb.models.from_pretrained(tmp_path / "ckpt", impl={"attention": "eager"})
    assert torch.equal(ours.lm_head.weight, model.lm_head.weight)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 19))
    with torch.no_grad():
        want, got = ref(ids).logits.double(), ours(ids).logits.double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5  # a silently tied head is off by O(1)
    ours.save_pretrained(tmp_path / "again")  # the export keeps both
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = bb.models.from_pretrained(tmp_path / "again")
    assert not [w for w in record if "NOT tied" in str(w.message)]
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_a_tied_config_with_an_equal_head_ties_it_without_a_word(tmp_path):
    model = bb.models.build(UNTIED, seed=1)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = bb.models.from_pretrained(tmp_path)
    assert not [w for w in record if "NOT tied" in str(w.message)]
    assert ours.lm_head.weight is ours.model.embed_tokens.weight and ours.config.tie_word_embeddings


def test_deepseek_v3_without_mtp_weights_names_the_fresh_ones(tmp_path):
    hf = {**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1}
    model = bb.models.build(hf, seed=1)
    state = {k: v for k, v in model.ours_to_hf_state(dict(model.state_dict())).items()
             if not k.startswith(f"model.layers.{model.config.num_hidden_layers}.")}
    config, gen = hf_io.export_configs(model)
    hf_io.save_weights(state, config, tmp_path, generation_config=gen)  # as transformers saves: no MTP
    with pytest.warns(UserWarning, match=r"newly initialized: \['mtp\.layers\.0\.") as record:
        bb.models.from_pretrained(tmp_path)
    fresh = [n for n in bb.models.build(hf).state_dict() if n.startswith("mtp.")]
    text = str(next(w.message for w in record if "newly initialized" in str(w.message)))
    assert fresh and all(repr(n) in text for n in fresh)
    model.save_pretrained(tmp_path / "with_mtp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        bb.models.from_pretrained(tmp_path / "with_mtp")
    assert not [w for w in record if "newly initialized" in str(w.message)]
