"""Saving into a folder that may hold files of others (a tokenizer, a README, sub-folders): each file
of ours is written aside and renamed into place, and nothing else in the folder is touched.

    folder = prepare_folder(path, "save_pretrained path")   # created if need be; a regular file is refused
    tmp = write_aside(folder, "config.json", lambda p: p.write_text(...))   # fsync'd, hidden name
    os.replace(tmp, folder / "config.json"); fsync_dir(folder)
    with progress(nbytes, "saving weights") as bar: ...   # a tqdm bar past a few seconds

Files and folders are created with the process's umask (tempfile's helpers would make them 0600/0700,
unreadable to the other users of a shared checkpoint).
"""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Callable

from tqdm import tqdm

TMP_TAG = ".tmp-"
PROGRESS_DELAY_S = 3.0  # a bar only for what takes longer: small checkpoints (and tests) stay quiet


def progress(total_bytes: int, desc: str, *, disable: bool = False) -> tqdm:
    """A bytes progress bar on stderr that shows up once the work has taken PROGRESS_DELAY_S."""
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=PROGRESS_DELAY_S, leave=False, disable=disable, file=sys.stderr)


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
    return f".{name}{TMP_TAG}{secrets.token_hex(4)}"


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


def read_json(path: Path):
    """The JSON in `path`, or None when it is missing or not valid JSON (a foreign or torn file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
