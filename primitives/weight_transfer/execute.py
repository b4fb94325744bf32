"""The executor: one update moves the plan's rounds over torch.distributed point to point, as a
transaction agreed through the process group's key-value store.

An update `n` (both sides count them) has three steps:
1. prepare: every rank checks its side (a sender's shards still match the plan, a receiver's
   targets too) and posts the result; any error -> every rank raises it, nothing moved;
2. move: each round is one `batch_isend_irecv` (one message per sender/receiver pair, the entries'
   bytes back to back, no header). A receiver receives into its staging buffer (its whole update:
   the cost of the guarantee) or, non-transactional, into a round buffer unpacked at once. An
   exception while packing or unpacking is kept and the rounds go on, so that every peer's
   messages are still consumed; a peer that dies surfaces as a failed or timed-out `wait`;
3. vote: every rank posts ok or its error and waits for all votes (`timeout_s`): a missing vote
   (a dead rank) or any error raises `TransferError` on every live rank; only after a unanimous ok
   do receivers copy the staged bytes into their targets.
"""
from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time

import torch
import torch.distributed as dist

from bumblebee.common.weight_transfer import TransferError
from bumblebee.primitives.weight_transfer import copies
from bumblebee.primitives.weight_transfer.boxes import box_shape, view
from bumblebee.primitives.weight_transfer.spec import dtype_of


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


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


