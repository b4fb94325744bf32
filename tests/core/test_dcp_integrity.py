"""A DCP checkpoint (`checkpoint.save`, the runtime's save_state) carries the sha256 of every tensor
chunk; a load checks them before DCP reads a byte, naming the file and the tensor; check_finite
refuses NaN/inf; a corrupt checkpoint json is reported as corrupt, not as another model; checkpoints
saved before checksums load as before. On 2 gloo ranks every rank raises the same errors."""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from bumblebee import checkpoint, files, integrity

META = {"impl": "test", "params": {"w": [6, 5], "v": [7]}, "model_type": "toy"}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 5, generator=g), "v": torch.randn(7, generator=g)},
            "optim": {"w.exp_avg": torch.randn(6, 5, generator=g)}, "step": torch.tensor(seed)}


def _blank():
    return {"model": {"w": torch.zeros(6, 5), "v": torch.zeros(7)}, "optim": {"w.exp_avg": torch.zeros(6, 5)},
            "step": torch.tensor(0)}


def _where(path, fqn):
    """(file, offset, length) of the stored bytes of state-dict entry `fqn` (DCP's dotted name)."""
    data = checkpoint.data_folder(path)
    for idx, info in FileSystemReader(str(data)).read_metadata().storage_data.items():
        if idx.fqn == fqn:
            return data / info.relative_path, info.offset, info.length
    raise KeyError(fqn)


