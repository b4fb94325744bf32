"""`bumblebee results --stale` on a throwaway git repository: a result file is current until a file its
benchmark measures changes (the slot's primitive, its benchmark script), not when its notes, its own
results or another slot's code change; a commit git does not know is reported unknown, never current."""
import json
import shutil
import subprocess

import pytest

from bumblebee.tools import staleness

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _commit(root, message):
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "HEAD")


def test_a_result_is_stale_once_its_measured_code_changes(tmp_path):
    _git(tmp_path, "init", "-q")
    for rel in ("primitives/router.py", "kernels/router_softmax.py", "primitives/mla.py",
                "benchmarks/router/bench.py", "benchmarks/router/NOTES.md"):
        _write(tmp_path, rel, "x = 1\n")
    measured = _commit(tmp_path, "code")
    _write(tmp_path, "benchmarks/router/results/router.json", json.dumps({"commit": measured, "rows": []}))
    _write(tmp_path, "benchmarks/router/results/history.jsonl", "")
    _write(tmp_path, "benchmarks/mla/results/mla.json", json.dumps({"commit": "f" * 40, "rows": []}))
    _commit(tmp_path, "results")

    def state():
        rows = staleness.report(tmp_path / "benchmarks", tmp_path)
        return {r["file"]: r["changed"] for r in rows}
    assert state() == {"router/results/router.json": [], "mla/results/mla.json": None}  # history not checked

    _write(tmp_path, "benchmarks/router/NOTES.md", "notes\n")  # notes, results and another slot: still current
    _write(tmp_path, "primitives/mla.py", "x = 2\n")
    _commit(tmp_path, "notes")
    assert state()["router/results/router.json"] == []

    _write(tmp_path, "kernels/router_softmax.py", "x = 2\n")
    _write(tmp_path, "benchmarks/router/bench.py", "x = 2\n")
    _commit(tmp_path, "kernel")
    assert state()["router/results/router.json"] == ["benchmarks/router/bench.py", "kernels/router_softmax.py"]
    text = staleness.render(staleness.report(tmp_path / "benchmarks", tmp_path))
    assert "STALE: 2 measured files changed" in text and "commit unknown to git" in text


def test_whole_step_benchmarks_measure_models_but_not_the_rl_system():
    specs = staleness.measured_paths("training_step")
    assert "models*" in specs and "primitives*" in specs and ":(exclude)*weight_transfer*" in specs
    assert ":(exclude)*weight_transfer*" not in staleness.measured_paths("rl_pipeline")
    assert staleness.measured_paths("router")[-1] == "common/router*"


def test_context_parallel_counts_only_for_the_benchmarks_that_apply_it(tmp_path):
    _git(tmp_path, "init", "-q")
    for rel in ("primitives/context_parallel/gdn.py", "kernels/context_parallel_maps.py", "primitives/attention.py",
                "benchmarks/training_step/bench.py", "benchmarks/composed_step/bench.py"):
        _write(tmp_path, rel, "x = 1\n")
    measured = _commit(tmp_path, "code")
    for slot in ("training_step", "composed_step"):
        _write(tmp_path, f"benchmarks/{slot}/results/{slot}.json", json.dumps({"commit": measured, "rows": []}))
    _commit(tmp_path, "results")
    _write(tmp_path, "primitives/context_parallel/gdn.py", "x = 2\n")
    _write(tmp_path, "kernels/context_parallel_maps.py", "x = 2\n")  # its kernels likewise
    _commit(tmp_path, "cp")
    state = {r["slot"]: r["changed"] for r in staleness.report(tmp_path / "benchmarks", tmp_path)}
    assert state == {"training_step": [],
                     "composed_step": ["kernels/context_parallel_maps.py", "primitives/context_parallel/gdn.py"]}
    _write(tmp_path, "primitives/attention.py", "x = 2\n")  # a primitive every step runs
    _commit(tmp_path, "attention")
    state = {r["slot"]: r["changed"] for r in staleness.report(tmp_path / "benchmarks", tmp_path)}
    assert state["training_step"] == ["primitives/attention.py"]


def test_a_probe_measures_its_own_result_only(tmp_path):
    _git(tmp_path, "init", "-q")
    for rel in ("primitives/router.py", "benchmarks/router/bench.py", "benchmarks/router/probes/probe_a.py",
                "benchmarks/router/probes/probe_b.py"):
        _write(tmp_path, rel, "x = 1\n")
    measured = _commit(tmp_path, "code")
    for name in ("router.json", "probe_a.json", "probe_a_variant.json", "probe_b.json"):
        _write(tmp_path, f"benchmarks/router/results/{name}", json.dumps({"commit": measured, "rows": []}))
    _commit(tmp_path, "results")
    _write(tmp_path, "benchmarks/router/probes/probe_a.py", "x = 2\n")
    _commit(tmp_path, "probe a")
    state = {r["file"]: r["changed"] for r in staleness.report(tmp_path / "benchmarks", tmp_path)}
    a = ["benchmarks/router/probes/probe_a.py"]
    assert state == {"router/results/router.json": [], "router/results/probe_a.json": a,
                     "router/results/probe_a_variant.json": a, "router/results/probe_b.json": []}


