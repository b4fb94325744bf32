"""The bench's anchor: the colocated synchronous loop (`runtime/pipeline/colocated.py`) over `ranks`
processes of its own, one GPU each (or CPU ranks on gloo), stopping where the bench's pipeline runs stop
(the threshold's window mean, or `--max-seconds` of its clock). Returns rank 0's per-step log."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.runtime.pipeline.colocated import colocated_run
from bumblebee.runtime.pipeline.engine import TransformersEngine
from bumblebee.runtime.pipeline.trainer import join_trainer_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reached(log, window: int, threshold: float) -> bool:
    """The bench's threshold: the mean reward of the last `window` steps reaches `threshold`."""
    return len(log) >= window and statistics.mean(m["reward"] for m in log[-window:]) >= threshold


def run_colocated(cfg, model_config: dict, task, *, ranks: int, device_type: str, window: int, threshold: float,
                  max_seconds: float | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(ranks, _free_port(), device_type, cfg, model_config, task, window, threshold,
                              max_seconds, out), nprocs=ranks, join=True)
        return json.loads(Path(out, "log.json").read_text())


def _rank(rank, world, port, device_type, cfg, model_config, task, window, threshold, max_seconds, out) -> None:
    torch.set_num_threads(cfg.threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the colocated ranks are the trainer's: gloo beside NCCL on GPUs (the step's metrics are CPU tensors)
    join_trainer_ranks(dataclasses.replace(cfg, trainer_ranks=world), f"127.0.0.1:{port}", rank, device)

    def until(log):
        return reached(log, window, threshold) or (max_seconds is not None and log[-1]["wall_s"] >= max_seconds)

    try:
        engine = TransformersEngine(model_config, device=str(device), eos_token_id=task.eos_id,
                                    pad_token_id=task.pad_id)
        log = colocated_run(cfg, model_config, task, engine, group=dist.group.WORLD, device=device, until=until)
        if rank == 0:
            Path(out, "log.json").write_text(json.dumps(log))
    except BaseException:
        dist.destroy_process_group()
        raise
    # a gloo rank's interpreter teardown may abort on a still-joinable C++ thread: meet, destroy, leave at once
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
