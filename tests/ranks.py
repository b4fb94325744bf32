"""How a spawned test rank starts (a free port for its group) and ends once its results are on disk.

A gloo rank that returns normally tears its transport down during interpreter exit, where a C++
thread still joinable aborts the process now and then under load ("terminate called without an
active exception", SIGABRT), failing a test whose ranks all finished. So a rank that succeeded meets
the others at a barrier, destroys its group and leaves without the interpreter's teardown. A rank
that failed destroys its group and raises as before.
"""
from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist


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
