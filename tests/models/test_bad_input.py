"""Bad input gives clear Python exceptions naming the file/key/argument and what is accepted."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import bumblebee as bb


@pytest.fixture
def saved(tmp_path):
    model = bb.models.build("qwen3-tiny", seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        bb.models.from_pretrained(tmp_path)


def test_unknown_model_type(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt99"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gpt99.*qwen3"):
        bb.models.from_pretrained(path)


def test_missing_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        bb.models.from_pretrained(path)


def test_misshaped_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(7,\).*\(64,\)"):
        bb.models.from_pretrained(path)


def test_unexpected_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    state["model.layers.5.mlp.up_proj.weight"] = torch.ones(3)
    save_file(state, path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.5"):
        bb.models.from_pretrained(path)


def test_save_over_existing_checkpoint_is_atomic(saved, monkeypatch):
    model, path = saved
    before = (path / "model.safetensors").read_bytes()
    import bumblebee.hf_io as hf_io

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_io, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(path)
    assert (path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]  # no temporary left behind


def test_token_ids_outside_vocab():
    model = bb.models.build("qwen3-tiny")
    with pytest.raises(ValueError, match=r"1024.*\[0, 1024\)"):
        model(torch.tensor([[1, 2, 1024]]))
    with pytest.raises(ValueError, match="-1"):
        model(torch.tensor([[1, -1]]))


def test_labels_wrong_shape():
    model = bb.models.build("qwen3-tiny")
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(2, 5, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long))


def test_unknown_slot_or_implementation():
    with pytest.raises(ValueError, match=r"unknown slot 'atention'.*attention"):
        bb.models.build("qwen3-tiny", impl={"atention": "sdpa"})
    with pytest.raises(ValueError, match=r"'flash9'.*\['eager', 'sdpa'\]"):
        bb.models.build("qwen3-tiny", impl={"attention": "flash9"})
    with pytest.raises(ValueError, match=r"unknown model 'qwen9'.*qwen3-tiny"):
        bb.models.build("qwen9")


def test_impl_naming_a_slot_the_model_does_not_use():
    # choosing an implementation for a slot the model never looks up would change nothing
    with pytest.raises(ValueError, match=r"slot mla is not used by model qwen3-tiny; it uses: attention, cross_entropy"):
        bb.models.build("qwen3-tiny", impl={"mla": "naive"})
    with pytest.raises(ValueError, match=r"slot router is not used by model qwen3-tiny"):
        bb.models.build("qwen3-tiny", impl={"router": "softmax_topk"})
    with pytest.raises(ValueError, match=r"state_sharding.*not used by model deepseek-v3-tiny; it uses: .*mla"):
        bb.models.build("deepseek-v3-tiny", impl={"state_sharding": "zero1"})
    assert "router" in bb.models.build("qwen3-moe-tiny", impl={"router": "softmax_topk"}).slots_used()


def test_impl_naming_an_unused_slot_on_load(saved):
    _, path = saved
    with pytest.raises(ValueError, match=r"slot moe_dispatch is not used by model qwen3 .*ckpt"):
        bb.models.from_pretrained(path, impl={"moe_dispatch": "local"})


def test_impl_must_be_a_mapping():
    with pytest.raises(TypeError, match=r"impl must be a dict.*cross_entropy.*linear_ce.*got str 'linear_ce'"):
        bb.models.build("qwen3-tiny", impl="linear_ce")


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny", "deepseek-v3-tiny"])
def test_empty_batch_is_refused_alike_by_every_model(name):
    model = bb.models.build(name)
    for shape in ((0, 6), (2, 0)):
        ids = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(ValueError, match=rf"input_ids is an empty batch of shape \({shape[0]}, {shape[1]}\)"):
            model(ids, labels=ids)
        with pytest.raises(ValueError, match="empty batch"):
            model(ids)
    with pytest.raises(ValueError, match="empty batch"):  # packed: refused before the boundaries
        model(torch.zeros(1, 0, dtype=torch.long), cu_seqlens=torch.tensor([0]))


def test_malformed_config_names_the_file_and_place(saved):
    _, path = saved
    (path / "config.json").write_text('{"model_type": "qwen3",\n "hidden_size": 64,,}')
    with pytest.raises(ValueError, match=r"ckpt/config.json is not valid JSON: .* line 2, column"):
        bb.models.from_pretrained(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got a list"):
        bb.models.from_pretrained(path)


def test_missing_config_field_names_it(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"ckpt/config.json lacks the field 'hidden_size', which qwen3 needs"):
        bb.models.from_pretrained(path)
    moe = dict(bb.models.NAMED["qwen3-moe-tiny"])
    del moe["num_experts_per_tok"]
    with pytest.raises(ValueError, match=r"the config lacks the field 'num_experts_per_tok', which qwen3_moe needs"):
        bb.models.build(moe)


def test_unsupported_hidden_act_is_refused(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"  # the MLPs are SwiGLU: it would silently run as silu
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"qwen3 supports hidden_act 'silu', got 'gelu'"):
        bb.models.from_pretrained(path)
    with pytest.raises(ValueError, match=r"qwen3_moe supports hidden_act 'silu', got 'relu'"):
        bb.models.build({**bb.models.NAMED["qwen3-moe-tiny"], "hidden_act": "relu"})


def test_corrupt_shard_is_named(tmp_path):
    model = bb.models.build("qwen3-tiny", seed=1)
    model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].write_bytes(shards[1].read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match=rf"{shards[1].name} is not a readable safetensors file"):
        bb.models.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not valid JSON"):
        bb.models.from_pretrained(tmp_path)


def test_inputs_that_are_not_tensors_name_the_argument():
    model = bb.models.build("qwen3-tiny")
    with pytest.raises(TypeError, match=r"input_ids must be a torch.Tensor of token ids \[B, T\].*got list.*torch.tensor"):
        model([[1, 2, 3]])
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"labels must be a torch.Tensor \[B, T\] like input_ids, got list"):
        model(ids, labels=[[1, 2, 3]])
    with pytest.raises(TypeError, match=r"position_ids must be a torch.Tensor"):
        model(ids, position_ids=(0, 1, 2), cu_seqlens=torch.tensor([0, 3]))


@pytest.mark.parametrize("name", ["qwen3-tiny", "deepseek-v3-tiny", "qwen3.5-tiny"])
def test_position_ids_that_are_not_integers_are_refused(name):
    # a float position would silently rotate by fractional angles
    model = bb.models.build(name)
    ids = torch.tensor([[1, 2, 3]])
    for bad in (torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[0.5, 1.5, 2.5]]), torch.ones(1, 3, dtype=torch.bool)):
        with pytest.raises(ValueError, match=rf"position_ids must be an integer tensor .*got {bad.dtype}"):
            model(ids, position_ids=bad)
        with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
            model(ids, position_ids=bad, cu_seqlens=torch.tensor([0, 3]))
    model(ids, position_ids=torch.tensor([[0, 1, 2]], dtype=torch.int32))  # int32 and int64 are positions


def test_dtype_that_is_not_a_torch_dtype_is_refused(saved):
    _, path = saved
    for load in (lambda dtype: bb.models.build("qwen3-tiny", dtype=dtype),
                 lambda dtype: bb.models.from_pretrained(path, dtype=dtype)):
        for bad in ("bfloat16", torch.int64):
            with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype .*got"):
                load(bad)
