"""The executor: one update moves the plan's rounds over torch.distributed point to point, as a
transaction agreed through the process group's key-value store.

An update `n` (both sides count them) has three steps:
1. prepare: every rank checks its side (a sender's shards still match the plan, a receiver's
   targets too) and posts the result; any error -> every rank raises it, nothing moved;
2. move: each round is one `batch_isend_irecv` (one message per sender/receiver pair, the entries'
   bytes back to back, no header). A receiver either stages (`commit="stage"`: it receives its whole
   update into a staging buffer, the cost of the guarantee) or lands each round in place: its
   receives go into two round buffers in turn, and once the host has seen round r complete (a timed
   wait, while round r + 1 is already on the wire) round r is unpacked into the targets on a side
   stream. Landing in place keeps the transaction with an undo copy (`commit="undo"`): before the
   first unpack, the side stream copies every element the update writes into a backup, while round
   0 is on the wire; `commit="undo_ahead"` takes it instead right after the previous update committed
   (off the update's critical path, beside the rollout's own work), valid while the targets changed only
   through this transfer: a target whose tensor was swapped or written in place through a torch op
   since (its version counter moved) gets the backup in the update's window again. An exception while
   packing or unpacking is kept and the rounds go on, so that
   every peer's messages are still consumed; a peer that dies surfaces as a failed or timed-out `wait`;
3. vote: every rank posts ok or its error and waits for all votes (`timeout_s`): a missing vote
   (a dead rank) or any error raises `TransferError` on every live rank. After a unanimous ok a
   staging receiver copies the staged bytes into its targets (after the wire: the update's critical
   path); after a failed vote an undo receiver copies the backup back. Only rounds the host saw
   complete are ever unpacked, so no late or aborted receive can write after that restore.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from bumblebee.primitives.weight_transfer import copies
from bumblebee.primitives.weight_transfer.boxes import box_shape, view
from bumblebee.primitives.weight_transfer.spec import dtype_of


COMMITS = ("stage", "undo", "undo_ahead")  # P2PTransfer.commit


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


class Mover:
    """This rank's side of a plan: message layouts, persistent buffers, the rounds."""

    def __init__(self, plan, rank: int, group, *, transactional: bool, device, keep_programs: int = 1,
                 send_buffers: int = 1, commit: str = "stage"):
        if commit not in COMMITS:
            raise ValueError(f"Mover: commit must be one of {COMMITS}; got {commit!r}")
        self.plan, self.rank, self.group = plan, rank, group
        self.staging = transactional and commit == "stage"  # else rounds land in place as they arrive
        self.undo = transactional and commit in ("undo", "undo_ahead")
        self.backup_ahead = transactional and commit == "undo_ahead"
        self.ahead = None  # (targets' identity, their versions) the backup taken ahead holds, if any
        self.window_backups = 0  # updates that backed up inside their own window (undo modes)
        self.msgs = plan.messages(rank)
        self.size = {dt: dtype_of(dt).itemsize for dt in set(plan.dtypes.values())}
        # larger items first: each entry's offset stays aligned; then in the order of the receiver's
        # first write (target, offset), so that pieces adjacent in a target (the experts' rows of a
        # fused w13) are adjacent in the message too and their copies merge (copies.py). Both ends
        # sort the shared plan the same way, so the bytes of a message agree without a header.
        for key, entries in self.msgs.items():
            entries.sort(key=lambda e: (-self.size[plan.dtypes[e.hf_name]],) + (e.writes[0][0], e.writes[0][2])
                         if e.writes else (-self.size[plan.dtypes[e.hf_name]], "", 0))
        # byte offset of each message in this rank's buffers: sends per round, receives in staging or
        # per round (landing in place)
        self.offset, send_round, recv_round, total = {}, {}, {}, 0
        for key in sorted(self.msgs):
            r, src, dst = key
            n = _align(sum(e.nbytes for e in self.msgs[key]))
            if src == rank:
                self.offset[key] = send_round.get(r, 0)
                send_round[r] = self.offset[key] + n
            else:
                self.offset[key] = total if self.staging else recv_round.get(r, 0)
                recv_round[r] = recv_round.get(r, 0) + n
                total += n
        # round r packs into buffer r % send_buffers: with two, round r + 1's pack needs only round r - 1
        # done (the buffer's previous bytes on the wire), so it runs while round r is on the wire
        size = max(send_round.values(), default=0)
        self.send_bufs = [torch.empty(size, dtype=torch.uint8, device=device)
                          for _ in range(send_buffers if size and plan.rounds > 1 else 1)]
        # landing in place: round r receives into buffer r % 2, so round r + 1 lands while round r unpacks
        rounds_in = len(recv_round)
        self.recv_bufs = [torch.empty(total, dtype=torch.uint8, device=device)] if self.staging else \
            [torch.empty(max(recv_round.values(), default=0), dtype=torch.uint8, device=device)
             for _ in range(2 if rounds_in > 1 else 1)]
        self.keep = None  # the undo backup, laid out on the first update (it needs the targets' dtypes)
        self.backed_up = False  # this update's backup was taken: a failed vote may restore it
        self.prepacked, self.last_prepacked = set(), 0  # round-0 messages packed before the agreement
        self.staged_bytes = total if transactional else 0  # staging, or the backup of the same elements
        # copy programs, per plan (a new plan gets a new Mover); `keep_programs`: how many source
        # identities to keep them for (the async sender's snapshots: 3)
        self.programs = copies.ProgramCache(keep_programs)

    def _slice(self, buf, key):
        n = sum(e.nbytes for e in self.msgs[key])
        return buf[self.offset[key]:self.offset[key] + n]

    def recv_slice(self, key):
        """Where message `key` lands: its place in staging, or in its round's buffer."""
        return self._slice(self.recv_bufs[0 if self.staging else key[0] % len(self.recv_bufs)], key)

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

    def prepack(self, read) -> None:
        """Pack this rank's round-0 messages ahead, while the agreement is still out (the receivers'
        answer then finds round 0 packed); a failure leaves them to `move`, which reports it."""
        self.prepacked = set()
        ident = _ident_of(read)
        try:
            for key in sorted(k for k in self.msgs if k[0] == 0 and k[1] == self.rank):
                self.pack(key, read, ident)
                self.prepacked.add(key)
        except Exception:
            self.prepacked = set()

    def _unpack_pairs(self, keys, targets):
        pairs = []
        for key in keys:
            buf, at = self.recv_slice(key), 0
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

    def _keep_pairs(self, keys, targets):
        """(backup view, target view) for every element the messages `keys` write: the backup holds
        each write's box in the target's dtype, laid out in message order (allocated on first use)."""
        views, total = [], 0
        for key in keys:
            for e in self.msgs[key]:
                for target, strides, offset in e.writes:
                    t = targets[target]
                    views.append((total, t.as_strided(box_shape(e.box), strides, t.storage_offset() + offset)))
                    total = _align(total + views[-1][1].numel() * t.element_size())
        if self.keep is None or self.keep.numel() != total:
            self.keep = torch.empty(total, dtype=torch.uint8, device=self.recv_bufs[0].device)
            self.staged_bytes = total
        return [(self.keep[at:at + v.numel() * v.element_size()].view(v.dtype).view(v.shape), v) for at, v in views]

    def _keep_copy(self, targets, ident, back: bool) -> None:
        keys = tuple(k for k in sorted(self.msgs) if k[2] == self.rank)
        make = lambda: copies.build([(v, b) if back else (b, v)  # noqa: E731
                                     for b, v in self._keep_pairs(keys, targets)])
        self.programs.get(ident or _targets_ident(targets), ("restore" if back else "backup", keys), make).run()

    def backup(self, targets, ident=None) -> None:
        """Copy every element this rank's update writes into the backup (undo mode), through a program
        cached under the targets' identity (`ident`, taken here when not given)."""
        self._keep_copy(targets, ident, back=False)

    def restore(self, targets, ident=None) -> None:
        """Copy the backup back into the targets: the previous version, where an undo update failed."""
        self._keep_copy(targets, ident, back=True)

    @torch.no_grad()
    def move(self, read=None, targets=None, timeout_s: float = 60.0, on_round=None) -> list[str]:
        """Run every round; the errors met (empty: all of this rank's messages went through)."""
        errors, self.peer_failed = [], False
        prepacked, self.prepacked = self.prepacked, set()  # used once: a later update packs again
        self.last_prepacked = len(prepacked)
        timeout = datetime.timedelta(seconds=timeout_s)
        # NCCL's wait with a timeout blocks the host until the round is done (no packing of the next
        # round meanwhile); without one it only orders the streams. This rank's last timed wait still
        # bounds its whole update (one stream: it completes after every earlier round). gloo's wait
        # always blocks, so there every round carries the timeout (a dead peer raises in time).
        stream_ordered = self.send_bufs[0].device.type == "cuda"
        last = max((k[0] for k in self.msgs), default=-1)  # this rank's last round with messages
        src_ident = _ident_of(read)
        mine = {}  # round -> this rank's receives in it
        for k in sorted(self.msgs):
            if k[2] == self.rank:
                mine.setdefault(k[0], []).append(k)
        landing = not self.staging and targets is not None and bool(mine)
        dst_ident = _targets_ident(targets) if landing else None
        side = _Side(self.recv_bufs[0].device) if landing else None
        landed = {}  # round -> its unpack's end on the side stream (its receive buffer free again)
        pending = {}  # round -> its works not waited for yet (their buffers not free yet)

        def settle(upto, timed=False) -> bool:
            """Wait, in round order, for every pending round <= upto; False (the error noted) where a
            dead or stuck peer failed one: the group cannot be trusted any more."""
            for q in sorted(k for k in pending if k <= upto):
                timed_q = timed or not stream_ordered or q == last
                try:
                    for w in pending.pop(q):
                        w.wait(timeout=timeout) if timed_q else w.wait()
                except Exception as e:
                    errors.append(f"round {q}: {type(e).__name__}: {e}")
                    self.peer_failed = True
                    return False
            return True

        def land(q) -> bool:
            """Round q's receives, seen complete by the host, unpacked into the targets on the side stream."""
            if not settle(q, timed=True):
                return False
            try:
                with side.run():
                    self.unpack(mine[q], targets, dst_ident)
                landed[q] = side.mark()
            except Exception as e:  # noted once: the vote fails (an undo receiver restores after it)
                landed[q] = None
                errors.append(f"round {q}: {type(e).__name__}: {e}")
            return True

        self.backed_up = False
        ahead, self.ahead = self.ahead, None  # used once: the next update's comes after this one's commit
        if landing and self.undo and ahead is not None and ahead == _backed_state(targets, dst_ident):
            self.backed_up = True  # the side stream runs it before this update's first unpack
        elif landing and self.undo:
            try:
                with side.run():
                    self.backup(targets, dst_ident)
                self.backed_up = True
                self.window_backups += 1
            except Exception as e:  # no backup: nothing may be written; the vote fails
                errors.append(f"backup: {type(e).__name__}: {e}")
                landing = False
        for r in range(self.plan.rounds):
            ops, keys = [], [k for k in sorted(self.msgs) if k[0] == r]
            # the round that used this round's send buffer (a landing receiver settles in land: timed)
            if not landing and not settle(r - len(self.send_bufs)):
                return errors
            if landing and r in mine:  # its receive buffer is free once the last unpack that read it ended
                side.wait_for(landed.get(max((q for q in landed if q <= r - len(self.recv_bufs)), default=None)))
            for key in keys:
                _, src, dst = key
                if src == self.rank:
                    try:
                        buf = self.send_buf(key) if key in prepacked else self.pack(key, read, src_ident)
                    except Exception as e:  # still send: the receiver is waiting for these bytes
                        errors.append(f"packing {key}: {type(e).__name__}: {e}")
                        buf = self.send_buf(key)
                    ops.append(dist.P2POp(dist.isend, buf, dst, self.group))
                else:
                    ops.append(dist.P2POp(dist.irecv, self.recv_slice(key), src, self.group))
            try:
                pending[r] = dist.batch_isend_irecv(ops) if ops else []
            except Exception as e:
                errors.append(f"round {r}: {type(e).__name__}: {e}")
                self.peer_failed = True
                return errors
            if landing:  # land the earlier receiving rounds while this one is on the wire
                for q in sorted(q for q in mine if q < r and q not in landed):
                    if not land(q):
                        return errors
            elif len(self.send_bufs) == 1 and not settle(r):  # a single send buffer is reused next round
                return errors
            try:
                if on_round is not None:
                    on_round(r)
            except Exception as e:
                errors.append(f"round {r}: {type(e).__name__}: {e}")
        if landing:
            for q in sorted(q for q in mine if q not in landed):
                if not land(q):
                    return errors
        settle(self.plan.rounds)
        return errors

    @torch.no_grad()
    def commit(self, targets) -> None:
        """After a unanimous vote: copy the staged update into the targets (staging); where rounds
        landed in place, order the caller's stream after their unpacks."""
        if self.staging:  # the whole update in one program
            self.unpack([k for k in sorted(self.msgs) if k[2] == self.rank], targets, _targets_ident(targets))
            return
        if self.recv_bufs[0].device.type == "cuda":
            torch.cuda.current_stream(self.recv_bufs[0].device).wait_stream(_Side.stream_of(self.recv_bufs[0].device))
        if self.backup_ahead and self.backed_up:
            self._back_up_ahead(targets)

    def _back_up_ahead(self, targets) -> None:
        """The next update's backup, taken now on the side stream (after this update's unpacks, before
        the next one's): the caller's stream goes on without it. Not taken where it fails (the next
        update then backs up in its window)."""
        side = _Side(self.recv_bufs[0].device, after_caller=False)
        state = _backed_state(targets)
        try:
            with side.run():
                self.backup(targets, state[0])
        except Exception:
            return
        self.ahead = state

    @torch.no_grad()
    def abort(self, targets) -> None:
        """After a failed vote: an undo receiver copies the backup back (after every unpack it made)."""
        if self.undo and self.backed_up:
            # not after the caller's stream: after a timed-out receive it may wait on NCCL for good;
            # the side stream holds the backup and every unpack, each of a receive seen complete
            side = _Side(self.recv_bufs[0].device, after_caller=False)
            with side.run():
                self.restore(targets)
            if self.recv_bufs[0].device.type == "cuda":
                torch.cuda.current_stream(self.recv_bufs[0].device).wait_stream(side.stream)
            if self.backup_ahead and not self.peer_failed:  # the targets equal the backup again
                self.ahead = _backed_state(targets)


