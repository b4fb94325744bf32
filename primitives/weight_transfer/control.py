"""The update's agreement: small pickled messages through the process group's key-value store
(every rank posts its check or vote, then collects everyone's within a timeout), so a failure on
any rank raises the same `TransferError` on every live rank (`endpoints.py`'s prepare and vote);
or, with `GroupVote`, one all-gather on the transfer group, the store carrying failures only."""
from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time

import torch
import torch.distributed as dist

from bumblebee.common.weight_transfer import TransferError


class Control:
    """Posts and collects small pickled messages under `prefix` in the store, with a timeout.

    Waiting is event-driven: each thread (the async service beside the trainer's main thread) talks
    through its own clone of the store client, so it can block in the store's `wait`, woken the
    moment the key is set, without holding up another thread's `set` (a shared client serializes
    them: a publish once waited 0.9 s behind the service's wait). Where the store cannot be cloned,
    one client is shared under a lock and polled with a backoff from 1 ms to `poll_s`; `polls`
    counts those pauses (0 on the event-driven path)."""

    def __init__(self, store, prefix: str, ranks, timeout_s: float, poll_s: float = 0.005):
        self.store = dist.PrefixStore(prefix, store)
        self.ranks, self.timeout_s, self.poll_s = tuple(ranks), timeout_s, poll_s
        self._lock = threading.Lock()
        self._local = threading.local()
        self.polls = 0
        try:
            self.store.clone()
            self._cloneable = True
        except Exception:  # a store without clone(): the shared, polled client
            self._cloneable = False

    @contextlib.contextmanager
    def _client(self):
        if not self._cloneable:
            with self._lock:
                yield self.store
            return
        own = getattr(self._local, "store", None)
        if own is None:
            own = self._local.store = self.store.clone()
        yield own

    def post(self, key: str, rank: int, obj) -> None:
        with self._client() as st:
            st.set(f"{key}/{rank}", pickle.dumps(obj))

    def wait(self, keys, timeout_s: float) -> bool:
        """Whether every key exists within `timeout_s` (TransferError if the store is gone)."""
        if self._cloneable:
            try:
                with self._client() as st:
                    st.wait(list(keys), datetime.timedelta(seconds=timeout_s))
                return True
            except Exception:  # a timeout, or a store that is gone (then _has raises)
                return self._has(*keys)
        deadline, pause = time.monotonic() + timeout_s, 0.001
        while not self._has(*keys):
            if time.monotonic() > deadline:
                return False
            self.polls += 1
            time.sleep(pause)
            pause = min(2 * pause, self.poll_s)
        return True

    def collect(self, key: str, ranks=None, timeout_s=None) -> dict:
        ranks = self.ranks if ranks is None else ranks
        keys = [f"{key}/{r}" for r in ranks]
        limit = timeout_s or self.timeout_s
        if not self.wait(keys, limit):
            late = [r for r, k in zip(ranks, keys) if not self._has(k)]
            raise TransferError(f"{key}: ranks {late} did not answer within {limit} s (dead or stuck)")
        with self._client() as st:  # one round trip for all ranks' values
            return {r: pickle.loads(v) for r, v in zip(ranks, st.multi_get(keys))}

    def _has(self, *keys) -> bool:
        try:
            with self._client() as st:
                return st.check(list(keys))
        except Exception as e:  # the store's host died: no answer will ever come
            raise TransferError(f"the control store is gone: {type(e).__name__}: {e}") from None

    def forget(self, key: str, rank: int) -> None:
        try:
            with self._client() as st:
                st.delete_key(f"{key}/{rank}")
        except Exception:
            pass


def agree(ctl: Control, key: str, rank: int, error: str | None, timeout_s=None, **extra) -> dict:
    """Post this rank's error (None: ok) and `extra`, collect everyone's; TransferError naming every
    rank that failed (the same message on every rank)."""
    ctl.post(key, rank, {"err": error, **extra})
    got = ctl.collect(key, timeout_s=timeout_s)
    bad = {r: v["err"] for r, v in got.items() if v["err"] is not None}
    if bad:
        raise TransferError("; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items())))
    return got


class GroupVote:
    """The update's prepare and vote as one all-gather of (error flag, value) a rank on a CPU (gloo)
    group over the link's ranks (`P2PTransfer(agreement="group")`), waited with the timeout, instead of
    the store's post, collect and forget round trips: no agreement keys in the store on a good update.
    No faster than the store (9cda0a1: an agreement's time is the ranks waiting for each other, not its
    transport). On the host, not the GPU: an all-gather on the NCCL transfer group queues behind the
    update's own wire and its wait polls the stream (measured 3.1 ms slower an update, e8c6d11). Every
    rank sees the same flags, so where one failed every rank turns to the store (`agree`) for the
    messages and raises the same `TransferError`; a rank that never joins makes the wait raise."""

    def __init__(self, ctl: Control, group, timeout_s: float):
        self.ctl, self.group, self.timeout_s = ctl, group, timeout_s
        self.ranks = dist.get_process_group_ranks(group)
        self.posted: set[str] = set()  # the keys this rank posted to the store (failures only)

    def __call__(self, key: str, rank: int, error: str | None, value: int = 0, timeout_s=None) -> dict:
        """rank -> value, once every rank answered without an error."""
        limit = timeout_s or self.timeout_s
        mine = torch.tensor([0 if error is None else 1, value], dtype=torch.int64)
        out = torch.empty(2 * len(self.ranks), dtype=torch.int64)
        try:
            work = dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=limit))
            got = out.view(-1, 2).tolist()
        except Exception as e:
            raise TransferError(f"{key}: a rank did not answer within {limit} s (dead or stuck): "
                                f"{type(e).__name__}: {e}") from None
        if any(flag for flag, _ in got):
            self.posted.add(key)
            agree(self.ctl, key, rank, error, timeout_s=limit)  # raises, naming every failed rank
            raise TransferError(f"{key}: a rank flagged an error that the store did not carry")
        return {r: v for r, (_, v) in zip(self.ranks, got)}


def vote_group_of(link) -> object:
    """The group `agreement="group"` votes on: `link.vote_group`, else the link's own group, which must
    then have a CPU backend (ValueError naming both ways to give it one)."""
    group = link.vote_group if link.vote_group is not None else (link.group or dist.group.WORLD)
    span = sorted(link.trainer_ranks + link.rollout_ranks)
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a rank it leaves out
        raise ValueError(f"Link.vote_group must span exactly the link's ranks {span}; this rank is not in it")
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        raise ValueError("P2PTransfer(agreement='group') votes on the host: Link.vote_group must be a group over the "
                         "link's ranks with a CPU backend, e.g. dist.new_group(ranks, backend='gloo'), or the link's "
                         "group must have one (init_process_group('cpu:gloo,cuda:nccl')); "
                         f"got {'vote_group' if link.vote_group is not None else 'group'} without one") from None
    members = sorted(dist.get_process_group_ranks(group))
    if members != span:
        raise ValueError(f"Link.vote_group must span exactly the link's ranks {span}; got {members}")
    return group
