"""`bumblebee results --stale`: which current result files measure code that changed since their commit.

A result file is stamped with the commit whose code ran it (`benchmarks/stamp.py`). It still measures
the current code when none of the files its benchmark measures changed between that commit and HEAD:
the benchmark's folder (its results and notes aside) and the shared timing helper, plus the slot's
primitive, twin, kernels and common types (the files and folders named for the slot); a benchmark of
a whole step measures every primitive (context parallelism only where it applies it), twin, kernel,
model, the runtime and the core package. Older runs (history.jsonl,
history/ and before_* folders) are not checked: they say what they measured. Reads git; a commit
that git does not know (a shallow clone) is reported as unknown, not as current.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from bumblebee.tools import results

CODE = ("primitives", "baselines", "kernels", "common")
WHOLE_STEP = (*CODE, "models", "runtime", "bumblebee")  # bumblebee/: the core (registry, recompute, fused, ...)
# benchmarks whose files measure more than the slot of their name
MEASURES = {
    "training_step": WHOLE_STEP,
    "composed_step": WHOLE_STEP,
    "rl_pipeline": WHOLE_STEP,
    "offload": WHOLE_STEP,
    "context_parallel": tuple(f"{d}/{s}" for d in CODE for s in ("context_parallel", "attention", "linear_attention")),
}
# what a training step never runs: the RL system around it
NOT_IN_STEP = (":(exclude)*weight_transfer*", ":(exclude)runtime/pipeline", ":(exclude)bumblebee/integrations")
# context parallelism runs only where a benchmark applies it (composed_step's --cp, its own slot)
RUNS_CP = ("composed_step", "context_parallel")


def measured_paths(slot: str) -> list[str]:
    """git pathspecs of the code a slot's benchmark measures (a `*` crosses folders, as git's default)."""
    own = [f"benchmarks/{slot}/", "benchmarks/timing.py", f":(exclude)benchmarks/{slot}/results", ":(exclude)*.md"]
    if slot in MEASURES:
        return own + [f"{p}*" for p in MEASURES[slot]] + (list(NOT_IN_STEP) if slot != "rl_pipeline" else []) \
            + ([] if slot in RUNS_CP else [":(exclude)primitives/context_parallel"])
    return own + [f"{d}/{slot}*" for d in CODE]


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def changed_since(commit: str, slot: str, root: Path) -> list[str] | None:
    """Files the slot's benchmark measures that differ between `commit` and HEAD (None: git does not
    know the commit)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return None
    got = _git(root, "diff", "--name-only", commit, "HEAD", "--", *measured_paths(slot))
    if got.returncode:
        raise RuntimeError(f"git diff failed: {got.stderr.strip()}")
    return sorted(got.stdout.split())


def current_files(directory: Path) -> list[tuple[str, Path]]:
    """(slot, file) of every current result file: older runs left out."""
    return [(slot, p) for slot, paths in results.by_slot(directory).items() for p in paths
            if not results.is_older_run(p, directory)]


def report(directory: Path | None = None, root: Path | None = None) -> list[dict]:
    """One record per current result file: file, slot, commit, and `changed` (the measured files
    changed since, [] when current; None where the commit is missing or unknown to git)."""
    directory = Path(directory) if directory else results.RESULTS_DIR
    root = Path(root) if root else results.ROOT
    rows = []
    for slot, path in current_files(directory):
        commit = results.load(path).get("commit")
        changed = changed_since(commit, slot, root) if isinstance(commit, str) and commit else None
        rows.append({"file": str(path.relative_to(directory)), "slot": slot, "commit": commit, "changed": changed})
    return rows


def render(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        commit = (r["commit"] or "none")[:12]
        if r["changed"] is None:
            state = "commit unknown to git" if r["commit"] else "no commit stamp"
        elif r["changed"]:
            shown = ", ".join(r["changed"][:4]) + (f" (+{len(r['changed']) - 4})" if len(r["changed"]) > 4 else "")
            state = f"STALE: {len(r['changed'])} measured files changed: {shown}"
        else:
            state = "current"
        lines.append(f"{r['file']}  [{commit}]  {state}")
    stale = sum(bool(r["changed"]) for r in rows)
    lines.append(f"{len(rows)} current result files; {stale} measure code that changed since their commit")
    return "\n".join(lines)