def _router_result(tmp_path, files: dict):
    """A repository with `files` and the router's bench, its one result stamped at that commit;
    returns what `--stale` lists as changed for it."""
    _git(tmp_path, "init", "-q")
    for rel, text in {**files, "benchmarks/router/bench.py": "x = 1\n"}.items():
        _write(tmp_path, rel, text)
    measured = _commit(tmp_path, "code")
    _write(tmp_path, "benchmarks/router/results/router.json", json.dumps({"commit": measured, "rows": []}))
    _commit(tmp_path, "results")
    return lambda: staleness.report(tmp_path / "benchmarks", tmp_path)[0]["changed"]


def test_a_change_of_words_only_keeps_a_result_current(tmp_path):
    changed = _router_result(tmp_path, {"primitives/router.py":
                                        '"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # why\n'})
    _write(tmp_path, "primitives/router.py", '"""Other doc."""\n\n\ndef f(x):\n    """New."""\n    return x + 1  # how\n')
    _commit(tmp_path, "words")
    assert changed() == []
    _write(tmp_path, "primitives/router.py", '"""Other doc."""\n\n\ndef f(x):\n    """New."""\n    return x + 2\n')
    _commit(tmp_path, "code")
    assert changed() == ["primitives/router.py"]


def test_the_cli_lists_this_checkouts_result_files(capsys):
    from bumblebee.tools import cli
    assert cli.main(["results", "router", "--stale"]) == 0
    out = capsys.readouterr().out
    assert "router/results/router.json" in out and "current result files" in out


def test_a_file_moved_as_it_was_keeps_a_result_current(tmp_path):
    body = "def f(x):\n    return x + 1\n" * 20  # long enough for git to pair the old and new names
    changed = _router_result(tmp_path, {"kernels/router_a.py": body, "kernels/router_c.py": body.replace("1", "3")})
    _git(tmp_path, "mv", "kernels/router_a.py", "kernels/router_b.py")
    _git(tmp_path, "mv", "kernels/router_c.py", "kernels/router_d.py")
    _write(tmp_path, "kernels/router_d.py", "# why\n" + body.replace("1", "3"))  # moved, a comment added
    _commit(tmp_path, "moved")
    assert changed() == []
    _write(tmp_path, "kernels/router_b.py", body.replace("x + 1\n", "x + 2\n", 1))  # moved, then its code
    _commit(tmp_path, "code")
    assert changed() == ["kernels/router_b.py"]


def test_a_step_does_not_measure_the_slots_its_model_never_runs(tmp_path):
    assert staleness.slots_not_in({"model_type": "qwen3_moe"}) == ("linear_attention", "mla")
    assert staleness.slots_not_in({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}) == ("mla",)
    assert staleness.slots_not_in({"kv_lora_rank": 512}) == ("linear_attention",)
    assert staleness.slots_not_in(None) == ()  # nothing recorded: every slot counts
    _git(tmp_path, "init", "-q")
    for rel in ("primitives/linear_attention.py", "kernels/mla_rope.py", "benchmarks/training_step/bench.py"):
        _write(tmp_path, rel, "x = 1\n")
    measured = _commit(tmp_path, "code")
    configs = {"moe": {"model_type": "qwen3_moe"}, "hybrid": {"layer_types": ["linear_attention"]}, "none": None}
    for name, hf in configs.items():
        _write(tmp_path, f"benchmarks/training_step/results/{name}.json",
               json.dumps({"commit": measured, "hf_config": hf, "rows": []}))
    _commit(tmp_path, "results")
    _write(tmp_path, "primitives/linear_attention.py", "x = 2\n")
    _write(tmp_path, "kernels/mla_rope.py", "x = 2\n")
    _commit(tmp_path, "gated deltanet and mla")
    state = {r["file"]: r["changed"] for r in staleness.report(tmp_path / "benchmarks", tmp_path)}
    assert state == {"training_step/results/moe.json": [],
                     "training_step/results/hybrid.json": ["primitives/linear_attention.py"],
                     "training_step/results/none.json": ["kernels/mla_rope.py", "primitives/linear_attention.py"]}
