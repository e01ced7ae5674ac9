"""The operator store: a local directory, durable updates, recovery on start.

Layout (``<store>`` is ``Settings.store``)::

    <store>/.lock                          held (flock) by the one server using the store
    <store>/operators/<name>/meta.json     factor, direction, how it was trained (written once)
    <store>/operators/<name>/snapshot-G.npz   operator state after every update of logs < G
    <store>/operators/<name>/log-G.jsonl      update records appended after snapshot G
    <store>/training-sets/                 training-set files (default operators' and jobs')

Durability.  Every update — an ``observations`` request, or a ``jit`` request that consulted
the oracle — is applied to the in-memory operator and appended to the current log as one
record (the (incoming, belief) pairs learned, exactly as JSON floats, with a CRC-32), and the
log is fsync'ed, all under the operator's exclusive lock; only then is the lock released and
the 2xx sent.  So anything any client can observe is already on disk ("durable before
visible").  If applying or writing fails, the record is cut off the log and the operator is
rebuilt from disk, so memory never runs ahead of the disk.

Snapshots.  When the current log holds ``snapshot_every`` records, the operator's state is
serialised (still under the lock, with :func:`kjit.persistence.dumps_state`), a new log
generation G+1 is started, and a background thread writes ``snapshot-(G+1).npz`` atomically
(temporary file, fsync, rename, directory fsync) and then deletes the generations below G+1.
On shutdown a final snapshot is written (it also saves the just-in-time counters, which
otherwise are durable only at snapshots).

Recovery.  On start, each operator loads its newest snapshot S and replays, in order, the
records of every log with generation >= S (each record is one ``partial_fit`` with the same
rows as online, so the replayed state is the same bit for bit).  A record that fails its CRC
or does not parse is accepted only at the very end of the newest log — a write the crash cut
short, never acknowledged — and is cut off; anywhere else it is corruption and the operator
is reported as failed (``/ready`` says which and why) instead of being served wrong.

Nothing in the store is ever unpickled: snapshots are read by :func:`kjit.persistence.loads_state`
(``allow_pickle=False``), logs are JSON.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from kjit import __version__ as kjit_version
from kjit.families import FAMILIES, Family
from kjit.operators import JITOperator, KernelOperator
from kjit.oracles import ImportanceSamplingOracle, OracleError, QuadratureOracle
from kjit.persistence import dumps_state, loads_state

from .locks import RWLock

log = logging.getLogger("kjit.service.store")

__all__ = [
    "OperatorStore",
    "Entry",
    "NotFound",
    "NotReady",
    "Conflict",
    "PersistError",
    "OracleFailure",
    "NAME_RE",
    "family_name",
]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_SNAP_RE = re.compile(r"^snapshot-(\d{8})\.npz$")
_LOG_RE = re.compile(r"^log-(\d{8})\.jsonl$")
MAX_IDEMPOTENCY_KEYS = 10_000
_FAMILY_NAMES = {cls: name for name, cls in FAMILIES.items()}


def family_name(cls_or_msg) -> str:
    cls = cls_or_msg if isinstance(cls_or_msg, type) else type(cls_or_msg)
    return _FAMILY_NAMES[cls]


class NotFound(LookupError):
    pass


class NotReady(RuntimeError):
    pass


class Conflict(RuntimeError):
    pass


class PersistError(RuntimeError):
    pass


class OracleFailure(RuntimeError):
    pass


# ------------------------------------------------------------------------------ file helpers
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


def _params_json(m: Family) -> dict[str, list]:
    return {n: np.asarray(p, float).ravel().tolist() for n, p in zip(m.param_names, m.params)}


def encode_record(rec: Mapping[str, Any]) -> bytes:
    body = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode_record(line: bytes) -> dict:
    crc, _, body = line.partition(b" ")
    if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
        raise ValueError("CRC mismatch")
    return json.loads(body)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------ one operator
class Entry:
    """One operator of the store: the JIT operator, its lock, its log and its version.

    ``version`` counts the update records applied since the operator was created; every
    response carries the version it was computed from.
    """

    def __init__(self, store: "OperatorStore", name: str, path: Path):
        self.store = store
        self.name = name
        self.path = path
        self.lock = RWLock()
        self.meta: dict = json.loads((path / "meta.json").read_text())
        self.jit: JITOperator | None = None
        self.version = 0
        self.observed_pairs = 0
        self.learned_pairs = 0
        self.keys: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        self.gen = 0
        self.n_log_records = 0
        self._log_fh = None
        self.snapshot_version = 0

    # ---------------------------------------------------------------- loading and recovery
    def _generations(self):
        snaps, logs = {}, {}
        for p in self.path.iterdir():
            if (m := _SNAP_RE.match(p.name)):
                snaps[int(m.group(1))] = p
            elif (m := _LOG_RE.match(p.name)):
                logs[int(m.group(1))] = p
        return snaps, logs

    def load(self) -> None:
        """(Re)build the operator from its newest snapshot and the logs after it."""
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        snaps, logs = self._generations()
        if not snaps:
            raise ValueError(f"operator {self.name!r}: no snapshot in {self.path}")
        g = max(snaps)
        kind, state = loads_state(snaps[g].read_bytes(), source=str(snaps[g]))
        if kind == "JITOperator":
            jit = JITOperator.from_state_dict(state)
        elif kind == "KernelOperator":  # a plain learned operator dropped into the store
            op = KernelOperator.from_state_dict(state)
            jit = JITOperator(op, QuadratureOracle(op.factor), threshold=float(self.meta.get("threshold", -8.5)))
        else:
            raise ValueError(f"{snaps[g]}: cannot serve an operator of kind {kind!r}")
        if jit.operator is None:
            raise ValueError(f"{snaps[g]}: the operator has no learned model yet; the store serves fitted operators")
        svc = state.get("service", {})
        self.jit = jit
        self.version = self.snapshot_version = int(svc.get("version", 0))
        self.observed_pairs = int(svc.get("observed_pairs", 0))
        self.learned_pairs = int(svc.get("learned_pairs", 0))
        self.keys = OrderedDict((k, (h, s, n)) for k, h, s, n in json.loads(svc.get("idempotency", "[]")))
        # stale generations (a crash between a snapshot and the clean-up) go
        for old, p in list(snaps.items()):
            if old < g:
                p.unlink()
        for old, p in list(logs.items()):
            if old < g:
                p.unlink()
                del logs[old]
        replay = sorted(logs)
        n_replayed = 0
        for i, lg in enumerate(replay):
            last = i == len(replay) - 1
            n_replayed += self._replay(logs[lg], last)
        self.gen = max([g] + replay)
        self.n_log_records = 0
        cur = self.path / f"log-{self.gen:08d}.jsonl"
        if cur.exists():
            with open(cur, "rb") as fh:
                self.n_log_records = sum(1 for _ in fh)
        self._open_log()
        self._counters_at_snapshot = self.jit.raw_counters() if not n_replayed else None
        if n_replayed:
            log.info("operator %s: replayed %d update record(s) to version %d", self.name, n_replayed, self.version)

    def _replay(self, path: Path, last: bool) -> int:
        data = path.read_bytes()
        lines = data.split(b"\n")
        # the final element is b"" after a complete last line, else a torn write
        good_end = 0
        pos = 0
        records = []
        bad_at = None
        for j, line in enumerate(lines):
            end = pos + len(line) + 1
            if j == len(lines) - 1:
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
            log.warning("operator %s: cutting an incomplete update record off %s (%d bytes; never acknowledged)",
                        self.name, path.name, len(data) - good_end)
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        n = 0
        for rec in records:
            seq = int(rec["seq"])
            if seq <= self.version:
                continue  # already in the snapshot
            if seq != self.version + 1:
                raise ValueError(f"{path}: update record {seq} follows version {self.version}: records are missing")
            self._apply_record(rec)
            n += 1
        return n

    def _messages_from_record(self, rec):
        factor = self.jit.factor
        inc = {v: factor.families[v].from_dict(d) for v, d in rec["incoming"].items()}
        bel = self.jit.family.from_dict(rec["beliefs"])
        return inc, bel

    def _apply_record(self, rec) -> None:
        inc, bel = self._messages_from_record(rec)
        self.jit.operator.partial_fit(inc, bel)
        self._account(rec, len(bel))

    def _account(self, rec, n: int) -> None:
        self.version = int(rec["seq"])
        if rec["kind"] == "observe":
            self.observed_pairs += n
        else:
            self.learned_pairs += n
            if rec.get("counters"):
                known = self.jit.raw_counters()
                self.jit.set_counters({k: v for k, v in rec["counters"].items() if k in known})
        if rec.get("key"):
            self.keys[rec["key"]] = (rec.get("body_hash", ""), int(rec["seq"]), n)
            self.keys.move_to_end(rec["key"])
            while len(self.keys) > MAX_IDEMPOTENCY_KEYS:
                self.keys.popitem(last=False)

    def _open_log(self) -> None:
        p = self.path / f"log-{self.gen:08d}.jsonl"
        created = not p.exists()
        self._log_fh = open(p, "ab", buffering=0)
        if created:
            os.fsync(self._log_fh.fileno())
            fsync_dir(self.path)

    def close(self) -> None:
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    # ---------------------------------------------------------------- durable updates
    def _append(self, rec: Mapping[str, Any]) -> None:
        """Append one record and fsync it; on failure cut the partial write off and raise."""
        data = encode_record(rec)
        fh = self._log_fh
        start = fh.tell()
        t = time.perf_counter()
        try:
            view = memoryview(data)
            while view:
                k = fh.write(view)
                view = view[k:]
            os.fsync(fh.fileno())
        except OSError as exc:
            try:
                fh.truncate(start)
                os.fsync(fh.fileno())
            except OSError:
                pass
            raise PersistError(f"could not write the update log of {self.name!r}: {exc}") from exc
        self.store.observe("fsync", time.perf_counter() - t)
        self.n_log_records += 1

    def _recover(self, why: str) -> None:
        log.error("operator %s: %s; rebuilding it from the store", self.name, why)
        try:
            self.load()
        except Exception:  # pragma: no cover - disk unusable
            log.exception("operator %s: could not be rebuilt", self.name)
            self.store._fail(self.name, f"could not be rebuilt after: {why}")
            raise

    def _commit(self, rec: dict, apply: Callable[[], None] | None) -> None:
        """Apply (if ``apply``) and log ``rec`` atomically w.r.t. readers; exclusive lock held."""
        try:
            if apply is not None:
                apply()
            self._append(rec)
        except PersistError:
            self._recover("an update could not be written")
            raise
        except Exception as exc:
            self._recover(f"an update failed half-way ({type(exc).__name__}: {exc})")
            raise
        self._account(rec, len(rec["beliefs"][next(iter(rec["beliefs"]))]))
        if self.n_log_records >= self.store.snapshot_every:
            self._rotate()

    def _rotate(self) -> None:
        """Start log G+1 and hand the state at this point to the snapshot writer (lock held)."""
        t = time.perf_counter()
        data = self._snapshot_bytes()
        self.close()
        self.gen += 1
        self.n_log_records = 0
        self._open_log()
        self.store._enqueue_snapshot(self, self.gen, data)
        self.store.observe("snapshot_serialise", time.perf_counter() - t)

    def _snapshot_bytes(self) -> bytes:
        state = self.jit.state_dict()
        state["service"] = {
            "version": self.version, "observed_pairs": self.observed_pairs, "learned_pairs": self.learned_pairs,
            "idempotency": json.dumps([[k, h, s, n] for k, (h, s, n) in self.keys.items()]),
        }
        self.snapshot_version = self.version
        self._counters_at_snapshot = dict(state["counters"])
        return dumps_state("JITOperator", state)

    # ---------------------------------------------------------------- requests
    def predict(self, incoming: dict[str, Family], mode: str):
        """``(belief, log_var or None, consulted mask, version, n_learned)`` for one batch."""
        jit = self.jit
        n = len(next(iter(incoming.values())))
        if mode == "predict":
            with self.lock.read():
                q, logvar = self.jit.operator.predict(incoming)
                version = self.version
            return q, logvar, np.zeros(n, dtype=bool), version, 0
        if mode == "oracle":
            # the importance sampler draws from a generator that is part of the state
            ctx = self.lock.write() if isinstance(jit.oracle, ImportanceSamplingOracle) else self.lock.read()
            with ctx:
                try:
                    q = self.jit.oracle.belief(incoming, self.jit.to)
                except OracleError as exc:
                    raise OracleFailure(str(exc)) from None
                version = self.version
            return q, None, np.ones(n, dtype=bool), version, 0
        # jit
        with self.lock.write():
            jit = self.jit
            consulted = None
            try:
                # on an oracle failure nothing was learned and JITOperator.predict leaves the
                # counters as they were
                q, logvar, consulted = jit.predict(incoming, jit.to)
            except OracleError as exc:
                raise OracleFailure(str(exc)) from None
            except Exception as exc:
                self._recover(f"a just-in-time request failed ({type(exc).__name__}: {exc})")
                raise
            idx = np.flatnonzero(consulted)
            if idx.size:
                rec = {
                    "seq": self.version + 1, "kind": "jit", "time": time.time(),
                    "incoming": {v: _params_json(m[idx]) for v, m in incoming.items()},
                    "beliefs": _params_json(q[idx]),
                    "counters": jit.raw_counters(),
                }
                self._commit(rec, apply=None)  # JITOperator.predict already learned the pairs
            version = self.version
        return q, logvar, consulted, version, int(idx.size)

    def observe(self, incoming: dict[str, Family], beliefs: Family, key: str | None, body_hash: str | None):
        """Add pairs; returns ``(version, n_accepted, duplicate)``."""
        n = len(beliefs)
        with self.lock.write():
            if key is not None and key in self.keys:
                h, seq, n0 = self.keys[key]
                if h != body_hash:
                    raise Conflict("this Idempotency-Key was used before with a different request body")
                return seq, n0, True
            rec = {
                "seq": self.version + 1, "kind": "observe", "time": time.time(),
                "incoming": {v: _params_json(m) for v, m in incoming.items()},
                "beliefs": _params_json(beliefs),
            }
            if key is not None:
                rec["key"], rec["body_hash"] = key, body_hash
            self._commit(rec, apply=lambda: self.jit.operator.partial_fit(incoming, beliefs))
            return self.version, n, False

    def snapshot_now(self) -> None:
        """Write a snapshot synchronously if anything changed since the last one (shutdown)."""
        with self.lock.write():
            if self.jit is None:
                return
            data = self._snapshot_bytes()
            self.close()
            self.gen += 1
            self.n_log_records = 0
            self._open_log()
            self.store._write_snapshot(self, self.gen, data)

    # ---------------------------------------------------------------- description
    def summary(self) -> dict:
        jit = self.jit
        fam = jit.factor.families
        return {
            "name": self.name, "factor": jit.factor.name, "factor_params": jit.factor.params(),
            "to": jit.to, "inputs": [v for v in jit.factor.variables if v != jit.to],
            "families": {v: family_name(fam[v]) for v in jit.factor.variables},
            "version": self.version, "n_train": int(jit.operator.n_train_),
        }

    def detail(self) -> dict:
        with self.lock.read():
            jit, op = self.jit, self.jit.operator
            d = self.summary()
            d.update({
                "features": {"n_inner": op.n_inner, "n_outer": op.n_outer, "treatment": op.treatment, "target": op.target},
                "hyperparameters": json.loads(json.dumps(op.hyperparameters(), default=lambda o: o.tolist())),
                "threshold": jit.threshold,
                "oracle": {"kind": "importance_sampling" if isinstance(jit.oracle, ImportanceSamplingOracle) else "quadrature"},
                "counters": jit.counters(),
                "updates": {"version": self.version, "observed_pairs": self.observed_pairs,
                            "learned_pairs": self.learned_pairs, "log_generation": self.gen,
                            "records_since_snapshot": self.version - self.snapshot_version},
                "training": self.meta.get("training", {}),
                "source": self.meta.get("source", {}),
                "created": self.meta.get("created"),
                "kjit_version": self.meta.get("kjit_version"),
            })
        return d


# ------------------------------------------------------------------------------ the store
class OperatorStore:
    """All operators of one store directory; one server process per store (flock)."""

    def __init__(self, root: Path, snapshot_every: int = 500, observer: Callable[[str, float], None] | None = None):
        self.root = Path(root)
        self.snapshot_every = int(snapshot_every)
        self._observer = observer
        self.entries: dict[str, Entry] = {}
        self.failed: dict[str, str] = {}
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
        for p in self.operators_dir.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)  # an interrupted creation
        with self._lock:
            self.loading = {p.name for p in self.operators_dir.iterdir() if p.is_dir()}
        self._snap_thread = threading.Thread(target=self._snapshot_worker, name="kjit-snapshots", daemon=True)
        self._snap_thread.start()

    def load_all(self) -> None:
        for name in sorted(self.loading):
            self._load_one(name)
        self.loaded = True

    def _load_one(self, name: str) -> None:
        t = time.perf_counter()
        try:
            entry = Entry(self, name, self.operators_dir / name)
            entry.load()
        except Exception as exc:
            log.error("operator %s could not be loaded: %s", name, exc)
            with self._lock:
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                self.loading.discard(name)
            return
        with self._lock:
            self.entries[name] = entry
            self.loading.discard(name)
        log.info("operator %s loaded (version %d) in %.2fs", name, entry.version, time.perf_counter() - t)

    def _fail(self, name: str, why: str) -> None:
        with self._lock:
            self.entries.pop(name, None)
            self.failed[name] = why

    def close(self) -> None:
        """Final snapshots of operators changed since their last one, then release the store."""
        self.closed = True
        if self._snap_thread is not None:  # queued snapshots first, in order
            self._snapq.put(None)
            self._snap_thread.join(timeout=120)
            self._snap_thread = None
        for entry in list(self.entries.values()):
            try:
                if entry.version != entry.snapshot_version or _counters_changed(entry):
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

    def abandon(self) -> None:
        """Release the store *without* final snapshots: what a crash leaves on disk (tests)."""
        self.closed = True
        if self._snap_thread is not None:
            self._snapq.put(None)
            self._snap_thread.join(timeout=120)
            self._snap_thread = None
        for entry in list(self.entries.values()):
            entry.close()
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

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
                self._write_snapshot(entry, gen, data)
            except Exception:  # the logs still hold every update: nothing is lost
                log.exception("snapshot %d of %s failed", gen, entry.name)

    def _write_snapshot(self, entry: Entry, gen: int, data: bytes) -> None:
        t = time.perf_counter()
        write_atomic(entry.path / f"snapshot-{gen:08d}.npz", data)
        for p in entry.path.iterdir():
            m = _SNAP_RE.match(p.name) or _LOG_RE.match(p.name)
            if m and int(m.group(1)) < gen:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        self.observe("snapshot_write", time.perf_counter() - t)

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
        raise NotFound(f"unknown operator {name!r}; known: {known}")

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
        final = self.operators_dir / name
        tmp = Path(tempfile.mkdtemp(prefix=f".new-{name}-", dir=self.operators_dir))
        try:
            meta = {"name": name, "factor": jit.factor.name, "factor_params": jit.factor.params(), "to": jit.to,
                    "created": _now(), "kjit_version": kjit_version, **dict(meta)}
            write_atomic(tmp / "meta.json", json.dumps(meta, indent=1, default=str).encode())
            state = jit.state_dict()
            state["service"] = {"version": 0, "observed_pairs": 0, "learned_pairs": 0, "idempotency": "[]"}
            write_atomic(tmp / "snapshot-00000000.npz", dumps_state("JITOperator", state))
            with self._lock:
                if final.exists():
                    raise Conflict(f"an operator named {name!r} already exists")
                os.rename(tmp, final)
                fsync_dir(self.operators_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entry = Entry(self, name, final)
        entry.load()
        with self._lock:
            self.entries[name] = entry
            self.failed.pop(name, None)
        return entry


def _counters_changed(entry: Entry) -> bool:
    now = entry.jit.raw_counters()
    return now != getattr(entry, "_counters_at_snapshot", None)


def body_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
