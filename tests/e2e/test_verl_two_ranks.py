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
