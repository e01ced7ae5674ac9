"""One operator's directory on disk: snapshot generations and the update log after each.

::

    <store>/operators/<name>/meta.json          factor, direction, how it was trained (written once)
    <store>/operators/<name>/snapshot-G.npz     operator state after every update of logs < G
    <store>/operators/<name>/log-G.jsonl        update records appended after snapshot G
    <store>/operators/<name>/served             empty: a server has opened its log (SERVED_MARK)

A record is appended and fsync'ed before the update it holds is acknowledged
(:func:`service.files.append_durably`: a failed write is cut off again).  Reading a log back
accepts a damaged record only at the very end of the newest log — a write a crash cut short,
never acknowledged — and cuts it off; anywhere else it is corruption, and reading refuses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from ..files import append_durably, decode_record, encode_record, fsync_dir, write_atomic
from .errors import PersistError

log = logging.getLogger("kjit.service.store")

__all__ = ["OperatorLog"]

#: an empty file a server writes in an operator's directory when it first opens its log: from then on every
#: snapshot generation, 0 included, must have its log
SERVED_MARK = "served"
_SNAP_RE = re.compile(r"^snapshot-(\d{8})\.npz$")
_LOG_RE = re.compile(r"^log-(\d{8})\.jsonl$")
#: the name a cut record's bytes are kept under, in the operator's directory (``cut-log-<gen>-<offset>.bin``)
CUT_PREFIX = "cut-"


class OperatorLog:
    """The generations of one operator's directory and the open log of the newest one.

    ``gen`` is the current generation, ``n_records`` the records in its log (a replica, whose
    log is the shared one, counts the records it applied instead: the snapshot cadence).
    """

    def __init__(self, path: Path, name: str, observe: Callable[[str, float], None]):
        self.path = Path(path)
        self.name = name
        self._observe = observe
        self.gen = 0
        self.n_records = 0
        self._fh = None
        # the log was left closed because opening it failed (a read-only or full disk): an append may
        # try again; never after a load closed it, nor after close() (found in review: an operator
        # whose rebuild failed, still held by a waiting request, reopened its log and acknowledged
        # updates that a later rotation deleted)
        self.reopenable = False
        # what a load cut that may have been an acknowledged update (a whole last line failing its check), said in
        # /ready's ``possible_loss`` (found by an audit: only the server's log said it, /ready answered 200 as ever)
        self.possible_loss: str | None = None

    # ---------------------------------------------------------------- reading
    def generations(self) -> tuple[dict[int, Path], dict[int, Path]]:
        snaps, logs = {}, {}
        for p in self.path.iterdir():
            if (m := _SNAP_RE.match(p.name)):
                snaps[int(m.group(1))] = p
            elif (m := _LOG_RE.match(p.name)):
                logs[int(m.group(1))] = p
        return snaps, logs

    def newest(self) -> tuple[Path, list[Path], list[Path]]:
        """The newest snapshot, the logs to replay after it (oldest first), and the stale files:
        generations older than the snapshot (a crash between a snapshot and the clean-up), which
        the caller deletes once the snapshot has loaded (:meth:`delete`)."""
        self.close()
        kept = sorted(p.name for p in self.path.glob(CUT_PREFIX + "*.bin"))
        self.possible_loss = (None if not kept else  # (what an earlier load cut, said until someone removes it)
                              f"update record bytes an earlier load cut off (a complete line failing its check: a "
                              f"write torn out of order, or an acknowledged update damaged and lost) are kept in "
                              f"{', '.join(kept)} (remove once looked at)")
        snaps, logs = self.generations()
        if not snaps:
            raise ValueError(f"operator {self.name!r}: no snapshot in {self.path}")
        g = max(snaps)
        if g not in logs and (g > 0 or (self.path / SERVED_MARK).exists()):
            # log-G is created and made durable before snapshot-G is written (a rotation, a final
            # snapshot), and log-0 when a server first opens the operator (SERVED_MARK says one did): without
            # it, the records after that snapshot were lost — serving the snapshot would reuse acknowledged
            # versions and forget their idempotency keys (found by audits: generation 0 was not checked at all).
            # A snapshot 0 with neither (an operator published by hand, as the training notebook does) is new.
            raise ValueError(f"operator {self.name!r}: {snaps[g].name} has no log-{g:08d}.jsonl after it (deleted?): "
                             f"refusing to serve a state that may lack acknowledged updates")
        stale = [p for old, p in list(snaps.items()) + list(logs.items()) if old < g]
        replay = sorted(k for k in logs if k >= g)
        return snaps[g], [logs[k] for k in replay], stale

    def delete(self, paths) -> None:
        """Remove stale generations, as far as the disk allows (they are never read again)."""
        for p in paths:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("operator %s: could not remove the stale %s (%s)", self.name, p.name, exc)

    def read_records(self, path: Path, last: bool) -> list[dict]:
        """The records of one log, in order; a torn or damaged tail of the newest log (``last``)
        is cut off the file, damage anywhere else raises ValueError."""
        data = path.read_bytes()
        lines = data.split(b"\n")
        # the final element is b"" after a complete last line, else a torn write
        good_end = 0
        pos = 0
        records = []
        bad_at = None
        unended = False  # a last record whole but for its newline
        for j, line in enumerate(lines):
            end = pos + len(line) + 1
            if j == len(lines) - 1:
                if line and bad_at is None and last:
                    # a record that passes its check is whole whatever byte follows it: kept, its newline restored
                    # (found by an audit: an acknowledged record that lost only its newline was cut as "never
                    # acknowledged", its version reused and its idempotency key forgotten); keeping a record never
                    # acknowledged is what a torn write after the fsync'ed record would be — allowed either way
                    try:
                        records.append(decode_record(line))
                        unended, good_end = True, len(data)
                        break
                    except (ValueError, json.JSONDecodeError):
                        pass
                if line:
                    bad_at = bad_at if bad_at is not None else pos  # torn: no newline
                break
            try:
                rec = decode_record(line)
            except (ValueError, json.JSONDecodeError):
                if bad_at is None:
                    bad_at = pos
                pos = end
                continue
            if bad_at is not None:
                raise ValueError(
                    f"{path}: damaged update record at byte {bad_at} followed by valid records: "
                    f"refusing to serve a state that skips an acknowledged update"
                )
            records.append(rec)
            good_end = end
            pos = end
        if bad_at is not None:
            if not last:
                raise ValueError(f"{path}: damaged update record at byte {bad_at} in a closed log")
            if b"\n" in data[good_end:]:
                # a whole line (its newline written) among the bytes cut — the last, or one before a torn write —
                # that fails its check: a write torn out of order, or damage
                # to a record that was acknowledged (found by an audit: one flipped bit in the last acknowledged
                # record, cut as "never acknowledged" at warning level, its version then reused) — cut, as a torn
                # write must be to serve at all, and said as what it may be
                # the bytes are kept aside first, never destroyed, and while they are there every load says so
                aside = self.path / f"{CUT_PREFIX}{path.stem}-{good_end}.bin"
                write_atomic(aside, data[good_end:])
                self.possible_loss = (f"the last update record of {path.name} ({len(data) - good_end} bytes, a "
                                      "complete line) failed its check and was cut off: a write torn out of order "
                                      "(never acknowledged), or damage to an acknowledged update, which is then lost; "
                                      f"the bytes are kept in {aside.name} (remove it once looked at)")
                log.error("operator %s: %s", self.name, self.possible_loss)
            else:
                log.warning("operator %s: cutting an incomplete update record off %s (%d bytes; never acknowledged)",
                            self.name, path.name, len(data) - good_end)
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        elif unended:
            log.warning("operator %s: the last update record of %s had lost its newline: kept, the newline restored",
                        self.name, path.name)
            with open(path, "ab", buffering=0) as fh:
                append_durably(fh, b"\n")
        return records

    # ---------------------------------------------------------------- writing
    def resume(self, gen: int) -> None:
        """Open generation ``gen``'s log for appending (created, and made durable, if new)."""
        self.close()
        self.gen = gen
        p = self._log_path(self.gen)
        self.n_records = 0
        if p.exists():
            with open(p, "rb") as fh:
                self.n_records = sum(1 for _ in fh)
        created = not p.exists()
        try:
            self._fh = open(p, "ab", buffering=0)
            if created:
                os.fsync(self._fh.fileno())
                fsync_dir(self.path)
            mark = self.path / SERVED_MARK
            if not mark.exists():  # (after the log is durable: from now on a missing log is damage, at generation 0 too)
                with open(mark, "ab") as fh:
                    os.fsync(fh.fileno())
                fsync_dir(self.path)
        except OSError:
            self.close()
            self.reopenable = True
            raise
        self.reopenable = False

    def abandon_generation(self, gen: int) -> None:
        """Go back to appending to generation ``gen`` after a rotation to ``gen + 1`` failed: the new
        log, if it was created and holds nothing, is removed — left behind it would make ``gen`` a
        closed log, whose torn tail (a crash mid-append, never acknowledged) then refuses to load
        instead of being cut (found in review)."""
        self.close()
        new = self._log_path(gen + 1)
        try:
            if new.exists() and new.stat().st_size == 0:
                new.unlink()
                fsync_dir(self.path)
        except OSError:
            pass  # (the loader also treats a log followed only by empty ones as the last)
        self.resume(gen)

    def append(self, rec: Mapping[str, Any]) -> None:
        """Append one record and fsync it; on failure cut the partial write off and raise PersistError."""
        data = encode_record(rec)
        t = time.perf_counter()
        if self._fh is None and self.reopenable:  # (opening failed before: tried again — the disk may be back)
            try:
                self.resume(self.gen)
            except OSError as exc:
                raise PersistError(f"could not write the update log of {self.name!r}: it cannot be opened "
                                   f"({exc})") from exc
        if self._fh is None:
            raise PersistError(f"could not write the update log of {self.name!r}: it is not open (a failed "
                               f"rotation, or an operator that could not be rebuilt)")
        try:
            append_durably(self._fh, data)
        except OSError as exc:
            raise PersistError(f"could not write the update log of {self.name!r}: {exc}") from exc
        self._observe("fsync", time.perf_counter() - t)
        self.n_records += 1

    def next_generation(self) -> int:
        """Start log G+1 (the snapshot of the state at this point is ``snapshot-(G+1)``)."""
        self.resume(self.gen + 1)
        return self.gen

    def write_snapshot(self, gen: int, data: bytes, guard: Callable[[], ContextManager] | None = None) -> None:
        """Write ``snapshot-gen`` atomically, then delete the generations below it — holding
        ``guard()`` if given (the snapshot writer: the operator's shared lock; the other callers
        hold its exclusive lock already).  A load lists the generations, then reads them: none
        may be deleted in between, and every load after the operator is served holds the exclusive
        lock (found by an audit: a rebuild after a failed append, racing the writer, met a log it
        had listed deleted — FileNotFoundError — and left the operator failed until a restart)."""
        t = time.perf_counter()
        write_atomic(self.path / f"snapshot-{gen:08d}.npz", data)
        self._observe("snapshot_write", time.perf_counter() - t)
        with guard() if guard is not None else contextlib.nullcontext():
            for p in self.path.iterdir():
                m = _SNAP_RE.match(p.name) or _LOG_RE.match(p.name)
                if m and int(m.group(1)) < gen:
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        self.reopenable = False
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _log_path(self, gen: int) -> Path:
        return self.path / f"log-{gen:08d}.jsonl"


def generation(path: Path) -> int:
    """The generation G of ``snapshot-G.npz`` or ``log-G.jsonl``."""
    m = _SNAP_RE.match(path.name) or _LOG_RE.match(path.name)
    if m is None:
        raise ValueError(f"{path}: not a snapshot or log of the store")
    return int(m.group(1))
