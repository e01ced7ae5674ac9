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

Replicas (``KJIT_SHARED_STORE``, :mod:`service.shared`).  The shared store's ordered log is then the
source of truth: an update is appended there (compare-and-set on the version) before it is
applied and acknowledged, and the local directory keeps snapshots only, each naming the shared
base it grew from; on start a replica loads its newest snapshot (or adopts the shared base) and
applies the shared log's records after its version.

Nothing in the store is ever unpickled: snapshots are read by :func:`kjit.persistence.loads_state`
(``allow_pickle=False``), logs are JSON.
"""

from __future__ import annotations

import copy
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
import uuid
import zlib
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from kjit import __version__ as kjit_version
from kjit.factors import UnknownFactorError
from kjit.certificates import certified
from kjit.families import Family, family_name  # noqa: F401  (family_name re-exported)
from kjit.operators import JITOperator, KernelOperator
from kjit.oracles import (ClientOracle, ImportanceSamplingOracle, MessageImportanceSampler, OracleError,
                          QuadratureOracle)
from kjit.persistence import dumps_state, loads_state

from .audit import AuditStats
from .files import append_durably, decode_record, encode_record, fsync_dir, write_atomic
from .locks import RWLock
from .names import NAME_RE
from .shared import SharedLog, SharedLogError
from .schemas import PARAM_MAX
from .validation import NUMERIC_ERRORS

log = logging.getLogger("kjit.service.store")

__all__ = [
    "OperatorStore",
    "Entry",
    "NotFound",
    "NotReady",
    "Conflict",
    "PersistError",
    "OracleFailure",
    "Unprocessable",
    "NAME_RE",
    "family_name",
]

_SNAP_RE = re.compile(r"^snapshot-(\d{8})\.npz$")
_LOG_RE = re.compile(r"^log-(\d{8})\.jsonl$")
MAX_IDEMPOTENCY_KEYS = 10_000
#: observations of at least this many rows are learned aside (``Entry._observe_aside``): predictions
#: are not held up behind them; smaller ones are learned in place (a copy costs more than they do)
ASIDE_ROWS = 256
class NotFound(LookupError):
    pass


class NotReady(RuntimeError):
    pass


class Conflict(RuntimeError):
    pass


class PersistError(RuntimeError):
    """An update was not made durable; ``unknown``: it may still have landed (shared store)."""

    def __init__(self, msg: str, unknown: bool = False):
        super().__init__(msg)
        self.unknown = unknown


class OracleFailure(RuntimeError):
    pass


class Unprocessable(ValueError):
    """The input is valid but the numerics cannot carry it (nothing was changed)."""


def _params_json(m: Family) -> dict[str, list]:
    return {n: np.asarray(p, float).ravel().tolist() for n, p in zip(m.param_names, m.params)}


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
        self.shared: SharedLog | None = store.shared
        self.base_hash: str | None = None  # replicas: sha256 of the shared base this state grew from
        self.last_rid: str | None = None   # replicas: id of the last shared-log record applied
        self.audit = getattr(store, "audit", None)  # service.audit.Auditor, or None (KJIT_AUDIT_RATE = 0)
        self.audit_stats = AuditStats()  # folded from the operator's audit records (service.audit)
        self.audited_pairs = 0

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
        snap_bytes = snaps[g].read_bytes()
        svc = self._load_state(snap_bytes, str(snaps[g]))
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
        if self.shared is not None:
            self._join_shared(svc.get("shared_base"), _sha256(snap_bytes), n_replayed)
        self._self_test()

    def _self_test(self) -> None:
        """An operator that cannot answer ordinary messages is not served (``/ready`` lists it as
        failed): predict a fixed batch from the factor's default distribution, if it has one."""
        sampler = self.jit.factor.default_incoming
        if sampler is None:
            return
        incoming = sampler(16, np.random.default_rng(0))
        try:
            with np.errstate(all="ignore"):
                q, logvar = self.jit.operator.predict(incoming)
                ok = np.isfinite(q.to_coords()).all() and np.isfinite(logvar).all()
                big = max(float(np.max(np.abs(p))) for p in q.params)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the operator cannot predict
            raise ValueError(f"the operator cannot predict ordinary messages ({type(exc).__name__}: {exc})") from None
        if not ok:
            raise ValueError("the operator cannot predict ordinary messages: its predictions are not finite")
        if big > PARAM_MAX:
            raise ValueError(f"the operator cannot predict ordinary messages: its beliefs have parameters of "
                             f"{big:.3g}, beyond the range requests may carry ({PARAM_MAX:g})")

    def _load_state(self, blob: bytes, source: str) -> dict:
        """Set the operator and the service's bookkeeping from a snapshot; returns its service dict."""
        kind, state = loads_state(blob, source=source)
        if kind == "JITOperator":
            jit = JITOperator.from_state_dict(state)
        elif kind == "KernelOperator":  # a plain learned operator dropped into the store
            op = KernelOperator.from_state_dict(state)
            jit = JITOperator(op, QuadratureOracle(op.factor), threshold=float(self.meta.get("threshold", -8.5)))
        else:
            raise ValueError(f"{source}: cannot serve an operator of kind {kind!r}")
        if jit.operator is None:
            raise ValueError(f"{source}: the operator has no learned model yet; the store serves fitted operators")
        svc = state.get("service", {})
        self.jit = jit
        self.version = self.snapshot_version = int(svc.get("version", 0))
        self.observed_pairs = int(svc.get("observed_pairs", 0))
        self.learned_pairs = int(svc.get("learned_pairs", 0))
        self.keys = OrderedDict((k, (h, s, n)) for k, h, s, n in json.loads(svc.get("idempotency", "[]")))
        self.last_rid = svc.get("shared_last_rid")
        self.audit_stats = AuditStats.from_state(json.loads(svc.get("audit", "null")))
        self.audited_pairs = int(svc.get("audited_pairs", 0))
        return svc

    # ---------------------------------------------------------------- replicas (service.shared)
    def base_blob(self) -> bytes:
        """This operator's current state as a shared base: version 0, its meta inside."""
        state = self.jit.state_dict()
        state["service"] = {"version": 0, "observed_pairs": 0, "learned_pairs": 0, "idempotency": "[]",
                            "meta": json.dumps(self.meta, default=str)}
        return dumps_state("JITOperator", state)

    def _join_shared(self, recorded_base: str | None, snapshot_hash: str, n_local: int) -> None:
        """Make this state a prefix of the shared log: publish or adopt the base, then catch up.

        ``recorded_base`` is the shared base the loaded snapshot grew from (None for a snapshot
        written outside replication — the base blob itself, or a standalone server's);
        ``n_local`` counts records replayed from this store's own log (taken standalone).
        """
        base = self.shared.get_base(self.name)
        if base is None:
            # the first replica to publish this operator: its current state becomes the base
            # (a standalone store joining a shared one keeps what it learned, at version 0)
            blob = self.base_blob()
            base = self.shared.publish_base(self.name, blob)
            if base == blob:
                self.version = self.snapshot_version = 0
                self.observed_pairs = self.learned_pairs = 0
                self.keys.clear()
                self.last_rid = None
                self.base_hash = _sha256(blob)
                self.n_log_records = self.store.snapshot_every  # a local snapshot at the next update
                return self._catch_up()
        if n_local:
            raise ValueError(
                f"operator {self.name!r} learned {n_local} update(s) in this store's own log (served without the "
                f"shared store) that are not in the shared store {self.shared.url}: serving it as a replica would "
                f"mix them into the shared order — move this store's copy away, or serve it under another name")
        if _sha256(base) != (recorded_base or snapshot_hash):
            if recorded_base is None and self.version > 0:
                raise ValueError(
                    f"operator {self.name!r} learned {self.version} update(s) in this store outside the shared "
                    f"store {self.shared.url}, which already holds another {self.name!r}: serving the shared one "
                    f"would drop them — move this store's copy away, or serve it under another name")
            # another replica's base: start from it
            log.info("operator %s: adopting the shared base from %s", self.name, self.shared.url)
            svc = self._load_state(base, f"{self.shared.url}/{self.name}/base")
            if "meta" in svc:  # the creator's description of the operator
                self.meta = json.loads(svc["meta"])
                write_atomic(self.path / "meta.json", json.dumps(self.meta, indent=1, default=str).encode())
            self.n_log_records = self.store.snapshot_every
        self.base_hash = _sha256(base)
        self._catch_up()

    def _catch_up(self, rid: str | None = None) -> int | None:
        """Apply the shared log's records after ``version`` in order (exclusive lock held).

        Returns the sequence number of the record whose ``rid`` is ``rid``, if it was among them.
        """
        found = None
        n = 0
        t = time.perf_counter()
        try:
            raws = self.shared.read(self.name, max(self.version - 1, 0))
            if self.version > 0:
                # the record at our version must still be the one we applied: a shared log that
                # lost its tail (a Redis without fsync restarted) or was rewritten is not ours
                if not raws:
                    raise ValueError(f"the shared log holds fewer than {self.version} records, the version of this "
                                     f"replica's state: the shared store lost updates or was reset")
                prev = decode_record(raws[0].rstrip(b"\n"))
                if int(prev["seq"]) != self.version or (self.last_rid is not None and prev.get("rid") != self.last_rid):
                    raise ValueError(f"record {self.version} of the shared log is not the one this replica applied: "
                                     f"the shared log was rewritten")
                raws = raws[1:]
        except (ValueError, KeyError) as exc:
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self.store._fail(self.name, why)
            raise ValueError(why) from exc
        for raw in raws:
            try:
                rec = decode_record(raw.rstrip(b"\n"))
                seq = int(rec["seq"])
                if seq != self.version + 1:
                    raise ValueError(f"record {seq} follows version {self.version}")
                self._apply_record(rec)
            except Exception as exc:
                why = f"the shared log could not be applied after version {self.version}: {type(exc).__name__}: {exc}"
                self.store._fail(self.name, why)
                raise ValueError(why) from exc
            n += 1
            if rid is not None and rec.get("rid") == rid:
                found = seq
            self._applied_shared()
        if n:
            self.store.observe("merge", time.perf_counter() - t)
        return found

    def _applied_shared(self) -> None:
        self.n_log_records += 1
        if self.n_log_records >= self.store.snapshot_every:
            self._rotate()

    def merge(self) -> int:
        """Apply the other replicas' records now; returns how many were applied."""
        if self.shared is None:
            raise Conflict("this server has no shared store (KJIT_SHARED_STORE): there is nothing to merge")
        if self.shared.length(self.name) == self.version:
            return 0  # (a shorter log is a loss the catch-up reports)
        with self.lock.write():
            before = self.version
            self._catch_up()
            return self.version - before

    def _commit_shared(self, make_rec: Callable[[], dict | None], rid: str) -> dict | None:
        """Append a record to the shared log (compare-and-set on the version), then apply it.

        ``make_rec`` builds the record after each catch-up (None: nothing to append, e.g. a
        duplicate key).  The record is in the shared store before it is applied here, and is
        applied by the same code as every other replica's records (bit-identical states).
        """
        for _ in range(self.MAX_APPEND_ATTEMPTS):
            try:
                found = self._catch_up(rid)
            except SharedLogError as exc:
                raise PersistError(f"the shared store is unavailable: {exc}") from exc
            if found is not None:
                return {"seq": found, "found": True}
            rec = make_rec()
            if rec is None:
                return None
            rec["seq"], rec["rid"] = self.version + 1, rid
            ok, found = self._place(rec)
            if found is not None:
                return {"seq": found, "found": True}
            if ok:
                try:
                    self._apply_record(rec)
                except Exception as exc:  # the record is in the shared log: the rebuilt state has it
                    self._recover(f"an update failed half-way ({type(exc).__name__}: {exc})")
                    return rec
                self._applied_shared()
                return rec
        raise PersistError(f"the shared log of {self.name!r} kept changing: {self.MAX_APPEND_ATTEMPTS} appends were "
                           f"refused; nothing was added")

    MAX_APPEND_ATTEMPTS = 100

    def _place(self, rec: dict, before_catch_up: Callable[[], None] | None = None):
        """Append ``rec`` as record ``version + 1``: ``(True, None)`` if it is there now,
        ``(False, None)`` if another record took the place.  If the append itself failed, the
        log is read to see whether the record landed anyway — ``before_catch_up`` first undoes
        what the caller already applied — and ``(None, seq)`` says it did (applied now by the
        catch-up); otherwise the outcome is unknown: PersistError(unknown=True)."""
        try:
            return self.shared.append(self.name, self.version, encode_record(rec)), None
        except SharedLogError as exc:
            if before_catch_up is not None:
                before_catch_up()
            try:
                found = self._catch_up(rec["rid"])
            except Exception:
                found = None
            if found is not None:
                return None, found
            raise PersistError(f"{exc}: the update may or may not have been recorded", unknown=True) from exc

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
        sizes = [int(g) for g in rec.get("groups", [len(bel)])]
        if sum(sizes) != len(bel) or min(sizes) < 1:
            raise ValueError(f"record {rec.get('seq')}: groups {sizes} for {len(bel)} beliefs")
        start = 0
        for size in sizes:  # one partial_fit per group, as the operator learned them
            sl = slice(start, start + size)
            self.jit.operator.partial_fit({v: m[sl] for v, m in inc.items()}, bel[sl])
            start += size
        self._account(rec, len(bel))
        self.last_rid = rec.get("rid")

    def _account(self, rec, n: int) -> None:
        self.version = int(rec["seq"])
        if rec["kind"] == "observe":
            self.observed_pairs += n
        elif rec["kind"] == "audit":  # audited pairs (service.audit): statistics and threshold decisions
            self.audited_pairs += n
            self.audit_stats.fold(rec["audit"], self.version)
            change = rec["audit"].get("threshold_change")
            if change:
                self.jit.threshold = float(change["to"])
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
        t = time.perf_counter()
        try:
            append_durably(self._log_fh, data)
        except OSError as exc:
            raise PersistError(f"could not write the update log of {self.name!r}: {exc}") from exc
        self.store.observe("fsync", time.perf_counter() - t)
        self.n_log_records += 1

    def _recover(self, why: str) -> None:
        log.error("operator %s: %s; rebuilding it from the store", self.name, why)
        # the JIT counters in memory count the requests that succeeded; those on disk only
        # reach the last snapshot or jit record: keep the former
        counters = self.jit.raw_counters() if self.jit is not None else None
        try:
            self.load()
            if counters is not None:
                self.jit.set_counters(counters)
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
            if isinstance(exc, NUMERIC_ERRORS):
                raise Unprocessable(str(exc)) from exc
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
            "audit": json.dumps(self.audit_stats.state()), "audited_pairs": self.audited_pairs,
        }
        if self.base_hash is not None:
            state["service"]["shared_base"] = self.base_hash
            if self.last_rid is not None:
                state["service"]["shared_last_rid"] = self.last_rid
        self.snapshot_version = self.version
        self._counters_at_snapshot = dict(state["counters"])
        return dumps_state("JITOperator", state)

    # ---------------------------------------------------------------- requests
    def predict(self, incoming: dict[str, Family], mode: str, wait: bool = True):
        """``(belief, log_var or None, consulted mask, version, n_learned)`` for one batch; the
        answer's certificates (:mod:`kjit.certificates`, version = the response's) are in
        :meth:`predict_certified`.  ``wait=False`` (``predict`` only): raise :class:`WouldBlock`
        rather than wait for an update."""
        return self.predict_certified(incoming, mode, wait=wait)[:5]

    def predict_certified(self, incoming: dict[str, Family], mode: str, wait: bool = True):
        """``(belief, log_var or None, consulted mask, version, n_learned, certificates, uncertain)``;
        ``uncertain`` (mode=predict, else None): the rows the operator's just-in-time rule would
        consult (:meth:`JITOperator.screen`) — what a client whose oracle runs on its side answers."""
        if mode == "predict":
            q, logvar, consulted, version, n_learned, cert, uncertain = self._screen(incoming, wait)
        else:
            q, logvar, consulted, version, n_learned, cert = self._predict(incoming, mode)
            uncertain = None
        # (the threshold is the one the answer was computed under: set under the operator's lock —
        # by JITOperator.certified in mode=jit — not read here, after an audit may have changed it)
        cert = cert.with_(version=version)
        if mode != "oracle" and self.audit is not None:
            self.audit.offer(self, incoming, q, cert)  # a background re-check of a sample (never blocks)
        return q, logvar, consulted, version, n_learned, cert, uncertain

    def _screen(self, incoming: dict[str, Family], wait: bool):
        """mode=predict under the shared lock (``wait=False``: WouldBlock rather than wait): the
        learned answer, its certificates (the threshold in force, set by screen_certified) and the
        rows the just-in-time rule would consult."""
        n = len(next(iter(incoming.values())))
        with self.lock.read(blocking=wait):
            try:
                q, cert, uncertain = self.jit.screen_certified(incoming)
            except NUMERIC_ERRORS as exc:
                raise Unprocessable(str(exc)) from None
            version = self.version
        return q, cert.log_var, np.zeros(n, dtype=bool), version, 0, cert, np.asarray(uncertain).reshape(-1)

    def _predict(self, incoming: dict[str, Family], mode: str):
        """mode=oracle or mode=jit: ``(belief, log_var or None, consulted, version, n_learned, certificates)``."""
        jit = self.jit
        n = len(next(iter(incoming.values())))
        if mode == "oracle":
            # the importance sampler draws from a generator that is part of the state
            ctx = (self.lock.write() if isinstance(jit.oracle, (ImportanceSamplingOracle, MessageImportanceSampler))
                   else self.lock.read())
            with ctx:
                try:
                    q, cert = certified(self.jit.oracle, incoming, self.jit.to)
                    cert = cert.with_(threshold=self.jit.threshold)
                except (OracleError, *NUMERIC_ERRORS) as exc:
                    raise OracleFailure(str(exc)) from None
                version = self.version
            return q, None, np.ones(n, dtype=bool), version, 0, cert
        if self.shared is not None:
            return self._predict_jit_shared(incoming)
        # jit
        with self.lock.write():
            jit = self.jit
            consulted = None
            try:
                # on an oracle failure nothing was learned and JITOperator.predict leaves the
                # counters as they were
                q, cert = jit.certified(incoming, jit.to)
                logvar, consulted = cert.log_var, cert.source != "learned"
            except OracleError as exc:
                raise OracleFailure(str(exc)) from None
            except NUMERIC_ERRORS as exc:  # JITOperator.predict is atomic: nothing learned or counted
                raise Unprocessable(str(exc)) from None
            except Exception as exc:
                self._recover(f"a just-in-time request failed ({type(exc).__name__}: {exc})")
                raise
            rec, n_learned = self._jit_record(incoming, q)
            if rec is not None:
                rec["counters"] = jit.raw_counters()
                self._commit(rec, apply=None)  # JITOperator.predict already learned the pairs
            version = self.version
        return q, logvar, consulted, version, n_learned, cert

    def _jit_record(self, incoming, q):
        """``(record, n)`` of the pairs the last jit request learned — in the order learned, with
        the sizes of its rounds when there were several (replayed round by round) — or
        ``(None, 0)`` if it learned nothing."""
        groups = self.jit.last_learned_groups_
        if not groups:
            return None, 0
        idx = np.concatenate(groups)
        flat = {v: m.ravel() for v, m in incoming.items()}
        rec = {"seq": self.version + 1, "kind": "jit", "time": time.time(),
               "incoming": {v: _params_json(m[idx]) for v, m in flat.items()},
               "beliefs": _params_json(q.ravel()[idx])}
        if len(groups) > 1:
            rec["groups"] = [int(len(g)) for g in groups]
        return rec, int(idx.size)

    def _predict_jit_shared(self, incoming):
        """``jit`` on a replica: answer and learn as a standalone server does (greedy selection
        learns in rounds), then place the learned pairs in the shared log; if another replica's
        record took that place first, undo, apply it, and answer again."""
        rid = uuid.uuid4().hex
        with self.lock.write():
            for _ in range(self.MAX_APPEND_ATTEMPTS):
                try:
                    self._catch_up()
                except SharedLogError as exc:
                    raise PersistError(f"the shared store is unavailable: {exc}") from exc
                jit = self.jit
                try:
                    q, cert = jit.certified(incoming, jit.to, revertible=True)
                    logvar, consulted = cert.log_var, cert.source != "learned"
                except OracleError as exc:  # nothing was learned or counted
                    raise OracleFailure(str(exc)) from None
                except NUMERIC_ERRORS as exc:
                    raise Unprocessable(str(exc)) from None
                rec, n_learned = self._jit_record(incoming, q)
                if rec is None:
                    return q, logvar, consulted, self.version, 0, cert
                rec["rid"] = rid
                ok, found = self._place(rec, before_catch_up=jit.revert_last_)
                if found is not None:  # it landed after all; the catch-up applied it from the log
                    return q, logvar, consulted, self.version, n_learned, cert
                if ok:  # learned already, exactly as the record replays
                    self._account(rec, n_learned)
                    self.last_rid = rid
                    self._applied_shared()
                    return q, logvar, consulted, self.version, n_learned, cert
                jit.revert_last_()  # another replica's update came first
            raise PersistError(f"the shared log of {self.name!r} kept changing: {self.MAX_APPEND_ATTEMPTS} appends "
                               f"were refused; nothing was learned")

    def _observe_shared(self, incoming, beliefs, key, body_hash):
        n = len(beliefs)
        dup = []

        def make():
            if key is not None and key in self.keys:
                h, seq, n0 = self.keys[key]
                if h != body_hash:
                    raise Conflict("this Idempotency-Key was used before with a different request body")
                dup.append((seq, n0))
                return None
            rec = {"kind": "observe", "time": time.time(),
                   "incoming": {v: _params_json(m) for v, m in incoming.items()}, "beliefs": _params_json(beliefs)}
            if key is not None:
                rec["key"], rec["body_hash"] = key, body_hash
            return rec

        with self.lock.write():
            rec = self._commit_shared(make, uuid.uuid4().hex)
            if rec is None:
                return dup[0][0], dup[0][1], True
            return int(rec["seq"]), n, False

    def observe(self, incoming: dict[str, Family], beliefs: Family, key: str | None, body_hash: str | None):
        """Add pairs; returns ``(version, n_accepted, duplicate)``."""
        if self.shared is not None:
            return self._observe_shared(incoming, beliefs, key, body_hash)
        n = len(beliefs)
        if n >= ASIDE_ROWS:
            return self._observe_aside(incoming, beliefs, key, body_hash)
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

    def audit_update(self, incoming: dict[str, Family], beliefs: Family, make_payload) -> int | None:
        """Learn audited pairs (the oracle's beliefs) with their audit statistics, durably: one
        ``audit`` record, in the log (or the shared log) before it is applied and counted — the
        same path as observations.  ``make_payload(stats, threshold)`` builds the record's ``audit``
        part under the exclusive lock (the threshold decision sees every earlier audit).  Returns
        the version."""
        def make():
            return {"kind": "audit", "time": time.time(),
                    "incoming": {v: _params_json(m) for v, m in incoming.items()}, "beliefs": _params_json(beliefs),
                    "audit": make_payload(self.audit_stats, float(self.jit.threshold))}

        with self.lock.write():
            if self.shared is not None:
                rec = self._commit_shared(make, uuid.uuid4().hex)
            else:
                rec = make()
                rec["seq"] = self.version + 1
                self._commit(rec, apply=lambda: self.jit.operator.partial_fit(incoming, beliefs))
            version = self.version
        change = rec.get("audit", {}).get("threshold_change") if rec else None
        if change:
            log.warning("operator %s (version %d): %s", self.name, version, change["reason"])
        return version

    def _observe_aside(self, incoming, beliefs, key, body_hash):
        """``observe`` for a long update: the same record and the same ``partial_fit`` (so the same
        state, bit for bit) on a copy of the operator while predictions go on with the current one;
        the copy replaces it, exclusively for an instant, once the record is on disk."""
        n = len(beliefs)
        with self.lock.update():
            if key is not None and key in self.keys:
                h, seq, n0 = self.keys[key]
                if h != body_hash:
                    raise Conflict("this Idempotency-Key was used before with a different request body")
                return seq, n0, True
            rec = {"seq": self.version + 1, "kind": "observe", "time": time.time(),
                   "incoming": {v: _params_json(m) for v, m in incoming.items()}, "beliefs": _params_json(beliefs)}
            if key is not None:
                rec["key"], rec["body_hash"] = key, body_hash
            new = copy.deepcopy(self.jit)
            try:
                new.operator.partial_fit(incoming, beliefs)
            except NUMERIC_ERRORS as exc:  # nothing changed: the served operator is untouched
                raise Unprocessable(str(exc)) from exc
            try:
                self._append(rec)
            except PersistError:
                with self.lock.upgrade():
                    self._recover("an update could not be written")
                raise
            with self.lock.upgrade():
                self.jit = new
                self._account(rec, n)
                if self.n_log_records >= self.store.snapshot_every:
                    self._rotate()
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
                "oracle": {"kind": oracle_kind(jit.oracle)},
                "audit": {"enabled": self.audit is not None and not isinstance(jit.oracle, ClientOracle),
                          "audited_pairs": self.audited_pairs,
                          **self.audit_stats.summary(self.audit.kl_target if self.audit is not None else None),
                          "server": self.audit.summary() if self.audit is not None else None},
                "threshold_note": (self.audit_stats.threshold_changes[-1]["reason"]
                                   if self.audit_stats.threshold_changes else None),
                "counters": jit.counters(),
                "updates": {"version": self.version, "observed_pairs": self.observed_pairs,
                            "learned_pairs": self.learned_pairs, "audited_pairs": self.audited_pairs,
                            "log_generation": self.gen,
                            "records_since_snapshot": self.version - self.snapshot_version},
                "training": self.meta.get("training", {}),
                "source": self.meta.get("source", {}),
                "created": self.meta.get("created"),
                "kjit_version": self.meta.get("kjit_version"),
            })
            if self.shared is not None:
                d["replication"] = {"shared_store": self.shared.url, "base_sha256": self.base_hash,
                                    "version": self.version}
        return d


