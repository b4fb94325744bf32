"""The `slow` marker (tests/conftest.py): cases that start processes are marked, so the README's quick
check `pytest -m "not slow"` leaves them to the full suite."""
import types

from tests import conftest


def _spawns(tmp_path):
    return spawn(2, "two_ranks", tmp_path)  # noqa: F821 (only its source is read)


def _spawns_within():
    return spawn_within(_plain, (), nprocs=2, timeout_s=SUBPROCESS_TIMEOUT_S)  # noqa: F821


def _interprets():
    return run_under_interpreter(__file__)  # noqa: F821


def _python_child():
    return subprocess.run([sys.executable, "-c", "import torch"])  # noqa: F821


def _ray_cluster():
    ray.init(num_cpus=2)  # noqa: F821


def _plain():
    return subprocess.run(["git", "status"])  # noqa: F821


def _item(fn, nodeid="tests/x/test_y.py::test_z", fixtures=()):
    defs = {f.__name__: [types.SimpleNamespace(func=f)] for f in fixtures}
    return types.SimpleNamespace(function=fn, nodeid=nodeid, _fixtureinfo=types.SimpleNamespace(name2fixturedefs=defs))


def test_a_case_that_starts_processes_is_slow():
    assert conftest._starts_processes(_item(_spawns))
    assert conftest._starts_processes(_item(_spawns_within))
    assert conftest._starts_processes(_item(_interprets))
    assert conftest._starts_processes(_item(_python_child))
    assert conftest._starts_processes(_item(_ray_cluster))
    assert conftest._starts_processes(_item(_plain, fixtures=(_spawns,)))  # through a fixture


def test_a_case_that_does_not_is_not():
    assert not conftest._starts_processes(_item(_plain))
    assert not conftest._starts_processes(_item(None))
