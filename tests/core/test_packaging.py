"""pyproject's package list names every package folder of the tree: a wheel (a non-editable install)
holds only the packages listed, so a subpackage left out is missing there while editable installs
still find it."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in tool["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert "bumblebee.kernels" in found  # the walk reads the mapping
    missing = sorted(found - set(tool["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
