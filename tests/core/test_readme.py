"""The README's Quickstart: one bash block of exactly two commands, the second being what CI runs."""
import re
import subprocess
from pathlib import Path

import pytest

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


def _run_ci_with_stubs(tmp_path, cpu_rc, verl_rc, pip_rc=0):
    """.ci/run on a copy of the README whose python/pip are stubs: each logs its call and exits with
    the status given (pytest in .venv: cpu_rc, in .venv-verl: verl_rc, pip: pip_rc)."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci/run").write_text((ROOT / ".ci/run").read_text())
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    log = tmp_path / "calls.log"
    stub = f'#!/bin/sh\necho "$0 $*" >> {log}\ncase "$0 $*" in\n' \
           f'  *.venv-verl/bin/python\\ -m\\ pytest*) exit {verl_rc};;\n  *.venv/bin/python\\ -m\\ pytest*) exit {cpu_rc};;\n' \
           f'  */pip\\ *) exit {pip_rc};;\nesac\nexit 0\n'
    for rel in ("bin/python3", ".venv/bin/pip", ".venv/bin/python", ".venv-verl/bin/pip", ".venv-verl/bin/python"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(stub)
        (tmp_path / rel).chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(tmp_path / ".ci/run")], cwd=tmp_path, env=env, capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    return p.returncode, [c for c in calls if " -m pytest" in c]


@pytest.mark.parametrize("cpu_rc,verl_rc", [(0, 0), (1, 0), (0, 1), (1, 1), (5, 0)])
def test_the_verl_tests_run_whatever_the_cpu_tests_did_and_either_failure_fails(tmp_path, cpu_rc, verl_rc):
    rc, pytests = _run_ci_with_stubs(tmp_path, cpu_rc, verl_rc)
    assert [c.split()[0] for c in pytests] == [".venv/bin/python", ".venv-verl/bin/python"], pytests
    assert (rc == 0) == (cpu_rc == 0 and verl_rc == 0), rc


def test_a_failed_install_stops_the_command(tmp_path):
    rc, pytests = _run_ci_with_stubs(tmp_path, 0, 0, pip_rc=1)
    assert rc != 0 and pytests == []
