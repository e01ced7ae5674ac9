"""Update records: one durable update of an operator — the (incoming, belief) pairs it learned,
exactly as JSON floats (shortest round-trip repr), so replaying a record is the same
``partial_fit`` bit for bit.  Framing (CRC-32, one line) is :mod:`service.files`."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kjit.families import Family

__all__ = ["params_json", "pairs_record", "jit_record", "messages_from_record", "record_rows", "sha256"]


def params_json(m: Family) -> dict[str, list]:
    return {n: np.asarray(p, float).ravel().tolist() for n, p in zip(m.param_names, m.params)}


def pairs_record(kind: str, incoming: dict[str, Family], beliefs: Family, **more) -> dict:
    """A record of ``kind`` (``observe``, ``jit``, ``audit``) without its place in the log (``seq``)."""
    return {"kind": kind, "time": time.time(), "incoming": {v: params_json(m) for v, m in incoming.items()},
            "beliefs": params_json(beliefs), **more}


def jit_record(jit, incoming: dict[str, Family], q: Family) -> tuple[dict | None, int]:
    """``(record, n)`` of the pairs the last jit request of ``jit`` learned — in the order learned,
    with the sizes of its rounds when there were several (replayed round by round) — or
    ``(None, 0)`` if it learned nothing."""
    groups = jit.last_learned_groups_
    if not groups:
        return None, 0
    idx = np.concatenate(groups)
    rec = pairs_record("jit", {v: m.ravel()[idx] for v, m in incoming.items()}, q.ravel()[idx])
    if len(groups) > 1:
        rec["groups"] = [int(len(g)) for g in groups]
    return rec, int(idx.size)


def messages_from_record(jit, rec) -> tuple[dict[str, Family], Family]:
    factor = jit.factor
    inc = {v: factor.families[v].from_dict(d) for v, d in rec["incoming"].items()}
    return inc, jit.family.from_dict(rec["beliefs"])


def record_rows(rec) -> int:
    """The number of pairs a record holds."""
    beliefs = rec["beliefs"]
    return len(beliefs[next(iter(beliefs))])


def sha256(data: bytes) -> str:
    """The fingerprint of a snapshot or base blob (replicas name the base a state grew from)."""
    return hashlib.sha256(data).hexdigest()
