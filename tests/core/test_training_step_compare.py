"""benchmarks/training_step: what a traced step launched (attention kernel family, optimizer path) and how
ours pairs with the peer (same attention family first, fused-AdamW peers only, the ratio's spread over
the interleaved rounds and its verdict against a target)."""
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # step_profile reads benchmarks/timing.py
    spec = importlib.util.spec_from_file_location(name, BENCH / "training_step" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FA4 = "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor0000o1110"
CUDNN = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0"
FUSED_ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
              "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor")


def test_launched_reads_the_family_and_optimizer_from_names(monkeypatch):
    prof = _load("step_profile", monkeypatch)
    seen = prof.launched({FA4: 130.0, CUDNN: 5.0, FUSED_ADAM: 25.0, "nvjet_sm90_tst_256x128": 30.0}, set())
    assert seen["attention_kernel"] == "fa4" and seen["attention_kernel_ms"] == {"fa4": 130.0, "cudnn": 5.0}
    assert seen["optimizer"] == "fused"
    foreach = prof.launched({CUDNN: 9.0}, {"aten::_foreach_lerp_", "aten::_foreach_addcdiv_", "aten::mm"})
    assert foreach["attention_kernel"] == "cudnn" and foreach["optimizer"] == "foreach"
    none = prof.launched({"void at::native::softmax_warp_forward": 1.0}, {"aten::addcdiv_"})
    assert none["attention_kernel"] == "unfused" and none["optimizer"] == "single_tensor"
    assert prof.attention_family("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "flash2"
    assert prof.attention_family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") is None


def _row(stack, ms, rnd, fam="fa4", opt="fused", seq=32768, peak=50):
    return {"stack": stack, "seq_len": seq, "fits": True, "median_ms": ms, "round": rnd, "attention_kernel": fam,
            "optimizer": opt, "peak_bytes": peak, "static_bytes": 10, "losses": [2.0, 1.9], "grad_norms": [1.0, 0.9]}


def test_pairing_spread_and_verdict(monkeypatch):
    cmp = _load("step_compare", monkeypatch)
    rows = [_row("transformers+liger", 600, 0, peak=52), _row("bumblebee", 500, 0),
            _row("transformers+liger-reference", 700, 0, fam="cudnn", opt="foreach"),
            _row("transformers+liger", 610, 1, peak=52), _row("bumblebee", 490, 1)]
    (c,) = cmp.compare(rows)
    assert c["peer"] == "transformers+liger" and c["rounds"] == 2 and c["same_attention_kernel"]
    assert c["speed_ratio"] == pytest.approx(605 / 495)
    assert (c["speed_ratio_low"], c["speed_ratio_high"]) == (pytest.approx(600 / 500), pytest.approx(610 / 490))
    assert c["target_verdict"] == "missed" and c["peak_at_most_peer"]
    assert cmp.compare(rows, target=1.22)[0]["target_verdict"] == "not shown"  # inside [1.200, 1.245]
    assert cmp.compare(rows, target=1.1)[0]["target_verdict"] == "shown"


def test_a_peer_of_another_family_is_paired_only_saying_so(monkeypatch):
    cmp = _load("step_compare", monkeypatch)
    rows = [_row("transformers+liger", 660, 0), _row("bumblebee", 520, 0, fam="cudnn"),
            _row("transformers+liger-reference", 700, 0, fam="cudnn", opt="foreach")]
    (c,) = cmp.compare(rows)  # the foreach reference is never paired, though its family matches
    assert c["peer"] == "transformers+liger" and not c["same_attention_kernel"]
    assert c["attention_kernel"] == {"ours": "cudnn", "peer": "fa4"}
    rows.append(_row("transformers+liger:attn=sdpa", 680, 0, fam="cudnn"))
    (c,) = cmp.compare(rows)
    assert c["peer"] == "transformers+liger:attn=sdpa" and c["same_attention_kernel"]


def test_peer_options_are_checked(monkeypatch):
    import torch
    monkeypatch.syspath_prepend(str(BENCH / "training_step"))
    stacks = _load("step_stacks", monkeypatch)
    with pytest.raises(ValueError, match="unknown peer options"):
        stacks.build("transformers+liger:atn=sdpa", None, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="attn"):
        stacks.build("transformers+liger:attn=flash", None, torch.device("cpu"), None)
    assert stacks.peer_attention(torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError, match="unknown stack"):
        stacks.build("megatron", None, torch.device("cpu"), None)
