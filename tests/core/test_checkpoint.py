"""bumblebee.checkpoint (the DCP checkpoints of state_sharding and the runtime) in one process: a save
writes only its own files into a folder that may hold others, refuses a path that is a file, and a
crash before or after its commit leaves a loadable checkpoint; the earlier layout still loads."""
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bumblebee import checkpoint
from bumblebee.primitives.attention import SDPA

META = {"impl": "test", "params": {"w": [5, 3]}, "model_type": "toy"}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FOREIGN = {"README.md": "# run notes\n", "sub/keep.txt": "keep", "tokenizer.json": "{}",
           "__9_9.distcp": "named like DCP's files, listed by no metadata of ours"}


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(5, 3, generator=g)}, "step": torch.tensor(seed)}


def _loaded(path):
    sd = {"model": {"w": torch.zeros(5, 3)}, "step": torch.tensor(0)}
    checkpoint.load(sd, path, meta=META)
    return sd


def _same(a, b):
    return torch.equal(a["model"]["w"], b["model"]["w"]) and int(a["step"]) == int(b["step"])


def _put_foreign(path, foreign=FOREIGN):
    for rel, text in foreign.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)


def _foreign_intact(path, foreign=FOREIGN):
    return all((path / rel).read_text() == text for rel, text in foreign.items())


def _listing(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def test_save_keeps_the_folders_other_files(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    _put_foreign(path)
    for seed in (1, 2):
        checkpoint.save(_state(seed), path, meta=META)
        assert _same(_loaded(path), _state(seed)) and _foreign_intact(path)
    data = [p.name for p in path.iterdir() if p.name.startswith("dcp-")]
    assert data == [json.loads((path / checkpoint.MARKER).read_text())["data"]]  # the first save's data is gone


def test_save_refuses_a_regular_file(tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("someone's file")
    with pytest.raises(ValueError, match=r"checkpoint path .*ckpt exists and is not a folder"):
        checkpoint.save(_state(1), target, meta=META)
    assert target.read_text() == "someone's file" and _listing(tmp_path) == ["ckpt"]


def test_crash_before_the_commit_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    checkpoint.save(_state(1), path, meta=META)
    _put_foreign(path)
    before = _listing(path)
    real = dcp.save

    def save_then_crash(*a, **kw):  # every DCP file written, then the process dies
        real(*a, **kw)
        raise RuntimeError("simulated crash after the DCP files")

    monkeypatch.setattr(checkpoint.dcp, "save", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoint.save(_state(2), path, meta=META)
    monkeypatch.undo()
    assert _listing(path) == before  # the new data folder is gone, nothing else changed
    assert _same(_loaded(path), _state(1))


def test_crash_after_the_commit_leaves_the_new_checkpoint_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    checkpoint.save(_state(1), path, meta=META)
    first = json.loads((path / checkpoint.MARKER).read_text())["data"]
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        checkpoint.save(_state(2), path, meta=META)
    monkeypatch.undo()
    assert (path / first).is_dir() and _same(_loaded(path), _state(2))
    checkpoint.save(_state(3), path, meta=META)
    assert not (path / first).exists() and _same(_loaded(path), _state(3))
    assert len([p for p in path.iterdir() if p.name.startswith("dcp-")]) == 1


def test_a_checkpoint_of_the_earlier_layout_loads_and_is_replaced_exactly(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(_state(1), checkpoint_id=str(path))  # DCP's files directly in the folder, as before
    (path / checkpoint.MARKER).write_text(json.dumps(META))
    _put_foreign(path)
    assert _same(_loaded(path), _state(1))
    checkpoint.save(_state(2), path, meta=META)
    assert _same(_loaded(path), _state(2)) and _foreign_intact(path)
    assert not (path / ".metadata").exists() and (path / "__9_9.distcp").exists()
    assert not [p for p in path.glob("__0_*.distcp")]


def test_incomplete_folders_are_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        _loaded(tmp_path / "half")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / checkpoint.MARKER).write_text(json.dumps({**META, "data": "dcp-000000000000"}))
    with pytest.raises(ValueError, match="incomplete.*dcp-000000000000"):
        _loaded(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _loaded(tmp_path / "none")


def test_the_json_and_the_hf_export_record_the_models_impl_configs(tmp_path):
    """A training state's checkpoint json and its HF export hold the model's resolved slot configs
    (defaults included); the configs are a record: a state of other options loads the checkpoint."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bumblebee import models, registry
    from bumblebee import hf_io

    impl = {"attention": "sdpa:fa4=off,varlen=off", "cross_entropy": "linear_ce:path=lean"}
    model = models.build("qwen3-tiny", impl, seed=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        make = registry.resolve("state_sharding", "zero1")
        make(model, mesh, lr=1e-3, weight_decay=0.0, grad_clip=1.0, mixed_precision="fp32").save(tmp_path / "ckpt")
        make(model, mesh, lr=1e-3, weight_decay=0.0, grad_clip=1.0, mixed_precision="fp32").save_pretrained(
            tmp_path / "hf")
        other = make(models.build("qwen3-tiny", seed=1), mesh, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                     mixed_precision="fp32")
        other.load(tmp_path / "ckpt")
    finally:
        dist.destroy_process_group()
    meta = json.loads((tmp_path / "ckpt" / checkpoint.MARKER).read_text())
    assert meta["impl_configs"] == model.impl_configs()
    assert meta["impl_configs"]["attention"] == {"impl": "sdpa", "fa4": "off", "varlen": False,
                                                  "recompute_keep_bytes": SDPA.recompute_keep_bytes}
    assert meta["impl_configs"]["cross_entropy"]["path"] == "lean"
    record = json.loads((tmp_path / "hf" / hf_io.IMPL_RECORD).read_text())
    assert record == {"impl_configs": model.impl_configs()}
    assert torch.equal(other.model.lm_head.weight, model.lm_head.weight)
