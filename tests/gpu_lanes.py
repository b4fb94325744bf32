"""Several GPU shards at once on one host, one lane per GPU, within a time limit (`tests/gpu_shards.py
--gpus`). Each lane runs its shards in turn with every GPU visible, its own first, so a two-GPU test's
second rank lands on the next lane's GPU; shards go to lanes longest first (by `FRESH_MINUTES`) onto
the least loaded lane. A shard is stopped with its whole process group (spawned ranks included) when
the limit comes, and one not started by then is reported as such: nothing is left running, and every
shard gets a line saying what happened to it."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

# minutes a shard took on a fresh H200 with the seeded autotuning (tests/GPU_RUNS.md, 32a0c52):
# the order in which shards are handed to lanes, and what `gpu_shards.py` lists
FRESH_MINUTES = {1: 2, 2: 7, 3: 3, 4: 4, 5: 3, 6: 5, 7: 3, 8: 2}
MIN_START_S = 30  # a shard with less time left than this is not started


def lanes(shards: list[int], gpus: list[str]) -> list[tuple[str, list[int]]]:
    """[(CUDA_VISIBLE_DEVICES, shards in run order)] for one lane per GPU."""
    if not gpus or len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus must be distinct device indices, got {gpus}")
    load, order = [0.0] * len(gpus), [[] for _ in gpus]
    for n in sorted(shards, key=lambda s: -FRESH_MINUTES.get(s, 5)):
        i = min(range(len(gpus)), key=lambda j: (load[j], j))
        load[i] += FRESH_MINUTES.get(n, 5)
        order[i].append(n)
    return [(",".join(gpus[i:] + gpus[:i]), order[i]) for i in range(len(gpus))]


def _run_one(cmd, visible, log: Path, left_s: float, cwd) -> tuple[int | None, float]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=left_s), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and every rank it spawned
            proc.wait()
            return None, time.monotonic() - t0


def _last_summary(log: Path) -> str:
    lines = [ln.strip("= \n") for ln in log.read_text(errors="replace").splitlines()
             if any(w in ln for w in (" passed", " failed", " error", " skipped", " deselected"))]
    return lines[-1] if lines else ""


def run_lanes(shards: list[int], gpus: list[str], command, limit_s: float, log_dir: Path, cwd,
              min_start_s: float = MIN_START_S) -> list[dict]:
    """Run `command(shard)` for every shard over the lanes; returns one record per shard."""
    if limit_s <= 0:
        raise ValueError(f"limit_s must be > 0, got {limit_s}")
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline, records, lock = time.monotonic() + limit_s, [], threading.Lock()

    def lane(visible, order):
        for n in order:
            left, log = deadline - time.monotonic(), log_dir / f"shard{n}.log"
            if left < min_start_s:
                rec = {"shard": n, "gpus": visible, "status": "not started", "seconds": 0.0, "summary": ""}
            else:
                rc, took = _run_one(command(n), visible, log, left, cwd)
                status = "out of time" if rc is None else ("passed" if rc == 0 else f"rc {rc}")
                rec = {"shard": n, "gpus": visible, "status": status, "seconds": round(took, 1),
                       "summary": _last_summary(log), "log": str(log)}
            with lock:
                records.append(rec)
                print(f"shard {n} (CUDA_VISIBLE_DEVICES={visible}): {rec['status']} in {rec['seconds']:.0f} s"
                      f"{': ' + rec['summary'] if rec['summary'] else ''}", flush=True)

    threads = [threading.Thread(target=lane, args=lv) for lv in lanes(shards, gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: r["shard"])
