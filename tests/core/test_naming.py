"""One spelling per slot (docs/ARCHITECTURE.md, "One spelling per slot"): every file of a slot
carries the slot's name, so a newcomer finds its primitive, twin, kernels, shared code, tests,
skill, benchmark and results by that name alone."""
import ast
import re
from pathlib import Path

from bumblebee import registry

ROOT = Path(__file__).resolve().parents[2]
# workflows and components with a skill, benchmark or test folder of their own (not slots)
WORKFLOWS = {"pairing", "rl_runtime", "rl_smoke", "rl_pipeline", "long_context_recipe", "moe", "training_step", "composed_step",
             "offload", "memory_estimator"}
# other spellings of slot names, never to appear as a file or folder name
VARIANTS = ("linear_ce", "lce", "linear_cross_entropy", "crossentropy", "xent", "gdn_attention", "deltanet")


def slots() -> set[str]:
    """The registered slots and those whose primitive is a package of its own (registered on import)."""
    return set(registry.slots()) | {p.name for p in (ROOT / "primitives").iterdir()
                                    if (p / "__init__.py").exists()}


def slot_of(stem: str, names: set[str]) -> str | None:
    """The slot a file stem is named after: the stem itself or `<slot>_...`, the longest match."""
    found = [s for s in names if stem == s or stem.startswith(s + "_")]
    return max(found, key=len) if found else None


def misnamed(names: set[str]) -> list[str]:
    """Every file or folder of the slot layout that is not named after a slot (or a workflow)."""
    bad = []

    def check(path: Path, stem: str, allowed=names):
        if slot_of(stem, allowed) is None:
            bad.append(str(path.relative_to(ROOT)))

    for folder in ("primitives", "kernels", "common"):
        for p in sorted((ROOT / folder).iterdir()):
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists()):
                check(p, p.stem)
    for p in sorted((ROOT / "baselines").glob("*.py")):
        if p.name != "__init__.py" and p.stem not in names:
            bad.append(str(p.relative_to(ROOT)))
    for p in sorted((ROOT / "skills").iterdir()):
        if p.is_dir():
            if "_" in p.name:
                bad.append(f"{p.relative_to(ROOT)} (skills use dashes)")
            check(p, p.name.replace("-", "_"), names | WORKFLOWS)
    for p in sorted((ROOT / "benchmarks").iterdir()):
        if p.is_dir() and not p.name.startswith(("_", ".")):
            check(p, p.name, names | WORKFLOWS)
            for r in sorted((p / "results").rglob("*")) if (p / "results").is_dir() else ():
                other = slot_of(r.stem, names - {p.name})
                if r.is_file() and other is not None and slot_of(r.stem, {p.name}) is None:
                    bad.append(f"{r.relative_to(ROOT)} (named after {other}, in {p.name}'s results)")
    for p in sorted((ROOT / "tests" / "primitives").glob("test_*.py")):
        check(p, p.stem[len("test_"):], names | WORKFLOWS)
    return bad


def variants() -> list[str]:
    """Files or folders spelled with another name of a slot."""
    pattern = re.compile(rf"(^|[_/-])({'|'.join(VARIANTS)})([_./-]|$)")
    return sorted(p for p in (str(q.relative_to(ROOT)) for folder in ("primitives", "baselines", "kernels", "common",
                                                                       "skills", "benchmarks", "tests")
                              for q in (ROOT / folder).rglob("*")) if pattern.search(p.replace("-", "_")))


def torch_paths_not_suffixed_torch() -> list[str]:
    """Kernel-module functions named as references (`_ref`, `_ref_`): a kernel's algorithm in torch
    is `<name>_torch` (in place: `<name>_torch_`)."""
    out = []
    for p in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef) and re.search(r"_ref_?$", node.name):
                out.append(f"{p.name}:{node.lineno} {node.name}")
    return out


def test_every_slot_file_is_named_after_its_slot():
    assert "cross_entropy" in slots()
    bad = misnamed(slots())
    assert bad == [], f"name these after their slot (docs/ARCHITECTURE.md), or list a workflow in WORKFLOWS: {bad}"


def test_no_other_spelling_of_a_slot():
    assert variants() == []


def test_a_kernels_torch_path_is_suffixed_torch():
    assert torch_paths_not_suffixed_torch() == []


def test_kernels_and_shared_code_have_names_of_their_own():
    """A kernel module is `<slot>_<what>.py` (never the primitive's `<slot>.py`), and no file of
    kernels/ shares its name with one of common/ (`moe_dispatch_permute.py` in both made every
    mention ambiguous)."""
    names = slots()
    bare = sorted(p.name for p in (ROOT / "kernels").glob("*.py") if p.stem in names)
    assert bare == [], f"name each kernel module <slot>_<what>.py: {bare}"
    both = {p.name for p in (ROOT / "kernels").glob("*.py")} & {p.name for p in (ROOT / "common").glob("*.py")}
    assert both - {"__init__.py"} == set()


def test_the_checks_catch_what_they_should():
    names = {"cross_entropy", "moe_dispatch"}
    assert slot_of("cross_entropy_linear", names) == "cross_entropy"
    assert slot_of("moe_dispatch_permute", names) == "moe_dispatch"
    assert slot_of("linear_ce", names) is None and slot_of("moe", names) is None
    assert re.search("linear_ce", "tests/primitives/test_linear_ce.py")