# ------------------------------------------------------------------------------ the store
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
        for p in self.operators_dir.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)  # an interrupted creation
        with self._lock:
            self.loading = {p.name for p in self.operators_dir.iterdir() if p.is_dir()}
            if self.shared is not None:  # operators other replicas published are adopted when loading
                self.loading |= set(self.shared.names())
        self._snap_thread = threading.Thread(target=self._snapshot_worker, name="kjit-snapshots", daemon=True)
        self._snap_thread.start()
        if self.shared is not None and self.merge_interval > 0:
            self._merge_thread = threading.Thread(target=self._merge_worker, name="kjit-merge", daemon=True)
            self._merge_thread.start()

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
            entry.load()
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
        raise NotFound(f"unknown operator {name!r}; known: {known}")

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
        entry.load()
        with self._lock:
            self.entries[name] = entry
            self.failed.pop(name, None)
            self.missing_factors.pop(name, None)
        return entry


def oracle_kind(oracle) -> str:
    """The name a request uses for this oracle (``source.oracle`` of ``POST /v1/operators``)."""
    if isinstance(oracle, ClientOracle):
        return "client"
    if isinstance(oracle, MessageImportanceSampler):
        return "message_sampler"
    if isinstance(oracle, ImportanceSamplingOracle):
        return "importance_sampling"
    return "quadrature"


def _counters_changed(entry: Entry) -> bool:
    now = entry.jit.raw_counters()
    return now != getattr(entry, "_counters_at_snapshot", None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def body_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