class Mover:
    """This rank's side of a plan: message layouts, persistent buffers, the rounds."""

    def __init__(self, plan, rank: int, group, *, transactional: bool, device, keep_programs: int = 1,
                 send_buffers: int = 1):
        self.plan, self.rank, self.group = plan, rank, group
        self.transactional = transactional
        self.msgs = plan.messages(rank)
        self.size = {dt: dtype_of(dt).itemsize for dt in set(plan.dtypes.values())}
        # larger items first: each entry's offset stays aligned; then in the order of the receiver's
        # first write (target, offset), so that pieces adjacent in a target (the experts' rows of a
        # fused w13) are adjacent in the message too and their copies merge (copies.py). Both ends
        # sort the shared plan the same way, so the bytes of a message agree without a header.
        for key, entries in self.msgs.items():
            entries.sort(key=lambda e: (-self.size[plan.dtypes[e.hf_name]],) + (e.writes[0][0], e.writes[0][2])
                         if e.writes else (-self.size[plan.dtypes[e.hf_name]], "", 0))
        # byte offset of each message in this rank's buffers: sends per round, receives in staging
        self.offset, send_round, recv_round, total = {}, {}, {}, 0
        for key in sorted(self.msgs):
            r, src, dst = key
            n = _align(sum(e.nbytes for e in self.msgs[key]))
            if src == rank:
                self.offset[key] = send_round.get(r, 0)
                send_round[r] = self.offset[key] + n
            else:
                self.offset[key] = total if transactional else recv_round.get(r, 0)
                recv_round[r] = recv_round.get(r, 0) + n
                total += n
        # round r packs into buffer r % send_buffers: with two, round r + 1's pack needs only round r - 1
        # done (the buffer's previous bytes on the wire), so it runs while round r is on the wire
        size = max(send_round.values(), default=0)
        self.send_bufs = [torch.empty(size, dtype=torch.uint8, device=device)
                          for _ in range(send_buffers if size and plan.rounds > 1 else 1)]
        self.recv_buf = torch.empty(total if transactional else max(recv_round.values(), default=0),
                                    dtype=torch.uint8, device=device)
        self.staged_bytes = self.recv_buf.numel() if transactional else 0
        # copy programs, per plan (a new plan gets a new Mover); `keep_programs`: how many source
        # identities to keep them for (the async sender's snapshots: 3)
        self.programs = copies.ProgramCache(keep_programs)

    def _slice(self, buf, key):
        n = sum(e.nbytes for e in self.msgs[key])
        return buf[self.offset[key]:self.offset[key] + n]

    def send_buf(self, key):
        """The send slice of message `key` (its round's buffer)."""
        return self._slice(self.send_bufs[key[0] % len(self.send_bufs)], key)

    def _pack_pairs(self, key, read):
        out, at, pairs = self.send_buf(key), 0, []
        for e in self.msgs[key]:
            src = read(e)  # the shards are in the wire dtype: their bytes go as they are
            pairs.append((out[at:at + e.nbytes].view(src.dtype).view(src.shape), src))
            at += e.nbytes
        return pairs

    def pack(self, key, read, ident=None) -> torch.Tensor:
        """Fill the send slice of message `key`; `read(entry)` gives the entry's source view. With
        `ident` (the sources' `copies.identity`) the message's copy program is cached under it."""
        make = lambda: copies.build(self._pack_pairs(key, read))  # noqa: E731
        (make() if ident is None else self.programs.get(ident, ("pack", key), make)).run()
        return self.send_buf(key)

    def _unpack_pairs(self, keys, targets):
        pairs = []
        for key in keys:
            buf, at = self._slice(self.recv_buf, key), 0
            for e in self.msgs[key]:
                dt = dtype_of(self.plan.dtypes[e.hf_name])
                got = buf[at:at + e.nbytes].view(dt).view(box_shape(e.box))
                for target, strides, offset in e.writes:
                    t = targets[target]
                    pairs.append((t.as_strided(box_shape(e.box), strides, t.storage_offset() + offset), got))
                at += e.nbytes
        return pairs

    def unpack(self, keys, targets, ident=None) -> None:
        """Copy the received messages `keys` (in order) into `targets`, through one cached program
        when `ident` (the targets' `copies.identity`) is given."""
        keys = tuple(keys)
        make = lambda: copies.build(self._unpack_pairs(keys, targets))  # noqa: E731
        (make() if ident is None else self.programs.get(ident, ("unpack", keys), make)).run()

    def copy_stats(self) -> dict:
        """Entries (with their writes) this rank copies per update, and the copy calls its newest
        programs make for them (the multi-tensor copy counted once)."""
        progs = self.programs.entries[-1][1].values() if self.programs.entries else ()
        return {"entries": sum(len(v) for v in self.msgs.values()),
                "copy_calls": sum(p.launches for p in progs), "builds": self.programs.builds,
                "volatile": self.programs.volatile}

    @torch.no_grad()
    def move(self, read=None, targets=None, timeout_s: float = 60.0, on_round=None) -> list[str]:
        """Run every round; the errors met (empty: all of this rank's messages went through)."""
        errors, self.peer_failed = [], False
        timeout = datetime.timedelta(seconds=timeout_s)
        # NCCL's wait with a timeout blocks the host until the round is done (no packing of the next
        # round meanwhile); without one it only orders the streams. This rank's last timed wait still
        # bounds its whole update (one stream: it completes after every earlier round). gloo's wait
        # always blocks, so there every round carries the timeout (a dead peer raises in time).
        stream_ordered = self.send_bufs[0].device.type == "cuda"
        last = max((k[0] for k in self.msgs), default=-1)  # this rank's last round with messages
        src_ident = _ident_of(read)
        unpacking = not self.transactional and targets is not None
        dst_ident = _targets_ident(targets) if unpacking else None
        pending = {}  # round -> its works not waited for yet (their buffers not free yet)

        def settle(upto) -> bool:
            """Wait, in round order, for every pending round <= upto; False (the error noted) where a
            dead or stuck peer failed one: the group cannot be trusted any more."""
            for q in sorted(k for k in pending if k <= upto):
                timed = not stream_ordered or q == last
                try:
                    for w in pending.pop(q):
                        w.wait(timeout=timeout) if timed else w.wait()
                except Exception as e:
                    errors.append(f"round {q}: {type(e).__name__}: {e}")
                    self.peer_failed = True
                    return False
            return True

        for r in range(self.plan.rounds):
            ops, keys = [], [k for k in sorted(self.msgs) if k[0] == r]
            if not settle(r - len(self.send_bufs)):  # the round that used this round's send buffer
                return errors
            for key in keys:
                _, src, dst = key
                if src == self.rank:
                    try:
                        buf = self.pack(key, read, src_ident)
                    except Exception as e:  # still send: the receiver is waiting for these bytes
                        errors.append(f"packing {key}: {type(e).__name__}: {e}")
                        buf = self.send_buf(key)
                    ops.append(dist.P2POp(dist.isend, buf, dst, self.group))
                else:
                    ops.append(dist.P2POp(dist.irecv, self._slice(self.recv_buf, key), src, self.group))
            mine = [k for k in keys if k[2] == self.rank]
            try:
                pending[r] = dist.batch_isend_irecv(ops) if ops else []
            except Exception as e:
                errors.append(f"round {r}: {type(e).__name__}: {e}")
                self.peer_failed = True
                return errors
            # a receive is read at once (unpacked) or its staging is not reused: only a write-through
            # receiver and a single send buffer need the round done before the next one
            if ((mine and unpacking) or len(self.send_bufs) == 1) and not settle(r):
                return errors
            try:
                if unpacking and mine:
                    self.unpack(mine, targets, dst_ident)
                if on_round is not None:
                    on_round(r)
            except Exception as e:
                errors.append(f"round {r}: {type(e).__name__}: {e}")
        settle(self.plan.rounds)
        return errors

    @torch.no_grad()
    def commit(self, targets) -> None:
        """Copy the staged update into the targets (transactional mode, after a unanimous vote)."""
        if self.transactional:  # the whole update in one program
            self.unpack([k for k in sorted(self.msgs) if k[2] == self.rank], targets, _targets_ident(targets))


def _ident_of(read):
    if isinstance(read, read_from):
        return read.ident
    tensors = getattr(read, "tensors", None)
    return None if tensors is None else copies.identity(tensors)


def _targets_ident(targets: dict):
    return tuple(targets) + copies.identity(targets.values())


class read_from:
    """`read(entry)` over this rank's shards {(hf name, box): tensor}: the entry's view. `tensors`:
    the shards, whose identity (`ident`, taken now: the sender builds this before waiting for its
    peers) keys the sender's cached copy programs."""

    def __init__(self, local: dict):
        self.by_name: dict = {}
        for (name, box), t in local.items():
            self.by_name.setdefault(name, []).append((box, t))
        self.tensors = tuple(local.values())
        self.ident = copies.identity(self.tensors)

    def __call__(self, e):
        for box, t in self.by_name.get(e.hf_name, ()):
            if all(s <= es and es + (ec - 1) * est < s + c for (s, _, c), (es, est, ec) in zip(box, e.box)):
                return view(t, e.box, tuple(s for s, _, _ in box))
        raise KeyError(f"this rank holds no box of {e.hf_name!r} covering {e.box}")
