"""How an operator's updates become durable: one strategy per deployment shape.

Both strategies give the same guarantee — an update is durable before it is visible, and
memory never runs ahead of the source of truth — and the same interface:

* ``update(make, apply, aside=False)``: build a record (``make``, under the operator's
  exclusive lock; None: nothing to do, e.g. a duplicate key), make it durable and apply it;
  returns the record (its ``seq`` is the version it made), or None;
* ``jit(incoming)``: answer a ``mode=jit`` request and make what it learned durable;
* ``join(...)`` after the operator is loaded, ``merge()`` on request.

:class:`Standalone`: the operator's own log (:class:`service.store.log.OperatorLog`) is the source
of truth: apply, append and fsync, then acknowledge; a failure rebuilds the operator from disk.
Large observations and `mode=jit` requests are learned aside (on a copy) so predictions are not held up.

:class:`Replicated` (``KJIT_SHARED_STORE``, :mod:`service.shared`): the shared log is: a record
is appended there (compare-and-set on the version) before it is applied and acknowledged; the
local directory keeps snapshots only, each naming the shared base it grew from.  Long `mode=jit`
requests and large observations are learned aside there too.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import uuid
from typing import Callable

from kjit.oracles import OracleError

from ..files import decode_record, encode_record
from ..shared import SharedLog, SharedLogError
from ..validation import NUMERIC_ERRORS
from .blas import one_blas_thread
from .errors import Conflict, OracleFailure, PersistError, SharedLogDamaged, Unprocessable
from .records import jit_record, record_rows, sha256

log = logging.getLogger("kjit.service.store")

__all__ = ["Standalone", "Replicated", "ASIDE_ROWS"]

#: observations and ``mode=jit`` requests of at least this many rows are learned aside (``Standalone.update``,
#: ``Standalone.jit``): predictions are not held up behind them; smaller ones are learned in place (a copy costs
#: more than they do)
ASIDE_ROWS = 256

#: ``make`` builds a record (None: nothing to add); ``apply(jit)`` is the in-memory update it stands for
MakeRecord = Callable[[], "dict | None"]
Apply = Callable[[object], None]


def _answer(jit, incoming, revertible: bool = False):
    """``jit.certified`` for a ``mode=jit`` request, its failures as the store's errors (after
    which nothing was learned or counted: JITOperator.predict is atomic)."""
    try:
        with one_blas_thread():  # (it may learn: as its record replays)
            q, cert = jit.certified(incoming, jit.to, revertible=revertible)
    except OracleError as exc:
        raise OracleFailure(str(exc), getattr(exc, "rows", None)) from None
    except NUMERIC_ERRORS as exc:
        raise Unprocessable.of(exc) from None
    return q, cert, cert.log_var, cert.source != "learned"


def _stamp_jit_record(rec: dict, jit, seq: int) -> None:
    """A jit record's place and what it carries beyond its pairs: the JIT's counters and its sampler's generator
    (a replay continues its stream exactly)."""
    rec["seq"] = seq
    rec["counters"] = jit.raw_counters()
    oracle = jit.oracle_state()
    if oracle is not None:
        rec["oracle_state"] = oracle


class Standalone:
    """Updates are made durable in the operator's own log."""

    def __init__(self, entry):
        self.entry = entry

    def join(self, recorded_base: str | None, snapshot: bytes, n_local: int) -> None:
        """Nothing to join: the local log is the whole history."""

    def merge(self) -> int:
        raise Conflict("this server has no shared store (KJIT_SHARED_STORE): there is nothing to merge")

    def update(self, make: MakeRecord, apply: Apply, aside: bool = False) -> dict | None:
        if aside:
            return self._update_aside(make, apply)
        e = self.entry
        with e.lock.write():
            rec = make()
            if rec is None:
                return None
            rec["seq"] = e.version + 1
            self._commit(rec, lambda: apply(e.jit))
            return rec

    def jit(self, incoming):
        if len(next(iter(incoming.values()))) >= ASIDE_ROWS:
            return self._jit_aside(incoming)
        e = self.entry
        with e.lock.write():
            jit = e.jit
            counters = jit.raw_counters()  # restored if the request's record cannot be written
            try:
                q, cert, logvar, consulted = _answer(jit, incoming)
            except (OracleFailure, Unprocessable):
                raise
            except Exception as exc:
                e._recover(f"a just-in-time request failed ({type(exc).__name__}: {exc})")
                raise
            rec, n_learned = jit_record(jit, incoming, q)
            if rec is not None:
                _stamp_jit_record(rec, jit, e.version + 1)
                self._commit(rec, None, counters)  # JITOperator.predict already learned the pairs
            return q, logvar, consulted, e.version, n_learned, cert

    def _jit_aside(self, incoming):
        """A long ``mode=jit`` request (``ASIDE_ROWS`` rows or more): answered and learned by a copy of the JIT while
        predictions go on with the served one — its oracle calls took the operator's exclusive lock for as long as
        they ran (a hostile batch at the size cap: ~55 s of predictions held up) — and swapped in once its record
        is on disk: the same record and state as in place (the copy's oracle, a sampler's generator included,
        continues as the served one's would).  A failure before the swap leaves the served JIT as it was."""
        e = self.entry
        with e.lock.update():
            new = copy.deepcopy(e.jit)
            q, cert, logvar, consulted = _answer(new, incoming)  # (raises: nothing served has changed)
            rec, n_learned = jit_record(new, incoming, q)
            if rec is not None:
                _stamp_jit_record(rec, new, e.version + 1)
            self._append_and_swap(rec, new)  # (with nothing learned too: its counters and its oracle's state)
            return q, logvar, consulted, e.version, n_learned, cert  # (the update lock: no other update since)

    def _append_and_swap(self, rec: dict | None, new) -> None:
        """Under the update lock: make ``rec`` durable (None: nothing to write), then serve ``new`` — the copy that
        learned it — exclusively for an instant.  A record that cannot be written rebuilds the operator from disk."""
        e = self.entry
        if rec is not None:
            try:
                e.log.append(rec)
            except PersistError:
                with e.lock.upgrade():
                    e._recover("an update could not be written")
                raise
        with e.lock.upgrade():
            e.jit = new
            if rec is not None:
                e._account(rec, record_rows(rec))
                e._snapshot_if_due()

    def _commit(self, rec: dict, apply: Callable[[], None] | None, counters: dict | None = None) -> None:
        """Apply (if ``apply``) and log ``rec`` atomically w.r.t. readers; exclusive lock held.
        ``counters``: the JIT counters before the request (a jit request, which counted itself
        already) — what a failure leaves, since the request changed nothing."""
        e = self.entry
        try:
            if apply is not None:
                with one_blas_thread():  # (as the record replays)
                    apply()
            e.log.append(rec)
        except PersistError:
            e._recover("an update could not be written", counters)
            raise
        except Exception as exc:
            e._recover(f"an update failed half-way ({type(exc).__name__}: {exc})", counters)
            if isinstance(exc, NUMERIC_ERRORS):
                raise Unprocessable.of(exc) from exc
            raise
        e._account(rec, record_rows(rec))
        e._snapshot_if_due()

    def _update_aside(self, make: MakeRecord, apply: Apply) -> dict | None:
        """A long update: the same record and the same ``partial_fit`` (so the same state, bit for
        bit) on a copy of the operator while predictions go on with the current one; the copy
        replaces it, exclusively for an instant, once the record is on disk."""
        e = self.entry
        with e.lock.update():
            rec = make()
            if rec is None:
                return None
            rec["seq"] = e.version + 1
            new = copy.deepcopy(e.jit)
            try:
                with one_blas_thread():  # (as the record replays)
                    apply(new)
            except NUMERIC_ERRORS as exc:  # nothing changed: the served operator is untouched
                raise Unprocessable.of(exc) from exc
            self._append_and_swap(rec, new)
            return rec


