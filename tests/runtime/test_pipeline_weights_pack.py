"""The object-store channel's packing: every tensor comes back bitwise, any dtype and shape, through
Ray's object store as through memory; a stored array is read from shared memory (no copy)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray", reason="the RL pipeline needs Ray: pip install -e '.[rl]'")

from bumblebee.runtime.pipeline.weights import pack, unpack  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(3, 5, generator=g)), ("b16", torch.randn(7, generator=g).bfloat16()),
            ("scalar", torch.tensor(3.0, dtype=torch.float64)), ("empty", torch.empty(0, 4)),
            ("ids", torch.arange(5)), ("transposed", torch.randn(4, 6, generator=g).t()),
            ("odd", torch.randn(3, generator=g).half())]


def _same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def test_pack_round_trip_in_memory():
    items = _tensors()
    _same(unpack(pack(items), "cpu"), items)


def test_pack_views_cpu_tensors_and_round_trips_through_the_object_store():
    import ray
    items = _tensors()
    packed = pack(items)
    assert packed[0][3].ctypes.data == items[0][1].data_ptr()  # a view of the tensor, not a copy
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        ref = ray.put(packed)
        del packed
        got = ray.get(ref)
        assert not got[0][3].flags.writeable  # mapped from the store, read-only
        _same(unpack(got, "cpu"), items)
    finally:
        ray.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_of_cuda_tensors_round_trips_onto_the_device():
    items = [(n, t.cuda()) for n, t in _tensors()]
    got = unpack(pack(items), "cuda")
    assert all(t.is_cuda for _, t in got)
    _same(got, items)