def _flip(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_the_data_folder_records_each_chunks_sha256(tmp_path):
    checkpoint.save(_state(1), tmp_path, meta=META)
    manifest = json.loads((checkpoint.data_folder(tmp_path) / integrity.MANIFEST).read_text())
    file, offset, length = _where(tmp_path, "model.w")
    entry = manifest["files"][file.name]
    assert entry["bytes"] == file.stat().st_size and set(entry["tensors"]) >= {"model.w[0,0]", "optim.w.exp_avg[0,0]"}
    assert entry["tensors"]["model.w[0,0]"] == integrity._range_sha256(file, offset, length)
    loaded = _blank()
    checkpoint.load(loaded, tmp_path, meta=META)
    assert torch.equal(loaded["model"]["w"], _state(1)["model"]["w"])


@pytest.mark.parametrize("fqn", ["model.w", "optim.w.exp_avg"])
def test_a_flipped_byte_in_a_distcp_file_is_caught_naming_the_file_and_the_tensor(tmp_path, fqn):
    checkpoint.save(_state(1), tmp_path, meta=META)
    file, offset, length = _where(tmp_path, fqn)
    _flip(file, offset + length // 2)
    loaded = _blank()
    with pytest.raises(ValueError, match=rf"{file.name}: tensor {fqn}\[0,0\] does not match its sha256"):
        checkpoint.load(loaded, tmp_path, meta=META)
    assert not loaded["model"]["w"].any()  # refused before DCP wrote a byte into the state


def test_a_truncated_distcp_file_is_caught(tmp_path):
    checkpoint.save(_state(1), tmp_path, meta=META)
    file, _, _ = _where(tmp_path, "model.w")
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(ValueError, match=rf"{file.name}: {file.stat().st_size} bytes, {file.stat().st_size + 3} when"):
        checkpoint.load(_blank(), tmp_path, meta=META)


def test_check_finite_refuses_nan_state(tmp_path):
    state = _state(1)
    state["optim"]["w.exp_avg"][2, 3] = float("inf")
    checkpoint.save(state, tmp_path, meta=META)
    checkpoint.load(_blank(), tmp_path, meta=META)  # off by default
    with pytest.raises(ValueError, match=r"1 tensors hold NaN or inf \(check_finite=True\): \['optim.w.exp_avg'\]"):
        checkpoint.load(_blank(), tmp_path, meta=META, check_finite=True)


def test_a_corrupt_checkpoint_json_is_reported_as_corrupt(tmp_path):
    checkpoint.save(_state(1), tmp_path, meta=META)
    marker = tmp_path / checkpoint.MARKER
    marker.write_text(marker.read_text()[:-20])
    with pytest.raises(ValueError, match=rf"{checkpoint.MARKER} is not valid JSON: .* line \d+, column"):
        checkpoint.load(_blank(), tmp_path, meta=META)
    checkpoint.save(_state(2), tmp_path, meta=META)  # a save over it still works, and keeps unknown data
    loaded = _blank()
    checkpoint.load(loaded, tmp_path, meta=META)
    assert int(loaded["step"]) == 2


def test_a_checkpoint_saved_before_checksums_loads(tmp_path):
    checkpoint.save(_state(1), tmp_path, meta=META)
    (checkpoint.data_folder(tmp_path) / integrity.MANIFEST).unlink()
    loaded = _blank()
    checkpoint.load(loaded, tmp_path, meta=META)
    assert torch.equal(loaded["model"]["v"], _state(1)["model"]["v"])


# ---- two gloo ranks -----------------------------------------------------------------------------

def _worker(rank, world, port, out):
    """A gloo rank that runs `two_ranks` and saves its result: only this module is imported in the
    child (no models), so the spawn costs little more than importing torch."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from tests.limits import PROCESS_GROUP_TIMEOUT
    from tests.ranks import leave_group
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        result = two_ranks(init_device_mesh("cpu", (world,)), Path(out))
        torch.save(result, Path(out) / f"two_ranks-{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def two_ranks(mesh, out: Path):
    """Each rank saves its own rows of `w` (a DTensor); a held lock, a corrupt byte of rank 0's rows and
    NaN in rank 1's are refused on both ranks alike."""
    rank = dist.get_rank()
    res = {}

    from torch.distributed.tensor import DTensor, Shard

    def rows(t):  # this rank's rows of a [6, 5] tensor, as the DTensor a sharded state holds
        return DTensor.from_local(t[rank * 3:(rank + 1) * 3].clone(), mesh, [Shard(0)], run_check=False)

    def state(seed):
        full = _state(seed)
        return {"model": {"w": rows(full["model"]["w"]), "v": full["model"]["v"]}, "step": full["step"]}

    meta = META
    try:
        checkpoint.save(state(1), out / "locked", meta=meta)
    except Exception as e:  # noqa: BLE001
        res["locked"] = f"{type(e).__name__}: {e}"
    checkpoint.save(state(1), out / "ok", meta=meta)
    dist.barrier()
    loaded = {"model": {"w": rows(torch.zeros(6, 5)), "v": torch.zeros(7)}, "step": torch.tensor(0)}
    checkpoint.load(loaded, out / "ok", meta=meta)
    res["ok"] = torch.equal(loaded["model"]["w"].to_local(), state(1)["model"]["w"].to_local())
    if rank == 0:
        file, offset, length = _where(out / "ok", "model.w")
        _flip(file, offset + 1)
    dist.barrier()
    try:
        checkpoint.load(loaded, out / "ok", meta=meta)
    except ValueError as e:
        res["corrupt"] = str(e)
    bad = state(2)
    bad["model"]["w"].to_local()[0, 0] = float("nan") if rank == 1 else 0.0
    checkpoint.save(bad, out / "nan", meta=meta)
    try:
        checkpoint.load(loaded, out / "nan", meta=meta, check_finite=True)
    except ValueError as e:
        res["nan"] = str(e)
    return res


def test_two_ranks_share_the_lock_the_checksums_and_the_refusals(tmp_path):
    import torch.multiprocessing as mp

    from tests.ranks import free_port
    (tmp_path / "locked").mkdir()
    with files.writer_lock(tmp_path / "locked", "test"):  # another writer holds the folder
        mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"two_ranks-{r}.pt") for r in range(2)]
    for res in results:
        assert res["locked"].startswith("SaveInProgressError: checkpoint path") and "another save" in res["locked"]
        assert res["ok"]
        assert "does not match its sha256" in res["corrupt"] and "tensor model.w[" in res["corrupt"]
        assert "tensors hold NaN or inf" in res["nan"] and "model.w" in res["nan"]
    assert results[0] == results[1]
    assert not [p for p in (tmp_path / "locked").iterdir()]  # the refused save wrote nothing
