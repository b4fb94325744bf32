"""benchmarks/timing.py: the one place the benchmarks read a clock, and what its timers call when.

Checked on the CPU with a fake clock, so every expected value is exact and nothing depends on how
fast the machine is."""
import importlib.util
import io
import tokenize
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# names that read a clock or time a call (time.time is matched as the pair `time . time`)
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time_ns", "process_time", "Event",
          "elapsed_time", "do_bench", "Timer", "timeit"}
# scripts whose clocks have not moved onto timing.py yet, and why; an entry must go once its script is clean
NOT_YET: dict = {}


def clock_names(path: Path) -> list:
    """(line, name) of every clock read in the code of `path`; strings and comments do not count."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    found = [(t.start[0], t.string) for t in toks if t.type == tokenize.NAME and t.string in CLOCKS]
    found += [(a.start[0], "time.time") for a, dot, b in zip(toks, toks[1:], toks[2:])
              if (a.string, dot.string, b.string) == ("time", ".", "time")]
    return sorted(found)


def scripts():
    return sorted(p for p in BENCHMARKS.rglob("*.py") if p.name != "timing.py")


@pytest.mark.parametrize("path", scripts(), ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_benchmarks_time_only_through_timing_py(path):
    """Probes included: they time through timing.py like the benchmarks (none needs its own clock)."""
    rel = str(path.relative_to(BENCHMARKS))
    found = clock_names(path)
    if rel in NOT_YET:
        assert found, f"{rel} no longer reads a clock of its own: remove it from NOT_YET"
    else:
        assert not found, f"{rel} times itself ({found}): use benchmarks/timing.py (extend it if it lacks a need)"


def test_the_clock_finder_sees_code_and_ignores_text(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('import time\n"""perf_counter in a docstring"""\nt = time.time()  # perf_counter\n'
                 "e = torch.cuda.Event(enable_timing=True)\nfrom time import perf_counter\n")
    assert clock_names(f) == [(3, "time.time"), (4, "Event"), (5, "perf_counter")]


@pytest.fixture
def timing(monkeypatch):
    """benchmarks/timing.py loaded from its file, its clock replaced by one that each timed call of a
    `FakeWork` advances by that call's cost."""
    spec = importlib.util.spec_from_file_location("bench_timing_under_test", BENCHMARKS / "timing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "time", types.SimpleNamespace(perf_counter=lambda: FakeWork.now))
    return mod


class FakeWork:
    """A callable whose k-th call (from 0) takes costs[k] ms on the fake clock; `log` records it."""
    now = 0.0

    def __init__(self, costs, log, name="fn"):
        self.costs, self.log, self.name, self.calls = list(costs), log, name, 0

    def __call__(self):
        FakeWork.now += self.costs[self.calls] / 1e3
        self.calls += 1
        self.log.append(self.name)


def test_step_times_ms_times_every_call_and_keeps_those_after_the_warmups(timing):
    log = []
    work = FakeWork([100, 90, 5, 1, 3], log)
    times = timing.step_times_ms(work, iters=3, warmup=2, before=lambda: log.append("before"),
                                 after=lambda i: log.append(f"after {i}"), cuda=False)
    assert log == [x for i in range(5) for x in ("before", "fn", f"after {i}")]
    assert times == pytest.approx([5, 1, 3])


def test_step_times_ms_with_no_iterations_only_warms_up(timing):
    work = FakeWork([4, 4], [])
    assert timing.step_times_ms(work, iters=0, warmup=2, cuda=False) == [] and work.calls == 2


def test_step_median_ms_is_the_median_of_the_kept_calls(timing):
    assert timing.step_median_ms(FakeWork([70, 2, 9, 4], []), iters=3, warmup=1, cuda=False) == pytest.approx(4)


def test_interleaved_median_ms_spreads_iters_over_rounds_in_one_order(timing):
    log, barriers = [], []
    a, b = FakeWork(range(1, 30), log, "a"), FakeWork(range(101, 130), log, "b")
    res = timing.interleaved_median_ms({"a": a, "b": b}, iters=5, warmup=2, rounds=2,
                                       before=lambda: barriers.append(1), cuda=False)
    # 3 calls a round (ceil 5 / 2); 2 warm-ups in round 1, 1 in round 2
    assert log == ["a"] * 5 + ["b"] * 5 + ["a"] * 4 + ["b"] * 4
    assert len(barriers) == len(log)
    # a kept calls 3, 4, 5 and 7, 8, 9 (costs 3 4 5 7 8 9); b likewise (+100)
    assert res == pytest.approx({"a": 6, "b": 106})


def test_interleaved_median_ms_in_one_round_is_one_after_the_other(timing):
    log = []
    fns = {"a": FakeWork([9, 9, 1, 2, 3], log, "a"), "b": FakeWork([9, 9, 4, 5, 6], log, "b")}
    res = timing.interleaved_median_ms(fns, iters=3, warmup=2, cuda=False)
    assert log == ["a"] * 5 + ["b"] * 5 and res == pytest.approx({"a": 2, "b": 5})


def test_median_ms_leaves_warmups_untimed(timing):
    log = []
    assert timing.median_ms(FakeWork([50, 50, 3, 1, 2], log), iters=3, warmup=2, cuda=False) == pytest.approx(2)
    assert len(log) == 5


def test_synced_on_a_cpu_device_waits_for_nothing(timing, monkeypatch):
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda *a: pytest.fail("synchronized a CPU run"))
    log = []
    timing.synced(lambda: log.append(1), "cpu")()
    timing.sync("cpu")
    assert log == [1]


def test_matmul_tflops_reads_the_rate_through_the_given_timer(timing):
    seen = []

    def timer(fn):
        seen.append(fn().shape)
        return 2.0
    assert timing.matmul_tflops(64, device="cpu", timer=timer) == pytest.approx(2 * 64 ** 3 / 2.0 / 1e9)
    assert seen == [(64, 64)]


def test_stopwatch_counts_seconds_from_its_start_and_restart(timing):
    clock = timing.Stopwatch()
    FakeWork([1500], [])()
    assert clock.seconds() == pytest.approx(1.5)
    clock.restart()
    FakeWork([250], [])()
    assert clock.seconds() == pytest.approx(0.25)
