"""`context_parallel.model.mesh` / `expert_mesh` groups wait what the job's default group waits (or an
explicit timeout), not c10d's 30-minute default for new groups: a rank whose cp peer stalls raises
in about the timeout instead of hanging. 4 gloo ranks."""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from bumblebee.primitives.context_parallel import model as cp_model
from tests.limits import PROCESS_GROUP_TIMEOUT
from tests.primitives.context_parallel_ranks import spawn

SHORT = datetime.timedelta(seconds=2)


def _timeout(group):
    return group._get_backend(torch.device("cpu")).options._timeout


def mesh_timeouts(group):
    m = cp_model.mesh("cpu", 2, 2)
    em = cp_model.expert_mesh(m, 2, over="dp")
    short = cp_model.mesh("cpu", 2, 2, timeout=SHORT)
    got = {f"mesh.{n}": _timeout(m[n].get_group()) for n in ("dp", "cp")}
    got.update({f"expert_mesh.{n}": _timeout(em[n].get_group()) for n in ("efsdp", "ep")})
    got.update({f"short.{n}": _timeout(short[n].get_group()) for n in ("dp", "cp")})
    got["world"] = _timeout(dist.group.WORLD)
    # the cp peer of an even rank stalls: the even rank's all-reduce raises, in about SHORT
    cp_group, waited, error = short["cp"].get_group(), None, None
    if dist.get_rank() % 2 == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=cp_group)
        except RuntimeError as e:
            error = str(e)
        waited = time.monotonic() - start
    return {"timeouts": got, "waited": waited, "error": error}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(4, __name__, "mesh_timeouts", tmp_path_factory.mktemp("cp_mesh"))


def test_mesh_groups_take_the_default_groups_timeout(four_ranks):
    for r in four_ranks:
        t = r["timeouts"]
        assert t["world"] == PROCESS_GROUP_TIMEOUT
        for name in ("mesh.dp", "mesh.cp", "expert_mesh.efsdp", "expert_mesh.ep"):
            assert t[name] == PROCESS_GROUP_TIMEOUT, (name, t[name])
        assert t["short.dp"] == t["short.cp"] == SHORT


def test_a_stalled_cp_peer_raises_within_the_timeout(four_ranks):
    for rank, r in enumerate(four_ranks):
        if rank % 2:
            continue
        assert r["error"] is not None, "the all-reduce returned though its peer never joined"
        assert SHORT.total_seconds() * 0.5 <= r["waited"] <= SHORT.total_seconds() + 30


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout must be a positive datetime.timedelta"):
        cp_model._with_timeout(None, (), datetime.timedelta(0))
