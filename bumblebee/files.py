"""Saving into a folder that may hold files of others (a tokenizer, a README, sub-folders): each file
of ours is written aside and renamed into place, and nothing else in the folder is touched.

    folder = prepare_folder(path, "save_pretrained path")   # created if need be; a regular file is refused
    tmp = write_aside(folder, "config.json", lambda p: p.write_text(...))   # fsync'd, hidden name
    os.replace(tmp, folder / "config.json"); fsync_dir(folder)
    with progress(nbytes, "saving weights") as bar: ...   # a tqdm bar past a few seconds
    with writer_lock(folder, "save_pretrained path"): ...   # one save at a time into a folder

A save holds `writer_lock` for its whole duration: a second save into the folder (another process,
or another thread) is refused with SaveInProgressError. The lock is a `flock` on a hidden file in the
folder, so the OS releases it when its holder dies (after a SIGKILL the next save takes it at once); the
file names the holder (pid and host) for the refusal's message and is removed when the save ends.

Files and folders are created with the process's umask (tempfile's helpers would make them 0600/0700,
unreadable to the other users of a shared checkpoint).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from tqdm import tqdm

TMP_TAG = ".tmp-"
TMP_HEX = 8  # hex digits after TMP_TAG (`aside_name`)
LOCK = ".bumblebee-save.lock"


class SaveInProgressError(RuntimeError):
    """Another save into the same folder holds its writer lock."""
PROGRESS_DELAY_S = 3.0  # a bar only for what takes longer: small checkpoints (and tests) stay quiet


def progress(total_bytes: int, desc: str, *, disable: bool = False, started: float | None = None) -> tqdm:
    """A bytes progress bar on stderr that shows up once the work has taken PROGRESS_DELAY_S, counted
    from `started` (a `time.monotonic()`) when given: a load whose model construction took a while
    shows its bar from the first byte read."""
    delay = PROGRESS_DELAY_S if started is None else max(0.0, PROGRESS_DELAY_S - (time.monotonic() - started))
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=delay, leave=False, disable=disable, file=sys.stderr)


def prepare_folder(path, arg: str) -> Path:
    """`path` as an existing folder (created with its parents when missing). A path that is a regular
    file (or anything but a folder) is refused: saving must not put a folder in a file's place."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{arg} {path} exists and is not a folder: give a folder (new or existing); "
                         f"the file there is left as it is")
    path.mkdir(parents=True, exist_ok=True)
    return path


def aside_name(name: str) -> str:
    """The hidden temporary name that `name` is written under before its rename."""
    return f".{name}{TMP_TAG}{secrets.token_hex(TMP_HEX // 2)}"


def aside_pattern(names: str) -> str:
    """A regex of the temporary names `aside_name` gives to the names matched by the regex `names`."""
    return rf"\.(?:{names}){re.escape(TMP_TAG)}[0-9a-f]{{{TMP_HEX}}}"


def remove_leftovers(folder: Path, pattern: str, keep=()) -> list[str]:
    """Remove the regular files of `folder` whose names fully match the regex `pattern` (a killed
    save's temporary files), except the names in `keep`; returns the names removed. Call it holding
    the folder's writer lock: then no save of ours is writing such a file."""
    gone = []
    for entry in sorted(folder.iterdir()):
        if re.fullmatch(pattern, entry.name) and entry.name not in keep and entry.is_file() \
                and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            gone.append(entry.name)
    return gone


@contextlib.contextmanager
def writer_lock(folder: Path, arg: str):
    """Hold the folder's writer lock for the block, or raise SaveInProgressError at once (no waiting:
    two writers of one checkpoint are a mistake to report, not to serialize). The lock file is
    removed while still locked; a waiter that opened it just before re-checks that the file it locked
    is still the one at the path (else it retries), so two writers never hold two different files."""
    path = folder / LOCK
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise SaveInProgressError(
                f"{arg} {folder}: another save into this folder is under way ({holder} holds {path.name}); "
                f"two writers would mix their files. Save into another folder, or wait for that save to end "
                f"(a writer that died releases the lock by itself)") from None
        except OSError as e:  # a file system without flock (some network mounts): saves go unguarded
            os.close(fd)
            warnings.warn(f"{folder}: no file lock on this file system ({e}); concurrent saves into it are "
                          f"not detected", stacklevel=3)
            yield
            return
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # locked a file its holder had just removed: take the one at the path now
    else:
        raise SaveInProgressError(f"{arg} {folder}: could not take the writer lock {path.name}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: see the docstring
        os.close(fd)


def write_aside(folder: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a fresh hidden path in `folder`, fsync what it wrote and return the path.
    On failure the temporary file is removed and the error raised."""
    tmp = folder / aside_name(name)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # ours alone; umask applies
        mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        if os.stat(tmp).st_mode & 0o777 != mode:  # a writer that makes its own file (safetensors: 0600)
            os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before any rename can make it current
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_json_aside(folder: Path, name: str, obj) -> Path:
    def write(p: Path) -> None:
        with open(p, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    return write_aside(folder, name, write)


def fsync_dir(folder: Path) -> None:
    """Make the renames done in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json_object(file: Path) -> dict:
    """A JSON object from `file`; a ValueError naming the file and the place where it is not one
    (a corrupt file is reported as such, not as whatever its absent fields would suggest)."""
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: not UTF-8 text ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(data).__name__}")
    return data


def read_json(path: Path):
    """The JSON in `path`, or None when it is missing or not valid JSON (a foreign or torn file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
