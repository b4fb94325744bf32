"""Every SKILL.md: front matter, and every path, line range and command it cites exists."""
import re
import shlex
from pathlib import Path

import pytest

from bumblebee import registry

ROOT = Path(__file__).resolve().parents[2]
SKILLS = sorted((ROOT / "skills").glob("*/SKILL.md"))
PATH_RE = re.compile(r"`((?:\.ci/|[\w-]+/)[\w./-]*\.(?:py|md|json|png|toml|txt)|\.ci/run)(?::(\d+)(?:-(\d+))?)?`")
COMMANDS = {"list", "pair", "results", "recipe"}


def front_matter(text: str) -> dict:
    if not text.startswith("---\n"):
        return {}
    head = text[4:text.index("\n---", 4)]
    return dict(line.split(":", 1) for line in head.splitlines() if ":" in line)


def bash_lines(text: str):
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        yield from (ln.strip() for ln in block.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#"))


def test_skills_exist_for_every_slot():
    assert SKILLS
    for slot, impls in registry.slots().items():
        skill = next(iter(impls.values())).skill
        assert (ROOT / skill).is_file(), f"slot {slot} has no {skill}"


@pytest.mark.parametrize("path", SKILLS, ids=lambda p: p.parent.name)
def test_front_matter(path):
    meta = front_matter(path.read_text())
    assert meta.get("name", "").strip() == path.parent.name, "name must equal the folder name (kebab-case)"
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", path.parent.name)
    assert len(meta.get("description", "").strip()) > 40, "description says what it does and when to use it"
    assert len(path.read_text().splitlines()) < 200


@pytest.mark.parametrize("path", SKILLS, ids=lambda p: p.parent.name)
def test_cited_paths_and_line_ranges_exist(path):
    for rel, start, end in PATH_RE.findall(path.read_text()):
        target = ROOT / rel
        assert target.exists(), f"{path.parent.name}: cites {rel}, which does not exist"
        if start:
            n = len(target.read_text().splitlines())
            assert 1 <= int(start) <= int(end or start) <= n, f"{rel}:{start}-{end} is outside 1..{n}"


@pytest.mark.parametrize("path", SKILLS, ids=lambda p: p.parent.name)
def test_commands_exist(path):
    for line in bash_lines(path.read_text()):
        words = shlex.split(line)
        for w in words:
            w = w.split("::")[0]
            if w.startswith(("tests/", "benchmarks/", "skills/")):
                assert (ROOT / w).exists(), f"{path.parent.name}: `{line}` names {w}, which does not exist"
        if "bumblebee" in words:
            sub = words[words.index("bumblebee") + 1]
            assert sub in COMMANDS, f"unknown subcommand in `{line}`"
            opts = dict(zip(words[::1], words[1::1]))
            if "--slot" in opts:
                for side in ("--a", "--b"):
                    if side in opts:
                        registry.choose(opts["--slot"], opts[side])  # options included
