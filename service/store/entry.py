"""One operator of the store: its JIT operator, lock, version and bookkeeping; how it is loaded
(newest snapshot + the log after it), how a request is answered, and the records it applies.
How its updates become durable is its commit strategy (:mod:`service.store.commit`)."""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

import numpy as np

from kjit.certificates import Certificates, certified, projection_convention
from kjit.families import Family
from kjit.operators import JITOperator, KernelOperator
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler, OracleError, QuadratureOracle
from kjit.persistence import dumps_state, loads_state

from ..audit import AuditStats
from ..files import write_atomic
from ..locks import RWLock
from ..schemas import PARAM_MAX
from ..training import KL_CAP
from ..validation import NUMERIC_ERRORS, bad_output_rows
from . import describe
from .blas import one_blas_thread
from .commit import ASIDE_ROWS, Replicated, Standalone
from .errors import OracleFailure, PersistError, Unprocessable
from .idempotency import IdempotencyKeys
from .log import OperatorLog, generation as _generation
from .records import messages_from_record, pairs_record, record_rows, sha256

log = logging.getLogger("kjit.service.store")

__all__ = ["Entry"]


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except FileNotFoundError:
        return True


class Entry:
    """One operator of the store: the JIT operator, its lock, its log and its version.

    ``version`` counts the update records applied since the operator was created; every
    response carries the version it was computed from.
    """

    def __init__(self, store, name: str, path: Path):
        self.store = store
        self.name = name
        self.path = path
        self.lock = RWLock()
        self.meta: dict = json.loads((path / "meta.json").read_text())
        self.jit: JITOperator | None = None
        self.version = 0
        self.observed_pairs = 0
        self.learned_pairs = 0
        self.keys = IdempotencyKeys()
        self.log = OperatorLog(path, name, store.observe)
        self.snapshot_version = 0
        self.shared = store.shared
        self.base_hash: str | None = None  # replicas: sha256 of the shared base this state grew from
        self.last_rid: str | None = None   # replicas: id of the last shared-log record applied
        self.audit = getattr(store, "audit", None)  # service.audit.Auditor, or None (KJIT_AUDIT_RATE = 0)
        self.audit_stats = AuditStats()  # folded from the operator's audit records (service.audit)
        self.audited_pairs = 0
        self.commit = Standalone(self) if self.shared is None else Replicated(self, self.shared)

    # ---------------------------------------------------------------- loading and recovery
    def load(self) -> None:
        """(Re)build the operator from its newest snapshot and the logs after it."""
        snap, logs, stale = self.log.newest()
        snap_bytes = snap.read_bytes()
        svc = self._load_state(snap_bytes, str(snap))
        self.log.delete(stale)  # (only once the newest snapshot has loaded: until then they may be needed)
        n_replayed = 0
        for i, path in enumerate(logs):
            # the last log with records may have a torn tail (a crash mid-append) to cut; logs after it
            # that hold nothing (a rotation that failed half-way) do not make it a closed log
            n_replayed += self._replay(path, last=all(_empty(p) for p in logs[i + 1:]))
        try:
            self.log.resume(max([_generation(snap)] + [_generation(p) for p in logs]))
        except OSError as exc:  # (a read-only or full disk: served for reading; an update tries again)
            log.error("operator %s: its update log cannot be opened for appending (%s); updates answer 503 until "
                      "it can", self.name, exc)
        self._counters_at_snapshot = self.jit.raw_counters() if not n_replayed else None
        if n_replayed:
            log.info("operator %s: replayed %d update record(s) to version %d", self.name, n_replayed, self.version)
        self.commit.join(svc.get("shared_base"), snap_bytes, n_replayed)
        self._self_test()

    def _replay(self, path: Path, last: bool) -> int:
        n = 0
        for rec in self.log.read_records(path, last):
            seq = int(rec["seq"])
            if seq <= self.version:
                continue  # already in the snapshot
            if seq != self.version + 1:
                raise ValueError(f"{path}: update record {seq} follows version {self.version}: records are missing")
            self._apply_record(rec)
            n += 1
        return n

    def _self_test(self) -> None:
        self_test(self.jit)

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
        if getattr(jit, "kl_cap", None) is None and _trained_before_the_cap(self.meta):
            jit.kl_cap = KL_CAP  # (this service's policy, which its training then could not record)
            log.warning("operator %s: trained by this service before the expected-KL cap existed: served with "
                        "kl_cap %g (service.training.KL_CAP)", self.name, KL_CAP)
        svc = state.get("service", {})
        self.jit = jit
        self.version = self.snapshot_version = int(svc.get("version", 0))
        self.observed_pairs = int(svc.get("observed_pairs", 0))
        self.learned_pairs = int(svc.get("learned_pairs", 0))
        self.keys = IdempotencyKeys.from_json(svc.get("idempotency", "[]"), svc.get("idempotency_n_train"))
        self.last_rid = svc.get("shared_last_rid")
        self.audit_stats = AuditStats.from_state(json.loads(svc.get("audit", "null")))
        self.audited_pairs = int(svc.get("audited_pairs", 0))
        return svc

    def _recover(self, why: str, counters: dict | None = None, recorded: bool = False) -> None:
        """Rebuild the operator from the store after a failed update.  ``counters``: the JIT counters
        to keep (default: those in memory, which count the requests that succeeded — a failed jit
        request passes the ones from before it, as it counted itself already; found in review:
        a 503 'nothing was learned' request stayed counted, and became durable with the next record).
        A rebuild that fails is a PersistError (503), whose outcome is unknown when the update's
        record was already placed (``recorded``: a replica's, in the shared log)."""
        log.error("operator %s: %s; rebuilding it from the store", self.name, why)
        # those on disk only reach the last snapshot or jit record
        if counters is None:
            counters = self.jit.raw_counters() if self.jit is not None else None
        try:
            self.load()
            if counters is not None:
                self.jit.set_counters(counters)
        except Exception as exc:  # the disk no longer holds a loadable state
            log.exception("operator %s: could not be rebuilt", self.name)
            self.fail(f"could not be rebuilt after: {why}")
            raise PersistError(f"{why}; the operator could not be rebuilt from the store ({type(exc).__name__}) and "
                               f"is reported failed", unknown=recorded) from exc

    # ---------------------------------------------------------------- replicas' bases (commit.Replicated)
    def base_blob(self) -> bytes:
        """This operator's current state as a shared base: version 0, its meta inside."""
        state = self.jit.state_dict()
        state["service"] = {"version": 0, "observed_pairs": 0, "learned_pairs": 0, "idempotency": "[]",
                            "meta": json.dumps(self.meta, default=str)}
        return dumps_state("JITOperator", state)

    def renamed(self) -> bool:
        """This operator's directory was renamed by hand (its meta still names the operator it was
        created or adopted as): a new operator, whose state may be published under the new name."""
        return self.meta.get("name", self.name) != self.name

    def take_name(self) -> None:
        """A renamed operator about to be published: its meta names it as it is served now."""
        self.meta["name"] = self.name
        write_atomic(self.path / "meta.json", json.dumps(self.meta, indent=1, default=str).encode())

    def restart_at_base(self, blob: bytes) -> None:
        """This state was just published as the shared base: it is version 0 of the shared log.  Its
        local snapshot is written now (found in review: a restart before the next update loaded the
        standalone snapshot again, which the shared store then refused as another copy), and the audit
        statistics start from zero, as on every other replica (the base does not carry them)."""
        self.version = self.snapshot_version = 0
        self.observed_pairs = self.learned_pairs = 0
        self.audited_pairs = 0
        self.audit_stats = AuditStats()
        self.keys.clear()
        self.last_rid = None
        self.base_hash = sha256(blob)
        data = self._snapshot_bytes()
        self.log.write_snapshot(self.log.next_generation(), data)

    def adopt_base(self, blob: bytes, source: str) -> None:
        """Start from another replica's base (and its creator's description of the operator)."""
        svc = self._load_state(blob, source)
        if "meta" in svc:
            self.meta = json.loads(svc["meta"])
            write_atomic(self.path / "meta.json", json.dumps(self.meta, indent=1, default=str).encode())
        self.log.n_records = self.store.snapshot_every

    # ---------------------------------------------------------------- records
    def _apply_record(self, rec) -> None:
        self._account(rec, self._learn_record(self.jit, rec))
        self.last_rid = rec.get("rid")

    def _learn_record(self, jit, rec) -> int:
        """Learn the pairs of the record ``rec`` into ``jit`` (the served JIT, or a copy to be served) as they were
        learned when it was made; returns how many."""
        inc, bel = messages_from_record(jit, rec)
        sizes = [int(g) for g in rec.get("groups", [len(bel)])] if len(bel) else []  # (an audit that learned nothing)
        if sum(sizes) != len(bel) or (sizes and min(sizes) < 1):
            raise ValueError(f"record {rec.get('seq')}: groups {sizes} for {len(bel)} beliefs")
        start = 0
        with one_blas_thread():  # (as the update was learned: bit for bit)
            for size in sizes:  # one partial_fit per group, as the operator learned them
                sl = slice(start, start + size)
                # (acknowledged pairs: learned as they were, whatever today's range check says)
                jit.operator.partial_fit({v: m[sl] for v, m in inc.items()}, bel[sl], check_range=False)
                start += size
        if rec.get("oracle_state") and rec.get("rid") is None:
            # this server's own jit record: its sampler goes on from where the request left it, as it did
            # before the restart (found in review: after kill -9 it redrew particles already used).  Not on
            # live commits (the state is the live one) nor other replicas' records (generators are per replica)
            jit.set_oracle_state(rec["oracle_state"])
        return len(bel)

    def _account(self, rec, n: int) -> None:
        """Count the applied record ``rec`` (``n`` pairs learned) and make its seq the version; the
        operator's pairs at that version go into ``rec["n_train"]`` (after the record was written:
        what the update's answer reports) and with its idempotency key."""
        self.version = int(rec["seq"])
        rec["n_train"] = int(self.jit.operator.n_train_)
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
            self.keys.remember(rec["key"], rec.get("body_hash", ""), int(rec["seq"]), n, rec["n_train"])

    # ---------------------------------------------------------------- snapshots
    def _snapshot_if_due(self) -> None:
        """Hand the state to the snapshot writer every ``snapshot_every`` records (lock held).  Called
        after an update is durable: a rotation that fails (no file descriptor, a full disk) must not
        turn that update's answer into an error — it is logged, appending goes on in the generation
        that holds every record, and the rotation is tried again after the next record."""
        if self.log.n_records >= self.store.snapshot_every:
            gen = self.log.gen
            try:
                self._rotate()
            except Exception as exc:  # noqa: BLE001 - the update is durable; only the rotation failed
                log.error("operator %r: could not start log generation %d (%s: %s); the update is durable in "
                          "generation %d, the rotation will be retried", self.name, gen + 1, type(exc).__name__,
                          exc, gen)
                try:  # (whatever step failed: generation gen, open for appending, and no empty gen + 1)
                    self.log.abandon_generation(gen)
                except OSError as exc2:  # the next append reports it (PersistError: 503, nothing lost)
                    log.error("operator %r: could not reopen log generation %d (%s)", self.name, gen, exc2)

    def _rotate(self) -> None:
        """Start log G+1 and hand the state at this point to the snapshot writer (lock held)."""
        t = time.perf_counter()
        gen = self.log.next_generation()  # (first: if it fails, nothing else has changed)
        data = self._snapshot_bytes()
        self.store.observe("snapshot_serialise", time.perf_counter() - t)
        # (last: once queued, snapshot-gen will be written, and log-gen must stay — the records go there)
        self.store._enqueue_snapshot(self, gen, data)

    def _snapshot_bytes(self) -> bytes:
        state = self.jit.state_dict()
        keys, key_counts = self.keys.to_json()
        state["service"] = {
            "version": self.version, "observed_pairs": self.observed_pairs, "learned_pairs": self.learned_pairs,
            "idempotency": keys, "idempotency_n_train": key_counts,
            "audit": json.dumps(self.audit_stats.state()), "audited_pairs": self.audited_pairs,
        }
        if self.base_hash is not None:
            state["service"]["shared_base"] = self.base_hash
            if self.last_rid is not None:
                state["service"]["shared_last_rid"] = self.last_rid
        data = dumps_state("JITOperator", state)
        self.snapshot_version = self.version  # (once the bytes exist: a failed serialisation leaves them)
        self._counters_at_snapshot = dict(state["counters"])
        return data

    def snapshot_now(self) -> None:
        """Write a snapshot synchronously if anything changed since the last one (shutdown)."""
        with self.lock.write():
            if self.jit is None:
                return
            data = self._snapshot_bytes()
            gen = self.log.next_generation()
            self.log.write_snapshot(gen, data)

    def counters_changed(self) -> bool:
        """The JIT counters moved since the last snapshot (they are durable only at snapshots)."""
        return self.jit.raw_counters() != getattr(self, "_counters_at_snapshot", None)

    def close(self) -> None:
        self.log.close()

    def fail(self, why: str) -> None:
        """Report this operator failed (``why``), its update log closed: this Entry acknowledges nothing more (a
        replica failing it on a damaged shared log left the log open — "unclosed file" warnings)."""
        self.log.close()
        self.store._fail(self.name, why)

    # ---------------------------------------------------------------- requests
    def predict(self, incoming: dict[str, Family], mode: str, wait: bool = True):
        """``(belief, log_var or None, consulted mask, version, n_learned)`` for one batch; the
        answer's certificates (:mod:`kjit.certificates`, version = the response's) are in
        :meth:`predict_certified`.  ``wait=False`` (``predict`` only): raise :class:`WouldBlock`
        rather than wait for an update."""
        return self.predict_certified(incoming, mode, wait=wait)[:5]

    def predict_certified(self, incoming: dict[str, Family], mode: str, wait: bool = True, audit: bool = True):
        """``(belief, log_var or None, consulted mask, version, n_learned, certificates, uncertain)``;
        ``uncertain`` (mode=predict, else None): the rows the operator's just-in-time rule would
        consult (:meth:`JITOperator.screen`) — what a client whose oracle runs on its side answers.
        ``audit=False``: none of the answer is offered to the continuous audit (a request without the
        server's token: the audit learns its rows and may lower the threshold — a change of state)."""
        if mode == "predict":
            q, logvar, consulted, version, n_learned, cert, uncertain = self._screen(incoming, wait)
        else:
            q, logvar, consulted, version, n_learned, cert = self._predict(incoming, mode)
            uncertain = None
        # (the threshold is the one the answer was computed under: set under the operator's lock —
        # by JITOperator.certified in mode=jit — not read here, after an audit may have changed it)
        if cert.version != version:  # (mode=predict's are issued with it)
            cert = cert.with_(version=version)
        # a background re-check of a sample (never blocks) — not of an answer the route refuses as not finite
        # (found by a hostile-input audit: a 422 naming a row, and the audit then learned every row of it)
        if mode != "oracle" and self.audit is not None and audit and (mode == "jit" or not bad_output_rows(q, logvar)):
            self.audit.offer(self, incoming, q, cert)
        return q, logvar, consulted, version, n_learned, cert, uncertain

    def _screen(self, incoming: dict[str, Family], wait: bool):
        """mode=predict under the shared lock (``wait=False``: WouldBlock rather than wait): the
        learned answer, its certificates (the threshold in force, set by screen_certified) and the
        rows the just-in-time rule would consult."""
        n = len(next(iter(incoming.values())))
        with self.lock.read(blocking=wait):
            version = self.version  # (fixed while the read lock is held)
            try:
                q, cert, uncertain = self.jit.screen_certified(incoming, version=version)
            except NUMERIC_ERRORS as exc:
                raise Unprocessable.of(exc) from None
        return q, cert.log_var, np.zeros(n, dtype=bool), version, 0, cert, np.asarray(uncertain).reshape(-1)

    def draw_belief(self, incoming: dict[str, Family], seed: int | None):
        """``POST …/draws/{seed}/messages``: the beliefs of the operator's draw ``seed`` from its regression's posterior
        (:meth:`KernelOperator.draw`: the same weights for the same seed and version — what a client's
        :meth:`RemoteOperator.draws` asks for, every EP iteration of one draw), under the shared lock:
        ``(belief, version, certificates)``; nothing learned, nothing audited, the operator's last certificates
        untouched (``seed`` None: the posterior mean — the operator's own answers, as ``mode=predict``'s beliefs)."""
        with self.lock.read():
            version = self.version  # (fixed while the read lock is held)
            op = self.jit.operator
            if op is None:
                raise Unprocessable("the operator is not fitted yet: there is nothing to draw")
            try:
                if seed is None:  # (KernelOperator.belief without its certificates)
                    q = op._to_belief(*op._predict_coords(incoming, return_var=False, return_features=False))
                else:
                    q = op.draw(seed).belief(incoming, self.jit.to)
            except NUMERIC_ERRORS as exc:
                raise Unprocessable.of(exc) from None
        cert = Certificates.uniform("learned", q, incoming[self.jit.to], version=version,
                                    projection=projection_convention(op.factor))
        return q, version, cert

    def _predict(self, incoming: dict[str, Family], mode: str):
        """mode=oracle or mode=jit: ``(belief, log_var or None, consulted, version, n_learned, certificates)``."""
        if mode != "oracle":
            return self.commit.jit(incoming)
        n = len(next(iter(incoming.values())))
        # the importance sampler draws from a generator that is part of the state: it runs on a copy, under the lock
        # that excludes other updates but not predictions (before the forty-third session the exclusive lock, held
        # for the sampler's whole run), and the copy — its generator advanced — replaces it for an instant
        sampling = isinstance(self.jit.oracle, (ImportanceSamplingOracle, MessageImportanceSampler))
        with (self.lock.update() if sampling else self.lock.read()):
            oracle = copy.deepcopy(self.jit.oracle) if sampling else self.jit.oracle
            try:
                q, cert = certified(oracle, incoming, self.jit.to)
                cert = cert.with_(threshold=self.jit.threshold)
            except (OracleError, *NUMERIC_ERRORS) as exc:
                raise OracleFailure(str(exc), getattr(exc, "rows", None)) from None
            version = self.version
            if sampling:
                with self.lock.upgrade():
                    self.jit.oracle = oracle
        return q, None, np.ones(n, dtype=bool), version, 0, cert

    def observe(self, incoming: dict[str, Family], beliefs: Family, key: str | None, body_hash: str | None):
        """Add pairs durably; returns ``(version, n_learned, duplicate, n_train)``: ``n_train`` the
        operator's pairs at ``version`` (None for a duplicate whose key a snapshot of an older server kept).
        Pairs whose incoming messages lie outside the data the operator learned (``JITOperator.outside_rows``:
        below its density guard or beyond its input margin, where learning moves every prediction while every
        variance stays small) are acknowledged but not learned: the record holds the learned ones.  So are, as
        the audit's, pairs far outside the learned targets' range (the route checked them before the lock: the
        operator may have changed since, found in review); the rows the route did not check, beyond the input
        margin (a fixed range), are among the outside ones.  All decided under the lock, by the operator as it
        is (``JITOperator.unlearnable_rows``): replaying the requests in version order reproduces them.
        Nothing to learn and no ``key``: no record, the version and pairs as they are."""
        dup, learned, empty = [], {}, []

        def make():
            seen = self.keys.seen(key, body_hash)
            if seen is not None:
                dup.append(seen)
                return None
            skip = self.jit.unlearnable_rows(incoming, beliefs)  # (under the lock that applies them)
            keep = np.flatnonzero(~skip)
            if not keep.size and key is None:  # nothing to learn nor a key to keep: no record, the version stays
                empty.append((self.version, int(self.jit.operator.n_train_)))
                return None
            learned["pairs"] = ({v: m.ravel()[keep] for v, m in incoming.items()}, beliefs.ravel()[keep]) \
                if skip.any() else (incoming, beliefs)
            rec = pairs_record("observe", *learned["pairs"])
            if key is not None:
                rec["key"], rec["body_hash"] = key, body_hash
            return rec

        def apply(jit):
            inc, bel = learned["pairs"]
            if len(bel):
                jit.operator.partial_fit(inc, bel)

        rec = self.commit.update(make, apply, aside=len(beliefs) >= ASIDE_ROWS)
        if rec is None and empty:
            return empty[-1][0], 0, False, empty[-1][1]
        if rec is None:
            return dup[0][0], dup[0][1], True, dup[0][2]
        return int(rec["seq"]), record_rows(rec), False, rec.get("n_train")

    def audit_update(self, incoming: dict[str, Family], beliefs: Family, make_payload) -> int | None:
        """Learn audited pairs (the oracle's beliefs) with their audit statistics, durably: one
        ``audit`` record, in the log (or the shared log) before it is applied and counted — the
        same path as observations.  ``make_payload(stats, threshold)`` builds the record's ``audit``
        part under the exclusive lock (the threshold decision sees every earlier audit).  Returns
        the version."""
        learned = {}

        def make():
            # pairs far outside what the operator has learned are audited (their KLs are in the payload:
            # they are the worst) but not learned (KernelOperator.out_of_range_rows; found in review: one
            # such row made the whole audit fail after a rebuild of the operator)
            # (nor pairs outside the data: JITOperator.unlearnable_rows)
            keep = np.flatnonzero(~self.jit.unlearnable_rows(incoming, beliefs))
            learned["pairs"] = ({v: m[keep] for v, m in incoming.items()}, beliefs[keep])
            return pairs_record("audit", *learned["pairs"],
                                audit=make_payload(self.audit_stats, float(self.jit.threshold)))

        def apply(jit):
            inc, bel = learned["pairs"]
            if len(bel):
                jit.operator.partial_fit(inc, bel)

        rec = self.commit.update(make, apply)
        version = int(rec["seq"])
        change = rec.get("audit", {}).get("threshold_change")
        if change:
            log.warning("operator %s (version %d): %s", self.name, version, change["reason"])
        return version

    def merge(self) -> int:
        """Replicas: apply the other replicas' records now; returns how many were applied."""
        return self.commit.merge()

    # ---------------------------------------------------------------- description (service.store.describe)
    def summary(self) -> dict:
        return describe.summary(self)

    def detail(self) -> dict:
        return describe.detail(self)


