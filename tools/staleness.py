"""`bumblebee results --stale`: which current result files measure code that changed since their commit.

A result file is stamped with the commit whose code ran it (`benchmarks/stamp.py`). It still measures
the current code when none of the files its benchmark measures changed between that commit and HEAD:
the benchmark's folder (its results and notes aside; of its probes only the one that wrote the file)
and the shared timing helper, plus the slot's primitive, twin, kernels and common types (the files
and folders named for the slot); a benchmark of a whole step measures every primitive, twin, kernel,
model, the runtime and the core package (context parallelism's files only where it applies it, and
not a slot its model never runs, as its recorded HF config says: `slots_not_in`). Older
runs (history.jsonl, history/ and before_* folders) are not checked: they say what they measured.
A Python file whose change leaves its code alone (comments, docstrings) does not count, nor does a
file moved with its code as it was. Reads git; a commit that git does not know (a shallow clone) is
reported as unknown, not as current.
"""
from __future__ import annotations

import ast
import functools
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


def slots_not_in(hf_config) -> tuple[str, ...]:
    """Slots a whole step of the model with this HF config never runs, read from the config a result
    records: gated DeltaNet without `linear_attention` layer types, MLA without `kv_lora_rank`. No
    config (or not a dict): none, so every slot counts."""
    if not isinstance(hf_config, dict):
        return ()
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    layer_types = list(hf_config.get("layer_types") or []) + list(text.get("layer_types") or [])
    mla = "kv_lora_rank" in hf_config or "kv_lora_rank" in text
    return tuple(s for s, runs in (("linear_attention", "linear_attention" in layer_types), ("mla", mla)) if not runs)


def measured_paths(slot: str, not_run: tuple[str, ...] = ()) -> list[str]:
    """git pathspecs of the code a slot's benchmark measures (a `*` crosses folders, as git's default);
    `not_run`: slots a whole-step benchmark's model never runs (`slots_not_in`)."""
    own = [f"benchmarks/{slot}/", "benchmarks/timing.py", f":(exclude)benchmarks/{slot}/results", ":(exclude)*.md"]
    if slot in MEASURES:
        skip = (*not_run, *(() if slot in RUNS_CP else ("context_parallel",))) if MEASURES[slot] == WHOLE_STEP else ()
        return own + [f"{p}*" for p in MEASURES[slot]] + (list(NOT_IN_STEP) if slot != "rl_pipeline" else []) \
            + [f":(exclude){d}/{s}*" for s in skip for d in CODE]
    return own + [f"{d}/{slot}*" for d in CODE]


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def _measured_by(name: str, changed: str, slot: str) -> bool:
    """Whether a changed file under the slot's probes/ measures the result file `name`: only the probe
    that wrote it (`probe_<x>.py` writes `probe_<x>*.json[l]`) does; the benchmark's own files never
    import a probe."""
    prefix = f"benchmarks/{slot}/probes/"
    if not changed.startswith(prefix):
        return True
    script = Path(changed).stem
    return name.startswith("probe_") and Path(name).stem.startswith(script)


def _code_of(text: str | None):
    """A Python file's syntax tree without its docstrings (comments never reach it), or None."""
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)  # every result file of a commit asks about the same changed files
def _only_words(root: Path, commit: str, head: str, path: str, old_path: str | None = None) -> bool:
    """Whether a .py file changed only in comments and docstrings between `commit` and `head`
    (`old_path`: its name at `commit` where git found it moved)."""
    if not path.endswith(".py"):
        return False
    old, new = (_git(root, "show", f"{rev}:{name}") for rev, name in ((commit, old_path or path), (head, path)))
    if old.returncode or new.returncode:  # added or removed
        return False
    a = _code_of(old.stdout)
    return a is not None and a == _code_of(new.stdout)


def changed_since(commit: str, slot: str, root: Path, name: str = "",
                  not_run: tuple[str, ...] = ()) -> list[str] | None:
    """Files the slot's benchmark measures that differ between `commit` and HEAD (None: git does not
    know the commit); `name`, the result file's name, keeps the slot's probes out of what other files
    measure (`_measured_by`); `not_run` as in `measured_paths`."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return None
    got = _git(root, "diff", "--name-status", "-M", commit, "HEAD", "--", *measured_paths(slot, not_run))
    if got.returncode:
        raise RuntimeError(f"git diff failed: {got.stderr.strip()}")
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    changed = []
    for line in got.stdout.splitlines():
        status, *paths = line.split("\t")
        path, old = paths[-1], (paths[0] if status.startswith("R") else None)
        if status == "R100" or not _measured_by(name, path, slot) or _only_words(root, commit, head, path, old):
            continue  # moved as it was, another probe's, or words only
        changed.append(path)
    return sorted(changed)


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
        result = results.load(path)
        commit = result.get("commit")
        changed = changed_since(commit, slot, root, path.name, slots_not_in(result.get("hf_config"))) \
            if isinstance(commit, str) and commit else None
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
