"""The dependency direction of docs/ARCHITECTURE.md ("Layers and the import direction"), checked on
every import statement, and no import circle in the whole graph; that no
primitive reaches its twin's code another way (a registry look-up of a baseline, a relative import
of baselines/, a module named by string); and that what a primitive and its twin share lives in
common/, named after its slot."""
import ast
from pathlib import Path

import pytest

from bumblebee import registry

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"bumblebee": "bumblebee", "kernels": "bumblebee.kernels", "primitives": "bumblebee.primitives",
           "baselines": "bumblebee.baselines", "models": "bumblebee.models", "runtime": "bumblebee.runtime",
           "tools": "bumblebee.tools", "common": "bumblebee.common"}
# folder -> subpackages of bumblebee it must not import
FORBIDDEN = {
    "kernels": None,  # nothing of ours at all
    # a slot's parameters and plain steps that its primitive and its twin both import: as low as
    # the baselines, and never the twin or the primitive itself
    "common": ("kernels", "primitives", "baselines", "models", "runtime", "benchmarks", "tools"),
    "baselines": ("kernels", "primitives", "models", "runtime", "benchmarks"),
    "primitives": ("baselines", "models", "runtime", "benchmarks"),
    "models": ("kernels", "primitives", "baselines", "common", "runtime", "benchmarks"),
    "runtime": ("benchmarks", "tools"),
    "tools": ("benchmarks",),
    # the core: below the models and what uses them
    "bumblebee": ("benchmarks", "common", "models", "runtime", "tools"),
}
# the package's facade (`bb.models`, `bb.pair`) and the adapters to outside frameworks sit above everything
ABOVE_ALL = ("bumblebee/__init__.py", "bumblebee/integrations/")


def _imports(path: Path):
    yield from _imports_of(path.read_text(), path)


def _imports_of(source: str, path: Path):
    """Every module (and module.name) an import statement of `source` (the text of `path`) names,
    relative imports resolved against the file's package."""
    folder, *sub = path.relative_to(ROOT).parts[:-1]
    package = FOLDERS.get(folder, "bumblebee").split(".") + list(sub)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


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
        if str(path.relative_to(ROOT)).startswith(ABOVE_ALL):
            continue
        if len(parts) > 1 and parts[1] in FORBIDDEN[folder]:
            pytest.fail(f"{path}: {folder}/ must not import bumblebee.{parts[1]} ({name})")


def test_common_holds_only_files_named_after_a_slot():
    """common/ is no second core: each file serves one slot's pair and carries its name."""
    slots = registry.slots()
    for path in sorted((ROOT / "common").rglob("*.py")):
        if path.name != "__init__.py":
            assert any(path.stem == s or path.stem.startswith(f"{s}_") for s in slots), \
                f"{path.name}: name it <slot>_*.py after the slot whose primitive and twin use it"


LOOKUPS = {"get", "resolve", "build", "choose", "code_on", "record", "spec"}  # bumblebee.registry's


def _baselines() -> dict[str, set[str]]:
    return {slot: {n for n, impl in impls.items() if impl.kind == "baseline"} for slot, impls in registry.slots().items()}


def twin_reaches(source: str, baselines: dict[str, set[str]]) -> list[str]:
    """What in a primitive's source reaches baseline code without an import statement: a registry
    look-up (`registry.resolve(slot, name)`, `resolve(...)` imported from it, ...) naming a baseline
    of that slot (of any slot when the slot is not a literal), and any string naming a module of
    bumblebee.baselines (importlib)."""
    found = []
    any_baseline = set().union(*baselines.values())
    tree = ast.parse(source)
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "bumblebee.registry" for a in node.names if a.name in LOOKUPS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("bumblebee.baselines"):
            found.append(f"line {node.lineno}: names the module {node.value}")
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Attribute):  # registry.resolve(...), bumblebee.registry.resolve(...)
            owner = fn.value.id if isinstance(fn.value, ast.Name) else getattr(fn.value, "attr", None)
            name = fn.attr if owner == "registry" and fn.attr in LOOKUPS else None
        else:  # resolve(...) imported from bumblebee.registry
            name = fn.id if isinstance(fn, ast.Name) and fn.id in imported else None
        if name is None:
            continue
        strings = [a.value for a in list(node.args) + [k.value for k in node.keywords]
                   if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        slot = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        names = baselines.get(slot, set()) if slot in baselines else any_baseline
        hits = [s for s in strings[1 if slot in baselines else 0:] if s.split(":")[0] in names]
        if hits:
            found.append(f"line {node.lineno}: looks up the baseline {hits[0]!r} through {name}()")
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "primitives").rglob("*.py")), ids=lambda p: p.name)
def test_no_primitive_reaches_baseline_code(path):
    assert not twin_reaches(path.read_text(), _baselines()), f"{path}: runs baseline code"


