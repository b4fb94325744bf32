"""The weight-transfer benchmark's profile breakdown (`benchmarks/weight_transfer/profile_breakdown.py`):
kernel categories from real CUDA kernel names, busy / idle / lead / tail time and the timeline on a
synthetic GPU event list, and a real CPU-profiled call (phases, top ops, no device fields)."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


@pytest.fixture
def pb(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # profile_update reads benchmarks/timing.py
    spec = importlib.util.spec_from_file_location("profile_breakdown", BENCH / "weight_transfer" / "profile_breakdown.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NAMES = {
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "nccl",
    "Memcpy DtoD (Device -> Device)": "copy",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<unsigned char, 2, 1, 1>, "
    "at::native::Copy<unsigned char, unsigned char> >": "copy",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const>": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>>": "copy",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel>": "copy",
    "Memset (Device)": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
}


def test_kernel_names_fall_in_their_categories(pb):
    assert {n: pb.classify(n) for n in NAMES} == NAMES


def test_union_of_intervals(pb):
    assert pb.union_us([]) == 0
    assert pb.union_us([(5, 9), (0, 2), (1, 3), (6, 7), (9, 10)]) == 3 + 5  # [0, 3) and [5, 10)


def _ev(name, start, end, device=CPU, thread=1, self_us=0.0, **kw):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           thread=thread, self_cpu_time_total=self_us, **kw)


def test_breakdown_of_a_synthetic_gpu_update(pb):
    nccl = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    events = [
        _ev("bench.update", 100, 1100, self_us=240.0),
        _ev("bench.update", 100, 1100, device=CUDA, is_user_annotation=True),  # mirrored range: no kernel
        _ev("weight_transfer.move", 190, 880, device=CUDA),  # one a torch does not flag: no kernel either
        _ev("weight_transfer.prepare", 110, 190, self_us=80.0),
        _ev("weight_transfer.move", 190, 880, self_us=300.0),
        _ev("c10d::send", 200, 260, self_us=60.0),
        _ev("c10d::send", 300, 310, thread=7, self_us=9000.0),  # another thread's op: left out
        _ev("aten::copy_", 900, 905, self_us=5.0),
        _ev("Memcpy DtoD (Device -> Device)", 200, 350, device=CUDA),
        _ev(nccl, 300, 800, device=CUDA),  # overlaps the copy on another stream
        _ev("Memcpy DtoD (Device -> Device)", 900, 1000, device=CUDA),
        _ev("Memset (Device)", 1050, 1200, device=CUDA),  # clipped to the window
        _ev(nccl, 1300, 1400, device=CUDA),  # after the window
    ]
    got = pb.breakdown(events, "bench.update", wall_ms=1.02, device=True)
    assert got["window_ms"] == pytest.approx(1.0) and got["wall_ms"] == 1.02 and got["kernels"] == 4
    assert got["gpu_ms"] == pytest.approx({"nccl": 0.5, "copy": 0.25, "other": 0.05})
    assert got["gpu_busy_ms"] == pytest.approx(0.75)  # [200, 800) + [900, 1000) + [1050, 1100)
    assert got["gpu_idle_ms"] == pytest.approx(0.25)
    assert got["lead_ms"] == pytest.approx(0.1) and got["tail_ms"] == pytest.approx(0.0)
    assert [r[0] for r in got["timeline"]] == ["copy", "nccl", "copy", "other"]
    assert got["timeline"][1][1:] == pytest.approx([0.2, 0.7])
    assert [p[0] for p in got["phases"]] == ["prepare", "move"]
    assert got["phases"][1][1:] == pytest.approx([0.09, 0.69])
    ops = [(o["name"], o["count"]) for o in got["top_cpu_ops"]]
    assert ops == [("weight_transfer.move", 1), ("bench.update", 1), ("weight_transfer.prepare", 1),
                   ("c10d::send", 1), ("aten::copy_", 1)]
    assert got["top_cpu_ops"][0]["self_ms"] == pytest.approx(0.3)


def test_profile_update_on_the_cpu(pb):
    a = torch.randn(67, 67)

    def fn():
        with torch.profiler.record_function("weight_transfer.move"):
            for _ in range(3):
                a @ a
        torch.cat([a, a.t()])
    got = pb.profile_update(fn, "cpu", before=lambda: torch.ones(3).sum())
    assert got["wall_ms"] > 0 and 0 < got["window_ms"]
    assert [p[0] for p in got["phases"]] == ["move"]
    names = {o["name"]: o["count"] for o in got["top_cpu_ops"]}
    assert names.get("aten::mm") == 3 and names.get("aten::cat") == 1 and "aten::sum" not in names  # before(): outside
    assert got["gpu_ms"] is None and got["gpu_idle_ms"] is None and got["timeline"] is None
