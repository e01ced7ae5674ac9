"""The operator store: all operators of one store directory, served by one process (flock).

Layout (``<store>`` is ``Settings.store``)::

    <store>/.lock                 held (flock) by the one server using the store
    <store>/operators/<name>/     one operator (:mod:`service.store.log`)
    <store>/training-sets/        training-set files (default operators' and jobs')

This module opens and closes the store, loads every operator (in the background: ``/ready``
says which are still loading or failed, and why), creates new ones atomically, writes snapshots
on a background thread, and — for replicas — adopts operators other replicas published and
merges their updates every ``merge_interval`` seconds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from kjit import __version__ as kjit_version
from kjit.factors import UnknownFactorError
from kjit.operators import JITOperator
from kjit.persistence import dumps_state, loads_state

from ..files import fsync_dir, write_atomic
from ..names import NAME_RE
from ..shared import SharedLog, SharedLogError
from ..training import unguarded_note
from . import blas
from .entry import Entry, self_test
from .errors import Conflict, NotFound, NotReady

log = logging.getLogger("kjit.service.store")

__all__ = ["OperatorStore"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class OperatorStore:
    """All operators of one store directory; one server process per store (flock)."""

    def __init__(self, root: Path, snapshot_every: int = 500, observer: Callable[[str, float], None] | None = None,
                 shared: SharedLog | None = None, merge_interval: float = 1.0):
        self.shared = shared
        self.merge_interval = float(merge_interval)
        self._merge_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._adopt_lock = threading.Lock()
        self.retry: set[str] = set()  # operators waiting for the shared store to load
        self.root = Path(root)
        self.snapshot_every = int(snapshot_every)
        self._observer = observer
        self.audit = None  # service.audit.Auditor (set by the app when KJIT_AUDIT_RATE > 0)
        self.entries: dict[str, Entry] = {}
        self.failed: dict[str, str] = {}
        self.missing_factors: dict[str, str] = {}  # operator → the factor it needs that is not registered
        self.loading: set[str] = set()
        self.loaded = False
        self._lock = threading.Lock()
        self._lock_fh = None
        self._snapq: queue.Queue = queue.Queue()
        self._snap_thread: threading.Thread | None = None
        self.closed = False

    @property
    def operators_dir(self) -> Path:
        return self.root / "operators"

    def observe(self, what: str, seconds: float) -> None:
        if self._observer is not None:
            self._observer(what, seconds)

    # ---------------------------------------------------------------- open / close
    def open(self) -> None:
        """Create the layout, take the store lock and list the operators (not loaded yet)."""
        self.operators_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "training-sets").mkdir(parents=True, exist_ok=True)
        fh = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise RuntimeError(f"the store {self.root} is in use by another kjit server") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._lock_fh = fh
        blas.prepare()
        for p in self.operators_dir.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)  # an interrupted creation
        self._remove_temporary_files()
        with self._lock:
            self.loading = {p.name for p in self.operators_dir.iterdir() if p.is_dir()}
            if self.shared is not None:  # operators other replicas published are adopted when loading
                try:
                    self.loading |= set(self.shared.names())
                except SharedLogError as exc:  # (adopted once it is back: at a merge or a request for them)
                    log.warning("shared store: %s; operators published by other replicas are adopted when it is "
                                "back", exc)
        self._snap_thread = threading.Thread(target=self._snapshot_worker, name="kjit-snapshots", daemon=True)
        self._snap_thread.start()
        if self.shared is not None and self.merge_interval > 0:
            self._merge_thread = threading.Thread(target=self._merge_worker, name="kjit-merge", daemon=True)
            self._merge_thread.start()

    def _remove_temporary_files(self) -> None:
        """Remove what a crash inside :func:`service.files.write_atomic` left: ``.tmp-*`` files (a
        snapshot, a meta, a job record never renamed into place), in each operator's directory and in
        ``jobs/`` — nothing else removed them (found by an audit: one per crash, forever).  Only here,
        holding the store lock and before this store starts a thread: no other process serves this
        directory (replicas each have their own; the shared store is elsewhere), and no writer of this
        one has started (the job manager is created after :meth:`open`), so none is being written.
        ``training-sets/`` is left alone: files are put there by hand, by tools that do not take the lock."""
        dirs = [p for p in self.operators_dir.iterdir() if p.is_dir()] + [self.root / "jobs"]
        for d in dirs:
            try:
                stray = sorted(d.glob(".tmp-*"))
            except OSError:
                continue
            for p in stray:
                try:
                    p.unlink()
                    log.info("removed %s, left by an interrupted write", p)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("could not remove %s, left by an interrupted write (%s)", p, exc)

    def _merge_worker(self) -> None:
        """Replicas: every ``merge_interval`` s apply other replicas' records, adopt new operators."""
        while not self._stop.wait(self.merge_interval):
            if not self.loaded:
                continue
            try:
                for name in sorted(self.shared.names()) + sorted(self.retry):
                    try:
                        self._adopt_new(name)
                    except SharedLogError as exc:
                        log.warning("shared store: %s: %s (retrying)", name, exc)
                for entry in list(self.entries.values()):
                    try:
                        entry.merge()
                    except SharedLogError as exc:
                        log.warning("merge of %s: %s (retrying)", entry.name, exc)
                    except Exception:
                        log.exception("merge of %s failed", entry.name)
            except SharedLogError as exc:
                log.warning("shared store: %s (retrying)", exc)
            except Exception:  # pragma: no cover - keep merging whatever happens
                log.exception("merge loop")

    def load_all(self) -> None:
        for name in sorted(self.loading):
            self._load_one(name)
        self.loaded = True

    def _load_one(self, name: str) -> None:
        t = time.perf_counter()
        try:
            if not (self.operators_dir / name).exists() and self.shared is not None:
                self._adopt(name)
            entry = Entry(self, name, self.operators_dir / name)
            try:
                entry.load()
            except BaseException:  # (not served: its update log, which the load may have opened, is closed)
                entry.close()
                raise
        except SharedLogError as exc:  # the shared store is unreachable: not a verdict on the operator
            log.warning("operator %s: %s; loading it again at the next merge or request", name, exc)
            with self._lock:
                self.retry.add(name)
                self.loading.discard(name)
            return
        except UnknownFactorError as exc:  # the factor's package or module is not available here
            why = (f"factor {exc.name!r} is not available: install the package that provides it (entry point "
                   f"group kjit.factors) or name its module with --factors / KJIT_FACTORS ({exc})")
            log.error("operator %s could not be loaded: %s", name, why)
            with self._lock:
                self.failed[name] = why
                self.missing_factors[name] = exc.name
                self.loading.discard(name)
            return
        except Exception as exc:
            log.error("operator %s could not be loaded: %s", name, exc)
            with self._lock:
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                self.loading.discard(name)
            return
        with self._lock:
            self.entries[name] = entry
            self.loading.discard(name)
            self.retry.discard(name)
        log.info("operator %s loaded (version %d) in %.2fs", name, entry.version, time.perf_counter() - t)
        note = unguarded_note(entry.jit)
        if note is not None:  # (an operator of a store trained before the guards: said once, at load)
            log.warning("operator %s: %s", name, note)

    def _adopt(self, name: str) -> None:
        """Write another replica's operator into this store from its shared base."""
        blob = self.shared.get_base(name)
        if blob is None:
            raise ValueError(f"operator {name!r} is neither in this store nor in the shared store")
        _, state = loads_state(blob, source=f"{self.shared.url}/{name}/base")
        meta = json.loads(state.get("service", {}).get("meta", "{}"))
        meta.setdefault("name", name)
        self._install(name, meta, blob)
        log.info("operator %s adopted from the shared store %s", name, self.shared.url)

    def _install(self, name: str, meta: Mapping[str, Any], snapshot: bytes) -> Path:
        """Create ``operators/<name>`` (meta, snapshot 0, nothing else) atomically."""
        final = self.operators_dir / name
        tmp = Path(tempfile.mkdtemp(prefix=f".new-{name}-", dir=self.operators_dir))
        try:
            write_atomic(tmp / "meta.json", json.dumps(dict(meta), indent=1, default=str).encode())
            write_atomic(tmp / "snapshot-00000000.npz", snapshot)
            with self._lock:
                if final.exists():
                    raise Conflict(f"an operator named {name!r} already exists")
                os.rename(tmp, final)
                fsync_dir(self.operators_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _fail(self, name: str, why: str) -> None:
        with self._lock:
            self.entries.pop(name, None)
            self.failed[name] = why

    def close(self) -> None:
        """Final snapshots of operators changed since their last one, then release the store."""
        self.closed = True
        self._stop_merging()
        if self._snap_thread is not None:  # queued snapshots first, in order
            self._snapq.put(None)
            self._snap_thread.join(timeout=120)
            self._snap_thread = None
        for entry in list(self.entries.values()):
            try:
                if entry.version != entry.snapshot_version or entry.counters_changed():
                    entry.snapshot_now()
            except Exception:  # pragma: no cover - best effort at shutdown
                log.exception("final snapshot of %s failed", entry.name)
        for entry in list(self.entries.values()):
            entry.close()
        if self._lock_fh is not None:
            try:
                fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock_fh.close()
                self._lock_fh = None
        if self.shared is not None:
            self.shared.close()

    def abandon(self) -> None:
        """Release the store *without* final snapshots: what a crash leaves on disk (tests)."""
        self.closed = True
        self._stop_merging()
        if self._snap_thread is not None:
            self._snapq.put(None)
            self._snap_thread.join(timeout=120)
            self._snap_thread = None
        for entry in list(self.entries.values()):
            entry.close()
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

    def _stop_merging(self) -> None:
        self._stop.set()
        if self._merge_thread is not None:
            self._merge_thread.join(timeout=60)
            self._merge_thread = None

    # ---------------------------------------------------------------- snapshots
    def _enqueue_snapshot(self, entry: Entry, gen: int, data: bytes) -> None:
        self._snapq.put((entry, gen, data))

    def _snapshot_worker(self) -> None:
        while True:
            item = self._snapq.get()
            if item is None:
                return
            entry, gen, data = item
            try:
                entry.log.write_snapshot(gen, data, guard=entry.lock.read)  # (no rebuild lists files meanwhile)
            except Exception:  # the logs still hold every update: nothing is lost
                log.exception("snapshot %d of %s failed", gen, entry.name)

    # ---------------------------------------------------------------- lookup and creation
    def get(self, name: str) -> Entry:
        with self._lock:
            e = self.entries.get(name)
            if e is not None:
                return e
            if name in self.loading:
                raise NotReady(f"operator {name!r} is still loading")
            if name in self.failed:
                raise NotReady(f"operator {name!r} failed to load: {self.failed[name]}")
            known = ", ".join(sorted(self.entries)) or "none"
        if self.shared is not None and self.loaded and NAME_RE.match(name):
            # published by another replica since this one started, or waiting for the shared store
            try:
                self._adopt_new(name)
            except SharedLogError as exc:
                raise NotReady(f"operator {name!r}: the shared store is unavailable: {exc}") from None
            with self._lock:
                if name in self.entries:
                    return self.entries[name]
                if name in self.failed:
                    raise NotReady(f"operator {name!r} failed to load: {self.failed[name]}")
                if name in self.retry:
                    raise NotReady(f"operator {name!r} is waiting for the shared store {self.shared.url}")
        raise NotFound(f"unknown operator {_shown(name)}; known: {known}")

    def _adopt_new(self, name: str) -> bool:
        """Load ``name`` if another replica published it and it is not here, or if loading it
        failed for want of the shared store (``retry``); True if it is served now."""
        with self._adopt_lock:
            with self._lock:
                if name in self.entries or name in self.loading or name in self.failed:
                    return name in self.entries
                retrying = name in self.retry
            if not retrying and self.shared.get_base(name) is None:
                return False
            with self._lock:
                self.loading.add(name)
            self._load_one(name)
            with self._lock:
                return name in self.entries

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.entries)

    def exists(self, name: str) -> bool:
        return (self.operators_dir / name).exists()

    def create(self, name: str, jit: JITOperator, meta: Mapping[str, Any]) -> Entry:
        """Write a new operator (snapshot 0, meta, empty log) atomically and serve it."""
        if self.closed or self._lock_fh is None:
            raise RuntimeError("the store is not open")
        if not NAME_RE.match(name):
            raise ValueError(f"invalid operator name {name!r}")
        if jit.operator is None:
            raise ValueError("the store serves fitted operators only")
        # under the adoption lock: no request or merge adopts the name between publishing and installing
        with self._adopt_lock:
            return self._create(name, jit, meta)

    def _create(self, name: str, jit: JITOperator, meta: Mapping[str, Any]) -> Entry:
        if self.exists(name):
            raise Conflict(f"an operator named {name!r} already exists")
        # before anything is published or written: an operator that cannot answer ordinary messages
        # is not installed (found by an audit: the job said "failed", the directory stayed — the
        # name taken (409) and, after a restart, /ready 503 until removed by hand)
        self_test(jit)
        meta = {"name": name, "factor": jit.factor.name, "factor_params": jit.factor.params(), "to": jit.to,
                "created": _now(), "kjit_version": kjit_version, **dict(meta)}
        state = jit.state_dict()
        state["service"] = {"version": 0, "observed_pairs": 0, "learned_pairs": 0, "idempotency": "[]"}
        if self.shared is not None:
            # publish first: the name is taken deployment-wide by the first replica to publish
            state["service"]["meta"] = json.dumps(meta, default=str)
            blob = dumps_state("JITOperator", state)
            if self.shared.publish_base(name, blob) != blob:
                raise Conflict(f"an operator named {name!r} already exists in the shared store {self.shared.url}")
        else:
            blob = dumps_state("JITOperator", state)
        final = self._install(name, meta, blob)
        entry = Entry(self, name, final)
        try:
            entry.load()
        except BaseException:  # (not served: not left on disk either)
            entry.close()
            shutil.rmtree(final, ignore_errors=True)
            fsync_dir(self.operators_dir)
            raise
        with self._lock:
            self.entries[name] = entry
            self.failed.pop(name, None)
            self.missing_factors.pop(name, None)
        return entry


def _shown(value: str, limit: int = 64) -> str:
    """``repr(value)``, cut to ``limit`` characters: a path parameter is echoed only that far."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