class _Side:
    """The stream a receiver unpacks and backs up on (one per device, kept), beside the stream NCCL's
    receives wait on; on the CPU everything runs in order and these are no-ops."""
    _streams: dict = {}

    @classmethod
    def stream_of(cls, device):
        if device not in cls._streams:
            cls._streams[device] = torch.cuda.Stream(device)
        return cls._streams[device]

    def __init__(self, device, after_caller: bool = True):
        self.cuda = device.type == "cuda"
        self.stream = self.stream_of(device) if self.cuda else None
        if self.cuda and after_caller:  # after whatever the caller's stream did to the targets
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def run(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def mark(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait_for(self, ev) -> None:
        """The caller's stream (which NCCL's next receive waits on) after `ev`."""
        if ev is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(ev)


def _ident_of(read):
    if isinstance(read, read_from):
        return read.ident
    tensors = getattr(read, "tensors", None)
    return None if tensors is None else copies.identity(tensors)


def _targets_ident(targets: dict):
    return tuple(targets) + copies.identity(targets.values())


def _backed_state(targets: dict, ident=None) -> tuple:
    """What a backup taken now holds: the targets' identity (`ident`, taken here when not given) and
    version counters. An in-place write through a torch op moves a counter (one through `.data` or
    outside torch does not: `undo_ahead` asks that targets change only through the transfer);
    inference tensors keep none."""
    versions = tuple(None if t.is_inference() else t._version for t in targets.values())
    return (_targets_ident(targets) if ident is None else ident, versions)


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
