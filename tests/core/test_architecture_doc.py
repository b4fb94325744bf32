"""docs/ARCHITECTURE.md and README's Layout match the tree: every path they name exists (a recipe
whose file moved fails here), every folder of the distribution is described, and the layer table
covers every folder whose imports tests/core/test_dependencies.py checks."""
import re
import tomllib
from pathlib import Path

from tests.core.test_dependencies import FORBIDDEN

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# a backticked repository path: a slash, no spaces (`registry.py` alone is read in its folder's context)
PATH = re.compile(r"`([\w.<>-]*/[\w./<>-]*)`")


def named_paths(text: str) -> list[tuple[str, bool]]:
    """(path, planned) of every backticked path; `planned` where its line says so."""
    return [(m.group(1), "(planned)" in line) for line in text.splitlines() for m in PATH.finditer(line)]


def missing(text: str) -> list[str]:
    """The named paths that do not exist: a template (`attention_<name>.py`) needs its folder, a
    planned file its folder, any other path itself."""
    out = []
    for path, planned in named_paths(text):
        if "<" in path or planned:
            folder = path.split("<")[0].rsplit("/", 1)[0] if "/" in path.split("<")[0] else ""
            if folder and not (ROOT / folder).is_dir():
                out.append(path)
        elif not (ROOT / path).exists():
            out.append(path)
    return out


def _folders() -> set[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return set(package_dir.values()) | {"skills", "benchmarks", "tests", "docs"}


def test_every_path_the_architecture_doc_names_exists():
    assert len(named_paths(DOC.read_text())) > 40
    assert missing(DOC.read_text()) == []


def test_the_check_catches_a_moved_file():
    assert missing("1. `models/no_such_family.py`: the config") == ["models/no_such_family.py"]
    assert missing("`nowhere/attention_<name>.py`") == ["nowhere/attention_<name>.py"]
    assert missing("`primitives/attention_<name>.py`, `primitives/context_parallel.py` (planned)") == []


def test_the_layout_and_the_layer_table_cover_every_folder():
    text = DOC.read_text()
    layout = text.split("```")[1]
    described = {line.split()[0].rstrip("/") for line in layout.splitlines() if line and not line.startswith(" ")}
    assert _folders() <= described, _folders() - described
    table = text.split("## Layers and the import direction")[1].split("\n\n")[2]
    rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)/`", table, re.M)}
    assert set(FORBIDDEN) <= rows, set(FORBIDDEN) - rows


def test_readme_layout_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("\n## Layout\n")[1].split("\n## ")[0]
    assert missing(layout) == []
    named = {p.split("/")[0] for p, _ in named_paths(layout)}
    assert _folders() <= named, f"README's Layout does not describe {_folders() - named}"
