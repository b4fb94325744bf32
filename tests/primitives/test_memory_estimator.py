"""bumblebee.tools.memory.estimate against allocations measured by torch's MemTracker on 2 gloo ranks, and
against the committed GPU benchmark results.

fp32 on the CPU (the CPU tracker counts live tensor storages, the GPU benchmark checks bf16 against
the CUDA allocator), full recompute: a Qwen3 slice (both twins) and a DeepSeek-V3 slice (FSDP2: MLA,
a dense layer, then MoE layers with a shared expert through the local dispatch, one MTP depth); static
state within 5% for both cross_entropy slots; the step's peak within 10% with materialized_ce. The
estimator's linear_ce term models the Triton path's workspace (one fp32 vocabulary chunk); the CPU
path of primitives/cross_entropy.py keeps several chunk-sized temporaries, so its peak is checked on
the GPU (benchmarks/state_sharding/bench.py).

GPU results, read from benchmarks/*/results (so these follow the committed runs): the composed step's
Qwen3.5-35B-A3B slice (gated DeltaNet + gated attention + MTP, chunked EP, FSDP2, full recompute)
within 6% of every measured peak at EP = 2 and EP = 4; the state-sharding runs (Qwen3-30B-A3B slice,
FSDP2 and ZeRO-1, 2 and 4 ranks) within their own 10% target.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bumblebee import models, registry
from bumblebee.tools import memory
from tests.primitives.test_state_sharding import spawn

CONFIG = {**models.NAMED["qwen3-tiny"], "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8192}
# DeepSeek-V3 tiny, widened like CONFIG: one dense layer, two MoE layers (4 experts, top 2, one shared
# expert), one MTP depth (a MoE block); few experts and layers keep the tracker's per-op cost down.
# v_head_dim equals the q/k head dim (32 + 16) so that the CPU's SDPA takes its flash kernel, as cuDNN
# does on the GPU (other head dims fall back to the math path and its [T, T] scores).
DSV3 = {**models.NAMED["deepseek-v3-tiny"], "hidden_size": 256, "intermediate_size": 704, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 48, "vocab_size": 8192,
        "n_routed_experts": 4, "n_group": 1, "topk_group": 1}
MODELS = {"qwen3": CONFIG, "deepseek_v3": DSV3}
MICRO_BATCH, SEQ = 2, 128
CASES = ([("qwen3", s, loss) for s in ("fsdp2", "zero1") for loss in ("linear_ce", "materialized_ce")]
         + [("deepseek_v3", "fsdp2", loss) for loss in ("linear_ce", "materialized_ce")])


def measure(mesh, out):
    from torch.distributed._tools.mem_tracker import MemTracker
    res = {}
    for name, sharding, loss in CASES:
        config = MODELS[name]
        model = models.build(config, impl={"cross_entropy": loss}, seed=0).set_recompute(True)
        state = registry.resolve("state_sharding", sharding)(model, mesh, lr=1e-3, mixed_precision="fp32")
        g = torch.Generator().manual_seed(dist.get_rank())
        ids = torch.randint(0, config["vocab_size"], (MICRO_BATCH, SEQ), generator=g)
        tracker = MemTracker()  # Adam states exist from apply() on: the first step is a steady one
        tracker.track_external(state.model, state.optimizer)
        with tracker:
            state.model(ids, labels=ids).loss.backward()
            state.step()
            current = tracker.get_tracker_snapshot("current")
        state.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
        total = lambda snap: int(sum(v.get("Total", 0) for v in snap.values()))  # noqa: E731
        res[(name, sharding, loss)] = {"static": total(current), "peak": total(peak)}
    return res


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return spawn(2, "measure", tmp_path_factory.mktemp("memory"), module=__name__)


@pytest.mark.parametrize("name,sharding,loss", CASES)
def test_estimate_matches_the_tracker(measured, name, sharding, loss):
    est = memory.estimate(MODELS[name], memory.Parallel(dp=2, sharding=sharding, mixed_precision="fp32", loss=loss,
                                                        device="cpu", micro_batch=MICRO_BATCH, seq_len=SEQ))
    for rank in measured:
        got = rank[(name, sharding, loss)]
        assert abs(est.static - got["static"]) <= 0.05 * got["static"], (est.static, got)
        if loss == "materialized_ce":
            assert abs(est.peak - got["peak"]) <= 0.10 * got["peak"], (est.peak, got, est)


def test_recipe_accounting():
    est = memory.estimate("qwen3-8b", memory.Parallel(dp=8, sharding="fsdp2"))
    p = est.counts["P"]
    assert est.recipe_state == pytest.approx(18 * p / 8, rel=1e-6)
    assert est.static == pytest.approx(16 * p / 8, rel=1e-6)
    z = memory.estimate("qwen3-8b", memory.Parallel(dp=8, sharding="zero1"))
    assert z.static == pytest.approx(6 * p + 12 * p / 8, rel=1e-6)
    # EP: experts split over ep first, so every sharded term stays P/n; ZeRO-1's 6P shrinks for experts
    moe = memory.estimate("qwen3-30b-a3b", memory.Parallel(dp=8, ep=4, sharding="fsdp2"))
    pm = moe.counts["P"]
    assert moe.static == pytest.approx(16 * pm / 8, rel=1e-6)
    zm = memory.estimate("qwen3-30b-a3b", memory.Parallel(dp=8, ep=4, sharding="zero1"))
    assert zm.optimizer == pytest.approx(12 * pm / 8, rel=1e-6)
    assert 6 * pm / 4 < zm.params + zm.grads < 6 * pm / 2  # experts are most of P: near 6P/EP


def test_table_and_bad_input():
    text = memory.table("qwen3-0.6b", memory.Parallel(dp=4, seq_len=8192))
    assert "fsdp2" in text and "zero1" in text and "peak" in text
    with pytest.raises(ValueError, match="sharding 'zero3'"):
        memory.estimate("qwen3-tiny", memory.Parallel(sharding="zero3"))
    with pytest.raises(ValueError, match="ep dividing dp"):
        memory.estimate("qwen3-tiny", memory.Parallel(dp=4, ep=3))


def test_unsupported_config(monkeypatch):
    """A config the estimator cannot model is a ValueError naming its model type, not an AttributeError."""
    with pytest.raises(ValueError, match="deepseek_v3 config has 2"):  # the moments model one MTP depth
        memory.estimate({**models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 2}, memory.Parallel(dp=2))
    monkeypatch.delitem(memory._FAMILIES, "qwen3_moe")  # a model type without layer terms
    with pytest.raises(ValueError, match="cannot model model_type 'qwen3_moe'"):
        memory.estimate("qwen3-moe-tiny", memory.Parallel(dp=2))


def test_deepseek_terms():
    """DeepSeek-V3's terms: a MoE layer (8 routed rows) keeps more than a dense one; under full recompute a
    layer keeps only its input (MLA's lean backward caches nothing in the first forward); the main head's loss backward after the MTP depth's is a
    moment of its own; the local dispatch at EP = 1, the chunked one's terms with EP."""
    config = {**models.NAMED["deepseek-v3"], "num_hidden_layers": 5}
    _, cfg = memory._model_on_meta(config)
    n = 16384
    rows = memory._local_rows(cfg, 2, n, loop=False)
    dense, moe = (memory._mla_layer(cfg, m, 2, rows, True, True) for m in (False, True))
    assert moe[0] > dense[0] and moe[1] > dense[1]
    local = memory.estimate(config, memory.Parallel(dp=8, seq_len=n, moe_dispatch="local"))
    grouped = memory.estimate(config, memory.Parallel(dp=8, seq_len=n))  # the default: chunked's one-rank path
    assert grouped.moe_dispatch == n * sum(memory._grouped_dispatch(cfg, n, 2, 65536)) < local.moe_dispatch
    d = cfg.hidden_size  # bf16: 5 layer inputs; the final norm (fp32 input, rsqrt, output), the loss input, ~25
    assert local.activations == n * (5 * 2 * d + (4 * d + 4 + 2 * d) + 2 * d + 25)
    assert local.moe_dispatch == n * sum(rows)
    est = memory.estimate(config, memory.Parallel(dp=8, ep=8, seq_len=n))
    saved, backward, _ = memory._chunked_dispatch(cfg, n, 2, 8, fused=True)
    assert est.moe_dispatch >= n * (saved + backward)
    plain = memory.estimate({**config, "num_nextn_predict_layers": 0}, memory.Parallel(dp=8, ep=8, seq_len=n))
    assert "loss_after_mtp" in est.phases and "loss_after_mtp" not in plain.phases
    assert plain.mtp_activations == 0 < est.mtp_activations
    assert "at loss_after_mtp" in memory.table(config, memory.Parallel(dp=8, ep=8))


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _result(slot, path):
    """A result file of benchmarks/<slot>/results; a path no longer there is an older run's, read from
    the entry of results/history.jsonl that names the file it was kept in."""
    results = BENCHMARKS / slot / "results"
    if (results / path).is_file():
        return json.loads((results / path).read_text())
    for line in (results / "history.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["file"] == path:
            return entry["result"]
    raise FileNotFoundError(f"{path}: neither in {results} nor an entry of its history.jsonl")


def _rows(slot, *paths):
    """(run header, row) of every measured row of the given result files of benchmarks/<slot>/results."""
    for path in paths:
        run = _result(slot, path)
        for row in run.get("rows", run.get("results", [])):
            yield pytest.param(run, row, id=f"{Path(path).parent.name or path}-{row.get('seq_len', row.get('impl'))}")


@pytest.mark.parametrize("run,row", list(_rows("composed_step", "composed_step.json", "history/before_run_L/composed_step.json",
                                                "ep4/composed_step.json", "ep8/composed_step.json",
                                                "ep8/composed_step_256k.json")))
def test_composed_step_peak(run, row):
    """The composed step (benchmarks/composed_step/bench.py): one sequence per rank, bf16, linear_ce,
    chunked dispatch, FSDP2 with experts over efsdp = world / ep, every layer and the MTP block recomputed."""
    impl = run["impl"]
    assert (impl["cross_entropy"], impl["moe_dispatch"], impl["state_sharding"], impl["recompute"],
            impl["mixed_precision"]) == ("linear_ce", "chunked", "fsdp2", "full", "bf16")
    config = {**models.NAMED[run["model"]], "num_hidden_layers": run["layers"]}
    # runs without the key predate the chunked dispatch's fused recompute (it saves less)
    fused = impl.get("moe_fused_recompute", False)
    est = memory.estimate(config, memory.Parallel(dp=run["world_size"], ep=run["ep"], seq_len=row["seq_len"],
                                                  moe_fused_recompute=fused, adamw=run.get("adamw", "foreach"),
                                                  compiled_norms=False))  # every run predates Qwen3.5's compiled chains
    _, cfg = memory._model_on_meta(config)
    assert list(cfg.layer_types) == run["layer_types"] and cfg.mtp_num_hidden_layers == 1
    static, peak = row["static_GiB"] * 2**30, row["peak_GiB"] * 2**30
    assert abs(est.static - static) <= 0.02 * static, (est.static / 2**30, row["static_GiB"])
    assert abs(est.peak - peak) <= 0.06 * peak, (est.peak / 2**30, row["peak_GiB"], est.phases)


@pytest.mark.parametrize("run,row", list(_rows("state_sharding", "state_sharding.json", "ranks4/state_sharding.json",
                                                "ranks8/state_sharding.json")))
def test_state_sharding_benchmark_peak(run, row):
    """benchmarks/state_sharding/bench.py's estimator target: within 10% of the measured peak. These runs
    predate the compiled chains and the chunked dispatch at one rank (EP = 1 ran the local twin); those
    before the dispatch's fused recompute (landed 2026-11-22 08:08 UTC) saved the combined rows."""
    s = run["shape"]
    config = {**models.NAMED[s["model"]], "num_hidden_layers": s["layers"], "dtype": "float32"}
    est = memory.estimate(config, memory.Parallel(
        dp=run["world_size"], ep=s["ep"], sharding=row["impl"], mixed_precision=s["mixed_precision"],
        micro_batch=s["micro_batch"], seq_len=s["seq_len"], recompute=s["recompute"], loss=s["loss"],
        adamw=s.get("adamw", "foreach"),  # runs before fused AdamW
        compiled_norms=False, moe_dispatch="local", moe_fused_recompute=run["date"] >= "2026-11-22T08:08"))
    assert abs(est.peak - row["peak_bytes"]) <= 0.10 * row["peak_bytes"], (est.peak, row["peak_bytes"], est.phases)
    assert abs(est.static - row["static_bytes"]) <= 0.05 * row["static_bytes"]


def test_hybrid_layer_terms():
    """Qwen3.5's terms: a gated-DeltaNet layer keeps more than a gated-attention one; the MTP depth's
    tensors exist only with an MTP head; the peak moves from the first decoder layer (gradients of the
    other blocks reduced) to the MTP block (every layer input and the depth's tensors kept) with length."""
    config = {**models.NAMED["qwen3.5-35b-a3b"], "num_hidden_layers": 4}
    _, cfg = memory._model_on_meta(config)
    dispatch = memory._chunked_dispatch(cfg, 65536, 2, 2)[:2]
    delta = memory._hybrid_layer(cfg, "linear_attention", 2, dispatch, True)
    gated = memory._hybrid_layer(cfg, "full_attention", 2, dispatch, True)
    assert delta[0] > gated[0] and delta[1] > gated[1]
    for kind in ("linear_attention", "full_attention"):  # compiled chains keep 16-bit inputs, not fp32 rows
        eager, compiled = (memory._hybrid_layer(cfg, kind, 2, dispatch, True, c) for c in (False, True))
        assert compiled[0] < eager[0] and compiled[1] < eager[1], kind
    # the eager chains' terms, as the composed-step runs measured them
    short, long = (memory.estimate(config, memory.Parallel(dp=2, ep=2, seq_len=s, moe_fused_recompute=False,
                                                           compiled_norms=False)) for s in (32768, 196608))
    fused = memory.estimate(config, memory.Parallel(dp=2, ep=2, seq_len=196608, compiled_norms=False))
    assert fused.peak < long.peak  # the fused recompute keeps the routing weights, not [R, D] outputs
    assert max(short.phases, key=short.phases.get) == "last_block"
    assert max(long.phases, key=long.phases.get) == "first_block"
    plain = memory.estimate({**config, "mtp_num_hidden_layers": 0}, memory.Parallel(dp=2, ep=2, seq_len=32768))
    assert plain.mtp_activations == 0 < short.mtp_activations
    assert plain.phases["first_block"] < short.phases["first_block"]
    text = memory.table(config, memory.Parallel(dp=2, ep=2, seq_len=32768))
    assert "at last_block" in text and "mtp_activations" in text


@pytest.mark.parametrize("run,row", [p for p in _rows("training_step", "training_step_qwen3-30b-a3b_h200_x1.json",
                                                      "history/6214fc0/training_step_qwen3-30b-a3b_h200_x1_long.json",
                                                      "history/6214fc0/training_step_qwen3-30b-a3b_h200_x1_longest_ours.json",
                                                      "history/461f8c0/training_step_qwen3.5-35b-a3b_h200_x1.json",
                                                      "history/290e38b/training_step_qwen3.5-35b-a3b_h200_x1_long.json")
                                     if p.values[1]["stack"] == "bumblebee"])
def test_training_step_peak(run, row):
    """benchmarks/training_step/bench.py, our stack: the defaults on one rank (linear_ce, chunked dispatch
    with its fused recompute, FSDP2 with fused AdamW, full recompute, bf16)."""
    assert row["config"]["impl"]["cross_entropy"] == "linear_ce" and row["gpus"] == 1
    # runs before the one-rank grouped path record no group_rows: they kept every routed row
    dispatch = row["config"].get("impl_configs", {}).get("moe_dispatch", {})
    est = memory.estimate(run["hf_config"], memory.Parallel(
        dp=1, seq_len=row["seq_len"], moe_dispatch="chunked" if "group_rows" in dispatch else "local",
        moe_group_rows=dispatch.get("group_rows", 65536)))
    assert abs(est.peak - row["peak_bytes"]) <= 0.06 * row["peak_bytes"], (est.peak, row["peak_bytes"], est.phases)
