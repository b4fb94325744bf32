"""No test waits on a fixed limit tighter than CI's budget: a loaded 2-core machine runs slow, and a
limit tuned on a quiet one fails there (tests/limits.py holds the one limit every test uses)."""
import re
from pathlib import Path

from tests.limits import CI_BUDGET_S, PROCESS_GROUP_TIMEOUT, SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
# a literal limit: timeout=600, timeout: int = 600, timedelta(seconds=60), timedelta(minutes=3)
LITERAL = re.compile(r"timeout(?:\s*:\s*\w+)?\s*=\s*(\d+(?:\.\d+)?)\b|timedelta\(\s*(seconds|minutes)\s*=\s*(\d+)")
POLL_S = 10  # a shorter wait is a poll in a loop (`ctx.join(timeout=1)`), not a limit on the whole


def literal_limits(text: str) -> list[tuple[int, float]]:
    """(line, seconds) of each literal time limit in a source text."""
    out = []
    for m in LITERAL.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, float(m.group(1)) if m.group(1) else float(m.group(3)) * (60 if m.group(2) == "minutes"
                                                                                    else 1)))
    return out


def test_the_limits_fit_the_budget():
    assert 30 * 60 <= SUBPROCESS_TIMEOUT_S < CI_BUDGET_S
    assert PROCESS_GROUP_TIMEOUT.total_seconds() == SUBPROCESS_TIMEOUT_S


def test_the_scanner_finds_literal_limits():
    src = "def f(timeout: int = 600):\ninit(timeout=datetime.timedelta(seconds=60))\nw = timedelta(minutes=3)\n"
    assert literal_limits(src) == [(1, 600.0), (2, 60.0), (3, 180.0)]


def test_no_test_has_a_tight_literal_limit():
    tight = [f"{p.relative_to(ROOT)}:{line}: {s:g} s" for p in sorted((ROOT / "tests").rglob("*.py"))
             if p.name != "test_limits.py" for line, s in literal_limits(p.read_text())
             if POLL_S <= s < SUBPROCESS_TIMEOUT_S]
    assert not tight, "use tests.limits.SUBPROCESS_TIMEOUT_S / PROCESS_GROUP_TIMEOUT: " + "; ".join(tight)
