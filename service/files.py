"""Durable file writes and the update-record framing of the store and the shared logs."""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any, Mapping

__all__ = ["fsync_dir", "write_atomic", "append_durably", "encode_record", "decode_record", "record_ok"]


def encode_record(rec: Mapping[str, Any]) -> bytes:
    """One update record: ``<crc32 hex> <compact JSON>\\n``."""
    body = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode_record(line: bytes) -> dict:
    """The record of one line (without its newline); ValueError if the CRC does not match."""
    crc, _, body = line.partition(b" ")
    if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
        raise ValueError("CRC mismatch")
    return json.loads(body)


def record_ok(line: bytes) -> bool:
    try:
        decode_record(line.rstrip(b"\n"))
    except ValueError:  # includes JSONDecodeError
        return False
    return True


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