def test_twin_reach_check_catches_what_it_should():
    baselines = _baselines()
    caught = [
        'from bumblebee.registry import resolve\ntwin = resolve("linear_attention", "torch_chunked")',
        'from bumblebee import registry\nf = registry.get("router", name="aux_free_ref").obj',
        'from bumblebee.registry import build as b\nm = b("mla", "naive", 24, 3)',
        'import bumblebee\nbumblebee.registry.build("mla", "naive", 24, 3)',
        'fn = registry.resolve(slot, "eager")',  # slot not a literal: any slot's baseline
        'importlib.import_module("bumblebee.baselines.mtp")',
    ]
    for src in caught:
        assert twin_reaches(src, baselines), src
    for src in ('from bumblebee.registry import resolve\nf = resolve("cross_entropy", "linear_ce")',
                'registry.get("linear_attention", "fla")', 'x.get("eager")', 'resolve("linear_attention", "torch_chunked")',
                'loss_fn = registry.resolve("cross_entropy")'):
        assert not twin_reaches(src, baselines), src
    relative = ROOT / "primitives" / "x.py"
    tree_imports = list(_imports_of("from ..baselines.router import aux_free_topk\n", relative))
    assert "bumblebee.baselines.router" in tree_imports, tree_imports


def test_plotting_benchmarks_have_an_extra_that_installs_matplotlib():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    plotting = [p.name for p in (ROOT / "benchmarks").rglob("*.py") if "matplotlib" in set(_imports(p))]
    assert plotting, "no benchmark draws a plot: drop this test"
    assert any(dep.startswith("matplotlib") for deps in extras.values() for dep in deps), \
        f"{plotting} import matplotlib, which no extra of pyproject.toml installs"


def _modules() -> dict[str, Path]:
    """{module name: file} of every module the distribution installs, placed by pyproject's package-dir."""
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in package_dir.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[0] in package_dir.values() and folder == "bumblebee":
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of ours its import statements name (in functions too)}: `from a import b`
    is a.b where that is a module, else a; a module's parent packages are not counted as imported."""
    modules = _modules()

    def ours(name):  # the longest prefix of `name` that is one of our modules, or None
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        # per statement: `import a.b` names a.b; `from a import b` names a.b (a module) or a (b an attribute)
        targets = {ours(n) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for n in _statement_imports(node, path)}
        graph[name] = targets - {name, None}
    return graph


def _statement_imports(node, path):
    named = list(_imports_of(ast.unparse(node), path))
    return named[1:] if isinstance(node, ast.ImportFrom) else named


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    """No module reaches itself through import statements: the registry imports no implementation (the
    package names their loader, registry.load_with), so adding a slot never closes a loop."""
    graph = import_graph()
    assert "bumblebee.primitives.cross_entropy" in graph["bumblebee.primitives"]  # the graph sees the folders
    assert graph["bumblebee.registry"] <= {"bumblebee.options"}, graph["bumblebee.registry"]
    assert import_circles(graph) == []


def test_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


def _run(code: str) -> str:
    import subprocess
    import sys

    from tests.limits import SUBPROCESS_TIMEOUT_S

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_kernels_loads_no_primitive_or_model_code():
    kernels = sorted(p.stem for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__")
    loaded = _run("import sys\n" + "".join(f"import bumblebee.kernels.{k}\n" for k in kernels)
                  + "print(' '.join(m for m in sys.modules if m.startswith('bumblebee')))").split()
    core = {"bumblebee", "bumblebee.registry", "bumblebee.options", "bumblebee.model_registry"}
    assert {f"bumblebee.kernels.{k}" for k in kernels} <= set(loaded)
    assert set(loaded) - core - {"bumblebee.kernels"} == {f"bumblebee.kernels.{k}" for k in kernels}, loaded


NO_TRITON = """
import importlib.abc, json, sys
class NoTriton(importlib.abc.MetaPathFinder):  # as on an install without Triton
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTriton())
import torch
from bumblebee import registry
print(json.dumps({slot: {name: registry.code_on(slot, name, "cuda", torch.bfloat16)[1] for name in impls}
                  for slot, impls in registry.slots().items()}))
assert "triton" not in sys.modules
"""


def _triton_slots() -> set[str]:
    """Registered slots with a kernel module that imports Triton (kernels/<slot>_*.py); a kernel of a
    primitive package outside the registry (context_parallel) is not a slot's."""
    names = set(registry.slots())
    packages = {p.name for p in (ROOT / "primitives").iterdir() if (p / "__init__.py").exists()}
    found = set()
    for path in (ROOT / "kernels").glob("*.py"):
        if any(n.split(".")[0] == "triton" for n in _imports(path)):
            owner = max((s for s in names | packages if path.stem.startswith(s + "_")), key=len)
            found |= {owner} & names
    return found


def test_registry_lists_every_slot_without_triton():
    """Without Triton every slot is listed, and each primitive whose fast path is a Triton kernel
    says why it does not run (on a GPU too: `code_on(..., "cuda", bf16)`)."""
    import json

    why = json.loads(_run(NO_TRITON))
    assert {s: set(i) for s, i in why.items()} == {s: set(i) for s, i in registry.slots().items()}
    assert {"cross_entropy", "mla", "moe_dispatch", "router"} <= _triton_slots()
    silent = [f"{slot}/{name}" for slot in _triton_slots() for name, impl in registry.slots()[slot].items()
              if impl.kind == "primitive" and not (why[slot][name] and ("Triton" in why[slot][name]
                                                                       or "not installed" in why[slot][name]))]
    assert silent == [], f"primitives whose Triton fast path cannot run without saying why: {silent}"
