"""The two ends of a weight transfer: `WeightSender` on every trainer rank, `WeightReceiver` on
every rollout rank, over one process group spanning both (see `Link`).

Sync mode: `sender.update(shards, version)` and `receiver.update()` meet like a collective. Async
mode: `sender.publish(shards, version)` snapshots this rank's shards and returns (a service thread
serves requests); the rollout ranks call `receiver.poll()` together when they are ready, which
fetches the newest version every sender still holds (or returns None). A sender keeps at most three
snapshots (the one being served and the two newest), so a slow receiver never blocks the trainer
and skips the versions it was too slow for.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from bumblebee.common.weight_transfer import Link, TransferError, TransferInFlight
from bumblebee.primitives.weight_transfer.control import Control, GroupVote, agree, vote_group_of
from bumblebee.primitives.weight_transfer.execute import Mover, read_from
from bumblebee.primitives.weight_transfer.infer import LayoutCache, infer_layout
from bumblebee.primitives.weight_transfer.plan import make_plan
from bumblebee.primitives.weight_transfer.spec import SenderSpecs

# An idle service's store wait, after which it checks whether close() was called. close() does not
# wake it through the store: the request key is shared by every sender, so a wake posted there (and
# then deleted) reached the other senders' services as a request, or vanished under their read.
_IDLE_S = 0.5
# A sender's answer when the version a rollout asked for was dropped between the rollout's pick (from
# the senders' "pub" lists) and the service's turn: every rank sees it, and poll() picks again.
_GONE = "this sender no longer holds the requested version"
# How many times one poll() picks again after that (each pick is the newest version every sender holds).
_POLL_PICKS = 3


def _merge_manifests(manifests) -> tuple:
    out: dict = {}
    for m in manifests:
        for name, shape, dt in m:
            if out.setdefault(name, (shape, dt)) != (shape, dt):
                raise TransferError(f"senders disagree on {name!r}: {out[name]} vs {(shape, dt)} (a shape or "
                                    "dtype mismatch)")
    return tuple((n, s, d) for n, (s, d) in out.items())


class _Endpoint:
    def __init__(self, config, link: Link, rank: int):
        self.config, self.link, self.rank = config, link, rank
        store = link.store or dist.distributed_c10d._get_default_store()
        self.ctl = Control(store, f"weight_transfer/{link.name}/", link.trainer_ranks + link.rollout_ranks,
                           config.timeout_s, config.poll_s)
        self.n, self.version, self.plan, self.mover = 0, None, None, None
        # agreement="group": the vote group is checked here, before any update
        self.group_vote = GroupVote(self.ctl, vote_group_of(link), config.timeout_s) \
            if config.agreement == "group" else None
        self.forgotten_upto = 0  # the updates before this one left no store keys (see _left_before)
        self.broken: str | None = None
        self.on_round = None  # test seam: called with the round index after each round
        self._busy = threading.Lock()
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "staged_bytes": 0}

    @contextlib.contextmanager
    def _flight(self):
        if self.broken:
            raise TransferError(f"this endpoint is unusable after {self.broken}; open a new one")
        if not self._busy.acquire(blocking=False):
            raise TransferInFlight("an update is already in flight on this endpoint")
        try:
            yield
        finally:
            self._busy.release()

    def _setup(self, n, mine, wait_s):
        """Exchange specs (senders post theirs, receivers infer and post theirs) and plan."""
        t, r = self.link.trainer_ranks, self.link.rollout_ranks
        if self.rank in t:
            self.ctl.post(f"{n}/setup-s", self.rank, mine)
        senders = self.ctl.collect(f"{n}/setup-s", t, timeout_s=wait_s)
        manifest = _merge_manifests(m for _, m in senders.values())
        if self.rank in r:
            try:
                mine = self._infer(manifest)
            except Exception as e:
                mine = f"layout inference failed: {type(e).__name__}: {e}"
            self.ctl.post(f"{n}/setup-r", self.rank, mine)
        receivers = self.ctl.collect(f"{n}/setup-r", r, timeout_s=max(wait_s, self.config.timeout_s))  # inference
        bad = {k: v for k, v in receivers.items() if isinstance(v, str)}
        if bad:
            raise TransferError("; ".join(f"receiver rank {k}: {v}" for k, v in sorted(bad.items())))
        try:
            self.plan = make_plan([s for s, _ in senders.values()], receivers, manifest,
                                  budget_bytes=self.config.budget_bytes)
        except ValueError as e:
            raise TransferError(f"no plan: {e}") from None
        self.manifest = manifest
        self.stats.update(bytes_sent=self.plan.bytes_sent().get(self.rank, 0),
                          bytes_received=self.plan.bytes_received().get(self.rank, 0))
        self.mover = Mover(self.plan, self.rank, self.link.group, transactional=self.config.transactional,
                           device=self._device(), keep_programs=3 if self.config.mode == "async" else 1,
                           send_buffers=self.config.send_buffers, commit=self.config.commit)
        self.setup_n = n

    def _transfer(self, version, sent, wait_s):
        """One update (number self.n): setup on the first, then prepare, move, vote, commit, each a
        `weight_transfer.*` profiler range. Host work that needs no peer comes before the waits on
        them (the sources' views and identity before prepare's agreement: the peers may still be
        busy; the commit's launch before the store clean-up, which then overlaps the copy)."""
        n, self.n = self.n, self.n + 1
        is_sender = self.rank in self.link.trainer_ranks
        try:
            with record_function("weight_transfer.prepare"):
                if self.plan is None:  # the layout: the same for every version (checked below)
                    self._setup(n, self._planned(sent)[:2] if is_sender else None, wait_s)
                err = self._check(sent)
                read = read_from(sent[2]) if is_sender else None
                if is_sender and err is None:  # round 0 packs while the agreement is out
                    self.mover.prepack(read)
                if self.group_vote is not None:
                    got = self.group_vote(f"{n}/prep", self.rank, err, version if is_sender else -1, wait_s)
                    version = got[self.link.trainer_ranks[0]]
                else:
                    got = agree(self.ctl, f"{n}/prep", self.rank, err, timeout_s=wait_s, version=version)
                    version = got[self.link.trainer_ranks[0]]["version"]
        except TransferError as e:
            self.broken = self.broken or (None if self.plan is not None else f"a failed setup ({e})")
            if self.group_vote is not None and "did not answer" in str(e):  # a collective left unfinished
                self.broken = self.broken or f"update {n} ({e})"
            raise
        with record_function("weight_transfer.move"):
            errors = self.mover.move(read, getattr(self, "targets", None), self.config.timeout_s, self.on_round)
        try:
            with record_function("weight_transfer.vote"):
                vote = self.group_vote or functools.partial(agree, self.ctl)
                vote(f"{n}/vote", self.rank, "; ".join(errors) or None)
            if not is_sender:
                with record_function("weight_transfer.commit"):
                    self.mover.commit(self.targets)
        except TransferError as e:
            if not is_sender:  # an undo receiver puts the previous version back
                self.mover.abort(self.targets)
            if self.mover.peer_failed or "did not answer" in str(e):
                self.broken = f"update {n} ({e})"
            raise
        finally:
            with record_function("weight_transfer.forget"):
                for key in self._left_before(n):
                    self.ctl.forget(key, self.rank)
        self.version = version
        self.stats["staged_bytes"] = self.mover.staged_bytes
        return version

    def _left_before(self, n):
        """The store keys the updates before n may have left under this rank and no update forgot yet (an
        update that failed in its prepare forgets nothing); with the group's vote only the setup's and a
        failed agreement's."""
        done, self.forgotten_upto = self.forgotten_upto, n
        keys = [f"{m}/{step}" for m in range(done, n) for step in ("setup-s", "setup-r", "prep", "vote")]
        if self.group_vote is None:
            return keys
        posted = [k for k in keys if k in self.group_vote.posted]
        self.group_vote.posted.difference_update(posted)
        return [k for k in keys if k.startswith(f"{self.setup_n}/setup")] + posted


class WeightSender(_Endpoint):
    """A trainer rank's end. `shards`: objects with name, tensor, shape, offsets, replicated (what
    `runtime.export.export_weight_shards` yields), in the dtype to send."""

    def __init__(self, config, link: Link):
        rank = dist.get_rank()
        if rank not in link.trainer_ranks:
            raise ValueError(f"rank {rank} is not one of the link's trainer_ranks {link.trainer_ranks}")
        super().__init__(config, link, rank)
        self._slots: list = []  # [version, (spec, manifest, local), pinned]
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        self._published = 0
        self.error: BaseException | None = None
        self._specs = SenderSpecs()

    def _planned(self, sent):
        """(spec, manifest, local) to plan with: `sent`, or where its version is gone (async; the service
        runs only after a publish, so a snapshot is held) the newest snapshot, so that the first update
        fails by `_check` on every rank, not in the setup."""
        if sent[0] is not None:
            return sent
        with self._lock:
            return self._slots[-1][1]

    def _device(self):
        local = self._planned(self._sent)[2]
        return next(iter(local.values())).device if local else torch.device("cpu")

    def _check(self, sent):
        spec, manifest, _ = sent
        if spec is None:
            return _GONE
        layout = getattr(self, "sent_layout", None)
        if layout is not None and (manifest, spec.boxes) != layout:
            changed = sorted(set(layout[0]) ^ set(manifest)) or sorted(set(layout[1]) ^ set(spec.boxes))
            return f"the shards changed since the plan was made (names, shapes, dtypes or boxes): {changed[:2]}"
        self.sent_layout = (manifest, spec.boxes)
        return None

    def update(self, shards, version: int, timeout_s: float | None = None) -> int:
        """Sync mode: send this rank's part of `version`; returns when every receiver committed it.
        `timeout_s` (default the config's): how long to wait for the receivers to start (and, on the
        first update, to infer their layouts)."""
        if self.config.mode != "sync":
            raise RuntimeError("update() is the sync mode's call; this endpoint is async: use publish()")
        with self._flight():
            with record_function("weight_transfer.spec"):
                self._sent = self._specs(self.rank, shards)
            return self._transfer(version, self._sent, timeout_s or self.config.timeout_s)

    def publish(self, shards, version: int) -> None:
        """Async mode: snapshot this rank's shards as `version` and return; the service thread sends
        the newest version to the rollout when it asks. Raises the service's error, if it failed."""
        if self.config.mode != "async":
            raise RuntimeError("publish() is the async mode's call; this endpoint is sync: use update()")
        if self.error is not None:
            raise TransferError(f"the async service failed: {self.error}") from self.error
        spec, manifest, local = self._specs(self.rank, shards)
        with self._lock:  # reuse the oldest snapshot that is neither served nor the newest
            free = [i for i, s in enumerate(self._slots[:-1]) if not s[2]] if len(self._slots) >= 3 else []
            old = self._slots.pop(free[0])[1][2] if free else {}
            snap = ({k: old[k].copy_(t) for k, t in local.items()} if set(old) == set(local) else
                    {k: t.detach().clone() for k, t in local.items()})
            self._slots.append([version, (spec, manifest, snap), False])
            held = [s[0] for s in self._slots]
        self.ctl.post("pub", self.rank, held)
        # a fresh key per publish: what a rollout waiting in poll(wait_s) is woken by (a store wait
        # sees a key appear, never a value change); "pubn" says which one comes next
        self._published += 1
        self.ctl.post(f"pub-{self._published}", self.rank, version)
        self.ctl.post("pubn", self.rank, self._published)
        self.ctl.forget(f"pub-{self._published - 3}", self.rank)
        if self._thread is None:
            device = next(iter(snap.values())).device if snap else torch.device("cpu")
            self._thread = threading.Thread(target=self._serve, args=(device,), daemon=True, name="weight-transfer")
            self._thread.start()

    def _serve(self, device=None):
        if device is not None and device.type == "cuda":  # a new thread's current device is cuda:0
            torch.cuda.set_device(device)
        leader = self.link.rollout_ranks[0]
        while not self._stop.is_set():
            try:  # woken by the rollout's request
                if not self.ctl.wait([f"{self.n}/req/{leader}"], _IDLE_S):
                    continue
                if self._stop.is_set():
                    return
                req = self.ctl.collect(f"{self.n}/req", [leader])[leader]
            except TransferError as e:  # the store is gone
                self.error = e
                return
            with self._lock:
                slot = next((s for s in self._slots if s[0] == req), None)
                if slot is not None:
                    slot[2] = True
            try:
                self._sent = slot[1] if slot else (None, None, {})
                self._transfer(req, self._sent, self.config.timeout_s)
            except BaseException as e:
                if self.broken:
                    self.error = e
                    return
            finally:
                with self._lock:
                    if slot is not None:
                        slot[2] = False
                    keep = {id(s) for s in sorted(self._slots, key=lambda s: s[0])[-2:]}
                    self._slots = [s for s in self._slots if id(s) in keep or s[2]]

    def close(self):
        """Stop the service: within _IDLE_S when idle, after the transfer it is in otherwise."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class WeightReceiver(_Endpoint):
    """A rollout rank's end: `load_weights(iterable of (hf name, full tensor))` of the engine and
    the tensors it writes (`targets`: {name: tensor}, the engine's parameters, written in place)."""

    def __init__(self, config, link: Link, load_weights, targets: dict, *, layout_key: str = "",
                 cache: LayoutCache | None = None, layout=None):
        rank = dist.get_rank()
        if rank not in link.rollout_ranks:
            raise ValueError(f"rank {rank} is not one of the link's rollout_ranks {link.rollout_ranks}")
        if not callable(load_weights):
            raise TypeError(f"load_weights must be callable, got {load_weights!r}")
        super().__init__(config, link, rank)
        self.load_weights, self.targets = load_weights, dict(targets)
        self.layout_key, self.cache = layout_key, cache if cache is not None else LayoutCache()
        if layout is not None and not callable(layout):
            raise TypeError(f"layout must be a callable manifest -> ReceiverSpec, got {layout!r}")
        self.layout = layout
        self._polls = 0
        self.spec = None

    def _device(self):
        return next(iter(self.targets.values())).device if self.targets else torch.device("cpu")

    def _infer(self, manifest):
        given = self.layout(manifest) if self.layout is not None else None
        self.spec = infer_layout(self.load_weights, self.targets, manifest, key=self.layout_key, cache=self.cache,
                                 verify=self.config.verify, given=given)
        return self.spec

    def _check(self, sent):
        try:
            self.spec.check_targets(self.targets)
        except ValueError as e:
            return str(e)
        return None

    def update(self, timeout_s: float | None = None) -> int:
        """Sync mode: wait (up to `timeout_s`, default the config's) for the senders' next update,
        receive it whole, commit it after every rank agreed; returns its version."""
        if self.config.mode != "sync":
            raise RuntimeError("update() is the sync mode's call; this endpoint is async: use poll()")
        with self._flight():
            return self._transfer(None, None, timeout_s or self.config.timeout_s)

    def _newest(self):
        """The newest version every sender holds, if newer than ours (None: nothing newer)."""
        senders = self.link.trainer_ranks
        if not all(self.ctl._has(f"pub/{s}") for s in senders):
            return None
        held = self.ctl.collect("pub", senders)
        newest = max(set.intersection(*(set(v) for v in held.values())), default=None)
        return newest if newest is not None and (self.version is None or newest > self.version) else None

    def poll(self, wait_s: float = 0.0) -> int | None:
        """Async mode, called by every rollout rank together (with the same `wait_s`): fetch and
        commit the newest version all senders hold, if newer than ours; returns it, or None when
        there is nothing newer within `wait_s` seconds (the wait is woken by the senders' next
        publish, never a poll interval)."""
        if self.config.mode != "async":
            raise RuntimeError("poll() is the async mode's call; this endpoint is sync: use update()")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ValueError(f"poll: wait_s must be a number >= 0; got {wait_s!r}")
        with self._flight():
            for pick in range(_POLL_PICKS):
                try:
                    return self._poll_once(wait_s)
                except TransferError as e:  # every rank gets the same message: every rank picks again
                    if _GONE not in str(e) or pick == _POLL_PICKS - 1:
                        raise

    def _poll_once(self, wait_s):
        """One pick of the newest version and its transfer (every rollout rank together)."""
        leader, m = self.link.rollout_ranks[0], self._polls
        self._polls += 1
        if self.rank == leader:
            deadline = time.monotonic() + wait_s
            want = self._newest()
            while want is None and time.monotonic() < deadline:
                senders = self.link.trainer_ranks
                if not all(self.ctl._has(f"pubn/{s}") for s in senders):  # nothing published yet
                    nxt = {s: 1 for s in senders}
                else:
                    nxt = {s: n + 1 for s, n in self.ctl.collect("pubn", senders).items()}
                want = self._newest()  # a publish between reading pubn and here
                if want is None:
                    self.ctl.wait([f"pub-{n}/{s}" for s, n in nxt.items()], max(0.0, deadline - time.monotonic()))
                    want = self._newest()
            self.ctl.post(f"poll-{m}", leader, want)
        want = self.ctl.collect(f"poll-{m}", [leader], timeout_s=wait_s + self.config.timeout_s)[leader]
        # the previous answer goes once every rank has read it: a rank may still be on its way
        # to it when the leader, with nothing new, comes back for the next poll
        others = [r for r in self.link.rollout_ranks if r != leader]
        if self.rank != leader:
            self.ctl.post(f"poll-read-{m}", self.rank, True)
        elif m > 0 and others:
            self.ctl.collect(f"poll-read-{m - 1}", others)
            for r in others:
                self.ctl.forget(f"poll-read-{m - 1}", r)
        if self.rank == leader and m > 0:
            self.ctl.forget(f"poll-{m - 1}", leader)
        if want is None:
            return None
        if self.rank == leader:
            self.ctl.post(f"{self.n}/req", leader, want)
            self.ctl.forget(f"{self.n - 1}/req", leader)
        return self._transfer(want, None, self.config.timeout_s)

