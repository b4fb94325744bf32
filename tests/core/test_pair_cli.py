"""The pairing harness through its CLI: table on stdout, JSON with the documented keys."""
import json
import subprocess
import sys


from bumblebee.primitives.attention import SDPA
from bumblebee.tools.cli import main

STEP_KEYS = {"step", "loss_a", "loss_b", "loss_abs_diff", "grad_norm_a", "grad_norm_b", "grad_norm_rel_diff"}


def test_pair_cli_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["pair", "--model", "qwen3-tiny", "--slot", "attention", "--a", "sdpa", "--b", "eager",
                 "--steps", "3", "--seed", "4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "loss_a" in table and "peak memory" in table
    r = json.loads(out.read_text())
    assert {"model", "slot", "a", "b", "device", "steps", "peak_memory_bytes", "step_time_ms"} <= set(r)
    assert (r["model"], r["slot"], r["a"], r["b"], r["device"]) == ("qwen3-tiny", "attention", "sdpa", "eager", "cpu")
    assert r["timed_steps"] == 2 and r["warmup_steps"] == 1 and not r["step_time_includes_warmup"]
    assert "(median of 2 steps after 1 warm-up step)" in table
    assert r["status"] == "compared" and r["ran"] == {"a": {"code": "sdpa", "note": None},
                                                      "b": {"code": "eager", "note": None}}
    assert len(r["steps"]) == 3 and all(set(s) == STEP_KEYS for s in r["steps"])
    for s in r["steps"]:
        assert s["loss_abs_diff"] < 1e-4 and s["grad_norm_rel_diff"] < 1e-4
        assert 0 < s["loss_a"] < 20 and s["grad_norm_a"] > 0
    # training moves the loss; both sides see the same batches so they move together
    assert r["steps"][0]["loss_a"] != r["steps"][-1]["loss_a"]
    # the tracker counts at least the fp32 parameters, gradients and two Adam moments
    from bumblebee import models
    n_params = sum(p.numel() for p in models.build("qwen3-tiny").parameters())
    for side in "ab":
        assert r["peak_memory_bytes"][side] >= 4 * 4 * n_params
        assert r["step_time_ms"][side] > 0


def test_pair_of_two_configs_records_both_sides_resolved_configs(tmp_path, capsys):
    import dataclasses

    from bumblebee.primitives.cross_entropy import LinearCE

    out = tmp_path / "r.json"
    assert main(["pair", "--slot", "cross_entropy", "--a", "linear_ce:path=lean,chunk_columns=64",
                 "--b", "materialized_ce", "--steps", "2", "--seq-len", "8", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "a=linear_ce:path=lean,chunk_columns=64 ran its own code" in table
    r = json.loads(out.read_text())
    assert (r["a"], r["b"], r["status"]) == ("linear_ce", "materialized_ce", "compared")
    assert r["options"] == {"a": "linear_ce:path=lean,chunk_columns=64", "b": "materialized_ce"}

    lean = dataclasses.asdict(LinearCE(path="lean", chunk_columns=64))
    sdpa = {"impl": "sdpa", **dataclasses.asdict(SDPA())}
    assert r["configs"] == {"a": {"attention": sdpa, "cross_entropy": {"impl": "linear_ce", **lean}},
                            "b": {"attention": sdpa, "cross_entropy": {"impl": "materialized_ce"}}}
    assert all(s["loss_abs_diff"] < 1e-4 for s in r["steps"])
    # two paths of one implementation run different code: compared, not "same code"
    from bumblebee.tools.pairing import pair
    assert pair("qwen3-tiny", "cross_entropy", "linear_ce:path=lean", "linear_ce:path=grad_in_forward",
                steps=1, seq_len=8)["status"] == "compared"
    assert pair("qwen3-tiny", "cross_entropy", "linear_ce", "linear_ce", steps=1, seq_len=8)["status"] == "same_code"
    assert main(["pair", "--slot", "cross_entropy", "--a", "linear_ce:path=fast"]) == 2
    assert "LinearCE.path must be one of 'auto', 'grad_in_forward', 'lean'; got 'fast'" in capsys.readouterr().err


def test_pair_parses_attention_and_mla_options(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["pair", "--slot", "attention", "--a", "sdpa:fa4=off", "--b", "eager", "--steps", "2",
                 "--seq-len", "8", "--json", str(out)]) == 0
    assert "a=sdpa:fa4=off ran its own code" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["options"] == {"a": "sdpa:fa4=off", "b": "eager"} and r["status"] == "compared"
    assert r["configs"]["a"]["attention"] == {"impl": "sdpa", "fa4": "off", "varlen": True,
                                                  "recompute_keep_bytes": SDPA.recompute_keep_bytes}
    assert r["configs"]["b"]["attention"] == {"impl": "eager"}
    assert all(s["loss_abs_diff"] < 1e-4 for s in r["steps"])
    assert main(["pair", "--model", "deepseek-v3-tiny", "--slot", "mla", "--a", "flash:lean_backward=off,fa4=off",
                 "--b", "naive", "--steps", "1", "--seq-len", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["configs"]["a"]["mla"]["lean_backward"] is False and r["configs"]["a"]["mla"]["fa4"] == "off"
    assert r["configs"]["b"]["mla"] == {"impl": "naive"}
    assert main(["pair", "--slot", "attention", "--a", "sdpa:fa4=never"]) == 2
    assert "SDPA.fa4 must be one of 'auto', 'on', 'off'; got 'never'" in capsys.readouterr().err


def test_pair_detects_a_different_function(monkeypatch):
    """A twin that computes another function must show up in the report (the check can fail)."""
    from bumblebee import registry
    from bumblebee.baselines.attention import eager_attention
    from bumblebee.tools.pairing import pair

    def doubled_scale(q, k, v, *, scale=None):
        return eager_attention(q, k, v, scale=2 * scale)

    impl = registry.Impl("attention", "doubled", doubled_scale, "baseline", "sdpa", "skills/attention/SKILL.md")
    monkeypatch.setitem(registry._SLOTS["attention"], "doubled", impl)
    r = pair("qwen3-tiny", "attention", "sdpa", "doubled", steps=2, seq_len=16)
    assert max(s["grad_norm_rel_diff"] for s in r["steps"]) > 1e-3


def test_pair_says_when_a_primitive_ran_its_torch_path(tmp_path, capsys):
    # fla's kernels never run on a CPU: the primitive runs their algorithm in torch (its own code, not
    # the twin's), so the pair compares two implementations; the table and the JSON say which path ran
    out = tmp_path / "r.json"
    assert main(["pair", "--model", "qwen3.5-tiny", "--slot", "linear_attention", "--a", "fla",
                 "--b", "torch_chunked", "--steps", "1", "--seq-len", "12", "--device", "cpu",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "a=fla ran its own code (flash-linear-attention's kernels need CUDA: its algorithm runs in torch)" \
        in captured.out
    assert "SAME CODE" not in captured.out
    r = json.loads(out.read_text())
    assert r["status"] == "compared" and (r["ran"]["a"]["code"], r["ran"]["b"]["code"]) == ("fla", "torch_chunked")
    assert "CUDA" in r["ran"]["a"]["note"] and r["ran"]["b"]["note"] is None
    assert r["steps"][0]["loss_abs_diff"] < 1e-4 * r["steps"][0]["loss_b"]


def test_pair_of_an_implementation_with_itself_is_flagged():
    from bumblebee.tools.pairing import format_report, pair

    r = pair("qwen3-tiny", "attention", "eager", "eager", steps=1, seq_len=8)
    assert r["status"] == "same_code"
    # one step: the only time there is belongs to the warm-up step, and the report says so
    assert r["timed_steps"] == 1 and r["step_time_includes_warmup"]
    assert "(the warm-up step alone, not a steady-state time: run --steps 2 or more)" in format_report(r)


def test_progress_bar_stays_off_a_stream_that_is_not_a_terminal(monkeypatch):
    import io

    from bumblebee.tools import pairing

    stream, real = io.StringIO(), pairing.tqdm
    # no 3 s delay here, so that a bar would show within this short run
    monkeypatch.setattr(pairing, "tqdm", lambda *a, **k: real(*a, **{**k, "delay": 0, "file": stream}))
    pairing.pair("qwen3-tiny", steps=2, seq_len=8)
    assert stream.getvalue() == ""


def test_unknown_names_list_what_is_accepted(capsys):
    assert main(["pair", "--slot", "nope"]) == 2
    assert "attention" in capsys.readouterr().err
    assert main(["pair", "--slot", "attention", "--a", "flash9"]) == 2
    err = capsys.readouterr().err
    assert "flash9" in err and "sdpa" in err and "eager" in err


def test_pair_refuses_a_slot_the_model_does_not_use(capsys):
    # qwen3 has no router: both sides would run the same model and agree exactly
    assert main(["pair", "--model", "qwen3-tiny", "--slot", "router", "--a", "aux_free", "--b", "aux_free_ref"]) == 2
    assert "slot router is not used by model qwen3-tiny; it uses: attention, cross_entropy" in capsys.readouterr().err
    assert main(["pair", "--model", "qwen3-tiny", "--slot", "mla", "--a", "flash", "--b", "naive"]) == 2
    assert "slot mla is not used" in capsys.readouterr().err
    # with the default --a/--b (attention's sdpa, eager) the message is still about the slot
    assert main(["pair", "--model", "qwen3-tiny", "--slot", "router"]) == 2
    err = capsys.readouterr().err
    assert "slot router is not used by model qwen3-tiny; it uses: attention, cross_entropy" in err
    assert "sdpa" not in err


def test_bad_swap_device_and_dtype_are_refused_with_exit_2(capsys):
    import pytest
    import torch

    from bumblebee.tools.pairing import pair

    with pytest.raises(SystemExit) as exc:  # argparse's convention, as the help's exit statuses say
        main(["pair", "--swap", "cross_entropy"])
    assert exc.value.code == 2 and "--swap: expected SLOT=IMPL" in capsys.readouterr().err
    assert main(["pair", "--device", "gpu"]) == 2
    assert "device must be cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["pair", "--device", "cuda"]) == 2
        captured = capsys.readouterr()
        assert "device 'cuda': this torch" in captured.err and "sees no CUDA device" in captured.err
        assert "Traceback" not in captured.err and captured.out == ""
    with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype .* got 'bfloat16'"):
        pair("qwen3-tiny", dtype="bfloat16", steps=1, seq_len=8)


def test_cli_parses_arguments_before_importing_torch():
    """`bumblebee --help` and refusals at parsing come at once: torch (seconds to import) is not loaded."""
    code = ("import sys\n"
            "from bumblebee.tools import cli\n"
            "for argv in (['--help'], ['pair', '--help'], ['pair', '--swap', 'x']):\n"
            "    try:\n"
            "        cli.main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stderr.strip().splitlines()[-1] == "False", res.stderr


def test_cli_names_every_model_and_slot():
    from bumblebee import registry
    from bumblebee.models import NAMED
    from bumblebee.tools import cli

    assert set(cli.MODELS) == set(NAMED) and set(cli.SLOTS) == set(registry.slots())


def test_pair_prints_each_step_as_it_ends(monkeypatch):
    """Every step's line is written and flushed before the next step starts, whatever stdout is."""
    import io

    from bumblebee.tools import pairing

    class Stream(io.StringIO):
        flushed = ""

        def flush(self):
            self.flushed = self.getvalue()

    stream, seen, real = Stream(), [], pairing._step

    def step(*args):
        seen.append(stream.flushed.count(" step "))
        return real(*args)

    monkeypatch.setattr(pairing, "_step", step)
    monkeypatch.setattr(sys, "stdout", stream)
    assert main(["pair", "--steps", "2", "--seq-len", "8"]) == 0
    assert seen == [0, 1, 2, 2, 3, 4]  # a's two steps and its memory step, then b's
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("a step   0") and lines[0].endswith("(warm-up)")
    assert lines[3].startswith("b step   1") and "(warm-up)" not in lines[3]


def test_step_time_is_the_median_after_warmup_without_the_memory_probe(monkeypatch):
    import contextlib

    from bumblebee.tools import pairing

    state = {"timing": False, "probes": 0}
    times = iter([900.0, 3.0, 7.0, 5.0, 4.0] * 2)  # a warm-up step, then four: median 4.5

    @contextlib.contextmanager
    def wall_ms(device):
        state["timing"] = True
        out = {}
        yield out
        state["timing"] = False
        out["ms"] = next(times)

    real = pairing.peak_memory

    @contextlib.contextmanager
    def peak_memory(device, *track):
        assert not state["timing"], "the memory probe ran inside a timed step"
        state["probes"] += 1
        with real(device, *track) as mem:
            yield mem

    monkeypatch.setattr(pairing, "wall_ms", wall_ms)
    monkeypatch.setattr(pairing, "peak_memory", peak_memory)
    r = pairing.pair("qwen3-tiny", steps=5, seq_len=8)
    assert r["step_time_ms"] == {"a": 4.5, "b": 4.5} and r["warmup_steps"] == 1 and r["timed_steps"] == 4
    assert state["probes"] == 2 and all(r["peak_memory_bytes"][side] > 0 for side in "ab")


def test_pair_refuses_an_empty_batch_before_running(capsys):
    import pytest

    from bumblebee.tools.pairing import pair

    for opt in ("--batch-size", "--seq-len", "--steps"):
        with pytest.raises(SystemExit) as exc:
            main(["pair", opt, "0"])
        assert exc.value.code == 2 and f"{opt}: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        pair("qwen3-tiny", batch_size=0)


def test_pair_checks_the_json_path_before_running(tmp_path, monkeypatch, capsys):
    import pytest

    from bumblebee.tools import pairing

    def never(*a, **k):
        raise AssertionError("the run started before the --json path was checked")

    monkeypatch.setattr(pairing, "pair", never)
    for bad in (tmp_path / "no-such-dir" / "r.json", tmp_path):  # a missing folder; a folder itself
        with pytest.raises(SystemExit) as exc:
            main(["pair", "--json", str(bad)])
        assert exc.value.code == 2 and f"--json {bad}: cannot write there" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []


def test_pair_help_documents_every_option_its_default_and_the_models(capsys):
    import argparse

    import pytest

    from bumblebee.tools.cli import parser
    from bumblebee.models import NAMED

    with pytest.raises(SystemExit) as exc:
        main(["pair", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert exc.value.code == 0
    assert all(name in out for name in NAMED) and "cross_entropy" in out
    assert "(default: 5)" in out and "(default: qwen3-tiny)" in out and "exit status" in out
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["pair"]._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_list_and_console_entry_point():
    res = subprocess.run([sys.executable, "-m", "bumblebee.tools.cli", "list"], capture_output=True, text=True, check=True)
    assert "attention" in res.stdout and "materialized_ce" in res.stdout and "skills/" in res.stdout
    from bumblebee import registry
    for impls in registry.slots().values():
        for impl in impls.values():  # whole sentences, never cut at the docstring's first line break
            assert impl.summary.endswith((".", "!", "?")) and f": {impl.summary}" in res.stdout, impl.summary
    assert "FA4 where installed (dense: head dim <= 128; packed: any it runs), else SDPA, cuDNN first." in res.stdout
    for option in ("fa4='auto': ", "varlen=True: ", "lean_backward=True: ", "fused_rope=True: ", "pad_v=False: "):
        assert option in res.stdout, option  # the attention and mla options, with defaults and docs
