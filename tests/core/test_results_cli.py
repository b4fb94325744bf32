"""`bumblebee results`: reads every committed result file, whatever its age, into tables."""
import json

import pytest

from bumblebee.tools import cli, results

FILES = results.files()


def test_there_are_result_files_to_read():
    assert any(p.name.startswith("training_step_") for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(results.RESULTS_DIR)))
def test_every_result_file_renders_with_its_stamp(path):
    text = results.render_file(path, results.RESULTS_DIR)
    head, stamp = text.splitlines()[:2]
    assert head == f"== {path.relative_to(results.RESULTS_DIR)}"
    assert stamp.strip().startswith("commit ")


def test_the_training_step_table_shows_lengths_and_rates(capsys):
    assert cli.main(["results", "training_step"]) == 0
    out = capsys.readouterr().out
    for path in results.by_slot()["training_step"]:
        assert f"== {path.relative_to(results.RESULTS_DIR)}" in out
    header = next(line for line in out.splitlines() if "tokens_per_s" in line).split()
    assert "seq_len" in header and "peak_GiB" in header
    data = json.loads(results.by_slot()["training_step"][0].read_text())
    assert f"{data['rows'][0]['tokens_per_s']:.0f}" in out  # the file's own number, not a made-up one


def test_without_a_slot_it_lists_every_slot_and_file(capsys):
    assert cli.main(["results"]) == 0
    out = capsys.readouterr().out
    for slot, paths in results.by_slot().items():
        assert f"\n{slot}\n" in f"\n{out}"
        assert all(f"  {p.relative_to(results.RESULTS_DIR)}" in out for p in paths)


def test_a_file_in_any_shape_and_an_unknown_slot(tmp_path, capsys):
    old = {"slot": "demo", "device": "X", "results": [{"impl": "a", "peak_bytes": 3 * 2 ** 30, "ms": 1.5,
                                                         "nested": {"k": 1}}]}
    (tmp_path / "demo.json").write_text(json.dumps(old))
    assert cli.main(["results", "demo", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "commit unknown" in out and "peak_GiB" in out and "3.00" in out and "nested" not in out
    assert cli.main(["results", "other", "--dir", str(tmp_path)]) == 2
    assert "no result files for slot 'other'" in capsys.readouterr().err


def test_stamped_files_show_commit_and_dirty_flag(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"commit": "abcdef1234567890", "dirty": True, "device": "cpu", "rows": [{"n": 1}]}))
    assert "commit abcdef123456 | dirty tree | device cpu" in results.render_file(path)


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["results", "--help"])
    assert "commit unknown" in capsys.readouterr().out


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".json"],
                         ids=lambda p: str(p.relative_to(results.RESULTS_DIR)))
def test_every_result_file_names_a_commit(path):
    """Stamped by benchmarks/stamp.py, or (written before the stamp) the commit that recorded it."""
    stamp = results.render_file(path).splitlines()[1]
    assert not stamp.strip().startswith("commit unknown") or "(recorded in " in stamp, stamp


def test_older_runs_are_lines_of_a_history_file():
    histories = [p for p in FILES if p.name == results.HISTORY]
    assert histories
    for path in histories:
        for entry in results.load(path)["rows"]:
            assert list(entry) == ["file", "recorded_in_commit", "note", "result"], path
            assert entry["recorded_in_commit"] and entry["note"] and entry["result"], (path, entry["file"])
            assert not (path.parent / entry["file"]).exists(), f"{entry['file']} is both a file and a history line"
    rel = [p.relative_to(results.RESULTS_DIR) for p in FILES]
    assert not [p for p in rel if any(part.startswith("before_") for part in p.parts)], "older runs go to history.jsonl"


def test_history_prints_each_older_run_with_its_tables(tmp_path, capsys):
    (tmp_path / "demo" / "results").mkdir(parents=True)
    entry = {"file": "history/before_run_B/demo.json", "recorded_in_commit": "abc1234", "note": "run A, before B",
             "result": {"device": "X", "rows": [{"impl": "a", "median_ms": 2.5}]}}
    (tmp_path / "demo" / "results" / "history.jsonl").write_text(json.dumps(entry) + "\n")
    assert cli.main(["results", "demo", "--dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "history/before_run_B/demo.json" in listing and "median_ms" not in listing
    assert cli.main(["results", "demo", "--dir", str(tmp_path), "--history"]) == 0
    out = capsys.readouterr().out
    assert "== demo/results/history.jsonl: history/before_run_B/demo.json" in out
    assert "commit unknown (recorded in abc1234) | device X" in out and "run A, before B" in out and "2.50" in out


def test_a_probes_jsonl_carries_its_stamp_from_the_first_line(tmp_path):
    """Probes print their stamp first (`benchmarks/stamp.py` print_stamp): the commit is the file's, the
    stamp is not a row; a file without one has no commit (`results --stale` calls it unstamped)."""
    stamped = tmp_path / "probe_x.jsonl"
    stamped.write_text(json.dumps({"commit": "a" * 40, "dirty": False, "probe": "probe_x"}) + "\n"
                       + json.dumps({"case": 1, "ms": 2.0}) + "\n")
    data = results.load(stamped)
    assert data["commit"] == "a" * 40 and data["rows"] == [{"case": 1, "ms": 2.0}]
    bare = tmp_path / "probe_y.jsonl"
    bare.write_text(json.dumps({"case": 1, "ms": 2.0}) + "\n")
    assert "commit" not in results.load(bare) and results.load(bare)["rows"] == [{"case": 1, "ms": 2.0}]
