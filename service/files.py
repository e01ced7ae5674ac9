"""Durable file writes of the store and the directory shared log."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic", "append_durably"]


def fsync_dir(path) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Temporary file in the same directory, fsync, rename over ``path``, fsync the directory."""
    directory = path.parent
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def append_durably(fh, data: bytes) -> None:
    """Write all of ``data`` at the end of the unbuffered binary ``fh`` and fsync; on an OSError
    cut the partial write off again (best effort) and re-raise."""
    start = fh.seek(0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[fh.write(view):]
        os.fsync(fh.fileno())
    except OSError:
        try:
            fh.truncate(start)
            os.fsync(fh.fileno())
        except OSError:
            pass
        raise
