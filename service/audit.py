"""The continuous accuracy audit (issue 20): served answers re-checked against the oracle.

With ``KJIT_AUDIT_RATE`` = r > 0, each learned answer a served operator gives (``mode=predict`` and
the rows of ``mode=jit`` the oracle did not answer) is picked for audit with probability r — with a
token configured, only from requests that carry it (the audit learns and may lower the threshold).  The
request only copies the picked rows into a bounded queue (``KJIT_AUDIT_QUEUE`` rows; when it is
full the rows are dropped and counted, never waited for) — after its answer was computed, so the
audit cannot change or delay it.  One background thread per server:

1. takes up to ``KJIT_AUDIT_BATCH`` queued rows of one operator (waiting up to 1 s for the batch to
   fill: the oracle's fixed cost per call, the record and its fsync are paid once per batch — measured,
   batches of 1–2 rows cost ~11 ms of quadrature set-up each) and asks a private copy of the
   operator's oracle (a sampler's generator is part of the served state: the copy draws from its
   own) for their beliefs;
2. computes KL[oracle ‖ served] per row;
3. learns the audited pairs through the durable update path of the store: one ``audit`` record in
   the operator's log (or the shared log of replicas) holding the pairs, their KLs, the log
   variances and whether each answer was confident, and the threshold decision — applied and fsync'ed
   under the operator's exclusive lock before anything counts (:meth:`service.store.Entry.audit_update`);
   the statistics are rebuilt from the records on restart and kept in snapshots;
4. sleeps so that its CPU time stays within ``KJIT_AUDIT_CPU_SHARE`` of one core (after a batch
   that took c CPU seconds and w wall seconds, it sleeps c / share − w).

Drift.  The audited KLs of *confident* answers (learned, served as confident, log variance ≤ the
threshold in force when their record is made) since the threshold last changed form a window; once it holds ``KJIT_AUDIT_MIN_AUDITS`` answers and its 95th
percentile exceeds ``KJIT_AUDIT_KL_TARGET``, the threshold is lowered (more consultation): to the
largest log variance at which the window's answers at or below it have a 95th percentile KL within
the target — and at least ``THRESHOLD_STEP`` below the current one — or, when no such cut holds
5 answers, to ``THRESHOLD_STEP`` below the window's smallest log variance; never below the operator's
noise floor (:meth:`kjit.operators.JITOperator.threshold_floor`: below it the oracle would answer
every request — the first run of benchmarks/audit.py without the floor went to 100 % consultation).  The change is written in
the record, logged (warning) and listed in the operator's description (``audit.threshold_changes``).
The threshold is never raised by the audit.

Statistics per operator (``GET /v1/operators/{name}`` → ``audit``, and ``/metrics``): count, mean,
max (all audits), p95 and a log10-KL histogram (the last ``RECENT`` audits), the share above the
target (all audits; each audit is compared with the target in force when it was made), and the
recent audits themselves (time, version, KL, confident) for plots.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from kjit.certificates import Certificates, certified
from kjit.errors import rows_within
from kjit.operators import respect_factor_bounds
from kjit.families import Family
from kjit.oracles import ClientOracle

log = logging.getLogger("kjit.service.audit")

__all__ = ["AuditStats", "Auditor", "propose_threshold", "THRESHOLD_STEP", "RECENT"]

RECENT = 1000           # audits kept (p95, histogram, plot)
WINDOW = 200            # confident audits since the last threshold change considered for drift
THRESHOLD_STEP = 0.5    # the least a drift lowers the threshold by (log variance units)
HIST_EDGES = tuple(float(x) for x in np.arange(-8.0, 2.01, 0.5))  # log10 KL bins


def propose_threshold(u: np.ndarray, kl: np.ndarray, threshold: float, target: float, min_audits: int,
                      floor: float = -np.inf):
    """``(new threshold, p95)`` if the confident audits ``(u, kl)`` (log variance, KL) drift above
    ``target``, else ``(None, p95)`` (see the module docstring).  Never below ``floor`` (the operator's
    :meth:`~kjit.operators.JITOperator.threshold_floor`: below it the oracle would answer everything);
    at the floor already: ``(None, p95)``."""
    u, kl = np.asarray(u, float), np.asarray(kl, float)
    if kl.size < max(int(min_audits), 1):
        return None, (float(np.quantile(kl, 0.95)) if kl.size else None)
    p95 = float(np.quantile(kl, 0.95))
    if not p95 > target:
        return None, p95
    if not threshold > floor:
        return None, p95
    order = np.argsort(u)
    us, ks = u[order], kl[order]
    # the 95th percentile of every prefix (the answers at or below each cut), in one call
    n = len(us)
    srt = np.sort(np.where(np.tri(n, dtype=bool), ks[None, :], np.inf), axis=1)  # row i: prefix i sorted
    h = 0.95 * np.arange(n)                      # np.quantile's (linear) position in a prefix of i + 1
    lo = np.floor(h).astype(int)
    hi = np.minimum(lo + 1, np.arange(n))
    rows = np.arange(n)
    q95 = srt[rows, lo] + (h - lo) * (srt[rows, hi] - srt[rows, lo])
    cut = np.append(us[:-1] < us[1:], True) & (np.arange(n) >= 4)  # cuts holding at least 5 answers
    ok = np.flatnonzero(cut & (q95 <= target))
    best = float(us[ok[-1]]) if ok.size else None
    new = (min(best, threshold - THRESHOLD_STEP) if best is not None
           else min(threshold, float(us[0])) - THRESHOLD_STEP)
    new = max(new, floor)
    if not new < threshold:
        return None, p95
    return float(new), p95


class AuditStats:
    """Running audit statistics of one operator, folded from its ``audit`` records (deterministic:
    a replay of the records gives the same statistics)."""

    def __init__(self):
        self.count = 0
        self.sum_kl = 0.0
        self.max_kl = 0.0
        self.above = 0
        self.confident = 0
        self.confident_above = 0
        self.records = 0
        self.recent: deque = deque(maxlen=RECENT)    # (time, version, kl, confident)
        self.window: deque = deque(maxlen=WINDOW)    # (log var, kl) of confident audits since the last change
        self.threshold_changes: list[dict] = []      # the last 20

    # ---------------------------------------------------------------- records
    def fold(self, audit: dict, version: int) -> None:
        """Add one ``audit`` record's payload (see :meth:`Auditor._record_payload`)."""
        kl = np.asarray(audit["kl"], float)
        conf = np.asarray(audit["confident"], bool)
        u = np.array([np.nan if x is None else x for x in audit["log_var"]], float)
        target = float(audit["target"])
        # each row's serving version and time (records before the twenty-first session: the record's)
        n = kl.size
        versions = audit.get("served_version") or [int(version)] * n
        times = audit.get("served_time") or [float(audit.get("time", 0.0))] * n
        # the window: confident under the threshold in force when the record was made (decided then, in
        # the record; earlier records: confident when served)
        in_window = np.asarray(audit["in_window"], bool) if "in_window" in audit else conf
        self.records += 1
        self.count += int(kl.size)
        self.sum_kl += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max(initial=0.0)))
        self.above += int(np.count_nonzero(kl > target))
        self.confident += int(np.count_nonzero(conf))
        self.confident_above += int(np.count_nonzero(conf & (kl > target)))
        for t, v, k, c in zip(times, versions, kl.tolist(), conf.tolist()):
            self.recent.append((float(t), int(v), float(k), bool(c)))
        for uu, k in zip(u[in_window].tolist(), kl[in_window].tolist()):
            self.window.append((float(uu), float(k)))
        change = audit.get("threshold_change")
        if change:
            self.threshold_changes = (self.threshold_changes + [dict(change, version=int(version))])[-20:]
            self.window.clear()

    # ---------------------------------------------------------------- persistence (snapshots)
    def state(self) -> dict:
        return {"count": self.count, "sum_kl": self.sum_kl, "max_kl": self.max_kl, "above": self.above,
                "confident": self.confident, "confident_above": self.confident_above, "records": self.records,
                "recent": [list(r) for r in self.recent], "window": [list(w) for w in self.window],
                "threshold_changes": self.threshold_changes}

    @classmethod
    def from_state(cls, d: dict | None) -> "AuditStats":
        s = cls()
        if not d:
            return s
        for k in ("count", "above", "confident", "confident_above", "records"):
            setattr(s, k, int(d.get(k, 0)))
        s.sum_kl, s.max_kl = float(d.get("sum_kl", 0.0)), float(d.get("max_kl", 0.0))
        s.recent.extend((float(t), int(v), float(k), bool(c)) for t, v, k, c in d.get("recent", []))
        s.window.extend((float(u), float(k)) for u, k in d.get("window", []))
        s.threshold_changes = list(d.get("threshold_changes", []))
        return s

    # ---------------------------------------------------------------- description
    def summary(self, target: float | None = None) -> dict:
        kl = np.array([r[2] for r in self.recent], float)
        with np.errstate(divide="ignore"):
            lk = np.log10(np.maximum(kl, 1e-300))
        counts, _ = np.histogram(np.clip(lk, HIST_EDGES[0], HIST_EDGES[-1]), bins=np.array(HIST_EDGES))
        return {
            "count": self.count,
            "mean_kl": self.sum_kl / self.count if self.count else None,
            "p95_kl": float(np.quantile(kl, 0.95)) if kl.size else None,
            "max_kl": self.max_kl if self.count else None,
            "share_above_target": self.above / self.count if self.count else None,
            "confident": self.confident,
            "confident_share_above_target": self.confident_above / self.confident if self.confident else None,
            "kl_target": target,
            "records": self.records,
            "window": {"n": len(self.window),
                       "p95_kl": float(np.quantile([w[1] for w in self.window], 0.95)) if self.window else None},
            "histogram_log10_kl": {"edges": list(HIST_EDGES), "counts": counts.astype(int).tolist()},
            "recent": {"time": [r[0] for r in self.recent], "version": [r[1] for r in self.recent],
                       "kl": [r[2] for r in self.recent], "confident": [r[3] for r in self.recent]},
            "threshold_changes": list(self.threshold_changes),
        }


