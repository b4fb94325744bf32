"""Qwen3 on CUDA in bf16: our sdpa path against transformers, both measured against float64."""
import pytest
import torch

import bumblebee as bb
from tests.models.test_qwen3_hf_parity import hf_model, rel_err

pytestmark = pytest.mark.gpu


def test_bf16_logits_within_transformers_own_error(tmp_path):
    ref = hf_model(11, num_hidden_layers=3)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, ref.config.vocab_size, (2, 300), device="cuda")
    with torch.no_grad():
        exact = ref.double().cuda()(ids).logits
        hf_bf16 = ref.to(torch.bfloat16)(ids).logits
        ours = bb.models.from_pretrained(tmp_path, impl={"attention": "sdpa"}, dtype=torch.bfloat16, device="cuda")
        got = ours(ids).logits
    e_hf, e_ours = rel_err(hf_bf16, exact), rel_err(got, exact)
    assert e_ours <= 2 * e_hf + 1e-3, (e_ours, e_hf)


def test_sdpa_matches_eager_in_bf16():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1000, 128, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", generator=g) for _ in range(2))
    from bumblebee.registry import resolve
    exact = resolve("attention", "eager")(q.double(), k.double(), v.double())
    e_eager = rel_err(resolve("attention", "eager")(q.bfloat16(), k.bfloat16(), v.bfloat16()), exact)
    e_sdpa = rel_err(resolve("attention", "sdpa")(q.bfloat16(), k.bfloat16(), v.bfloat16()), exact)
    assert e_sdpa <= 2 * e_eager + 1e-3, (e_sdpa, e_eager)


def test_pair_on_cuda_reports_allocator_memory():
    r = bb.pair("qwen3-tiny", "attention", "sdpa", "eager", steps=3, seq_len=256, batch_size=4)
    assert r["device"] != "cpu"
    assert r["peak_memory_bytes"]["b"] > r["peak_memory_bytes"]["a"]  # eager holds [B, H, T, T] scores
    assert max(s["grad_norm_rel_diff"] for s in r["steps"]) < 1e-4
