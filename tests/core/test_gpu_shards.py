"""The GPU suite's shards (tests/gpu_shards.py): every file with a `gpu` mark runs in exactly one shard,
and every file a shard names exists and has a `gpu` mark."""
from collections import Counter

import pytest

from tests import gpu_shards


def test_every_gpu_file_in_exactly_one_shard():
    listed = Counter(f for _, files in gpu_shards.SHARDS.values() for f in files)
    assert not [f for f, n in listed.items() if n > 1], "a file in two shards runs twice"
    gpu = gpu_shards.gpu_files()
    assert gpu, "no gpu-marked test file found"
    assert not gpu - set(listed), f"gpu-marked files in no shard: {sorted(gpu - set(listed))}"
    assert not set(listed) - gpu, f"shards name files without a gpu mark: {sorted(set(listed) - gpu)}"


def test_command_and_bad_shard():
    cmd = gpu_shards.command(1, ["-x"])
    assert cmd[1:6] == ["-m", "pytest", "-m", "gpu", "-q"] and cmd[-1] == "-x"
    assert "-q" not in gpu_shards.command(1, ["-v"])  # a -v after -q would be cancelled
    assert set(gpu_shards.SHARDS[1][1]) <= set(cmd)
    with pytest.raises(ValueError, match="shard"):
        gpu_shards.command(99, [])
