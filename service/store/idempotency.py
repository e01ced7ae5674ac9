"""Idempotency keys: a retried update (same ``Idempotency-Key``) is applied once.

The keys are part of an operator's state: each update record carries its key and body hash,
so replaying the log (or another replica's records) rebuilds them, and snapshots keep them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Iterator

from .errors import Conflict

__all__ = ["IdempotencyKeys", "MAX_IDEMPOTENCY_KEYS"]

#: the most recent keys kept per operator (older ones are forgotten, oldest first: a retry beyond them is
#: applied again — documented in service/README.md and RemoteOperator.observe)
MAX_IDEMPOTENCY_KEYS = 10_000


class IdempotencyKeys:
    """key → (body hash, version of the update, rows accepted, the operator's pairs at that version —
    None for a key kept by a snapshot written before the twenty-third session), most recent last."""

    def __init__(self, items=()):
        self._keys: OrderedDict[str, tuple[str, int, int, int | None]] = OrderedDict(
            (k, (h, int(s), int(n), None if not rest or rest[0] is None else int(rest[0])))
            for k, h, s, n, *rest in items)

    def seen(self, key: str | None, body_hash: str | None) -> tuple[int, int, int | None] | None:
        """``(version, rows, n_train at that version)`` of the update that used ``key`` before, or
        None; :class:`Conflict` if it was used with another body."""
        if key is None or key not in self._keys:
            return None
        h, seq, n, n_train = self._keys[key]
        if h != body_hash:
            raise Conflict("this Idempotency-Key was used before with a different request body")
        return seq, n, n_train

    def remember(self, key: str, body_hash: str, seq: int, n: int, n_train: int | None = None) -> None:
        self._keys[key] = (body_hash, int(seq), int(n), None if n_train is None else int(n_train))
        self._keys.move_to_end(key)
        while len(self._keys) > MAX_IDEMPOTENCY_KEYS:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def to_json(self) -> tuple[str, str]:
        """``(keys, counts)``: the keys as ``[key, hash, version, rows]`` (what servers before the
        twenty-third session read: a snapshot stays readable by one — a fifth item was refused, found in
        review) and, apart, ``{key: n_train}``."""
        return (json.dumps([[k, h, s, n] for k, (h, s, n, _) in self._keys.items()]),
                json.dumps({k: t for k, (_, _, _, t) in self._keys.items() if t is not None}))

    @classmethod
    def from_json(cls, text: str, counts: str | None = None) -> "IdempotencyKeys":
        n_train = json.loads(counts) if counts else {}
        # (a fifth item: the n_train of a snapshot written in this session before the format was split)
        return cls([k, h, s, n, n_train.get(k, rest[0] if rest else None)] for k, h, s, n, *rest in json.loads(text))