class Replicated:
    """Updates are made durable in the shared log, in one order all replicas apply."""

    MAX_APPEND_ATTEMPTS = 100

    def __init__(self, entry, shared: SharedLog):
        self.entry = entry
        self.shared = shared

    # ---------------------------------------------------------------- joining and catching up
    def join(self, recorded_base: str | None, snapshot: bytes, n_local: int) -> None:
        """Make the loaded state a prefix of the shared log: publish or adopt the base, then catch up.

        ``snapshot`` is the loaded snapshot's blob; ``recorded_base`` the shared base it grew from
        (None for a snapshot written outside replication — the base blob itself, or a standalone
        server's);
        ``n_local`` counts records replayed from this store's own log (taken standalone).  A state
        that grew from a recorded base the shared store no longer holds, with updates of that base's
        log in it, is refused (SharedLogDamaged): that log was lost or replaced.
        """
        e = self.entry
        base = self.shared.get_base(e.name)
        if recorded_base is not None and (base is None or sha256(base) != recorded_base) \
                and (e.version > 0 or len(e.keys)) and not (base is None and e.renamed()):
            # checked before anything is published or adopted (found by an audit: a shared store that
            # lost everything was re-published from this state at version 0, keys forgotten, and a
            # retried key applied again; a replaced one was adopted, dropping acknowledged updates)
            raise SharedLogDamaged(self._lost_base(base is None, recorded_base))
        if base is None:
            # the first replica to publish this operator: its current state becomes the base
            # (a standalone store joining a shared one keeps what it learned, at version 0; so does
            # a replica's copy served under another name, the way out of a lost shared store)
            if e.renamed():
                e.take_name()
            blob = e.base_blob()
            base = self.shared.publish_base(e.name, blob)
            if base == blob:
                e.restart_at_base(blob)
                return self.catch_up()
        if n_local:
            raise ValueError(
                f"operator {e.name!r} learned {n_local} update(s) in this store's own log (served without the "
                f"shared store) that are not in the shared store {self.shared.url}: serving it as a replica would "
                f"mix them into the shared order — move this store's copy away, or serve it under another name")
        if sha256(base) != (recorded_base or sha256(snapshot)):
            if recorded_base is None and e.version > 0:
                raise ValueError(
                    f"operator {e.name!r} learned {e.version} update(s) in this store outside the shared "
                    f"store {self.shared.url}, which already holds another {e.name!r}: serving the shared one "
                    f"would drop them — move this store's copy away, or serve it under another name")
            # another replica's base: start from it
            log.info("operator %s: adopting the shared base from %s", e.name, self.shared.url)
            e.adopt_base(base, f"{self.shared.url}/{e.name}/base")
        e.base_hash = sha256(base)
        self.catch_up()

    def _lost_base(self, missing: bool, recorded_base: str) -> str:
        """Why a replica whose state grew from a shared base the shared store no longer holds is not
        served: records of that log were acknowledged (this state holds ``version`` of them), and
        neither publishing this state again at version 0 (its idempotency keys forgotten) nor
        adopting another base keeps them."""
        e = self.entry
        what = "holds no base for it" if missing else "holds another base for it"
        return (f"operator {e.name!r}: the shared store {self.shared.url} {what} (lost or replaced), but this "
                f"replica's state grew from the shared base {recorded_base[:12]} and holds {e.version} acknowledged "
                f"update(s) of its log: serving it would drop them, or apply their retries again. Restore the shared "
                f"store (its base and log of {e.name!r}) and restart; or, to go on from this replica's state as a new "
                f"operator (version 0; updates other replicas acknowledged after version {e.version} are lost), "
                f"rename this store's operators/{e.name} directory to a new name and restart (it is published "
                f"under that name), and remove the other replicas' copies of {e.name!r}")

    def catch_up(self, rid: str | None = None) -> dict | None:
        """Apply the shared log's records after ``version`` in order (exclusive lock held).

        Returns the record whose ``rid`` is ``rid``, if it was among them (its ``seq`` and, from
        :meth:`Entry._account`, ``n_train``: the state it made, which later records may have moved on).
        """
        e = self.entry
        found = None
        n = 0
        t = time.perf_counter()
        try:
            raws = self.shared.read(e.name, max(e.version - 1, 0))
            if e.version > 0:
                # the record at our version must still be the one we applied: a shared log that
                # lost its tail (a Redis without fsync restarted) or was rewritten is not ours
                if not raws:
                    raise ValueError(f"the shared log holds fewer than {e.version} records, the version of this "
                                     f"replica's state: the shared store lost updates or was reset")
                prev = decode_record(raws[0].rstrip(b"\n"))
                if int(prev["seq"]) != e.version or (e.last_rid is not None and prev.get("rid") != e.last_rid):
                    raise ValueError(f"record {e.version} of the shared log is not the one this replica applied: "
                                     f"the shared log was rewritten")
                raws = raws[1:]
        except (ValueError, KeyError) as exc:
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            e.fail(why)
            raise SharedLogDamaged(why) from exc
        for raw in raws:
            try:
                rec = decode_record(raw.rstrip(b"\n"))
                seq = int(rec["seq"])
                if seq != e.version + 1:
                    raise ValueError(f"record {seq} follows version {e.version}")
                e._apply_record(rec)
            except Exception as exc:
                why = f"the shared log could not be applied after version {e.version}: {type(exc).__name__}: {exc}"
                e.fail(why)
                raise SharedLogDamaged(why) from exc
            n += 1
            if rid is not None and rec.get("rid") == rid:
                found = rec
            self.applied()
        if n:
            e.store.observe("merge", time.perf_counter() - t)
        return found

    def applied(self) -> None:
        """One more record applied: the local snapshot cadence counts it."""
        e = self.entry
        e.log.n_records += 1
        e._snapshot_if_due()

    def merge(self) -> int:
        """Apply the other replicas' records now; returns how many were applied."""
        e = self.entry
        if self.shared.length(e.name) == e.version:
            return 0  # (a shorter log is a loss the catch-up reports)
        with e.lock.write():
            before = e.version
            self.catch_up()
            return e.version - before

    # ---------------------------------------------------------------- updates
    def update(self, make: MakeRecord, apply: Apply, aside: bool = False) -> dict | None:
        """``make`` runs after each catch-up (a duplicate key may have arrived from another
        replica); the record is in the shared store before it is applied here, and is applied by
        the same code as every other replica's records (``apply`` is not used: bit-identical states).
        ``aside``: under the update lock (readers go on), the record is learned by a copy of the JIT once it is in
        the shared log, and the copy served for an instant after (``Standalone.update``'s, for the same reason)."""
        with self.entry.lock.update() if aside else self.entry.lock.write():
            return self._commit(make, uuid.uuid4().hex, aside)

    def _exclusive(self, aside: bool):
        """What makes a change of the served JIT exclusive: the upgrade of the update lock an aside update holds;
        nothing more under the exclusive lock the others hold."""
        return self.entry.lock.upgrade if aside else contextlib.nullcontext

    def _commit(self, make: MakeRecord, rid: str, aside: bool = False) -> dict | None:
        e = self.entry
        exclusive = self._exclusive(aside)
        for _ in range(self.MAX_APPEND_ATTEMPTS):
            with exclusive():
                found = self._catch_up_for_update(rid)
            if found is not None:
                return found
            rec = make()
            if rec is None:
                return None
            rec["seq"], rec["rid"] = e.version + 1, rid
            ok, found = self._place(rec, locked=exclusive)
            if found is not None:
                return found
            if ok:
                try:  # (aside: learned by a copy while readers go on with the served JIT, served once it has)
                    new = copy.deepcopy(e.jit) if aside else e.jit
                    n = e._learn_record(new, rec)
                except Exception as exc:  # the record is in the shared log: the rebuilt state has it
                    with exclusive():
                        e._recover(f"an update failed half-way ({type(exc).__name__}: {exc})", recorded=True)
                    return rec
                with exclusive():
                    e.jit = new
                    e._account(rec, n)
                    e.last_rid = rid
                    self.applied()
                return rec
        raise PersistError(f"the shared log of {e.name!r} kept changing: {self.MAX_APPEND_ATTEMPTS} appends were "
                           f"refused; nothing was added")

    def _place(self, rec: dict, before_catch_up: Callable[[], None] | None = None, locked=contextlib.nullcontext):
        """Append ``rec`` as record ``version + 1``: ``(True, None)`` if it is there now,
        ``(False, None)`` if another record took the place.  If the append itself failed, the
        log is read to see whether the record landed anyway — ``before_catch_up`` first undoes
        what the caller already applied — and ``(None, record)`` says it did (applied now by the
        catch-up, with any later records); otherwise the outcome is unknown: PersistError(unknown=True).
        ``locked()`` is held while the catch-up changes the served JIT (the caller's exclusive lock)."""
        e = self.entry
        try:
            return self.shared.append(e.name, e.version, encode_record(rec)), None
        except SharedLogError as exc:
            with locked():
                if before_catch_up is not None:
                    before_catch_up()
                try:
                    found = self.catch_up(rec["rid"])
                except Exception:
                    found = None
            if found is not None:
                return None, found
            raise PersistError(f"{exc}: the update may or may not have been recorded", unknown=True) from exc

    def jit(self, incoming):
        """``jit`` on a replica: answer and learn as a standalone server does (greedy selection
        learns in rounds), then place the learned pairs in the shared log; if another replica's
        record took that place first, undo, apply it, and answer again.  A request of ``ASIDE_ROWS``
        rows or more is answered and learned by a copy of the JIT while predictions go on with the
        served one (its oracle calls held the exclusive lock for as long as they ran), and the copy is
        served once its record is in the shared log: the same answers, record and state as in place."""
        e = self.entry
        rid = uuid.uuid4().hex
        aside = len(next(iter(incoming.values()))) >= ASIDE_ROWS
        exclusive = self._exclusive(aside)  # (aside: the update lock, readers go on, but while the JIT changes)
        with e.lock.update() if aside else e.lock.write():
            for _ in range(self.MAX_APPEND_ATTEMPTS):
                with exclusive():
                    self._catch_up_for_update()
                jit = copy.deepcopy(e.jit) if aside else e.jit
                q, cert, logvar, consulted = _answer(jit, incoming, revertible=not aside)
                rec, n_learned = jit_record(jit, incoming, q)
                if rec is None:
                    if aside:  # (its counters, as in place)
                        with exclusive():
                            e.jit = jit
                    return q, logvar, consulted, e.version, 0, cert
                rec["seq"], rec["rid"] = e.version + 1, rid
                ok, found = self._place(rec, before_catch_up=None if aside else jit.revert_last_, locked=exclusive)
                if aside and not ok:  # the copy is dropped, its sampler's stream kept: as in place, the generator
                    # goes on past the particles drawn (found in review: a lost reply left the served sampler to
                    # draw again the particles whose answers the catch-up had just learned)
                    with exclusive():
                        self._keep_oracle_stream(jit)
                if found is not None:  # it landed after all; the catch-up applied it from the log, and any
                    # records after it (another replica's): the answer is the state before it (found by an
                    # audit: the response named the later version)
                    return q, logvar, consulted, int(found["seq"]), n_learned, cert
                if ok:  # learned already, exactly as the record replays
                    with exclusive():
                        e.jit = jit
                        e._account(rec, n_learned)
                        e.last_rid = rid
                        self.applied()
                    return q, logvar, consulted, e.version, n_learned, cert
                if not aside:
                    jit.revert_last_()  # another replica's update came first (a copy is dropped)
            raise PersistError(f"the shared log of {e.name!r} kept changing: {self.MAX_APPEND_ATTEMPTS} appends "
                               f"were refused; nothing was learned")

    def _keep_oracle_stream(self, jit) -> None:
        """The served JIT's oracle goes on from where ``jit``'s (a copy's) left it (exclusive lock held)."""
        state = jit.oracle_state()
        if state is not None:
            self.entry.jit.set_oracle_state(state)

    def _catch_up_for_update(self, rid: str | None = None) -> dict | None:
        """:meth:`catch_up` before an update, its failures as the update's (the exclusive lock held)."""
        try:
            return self.catch_up(rid)
        except SharedLogError as exc:
            raise PersistError(f"the shared store is unavailable: {exc}") from exc
        except SharedLogDamaged as exc:  # (found in review: a 500 for the request that found it)
            raise PersistError(f"{exc}; the operator is reported failed") from exc
