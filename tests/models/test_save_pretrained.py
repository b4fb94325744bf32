"""save_pretrained writes only its own files, each atomically, into a folder that may hold others;
a crash at any point leaves a loadable checkpoint (the previous one, or the new one once switched);
the export carries the loaded config's other fields and a generation_config.json."""
import json
import os
import time

import pytest
import torch

import bumblebee as bb
from bumblebee import hf_io

FOREIGN = {"tokenizer.json": "{\"version\": \"1.0\"}", "README.md": "# my model\n",
           "sub/notes.txt": "keep me", "adapter_model.safetensors": "not ours",
           "model-00009-of-00009.safetensors": "named like a shard, listed by no index of ours"}


def _model(seed):
    return bb.models.build("qwen3-tiny", seed=seed)


def _shard_bytes(model, parts):
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) // parts


def _same_weights(path, model):
    loaded = bb.models.from_pretrained(path).state_dict()
    want = model.state_dict()
    assert set(loaded) == set(want)
    return all(torch.equal(loaded[k], want[k]) for k in want)


def _put_foreign(path):
    for rel, text in FOREIGN.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)


def _foreign_intact(path):
    return all((path / rel).is_file() and (path / rel).read_text() == text for rel, text in FOREIGN.items())


def _hidden(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("parts", [1, 3])
def test_save_into_a_folder_keeps_its_other_files(tmp_path, parts):
    a, b = _model(1), _model(2)
    path = tmp_path / "ckpt"
    path.mkdir()
    _put_foreign(path)
    a.save_pretrained(path, max_shard_bytes=_shard_bytes(a, parts))
    assert _foreign_intact(path) and _same_weights(path, a)
    b.save_pretrained(path, max_shard_bytes=_shard_bytes(b, parts))  # over its own earlier save
    assert _foreign_intact(path) and _same_weights(path, b)
    assert _hidden(path) == []


def test_save_refuses_a_regular_file(tmp_path):
    target = tmp_path / "weights"
    target.write_text("a file of someone's")
    with pytest.raises(ValueError, match=r"save_pretrained path .*weights exists and is not a folder"):
        _model(1).save_pretrained(target)
    assert target.read_text() == "a file of someone's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


@pytest.mark.parametrize("parts", [1, 3])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, parts):
    a, b = _model(1), _model(2)
    path = tmp_path / "ckpt"
    a.save_pretrained(path, max_shard_bytes=_shard_bytes(a, parts))
    _put_foreign(path)
    before = sorted(p.name for p in path.iterdir())
    real, calls = hf_io.save_file, []

    def write_once_then_crash(*args, **kw):  # the first weight file is written, then the disk fills
        if calls:
            raise OSError(28, "No space left on device")
        calls.append(1)
        real(*args, **kw)

    monkeypatch.setattr(hf_io, "save_file", write_once_then_crash)
    with pytest.raises(OSError, match="No space left"):
        b.save_pretrained(path, max_shard_bytes=_shard_bytes(b, 3))
    monkeypatch.undo()
    assert calls and sorted(p.name for p in path.iterdir()) == before  # no temporary file left
    assert _same_weights(path, a) and _foreign_intact(path)


def test_changed_sharding_removes_only_the_stale_files_of_the_previous_checkpoint(tmp_path):
    models = [_model(s) for s in range(4)]
    path = tmp_path / "ckpt"
    path.mkdir()
    _put_foreign(path)
    for m, parts in zip(models, [3, 1, 2, 2]):  # sharded -> single -> sharded -> same names again
        m.save_pretrained(path, max_shard_bytes=_shard_bytes(m, parts))
        assert _same_weights(path, m) and _foreign_intact(path)
        ours = sorted(p.name for p in path.glob("model*") if p.name not in FOREIGN)
        if parts == 1:
            assert ours == ["model.safetensors"]
        else:
            index = json.loads((path / hf_io.INDEX).read_text())
            assert ours == sorted(set(index["weight_map"].values()) | {hf_io.INDEX})
    assert _hidden(path) == []


def test_crash_while_switching_same_named_shards_never_mixes(tmp_path, monkeypatch):
    """Re-saving with the same shard names: until the last rename an interim index names the new
    files by their temporary names, so a crash there leaves the new checkpoint whole."""
    a, b, c = _model(1), _model(2), _model(3)
    path = tmp_path / "ckpt"
    a.save_pretrained(path, max_shard_bytes=_shard_bytes(a, 2))

    def crash(src, dst):
        raise RuntimeError("killed while renaming")

    monkeypatch.setattr(hf_io, "_replace_keeping", crash)
    with pytest.raises(RuntimeError, match="killed"):
        b.save_pretrained(path, max_shard_bytes=_shard_bytes(b, 2))
    monkeypatch.undo()
    assert _same_weights(path, b)
    c.save_pretrained(path, max_shard_bytes=_shard_bytes(c, 2))  # the next save removes the interim files
    assert _same_weights(path, c) and _hidden(path) == []