class _Item:
    __slots__ = ("entry", "incoming", "served", "log_var", "confident", "version", "time")

    def __init__(self, entry, incoming, served, log_var, confident, version, when):
        self.entry, self.incoming, self.served = entry, incoming, served
        self.log_var, self.confident, self.version, self.time = log_var, confident, version, when

    def __len__(self) -> int:
        return len(self.served)

    def split(self, k: int) -> tuple["_Item", "_Item"]:
        """The first ``k`` rows and the rest."""
        a, b = slice(0, k), slice(k, None)
        return tuple(_Item(self.entry, {v: m[r] for v, m in self.incoming.items()}, self.served[r], self.log_var[r],
                           self.confident[r], self.version, self.time) for r in (a, b))


class Auditor:
    """The background audit of a server's operators (see the module docstring)."""

    def __init__(self, rate: float, cpu_share: float = 0.1, kl_target: float = 0.01, min_audits: int = 20,
                 max_queue: int = 1000, batch: int = 64, linger: float = 1.0, seed=None):
        if not 0 < rate <= 1:
            raise ValueError(f"the audit rate must lie in (0, 1], got {rate!r}")
        if not 0 < cpu_share <= 1:
            raise ValueError(f"the audit CPU share must lie in (0, 1], got {cpu_share!r}")
        self.rate = float(rate)
        self.cpu_share = float(cpu_share)
        self.kl_target = float(kl_target)
        self.min_audits = int(min_audits)
        self.batch = int(batch)
        self.linger = float(linger)  # seconds the worker waits for a batch to fill
        self._q: queue.Queue = queue.Queue()
        self._queued = 0          # rows in the queue (bounded by max_queue)
        self.max_queue = int(max_queue)
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self._oracles: dict[str, Any] = {}
        self._busy = 0             # batches being processed (drain())
        self.cpu_seconds = 0.0     # CPU time of the audit thread's work
        self.sleep_seconds = 0.0   # time slept to keep within the CPU share
        self.offered = 0           # learned answers offered
        self.picked = 0            # rows picked for audit
        self.dropped = 0           # picked rows dropped: queue full
        self.failed = 0            # rows the oracle could not answer (not audited)
        self._batch_failed = 0     # of the batch in hand, rows counted in `failed` already (_fail)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the request side (never blocks)
    def offer(self, entry, incoming: dict[str, Family], q: Family, cert: Certificates) -> int:
        """Pick learned rows of an answer already computed for audit; returns how many were queued."""
        learned = np.flatnonzero(cert.source == "learned")
        if learned.size == 0 or isinstance(entry.jit.oracle, ClientOracle):
            return 0
        with self._lock:
            pick = learned[self._rng.random(learned.size) < self.rate]
            self.offered += int(learned.size)
            if pick.size == 0:
                return 0
            self.picked += int(pick.size)
            room = self.max_queue - self._queued
            if room <= 0:
                self.dropped += int(pick.size)
                return 0
            if pick.size > room:
                self.dropped += int(pick.size - room)
                pick = pick[:room]
            self._queued += int(pick.size)
        # copies of the picked rows (fancy indexing): nothing the response holds is shared
        item = _Item(entry, {v: m.ravel()[pick] for v, m in incoming.items()}, q.ravel()[pick],
                     np.array(cert.log_var[pick]), np.array(cert.confident[pick]), cert.version, time.time())
        self._q.put_nowait(item)
        return int(pick.size)

    # ---------------------------------------------------------------- the worker
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kjit-audit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued row was audited (tests, benchmarks)."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            with self._lock:
                if self._queued == 0 and self._busy == 0:
                    return True
            time.sleep(0.01)
        return False

    def _take(self):
        """Up to ``batch`` queued rows of one operator (the first item's)."""
        first = self._q.get()
        if first is None:
            return None
        with self._lock:
            self._busy += 1
        items, rest = [first], []
        if len(first) > self.batch:  # (a request's rows beyond the batch wait for the next one, in front)
            first, later = first.split(self.batch)
            items, rest = [first], [later]
        n = len(first)
        # linger: a batch of rows costs the oracle's fixed cost, one record and one fsync once
        deadline = time.monotonic() + self.linger
        while n < self.batch:
            try:
                it = self._q.get(timeout=max(deadline - time.monotonic(), 0.0)) if not self._stop.is_set() \
                    else self._q.get_nowait()
            except queue.Empty:
                break
            if it is None:
                self._q.put(None)
                break
            if it.entry is first.entry:
                if n + len(it) > self.batch:  # at most KJIT_AUDIT_BATCH rows a record (found by an audit:
                    it, later = it.split(self.batch - n)  # a 300-row request made one record of 310)
                    rest.append(later)
                items.append(it)
                n += len(it)
            else:
                rest.append(it)
        self._requeue(rest)
        return items

    def _requeue(self, items) -> None:
        """Put items back in front of the queue, in their order (the queue's own lock: FIFO kept)."""
        if not items:
            return
        with self._q.mutex:
            self._q.queue.extendleft(reversed(items))
            self._q.not_empty.notify()

    def _run(self) -> None:
        while not self._stop.is_set():
            items = self._take()
            if items is None:
                return
            n = sum(len(it) for it in items)
            c0, w0 = time.thread_time(), time.monotonic()
            self._batch_failed = 0  # rows of this batch _audit counted as failed already
            try:
                self._audit(items)
            except Exception:  # noqa: BLE001 - the audit must never take the server down
                log.exception("audit of %s failed", items[0].entry.name)
                with self._lock:  # (the rest: picked == audited + dropped + queued + failed — found in review)
                    self.failed += n - self._batch_failed
            finally:
                c, w = time.thread_time() - c0, time.monotonic() - w0
                with self._lock:
                    self._queued -= n
                    self._busy -= 1
                    self.cpu_seconds += c
            pause = c / self.cpu_share - w
            if pause > 0:
                self.sleep_seconds += pause
                self._stop.wait(pause)

    def _oracle(self, entry):
        """A private copy of the operator's oracle (its own generator) — made once per operator."""
        o = self._oracles.get(entry.name)
        if o is None:
            with entry.lock.read():
                o = copy.deepcopy(entry.jit.oracle)
            if hasattr(o, "_rng"):
                o._rng = np.random.default_rng()
                if hasattr(o, "_pool"):
                    o._pool, o._pool_calls = None, 0
            self._oracles[entry.name] = o
        return o

    def _audit(self, items) -> None:
        entry = items[0].entry
        fam = entry.jit.family
        inc = {v: type(items[0].incoming[v]).concatenate([it.incoming[v] for it in items]) for v in items[0].incoming}
        served = fam.concatenate([it.served for it in items])
        log_var = np.concatenate([it.log_var for it in items])
        confident = np.concatenate([it.confident for it in items])
        version = np.concatenate([np.full(len(it), -1 if it.version is None else int(it.version)) for it in items])
        when = np.concatenate([np.full(len(it), float(it.time)) for it in items])
        oracle = self._oracle(entry)
        keep = np.arange(len(served))
        for attempt in range(2):
            sub = {v: m[keep] for v, m in inc.items()} if keep.size < len(served) else inc
            try:
                with np.errstate(all="ignore"):
                    truth, _ = certified(oracle, sub, entry.jit.to, unknown_source="oracle")
                    # what the just-in-time path learns: an answer on the wrong side of the factor's
                    # bound moved onto it (found by an audit: a sampler's beliefs wider than the incoming
                    # message were learned as they were)
                    truth = respect_factor_bounds(entry.jit.factor, entry.jit.to, {v: m.ravel() for v, m in sub.items()},
                                                  truth.ravel())[0]
                    kl = np.asarray(truth.kl(served[keep]), float).ravel()
                break
            except Exception as exc:  # noqa: BLE001 - e.g. a low ESS: these rows cannot be audited
                rows = getattr(exc, "rows", None)
                bad = rows_within(rows, keep.size)
                if attempt == 0 and bad is not None and 0 < bad.size < keep.size:
                    # the rows the oracle refused, by name: the others are audited (found by an audit: one
                    # refused row of another client failed the whole batch — the audit could be blinded)
                    log.info("audit of %s: the oracle could not answer %d row(s): %s", entry.name, bad.size, exc)
                    self._fail(int(bad.size))
                    keep = np.delete(keep, bad)
                    continue
                log.info("audit of %s: the oracle could not answer %d row(s): %s", entry.name, keep.size, exc)
                self._fail(int(keep.size))
                return
        inc = {v: m[keep] for v, m in inc.items()} if keep.size < len(served) else inc
        log_var, confident, version, when = log_var[keep], confident[keep], version[keep], when[keep]
        ok = np.isfinite(kl) & np.asarray(truth.is_proper, bool).ravel()
        if not ok.all():
            self._fail(int(np.count_nonzero(~ok)))
            if not ok.any():
                return
            inc = {v: m[ok] for v, m in inc.items()}
            truth, kl, log_var, confident, version, when = (truth[ok], kl[ok], log_var[ok], confident[ok], version[ok],
                                                            when[ok])
        u = np.max(log_var, axis=1)
        entry.audit_update(inc, truth, lambda stats, threshold: self._payload(entry, stats, threshold, kl, u,
                                                                              confident, version, when))

    def _fail(self, n: int) -> None:
        """Count ``n`` rows of the batch in hand as failed (not audited)."""
        with self._lock:
            self.failed += n
        self._batch_failed += n

    def _payload(self, entry, stats: AuditStats, threshold: float, kl, u, confident, version=None, when=None) -> dict:
        """The ``audit`` part of the record, decided under the operator's exclusive lock."""
        now = time.time()
        # the window holds answers confident under the threshold in force now: answers served as confident
        # under an earlier, higher one are not evidence against this one (found by an audit: rows queued
        # when the audit lowered the threshold lowered it again, on answers the new one would not give)
        with np.errstate(invalid="ignore"):
            in_window = np.asarray(confident, bool) & (u <= threshold)
        payload = {"kl": kl.tolist(), "log_var": [float(x) if np.isfinite(x) else None for x in u],
                   "confident": confident.tolist(), "in_window": in_window.tolist(), "target": self.kl_target,
                   "time": now}
        if version is not None:  # each row's serving version and time (not the record's)
            payload["served_version"] = [int(v) for v in version]
            payload["served_time"] = [float(t) for t in when]
        window = list(stats.window) + [(float(a), float(b)) for a, b, c in zip(u, kl, in_window) if c]
        window = window[-WINDOW:]
        floor = float(entry.jit.threshold_floor())
        new, p95 = propose_threshold(np.array([w[0] for w in window]), np.array([w[1] for w in window]),
                                     threshold, self.kl_target, self.min_audits, floor)
        if new is not None and np.isfinite(new):
            at_floor = new <= floor
            payload["threshold_change"] = {
                "time": now, "from": float(threshold), "to": float(new), "window": len(window),
                "p95_kl": p95, "kl_target": self.kl_target, "at_floor": bool(at_floor),
                "reason": (f"audited KL of confident answers drifted: p95 {p95:.3g} over the last {len(window)} "
                           f"> target {self.kl_target:g}; threshold lowered {threshold:.4g} -> {new:.4g} "
                           f"(more consultation)"
                           + ("; this is the operator's noise floor: lower, the oracle would answer everything — "
                              "if the audited KL stays above the target, retrain the operator" if at_floor else ""))}
        return payload

    def summary(self) -> dict:
        wall = max(time.monotonic() - self.started, 1e-9)
        with self._lock:
            return {"enabled": True, "rate": self.rate, "cpu_share_limit": self.cpu_share,
                    "kl_target": self.kl_target, "min_audits": self.min_audits, "offered": self.offered,
                    "picked": self.picked, "dropped": self.dropped, "failed": self.failed, "queued": self._queued,
                    "cpu_seconds": self.cpu_seconds, "cpu_share": self.cpu_seconds / wall}


