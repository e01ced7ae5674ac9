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

#: the most recent keys kept per operator (older ones are forgotten, oldest first)
MAX_IDEMPOTENCY_KEYS = 10_000


class IdempotencyKeys:
    """key → (body hash, version of the update, rows accepted), most recent last."""

    def __init__(self, items=()):
        self._keys: OrderedDict[str, tuple[str, int, int]] = OrderedDict(
            (k, (h, int(s), int(n))) for k, h, s, n in items)

    def seen(self, key: str | None, body_hash: str | None) -> tuple[int, int] | None:
        """``(version, rows)`` of the update that used ``key`` before, or None; :class:`Conflict`
        if it was used with another body."""
        if key is None or key not in self._keys:
            return None
        h, seq, n = self._keys[key]
        if h != body_hash:
            raise Conflict("this Idempotency-Key was used before with a different request body")
        return seq, n

    def remember(self, key: str, body_hash: str, seq: int, n: int) -> None:
        self._keys[key] = (body_hash, int(seq), int(n))
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

    def to_json(self) -> str:
        return json.dumps([[k, h, s, n] for k, (h, s, n) in self._keys.items()])

    @classmethod
    def from_json(cls, text: str) -> "IdempotencyKeys":
        return cls(json.loads(text))