def self_test(jit: JITOperator) -> None:
    """An operator that cannot answer ordinary messages is not served (``/ready`` lists it as
    failed; a training job that made one fails, installing nothing): predict a fixed batch from the
    factor's default distribution, if it has one — a ValueError saying what is wrong.  Nor is one
    whose answers' log_var is no log variance (``log_var_is_variance``: a learned-KL rule)."""
    if not jit.log_var_is_variance:
        # (a just-in-time rule on a learned KL: the audit's threshold changes, the threshold floor and the
        # clients' EP engines read the answers' log_var and the threshold as log variances)
        raise ValueError(f"the service serves just-in-time operators whose threshold applies to a log variance; "
                         f"this one's rule (uncertainty={jit.uncertainty!r}) compares a learned KL")
    if getattr(jit, "budget", None) is not None:
        # (a threshold that moves with the traffic: the audit's threshold changes and the clients read a fixed one)
        raise ValueError(f"the service serves just-in-time operators with a fixed threshold; this one ranks its rows "
                         f"within a consultation budget (budget={jit.budget})")
    sampler = jit.factor.default_incoming
    if sampler is None:
        return
    try:  # (the factor's own hint: a broken one says nothing about the operator — found by an audit)
        incoming, _ = jit.factor.check_incoming(sampler(16, np.random.default_rng(0)), jit.to)
    except Exception as exc:  # noqa: BLE001 - whatever the factor's code raises
        log.warning("operator of factor %r: not self-tested — the factor's default_incoming failed (%s: %s)",
                    jit.factor.name, type(exc).__name__, exc)
        return
    try:
        with np.errstate(all="ignore"):
            q, logvar = jit.operator.predict(incoming)
            ok = np.isfinite(q.to_coords()).all() and np.isfinite(logvar).all()
            big = max(float(np.max(np.abs(p))) for p in q.params)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the operator cannot predict
        raise ValueError(f"the operator cannot predict ordinary messages ({type(exc).__name__}: {exc})") from None
    if not ok:
        raise ValueError("the operator cannot predict ordinary messages: its predictions are not finite")
    if big > PARAM_MAX:
        raise ValueError(f"the operator cannot predict ordinary messages: its beliefs have parameters of "
                         f"{big:.3g}, beyond the range requests may carry ({PARAM_MAX:g})")


def _trained_before_the_cap(meta) -> bool:
    """An operator this service trained before the forty-fifth session, when ``JITOperator(kl_cap=)`` came: its
    training request (the meta's ``source``) names no ``kl_cap`` — one trained since names it (null: created
    without a cap, and so kept); an operator published without a training request (no ``source``) is as given."""
    src = meta.get("source")
    return isinstance(src, dict) and "kl_cap" not in src
