"""The dependency direction of ARCHITECTURE.md, checked on every import statement."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"bumblebee": "bumblebee", "kernels": "bumblebee.kernels", "primitives": "bumblebee.primitives",
           "baselines": "bumblebee.baselines", "models": "bumblebee.models", "runtime": "bumblebee.runtime"}
# folder -> subpackages of bumblebee it must not import
FORBIDDEN = {
    "kernels": None,  # nothing of ours at all
    "baselines": ("kernels", "primitives", "models", "runtime", "benchmarks"),
    "primitives": ("baselines", "models", "runtime", "benchmarks"),
    "models": ("kernels", "primitives", "baselines", "runtime", "benchmarks"),
    "runtime": ("benchmarks",),
    "bumblebee": ("benchmarks",),
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def _files():
    for folder in FORBIDDEN:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield folder, path


@pytest.mark.parametrize("folder,path", list(_files()), ids=lambda x: str(x).split("/work/main/")[-1])
def test_import_direction(folder, path):
    for name in _imports(path):
        assert not name.startswith(("tests", "benchmarks")), f"{path}: imports {name}"
        if not name.startswith("bumblebee"):
            continue
        if FORBIDDEN[folder] is None:
            pytest.fail(f"{path}: kernels import nothing of ours, found {name}")
        parts = name.split(".")
        if len(parts) > 1 and parts[1] in FORBIDDEN[folder]:
            pytest.fail(f"{path}: {folder}/ must not import bumblebee.{parts[1]} ({name})")


def test_plotting_benchmarks_have_an_extra_that_installs_matplotlib():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    plotting = [p.name for p in (ROOT / "benchmarks").glob("*.py") if "matplotlib" in set(_imports(p))]
    assert plotting, "no benchmark draws a plot: drop this test"
    assert any(dep.startswith("matplotlib") for deps in extras.values() for dep in deps), \
        f"{plotting} import matplotlib, which no extra of pyproject.toml installs"
