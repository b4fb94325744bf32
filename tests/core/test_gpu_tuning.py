"""tests/gpu_tuning.py: the GPU shards' autotuning results, collected from a Triton cache (the winner
only), merged, and seeded into the shards' own cache only on the GPU they were tuned on."""
import json

import pytest

from tests import gpu_tuning


def _cache(tmp_path):
    d = tmp_path / "cache"
    (d / "AAA").mkdir(parents=True)
    (d / "BBB").mkdir()
    cfg = lambda w: {"kwargs": {"BK": 64}, "num_warps": w, "num_stages": 2, "num_ctas": 1, "maxnreg": None,  # noqa: E731
                     "pre_hook": None, "ir_override": None}
    (d / "AAA" / "k1.autotune.json").write_text(json.dumps(
        {"key": [16, 32], "configs_timings": [[cfg(2), [16.5, 16.4]], [cfg(4), [0.32, 0.31]], [cfg(8), [0.4, 0.3]]]}))
    (d / "BBB" / "k2.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": []}))  # nothing to keep
    (d / "BBB" / "k2.cubin").write_bytes(b"\0")  # compiled kernels are not collected
    return d, cfg


def test_collect_keeps_the_winner_triton_would_pick(tmp_path):
    d, cfg = _cache(tmp_path)
    got = gpu_tuning.collect(d)
    assert list(got) == ["AAA/k1.autotune.json"]
    assert got["AAA/k1.autotune.json"] == {"key": [16, 32], "configs_timings": [[cfg(4), [0.32, 0.31]]]}


def test_save_merges_and_seed_writes_only_on_that_gpu(tmp_path):
    d, _ = _cache(tmp_path)
    f = tmp_path / "tuning.json"
    assert gpu_tuning.save(d, "NVIDIA H200", "first", path=f) == 1
    other = tmp_path / "other"
    (other / "CCC").mkdir(parents=True)
    (other / "CCC" / "k3.autotune.json").write_text(json.dumps({"key": [2], "configs_timings": [[{}, [1.0]]]}))
    assert gpu_tuning.save(other, "NVIDIA H200", "second", path=f) == 2  # merged, not replaced
    assert json.loads(f.read_text())["note"] == "second"
    with pytest.raises(ValueError, match="NVIDIA H100"):
        gpu_tuning.save(other, "NVIDIA H100", "x", path=f)

    seeded = tmp_path / "seeded"
    assert gpu_tuning.seed(seeded, "NVIDIA H100 80GB HBM3", path=f) == 0 and not seeded.exists()
    (seeded / "AAA").mkdir(parents=True)
    (seeded / "AAA" / "k1.autotune.json").write_text("kept")  # a result already there is never replaced
    assert gpu_tuning.seed(seeded, "NVIDIA H200", path=f) == 1
    assert (seeded / "AAA" / "k1.autotune.json").read_text() == "kept"
    k3 = json.loads((seeded / "CCC" / "k3.autotune.json").read_text())
    assert k3 == {"key": [2], "configs_timings": [[{}, [1.0]]]}  # the form Triton's disk cache reads
    assert gpu_tuning.seed(seeded, "NVIDIA H200", path=f) == 0


def test_seed_refuses_an_entry_outside_its_folder(tmp_path):
    f = tmp_path / "tuning.json"
    f.write_text(json.dumps({"device": "G", "entries": {"../k.autotune.json": {"configs_timings": []}}}))
    with pytest.raises(ValueError, match="key dir"):
        gpu_tuning.seed(tmp_path / "c", "G", path=f)


def test_the_committed_results_are_well_formed():
    data = json.loads(gpu_tuning.TUNING_FILE.read_text())
    assert data["device"] and data["entries"]
    for rel, entry in data["entries"].items():
        key_dir, name = rel.split("/")
        assert key_dir.isalnum() and name.endswith(gpu_tuning.SUFFIX), rel
        assert len(entry["configs_timings"]) == 1 and isinstance(entry["configs_timings"][0][0], dict), rel
