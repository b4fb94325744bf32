"""How a spawned test rank starts (a free port for its group), ends once its results are on disk, and
fails with its stack when it outlives a deadline (`spawn_within`).

A gloo rank that returns normally tears its transport down during interpreter exit, where a C++
thread still joinable aborts the process now and then under load ("terminate called without an
active exception", SIGABRT), failing a test whose ranks all finished. So a rank that succeeded meets
the others at a barrier, destroys its group and leaves without the interpreter's teardown. A rank
that failed destroys its group and raises as before.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def leave_group() -> None:
    """Barrier, destroy the default group, exit this process with status 0 at once."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A port free on this host now, for the spawned ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traced(index: int, fn, timeout_s: float, args: tuple) -> None:
    # a rank still running at its deadline writes every thread's stack to its stderr (which the parent's
    # test report carries) and exits with status 1: a stuck rank says where it is stuck
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        fn(index, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawn_within(fn, args: tuple, nprocs: int, timeout_s: float, grace_s: float = 60.0) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` with a deadline: a rank that raises fails the call
    as in spawn; a rank still running `timeout_s` after it started writes its stack to stderr and exits,
    the others are ended, and the call raises TimeoutError naming it. Ranks that cannot even do that are
    killed `grace_s` later. A stuck case fails on its own instead of holding the rest of its shard until
    an outer limit kills the whole run without a report."""
    if timeout_s <= 0 or nprocs < 1:
        raise ValueError(f"timeout_s must be > 0 and nprocs >= 1, got timeout_s={timeout_s}, nprocs={nprocs}")
    t0 = time.monotonic()
    ctx = mp.start_processes(_traced, args=(fn, timeout_s, args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = t0 + timeout_s + grace_s
    try:
        while not ctx.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() < deadline:
                continue
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            raise TimeoutError(f"rank(s) {alive} of {nprocs} still running {timeout_s + grace_s:.0f} s after "
                               "the start, killed")
    except mp.ProcessExitedException as e:
        if e.exit_code == 1 and time.monotonic() - t0 >= timeout_s:  # faulthandler's exit at the rank's deadline
            raise TimeoutError(f"rank {e.error_index} of {nprocs} still running {timeout_s:.0f} s after it "
                               "started: its stack is on stderr above") from e
        raise
