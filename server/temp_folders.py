"""The private temporary folders of a running tmod-serve: with `--workers N` the engine's socket and the
metrics' files; an ONNX export where the cache cannot be written (~87 MB for MiniLM, until its sessions load).

A killed server (SIGKILL, the out-of-memory killer) runs no clean-up and leaves its folders behind, so a
service restarted in a loop would fill /tmp (often memory: a tmpfs, or Kubernetes' emptyDir beside its pod).
Each folder holds a lock file, locked by the process that made it for as long as it lives (the kernel
drops the lock when the process goes, however it goes, and it holds across PID namespaces); a start
removes each folder of its kind whose lock nobody holds. A young lock file is left alone: its maker
may not have locked it yet."""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("tmod")

LOCK = ".lock"
ENGINE_SOCKET = "engine.sock"
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path on Linux (sun_path holds 108 with the NUL)
YOUNG_S = 60.0
_held: dict[Path, int] = {}


def make_private_folder(kind: str) -> Path:
    """A new folder `tmod-<kind>-*` in the temp directory, mode 0700 (only this user reaches it), locked
    while this process lives; the folders a killed server left are removed first."""
    remove_abandoned(kind)
    folder = Path(tempfile.mkdtemp(prefix=f"tmod-{kind}-"))
    lock = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    _held[folder] = lock
    return folder


def engine_socket_problem() -> str | None:
    """The engine's socket goes in the temp directory: a long $TMPDIR makes its path too long to bind."""
    longest = len(os.fsencode(Path(tempfile.gettempdir()) / "tmod-engine-xxxxxxxx" / ENGINE_SOCKET))
    if longest <= UNIX_PATH_MAX:
        return None
    return (f"--workers puts the engine's socket in the temp directory {tempfile.gettempdir()}, whose path is "
            f"too long for a Unix socket ({longest} bytes with the socket's name, at most {UNIX_PATH_MAX}): set "
            f"TMPDIR to a folder of a shorter path")


def remove_private_folder(folder: Path) -> None:
    lock = _held.pop(folder, None)
    shutil.rmtree(folder, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def remove_abandoned(kind: str) -> None:
    removed = 0
    for folder in Path(tempfile.gettempdir()).glob(f"tmod-{kind}-*"):
        if owned(folder) and abandoned(folder / LOCK):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d tmod-%s-* folder(s) that stopped servers left in %s", removed, kind,
                 tempfile.gettempdir())


def owned(folder: Path) -> bool:
    """A folder of this user's, not a link to one: only such a folder is ever removed."""
    try:
        about = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(about.st_mode) and about.st_uid == os.getuid()


def abandoned(lock_path: Path) -> bool:
    """True when the lock file is older than YOUNG_S, this user's and locked by no one. A folder without
    one (another program's, or being made) is never taken."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        about = os.fstat(fd)
        if about.st_uid != os.getuid() or time.time() - about.st_mtime < YOUNG_S:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held: its server runs
        return False
    finally:
        os.close(fd)