class AuditCollector:
    """Prometheus metrics of the audit, collected at scrape time:

    ``kjit_audit_kl{operator, stat}`` (mean | p95 | max), ``kjit_audit_count{operator}``,
    ``kjit_audit_share_above_target{operator}``, ``kjit_operator_threshold{operator}``,
    ``kjit_audit_threshold_changes{operator}``, ``kjit_audit_rows{state}`` (offered | picked |
    dropped | failed) and ``kjit_audit_cpu_seconds``.
    """

    def __init__(self, store):
        self.store = store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kl = GaugeMetricFamily("kjit_audit_kl", "audited KL[oracle || served] of learned answers", labels=["operator", "stat"])
        count = GaugeMetricFamily("kjit_audit_count", "learned answers audited", labels=["operator"])
        share = GaugeMetricFamily("kjit_audit_share_above_target", "share of audited answers above the KL target",
                                  labels=["operator"])
        thr = GaugeMetricFamily("kjit_operator_threshold", "the operator's JIT threshold (log predictive variance)",
                                labels=["operator"])
        changes = GaugeMetricFamily("kjit_audit_threshold_changes", "threshold changes the audit made (last 20 kept)",
                                    labels=["operator"])
        for name, e in dict(self.store.entries).items():
            st = getattr(e, "audit_stats", None)
            if st is None or e.jit is None:
                continue
            # the audit worker folds records into the statistics under the operator's exclusive
            # lock: read them under the shared one (their deques must not change while iterated)
            with e.lock.read():
                threshold, n, n_changes = float(e.jit.threshold), st.count, len(st.threshold_changes)
                s = st.summary() if n else None
            thr.add_metric([name], threshold)
            count.add_metric([name], n)
            changes.add_metric([name], n_changes)
            if s is not None:
                for stat in ("mean", "p95", "max"):
                    kl.add_metric([name, stat], float(s[f"{stat}_kl"]))
                share.add_metric([name], float(s["share_above_target"]))
        yield from (kl, count, share, thr, changes)
        aud = getattr(self.store, "audit", None)
        if aud is not None:
            rows = CounterMetricFamily("kjit_audit_rows", "learned answers offered to / picked / dropped / failed by "
                                                          "the audit", labels=["state"])
            s = aud.summary()
            for k in ("offered", "picked", "dropped", "failed"):
                rows.add_metric([k], s[k])
            yield rows
            yield CounterMetricFamily("kjit_audit_cpu_seconds", "CPU time of the audit thread", value=s["cpu_seconds"])

    def describe(self):
        return []