def test_export_carries_the_loaded_config_and_generation_config(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _model(1).save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    extra = {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "_name_or_path": "org/model",
             "some_tool_setting": {"k": [1, 2]}}
    dropped = {"quantization_config": {"quant_method": "fp8"}, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
    (src / "config.json").write_text(json.dumps({**cfg, **extra, **dropped}))
    gen = {"bos_token_id": 1, "eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.95, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    bb.models.from_pretrained(src).save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k) for k in extra} == extra
    assert not set(dropped) & set(written)  # plain weights, and no code files for auto_map to name
    assert json.loads((out / "generation_config.json").read_text()) == gen
    # without a source generation_config.json, one is derived from the token ids (as transformers does)
    (src / "generation_config.json").unlink()
    bb.models.from_pretrained(src).save_pretrained(out)
    derived = json.loads((out / "generation_config.json").read_text())
    assert {k: derived.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
        {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}
    transformers = pytest.importorskip("transformers")
    hf_gen = transformers.GenerationConfig.from_pretrained(out)
    assert hf_gen.eos_token_id == [2, 3] and hf_gen.pad_token_id == 0


def test_fields_the_model_uses_come_from_its_config(tmp_path):
    model = _model(1)
    model.hf_source["config"]["num_hidden_layers"] = 99  # stale source value: the model's config wins
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == \
        model.config.num_hidden_layers


def test_created_folder_and_files_honour_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _model(1).save_pretrained(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b"):
        assert p.stat().st_mode & 0o777 == 0o755, p
    for p in (tmp_path / "a" / "b").iterdir():
        assert p.stat().st_mode & 0o777 == 0o644, p


def test_from_pretrained_returns_eval_mode_as_transformers(tmp_path):
    model = _model(1)
    assert model.training  # a freshly built model is for training (transformers' from_config too)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = bb.models.from_pretrained(tmp_path / "ckpt")
    assert not loaded.training and not any(m.training for m in loaded.modules())
    transformers = pytest.importorskip("transformers")
    assert not transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").training


@pytest.mark.parametrize("name,impl", [
    ("qwen3-tiny", {"attention": "sdpa:fa4=off", "cross_entropy": "linear_ce:path=lean"}),
    ("deepseek-v3-tiny", {"mla": "flash:lean_backward=off,fused_rope=off"})])
def test_the_export_records_the_impl_configs_beside_what_transformers_reads(tmp_path, name, impl):
    model = bb.models.build(name, impl, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    record = json.loads((tmp_path / "ckpt" / hf_io.IMPL_RECORD).read_text())
    assert record == {"impl_configs": model.impl_configs()}
    slot = next(iter(impl))
    assert record["impl_configs"][slot]["impl"] == impl[slot].split(":")[0]
    assert "impl_configs" not in json.loads((tmp_path / "ckpt" / "config.json").read_text())
    # a record, not a choice: loading takes the impl it is given (the defaults here)
    assert bb.models.from_pretrained(tmp_path / "ckpt").impl_configs() == bb.models.build(name).impl_configs()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)
    assert not hasattr(hf.config, "impl_configs")


def test_progress_bars_on_stderr_only_past_the_delay(tmp_path, capsys, monkeypatch):
    from bumblebee import files
    model = _model(1)
    model.save_pretrained(tmp_path / "quick")
    bb.models.from_pretrained(tmp_path / "quick")
    assert capsys.readouterr().err == ""  # fast: no bar
    monkeypatch.setattr(files, "PROGRESS_DELAY_S", 0.0)  # as if every step took longer than the delay
    model.save_pretrained(tmp_path / "slow", max_shard_bytes=_shard_bytes(model, 3))
    bb.models.from_pretrained(tmp_path / "slow")
    out = capsys.readouterr()
    assert "saving slow" in out.err and "loading slow" in out.err and "B/s" in out.err  # bytes bars
    assert out.out == ""


def test_the_loading_bar_counts_its_delay_from_the_start_of_from_pretrained(tmp_path, capsys, monkeypatch):
    """A load whose model construction takes most of the time (a large model on the meta device, the
    first meta-device call importing torch's decompositions) shows its bar though the read is quick."""
    from bumblebee import files, registry
    _model(1).save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    monkeypatch.setattr(files, "PROGRESS_DELAY_S", 0.5)
    real = registry.check_used

    def slow_build(*a, **kw):  # the construction alone outlasts the delay
        time.sleep(0.6)
        return real(*a, **kw)

    monkeypatch.setattr(registry, "check_used", slow_build)
    bb.models.from_pretrained(tmp_path / "ckpt")
    assert "loading ckpt" in capsys.readouterr().err
