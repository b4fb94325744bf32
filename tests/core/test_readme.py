"""The README's Quickstart: one bash block of exactly two commands, the second being what CI runs."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quickstart_commands():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 3)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Quickstart holds a single bash block"
    return [ln for ln in blocks[0].splitlines() if ln.strip()]


def test_two_commands_run_the_pairing_demo_then_the_tests():
    first, second = quickstart_commands()
    assert "bumblebee pair" in first and "--json" in first
    assert "pytest" in second
    for cmd in (first, second):  # each installs what it needs on a fresh machine
        assert "pip install" in cmd and "torch==" in cmd


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci/run").read_text()
    awk = re.search(r"cmd=\$\((.*)\)\n", script).group(1)
    out = subprocess.run(["bash", "-c", awk], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert out == quickstart_commands()[1]
