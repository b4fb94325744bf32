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
