"""One writer per checkpoint folder, and no debris from killed saves.

A subprocess is SIGKILLed in the middle of a save (save_pretrained, and the DCP save of the runtime's
save_state): while it lives, a save into its folder is refused naming it; once it is dead its lock
is gone, and the next save removes what it left (temporary files, its dcp-* folder) and nothing
that is not ours."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import bumblebee as bb
from bumblebee import checkpoint, files, hf_io
from tests.core.test_checkpoint import _foreign_intact, _put_foreign
from tests.limits import SUBPROCESS_TIMEOUT_S

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
META = {"impl": "test", "params": {"w": [5, 3]}, "model_type": "toy"}
# Writes its first weight file (or all its DCP files), says so, and waits to be killed.
CHILD = r"""
import sys, time
from pathlib import Path
path, kind = Path(sys.argv[1]), sys.argv[2]
import torch
from bumblebee import checkpoint, hf_io

def then_wait(real):
    def write(*a, **kw):
        real(*a, **kw)
        print("written", flush=True)
        time.sleep(3600)
    return write

if kind == "hf":
    hf_io.save_file = then_wait(hf_io.save_file)
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(3)}
    hf_io.save_weights(state, {"model_type": "qwen3"}, path, max_shard_bytes=64 * 64 * 4)
else:
    import types
    checkpoint.dcp = types.SimpleNamespace(save=then_wait(checkpoint.dcp.save), load=checkpoint.dcp.load)
    checkpoint.save({"model": {"w": torch.full((5, 3), 7.0)}, "step": torch.tensor(7)}, path,
                    meta={"impl": "test", "params": {"w": [5, 3]}, "model_type": "toy"})
"""
FOREIGN = {".config.json.tmp-notours": "a name like ours, another pattern", ".cache": "someone's",
           "dcp-0123456789ab/notes.txt": "a dcp-* folder holding a file of another's"}


def _start(path, kind):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    return proc


def _wait_written(proc):
    timer = threading.Timer(SUBPROCESS_TIMEOUT_S, proc.kill)
    timer.start()
    try:
        line = proc.stdout.readline()
    finally:
        timer.cancel()
    assert line.strip() == "written", proc.stderr.read() if proc.poll() is not None else line


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(SUBPROCESS_TIMEOUT_S)
    proc.stdout.close()
    proc.stderr.close()


def _leftovers(path):
    return sorted(p.name for p in path.iterdir() if p.name not in FOREIGN and p.name != "dcp-0123456789ab"
                  and (p.name.startswith(".") or p.name.startswith("dcp-")))


def test_saves_into_the_folder_of_a_live_writer_are_refused_and_a_killed_ones_debris_is_removed(tmp_path):
    hf_path, dcp_path = tmp_path / "hf", tmp_path / "dcp"
    mine = bb.models.build("qwen3-tiny", seed=1)
    mine.save_pretrained(hf_path)
    checkpoint.save({"model": {"w": torch.ones(5, 3)}, "step": torch.tensor(1)}, dcp_path, meta=META)
    for path in (hf_path, dcp_path):
        _put_foreign(path, FOREIGN)
    procs = {"hf": _start(hf_path, "hf"), "dcp": _start(dcp_path, "dcp")}
    try:
        for proc in procs.values():
            _wait_written(proc)
        with pytest.raises(files.SaveInProgressError, match=rf"save_pretrained path .*hf: another save into this "
                                                            rf"folder is under way \(pid {procs['hf'].pid} on "):
            mine.save_pretrained(hf_path)
        with pytest.raises(files.SaveInProgressError, match=rf"checkpoint path .*dcp: another save .*pid "
                                                            rf"{procs['dcp'].pid} on "):
            checkpoint.save({"model": {"w": torch.zeros(5, 3)}, "step": torch.tensor(2)}, dcp_path, meta=META)
    finally:
        for proc in procs.values():
            _kill(proc)
    hf_debris, dcp_debris = _leftovers(hf_path), _leftovers(dcp_path)
    assert files.LOCK in hf_debris and any(".safetensors.tmp-" in n for n in hf_debris)
    assert files.LOCK in dcp_debris and len([n for n in dcp_debris if n.startswith("dcp-")]) == 2
    # the previous checkpoints are untouched and load
    assert all(torch.equal(a, b) for a, b in zip(bb.models.from_pretrained(hf_path).state_dict().values(),
                                                 mine.state_dict().values()))
    # the dead writers' locks are gone; the next save removes their debris, and only theirs
    other = bb.models.build("qwen3-tiny", seed=2)
    other.save_pretrained(hf_path)
    checkpoint.save({"model": {"w": torch.full((5, 3), 3.0)}, "step": torch.tensor(3)}, dcp_path, meta=META)
    assert _leftovers(hf_path) == [] and _foreign_intact(hf_path, FOREIGN)
    assert _leftovers(dcp_path) == [checkpoint.read_meta(dcp_path)["data"]] and _foreign_intact(dcp_path, FOREIGN)
    loaded = {"model": {"w": torch.zeros(5, 3)}, "step": torch.tensor(0)}
    checkpoint.load(loaded, dcp_path, meta=META)
    assert int(loaded["step"]) == 3
    state = bb.models.from_pretrained(hf_path).state_dict()
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())


def test_a_second_save_in_the_same_process_is_refused_too(tmp_path, monkeypatch):
    """The lock belongs to one save, not to a process: a thread saving into the folder blocks another."""
    model = bb.models.build("qwen3-tiny", seed=1)
    writing, release = threading.Event(), threading.Event()
    real = hf_io.save_file

    def wait_inside(*a, **kw):
        real(*a, **kw)
        writing.set()
        release.wait(SUBPROCESS_TIMEOUT_S)

    monkeypatch.setattr(hf_io, "save_file", wait_inside)
    thread = threading.Thread(target=lambda: model.save_pretrained(tmp_path))
    thread.start()
    try:
        assert writing.wait(SUBPROCESS_TIMEOUT_S)
        with pytest.raises(files.SaveInProgressError, match=rf"pid {os.getpid()} "):
            hf_io.save_weights({"w": torch.ones(2)}, {"model_type": "qwen3"}, tmp_path)
    finally:
        release.set()
        thread.join()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # lock file removed
