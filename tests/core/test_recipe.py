"""`bumblebee recipe` (tools/recipe.py): the tokens-per-GPU rule, the estimator's verdict on every
candidate, the longest fitting length, argument errors, JSON, and the emitted Python, which builds
and trains a tiny model (in process: Qwen3, Qwen3.5-MoE, DeepSeek-V3; on two gloo ranks: Qwen3-MoE
at CP = EP = 2 under FSDP2)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from bumblebee import models, registry
from bumblebee.tools import memory, recipe
from bumblebee.tools.cli import main
from tests.ranks import free_port

TINY = dict(gpu_memory_gib=1.0, headroom=0.0)


def _estimate(r: recipe.Recipe, check: recipe.Check) -> int:
    """The estimator's own peak for a check's layout (the recipe's, less the term it adds)."""
    lo = check.layout
    par = memory.Parallel(dp=lo.gpus, cp=lo.cp, ep=lo.ep, cp_exchange=lo.exchange, seq_len=check.seq_len,
                          attention_keep_bytes=memory.Parallel.attention_keep_bytes if lo.keep else 0)
    return memory.estimate(r.model, par).peak + check.terms["linear_attention_keep"]


@pytest.mark.parametrize("seq_len,cp", [(4096, 1), (32768, 1), (65536, 2), (98304, 4), (131072, 4), (262144, 8),
                                        (1 << 20, 8)])
def test_cp_follows_the_tokens_per_gpu_rule(seq_len, cp):
    assert recipe.rule_cp(seq_len, 8) == cp  # the smallest CP leaving <= 32K tokens a GPU; 8 GPUs cap it
    r = recipe.plan("qwen3-8b", gpus=8, seq_len=seq_len, gpu="h200")
    assert r.fits and r.rule_cp == cp and r.chosen.layout.cp == cp and r.chosen.layout.dp == 8 // cp
    assert r.chosen is r.checks[0]  # the rule's own layout fits: no lever was needed
    if seq_len >= 32768:
        assert 16384 <= seq_len // cp <= 32768 or cp == 8


def test_the_chosen_layout_is_the_estimators_and_fits():
    r = recipe.plan("qwen3-30b-a3b", gpus=8, seq_len=131072, gpu="h100")
    assert r.fits and r.chosen.layout.cp == 4 and r.chosen.layout.ep == 8
    for c in r.checks:  # every candidate is the estimator's number, judged against the budget
        assert c.peak == _estimate(r, c) and c.fits == (c.peak <= r.budget)
    assert all(not c.fits for c in r.checks[:-1]) and r.checks[-1] is r.chosen


def test_a_forced_cp_that_does_not_fit_is_reported_so(capsys):
    r = recipe.plan("qwen3-30b-a3b", gpus=8, seq_len=131072, gpu="h100", cp=1)
    assert not r.fits and r.forced_cp == 1 and {c.layout.cp for c in r.checks} == {1}
    assert all(c.peak > r.budget for c in r.checks)
    assert main(["recipe", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "131072", "--cp", "1"]) == 3
    out = capsys.readouterr().out
    assert "cp=1 does not fit 131072 tokens" in out and "longest that fits" in out


def test_a_length_that_fits_nowhere_gives_the_longest_that_does():
    r = recipe.plan("qwen3-moe-tiny", gpus=2, seq_len=1 << 20, **TINY)
    assert not r.fits and r.longest is not None and r.longest.fits
    L, step = r.longest.seq_len, r.step
    assert r.longest_next == L + step and L % step == 0 and 0 < L < r.seq_len
    # the bracket, asked again at both ends
    assert recipe.plan("qwen3-moe-tiny", gpus=2, seq_len=L, **TINY).fits
    assert not recipe.plan("qwen3-moe-tiny", gpus=2, seq_len=L + step, **TINY).fits
    # nothing fits when the state alone is over the budget
    r = recipe.plan("qwen3-8b", gpus=1, seq_len=4096, gpu_memory_gib=8)
    assert not r.fits and r.longest is None and r.longest_next == r.step and r.snippet() == ""


@pytest.mark.parametrize("kwargs,name", [
    (dict(gpus=0), "gpus"), (dict(seq_len=-1), "seq_len"), (dict(gpu="a100"), "gpu"),
    (dict(gpu_memory_gib=0), "gpu_memory_gib"), (dict(headroom=1.0), "headroom"), (dict(cp=3), "cp=3"),
    (dict(cp=16), "cp=16"), (dict(ep=3), "ep=3"), (dict(max_tokens_per_gpu=0), "max_tokens_per_gpu"),
    (dict(model="no-such-model"), "model"), (dict(mixed_precision="fp8"), "mixed_precision")])
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(model="qwen3-moe-tiny", gpus=8, seq_len=65536) | kwargs
    with pytest.raises(ValueError, match=name):
        recipe.plan(args.pop("model"), **args)


def test_ep_on_a_dense_model_and_an_indivisible_sequence_are_refused():
    with pytest.raises(ValueError, match="ep=2 given, but qwen3-tiny has no experts"):
        recipe.plan("qwen3-tiny", gpus=2, seq_len=64, ep=2)
    with pytest.raises(ValueError, match=r"cp=4: seq_len=100 must be divisible by 2 x cp = 8"):
        recipe.plan("qwen3-tiny", gpus=4, seq_len=100, cp=4)


def test_cli_refuses_bad_arguments_by_name(capsys):
    for argv, name in ((["--gpus", "0"], "--gpus"), (["--seq-len", "x"], "--seq-len"), (["--gpu", "a100"], "--gpu"),
                       (["--headroom", "2"], "--headroom")):
        with pytest.raises(SystemExit) as exc:
            main(["recipe", "qwen3-tiny", "--gpus", "2", "--seq-len", "64", *argv])
        assert exc.value.code == 2 and name in capsys.readouterr().err
    assert main(["recipe", "qwen3-tiny", "--gpus", "2", "--seq-len", "64", "--cp", "3"]) == 2
    assert "cp=3 must divide gpus=2" in capsys.readouterr().err


def test_recipe_help_documents_every_option_and_the_exit_status(capsys):
    import argparse

    from bumblebee.tools import cli
    with pytest.raises(SystemExit) as exc:
        main(["recipe", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and "exit status" in out and "(default: h100)" in out
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert all(action.help for action in sub.choices["recipe"]._actions)
    assert cli.GPUS == tuple(recipe.GPU_MEMORY)  # the CLI names them before importing torch


def test_json_round_trips(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["recipe", "qwen3.5-moe-tiny", "--gpus", "4", "--seq-len", "1048576", "--gpu-memory", "1",
                 "--json", str(path)]) == 3
    assert "longest that fits" in capsys.readouterr().out
    d = json.loads(path.read_text())
    r = recipe.Recipe.from_dict(d)
    assert r == recipe.plan("qwen3.5-moe-tiny", gpus=4, seq_len=1 << 20, gpu_memory_gib=1)
    assert json.loads(json.dumps(r.to_dict())) == d and d["impl"]["attention"]["impl"] == "sdpa"
    assert r.longest is not None and d["longest"]["seq_len"] == r.longest.seq_len


def test_an_hf_config_folder_is_a_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(models.NAMED["qwen3-moe-tiny"]))
    a = recipe.plan(str(tmp_path), gpus=2, seq_len=65536)
    b = recipe.plan("qwen3-moe-tiny", gpus=2, seq_len=65536)
    assert a.checks == b.checks and a.slots == b.slots


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3.5-moe-tiny", "deepseek-v3-tiny"])
def test_the_emitted_impl_builds_and_trains_a_tiny_model(name):
    """The recipe's typed options, read back from its snippet's IMPL, build the model (the default
    layout, and the longest length on 1 GiB: nothing kept through the recompute); where that changed
    an option, a recomputed forward and backward runs (Qwen3-MoE: the two-rank test below)."""
    for r in (recipe.plan(name, gpus=1, seq_len=64), recipe.plan(name, gpus=1, seq_len=1 << 20, **TINY)):
        assert r.built is not None
        ns = {}
        exec(r.snippet().split("\n\n\ndef setup")[0], ns)  # the imports and IMPL of the snippet
        assert ns["IMPL"] == r.impl() and ns["SEQ_LEN"] == r.built.seq_len
        model = models.build(name, ns["IMPL"], seed=0).set_recompute(True)
        assert {s: registry.record(s, c) for s, c in ns["IMPL"].items()} == \
            {s: c for s, c in model.impl_configs().items() if s in ns["IMPL"]}
    if name == "deepseek-v3-tiny":  # MLA keeps no outputs through the recompute: the defaults again
        assert r.built.layout.keep
        return
    assert not r.built.layout.keep
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _rank(rank, world, port, snippet, hf_dir, out):
    import torch.distributed as dist

    from tests.limits import PROCESS_GROUP_TIMEOUT
    from tests.ranks import leave_group
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        ns = {}
        exec(snippet, ns)
        model, state, cp_group = ns["setup"](hf_dir, "cpu", lr=1e-4, mixed_precision="fp32")
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
        losses = []
        for _ in range(2):
            loss = ns["step"](model, state, cp_group, ids)
            dist.all_reduce(loss)
            losses.append(loss.item() / world)  # each rank's share x CP: their mean is the batch's loss
        torch.save(losses, f"{out}/{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def test_the_emitted_snippet_trains_on_two_ranks_at_cp_and_ep_2(tmp_path):
    """The whole snippet (from_pretrained, EP over efsdp x ep, cp.apply, FSDP2 over dp x cp, the cp
    loss) on 2 gloo ranks trains the tiny Qwen3-MoE as one process does: the first loss equal to
    fp32 rounding, the second after an AdamW step with lr 1e-4 close (the exact cp contract is
    tests/primitives/test_context_parallel_model.py's)."""
    import torch.multiprocessing as mp

    r = recipe.plan("qwen3-moe-tiny", gpus=2, seq_len=64, max_tokens_per_gpu=32)
    assert r.fits and (r.chosen.layout.cp, r.chosen.layout.ep) == (2, 2)
    hf_dir = tmp_path / "hf"
    models.build("qwen3-moe-tiny", seed=0).save_pretrained(hf_dir)
    mp.spawn(_rank, args=(2, free_port(), r.snippet(), str(hf_dir), str(tmp_path)), nprocs=2, join=True)
    losses = [torch.load(tmp_path / f"{k}.pt") for k in range(2)]
    assert losses[0] == losses[1]
    model = models.from_pretrained(hf_dir, r.impl(), dtype=torch.float32).train().set_recompute(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
    want = []
    for _ in range(2):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert losses[0][0] == pytest.approx(want[0], rel=1e-5)
    assert losses[0][1] == pytest.approx(want[1], rel=1e-3)
