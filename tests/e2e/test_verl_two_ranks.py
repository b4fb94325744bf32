"""RL smoke level 2: levels 0-1 on two gloo ranks: FSDP2 over both (qwen3-tiny), and expert
parallel EP = 2 (qwen3-moe-tiny, 8 experts, 4 a rank) under FSDP2.

Each rank takes half of every global batch; verl's token-mean loss (normalized by the global token
count) makes the two ranks' update that of one process on the whole batch: grad norms within float
rounding, weights as close as Adam lets rounding-level gradients move them. Then the two-rank save and
resume is bitwise, as on one rank.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.e2e.test_verl_resume import check_resume  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

MODELS = {"dense": ("qwen3-tiny", 1), "moe": ("qwen3-moe-tiny", 2)}  # case -> (model, EP on two ranks)


def runs(mesh, out):
    world = mesh.size()
    return {case: vc.train_resume(out, name, ep_size=ep if world == 2 else 1) for case, (name, ep) in MODELS.items()}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-l2")
    for name, _ in MODELS.values():  # written once, before the ranks read them
        for seed in (0, 1):
            vc.tiny_checkpoint(out, name, seed)
    return spawn(2, "runs", out, module=__name__), spawn(1, "runs", out, module=__name__)[0]


@pytest.mark.parametrize("case", sorted(MODELS))
def test_two_ranks_follow_one_process(both, case):
    two, one = both
    ranks = [r[case] for r in two]
    ref = one[case]
    for i, want in enumerate(ref["steps"]):
        got = [r["steps"][i] for r in ranks]
        assert all(g["grad_norm"] == got[0]["grad_norm"] for g in got)  # one all-reduced norm
        assert got[0]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), i
        # each rank's loss is its tokens' share of the global mean times the rank count
        assert sum(g["loss"] for g in got) / len(got) == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), i
        assert got[0]["lr"] == want["lr"]
    for k, v in ref["weights"].items():
        assert all(torch.equal(r["weights"][k], ranks[0]["weights"][k]) for r in ranks), k  # same export
        d = (ranks[0]["weights"][k] - v).abs()
        # sums in another order (half batches, gloo): an entry whose gradient is rounding noise can
        # move by up to lr a step either way under Adam; almost all agree to 1e-5
        assert (d > 1e-5).float().mean() <= 1e-3 and d.max() <= 2 * vc.LR * vc.STEPS, k


@pytest.mark.parametrize("case", sorted(MODELS))
def test_two_ranks_resume_bitwise(both, case):
    two, _ = both
    for r in two:
        check_resume(r[case])


def assemble(ranks_shards) -> dict:
    """Full HF tensors from every rank's `get_per_tensor_param_shard` (verl's ShardSpec blocks)."""
    full = {}
    for shards in ranks_shards:
        for name, flat, shape, place, contributes in shards:
            t = full.setdefault(name, torch.full(shape, float("nan"), dtype=flat.dtype))
            if not contributes or flat.numel() == 0:
                continue
            if isinstance(place, int):
                t.view(-1)[place:place + flat.numel()] = flat
            else:
                t[tuple(slice(o, o + n) for o, n in zip(place.global_offset, place.local_shape))] = \
                    flat.view(place.local_shape)
    return full


@pytest.mark.parametrize("case", sorted(MODELS))
def test_shard_export_is_the_full_export_in_blocks(both, case):
    """get_per_tensor_param_shard: every rank names every HF tensor in one order (verl's delta engine
    runs in lockstep), and the blocks the contributing ranks hold make up the gathered export."""
    ranks = [r[case] for r in both[0]]
    names = [[s[0] for s in r["shards"]] for r in ranks]
    assert names[0] == names[1] and sorted(names[0]) == sorted(ranks[0]["weights"])
    full = assemble(r["shards"] for r in ranks)
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(full[k], v), k


@pytest.mark.parametrize("case", sorted(MODELS))
def test_delta_shards_bring_the_synced_weights_to_the_new_ones(both, case):
    """get_per_tensor_param_delta_shard (verl's diff of the shards since prime_delta_snapshots, in HF
    coordinates): applied to the weights of the last full sync, gives the weights after the step."""
    ranks = [r[case] for r in both[0]]
    got = {k: v.clone() for k, v in ranks[0]["seed"].items()}
    changed = 0
    for r in ranks:
        for slots, _dtype, counts, idx, val in r["delta"]:
            (name, shape), = slots
            assert tuple(got[name].shape) == tuple(shape)
            got[name].view(-1)[idx.long()] = val
            changed += int(counts.sum())
    assert changed > 0
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("case", sorted(MODELS))
def test_streamed_weights_in_transformers_give_the_trainers_log_probs(both, case, tmp_path):
    """The rollout side: the shards, assembled as a receiver would, saved as HF safetensors and
    loaded by transformers (float64, its own loader and layout): its response log-probs equal the
    trainer's on the same rollout batch."""
    import shutil

    from safetensors.torch import save_file

    from tests.e2e.test_verl_actor_update import _reference
    ranks = [r[case] for r in both[0]]
    name, _ = MODELS[case]
    src = vc.tiny_checkpoint(tmp_path, name, seed=0)
    rollout_dir = tmp_path / "rollout"
    rollout_dir.mkdir()
    shutil.copy(src / "config.json", rollout_dir / "config.json")
    save_file({k: v.contiguous() for k, v in assemble(r["shards"] for r in ranks).items()},
              rollout_dir / "model.safetensors")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(rollout_dir, dtype=torch.float64, attn_implementation="eager",
                                              experts_implementation="eager")  # grouped_mm has no float64
    batch = ranks[0]["sync_batch"]
    zeros = torch.zeros(batch["responses"].shape)
    with torch.no_grad():
        _, lp, _ = _reference(hf, batch, zeros, zeros)
    m = batch["response_mask"].bool()
    for r in ranks:
        torch.testing.assert_close(r["sync_lp"].double()[m], lp[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_merged_two_rank_checkpoint_is_the_synced_weights(both, case, tmp_path):
    """verl_merge of the two-rank checkpoint (FSDP2; EP = 2: experts split over the ranks) into one
    HF folder: its tensors are the weights exported right after that save."""
    from safetensors.torch import load_file

    from bumblebee.integrations.verl_merge import merge
    r = both[0][0][case]
    merge(r["ckpt"], tmp_path / "merged")
    got = load_file(tmp_path / "merged/model.safetensors")
    assert set(got) == set(r["seed"])
    for k, v in r["seed"].items():
        assert torch.equal(got[k], v), k
