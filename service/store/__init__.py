"""The operator store: a local directory, durable updates, recovery on start.

By concern: :mod:`.operator_store` (the directory of operators: open, load, create, close),
:mod:`.entry` (one operator: loading, requests, the records it applies), :mod:`.log` (its
snapshots and update log on disk), :mod:`.commit` (how an update becomes durable: standalone or
replicated, one strategy each), :mod:`.records`, :mod:`.idempotency`, :mod:`.describe` (what the
API shows of an operator), :mod:`.errors`.

Layout (``<store>`` is ``Settings.store``)::

    <store>/.lock                          held (flock) by the one server using the store
    <store>/operators/<name>/meta.json     factor, direction, how it was trained (written once)
    <store>/operators/<name>/snapshot-G.npz   operator state after every update of logs < G
    <store>/operators/<name>/log-G.jsonl      update records appended after snapshot G
    <store>/operators/<name>/served           empty: a server has opened its log (from then on every
                                           snapshot's log must exist, generation 0 too)
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

from kjit.families import family_name  # noqa: F401  (re-exported: the routes name families with it)

from ..files import decode_record, encode_record  # noqa: F401  (re-exported for tests and tools)
from ..names import NAME_RE
from .commit import ASIDE_ROWS
from .describe import oracle_kind
from .entry import Entry
from .errors import Conflict, NotFound, NotReady, OracleFailure, PersistError, Unprocessable
from .idempotency import MAX_IDEMPOTENCY_KEYS
from .operator_store import OperatorStore
from .records import params_json, sha256

#: (the name tests and tools have used)
_params_json = params_json

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
    "ASIDE_ROWS",
    "MAX_IDEMPOTENCY_KEYS",
    "family_name",
    "oracle_kind",
    "body_hash",
]


def body_hash(data: bytes) -> str:
    """The fingerprint an ``Idempotency-Key`` is stored with (sha256 of the canonical body)."""
    return sha256(data)
