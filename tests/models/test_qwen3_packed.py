"""Qwen3 dense and MoE on packed sequences (`cu_seqlens`): the same logits and loss as each sequence
run alone, with either attention implementation, in float64."""
import pytest
import torch

import bumblebee as bb


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_equals_separate_sequences(name, attention):
    model = bb.models.build(name, impl={"attention": attention}, seed=1, dtype=torch.float64)
    vocab = model.config.vocab_size
    lengths = [5, 70, 1, 20]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    packed = torch.cat(seqs)[None]
    want = torch.cat([_logits(model, s[None])[0] for s in seqs])
    # float64, but MoE routing weights and the eager twin's softmax go through fp32
    tol = 1e-7 if "moe" in name or attention == "eager" else 1e-10
    assert rel_err(_logits(model, packed, cu_seqlens=cu)[0], want) < tol
    # the packed stream is the batch's B*T tokens, rows included
    got2 = _logits(model, packed.view(2, -1), cu_seqlens=cu).reshape(-1, want.shape[-1])
    assert rel_err(got2, want) < tol
    # no target crosses a sequence boundary: the packed loss is the token-weighted mean of the parts
    loss = model(packed, labels=packed, cu_seqlens=cu).loss
    parts = [model(s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs if len(s) > 1]
    assert abs(loss.item() - (sum(parts) / sum(n - 1 for n in lengths)).item()) < tol * 10


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_bad_cu_seqlens(name):
    model = bb.models.build(name, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    for cu in ([0, 5, 19], [0, 12, 10, 20], [1, 20], [0, 20.0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(ids, cu_seqlens=torch.tensor(cu))
