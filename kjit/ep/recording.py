"""Record the messages an operator serves, so training sets come from real EP runs (SPEC §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..families import Family

__all__ = ["RecordingOperator", "Call"]


@dataclass(frozen=True)
class Call:
    """One served request: incoming messages (batch shape (k,)), recipient, projected belief."""

    method: str                  # "belief" or "message"
    incoming: dict[str, Family]
    to: str
    belief: Family


def _common_batch(incoming: Mapping[str, Family]) -> dict[str, Family]:
    shape = np.broadcast_shapes(*(m.shape for m in incoming.values()))
    if shape == ():
        shape = (1,)
    return {k: m.broadcast_to(shape) if m.shape != shape else m for k, m in incoming.items()}


class RecordingOperator:
    """Wrap any operator; record every ``(incoming, to, belief)`` it serves.

    ``belief`` and ``message`` calls are both recorded (for ``message`` the belief is
    ``message * incoming[to]``, the same natural-parameter sum the operator undid).
    ``log_partition`` is passed through unrecorded.  Other attributes (e.g. ``factor``) are
    forwarded to the wrapped operator.

    ``incoming(to)`` / ``beliefs(to)`` concatenate the recorded batches in call order;
    ``to`` may be omitted when all calls had the same recipient.
    """

    def __init__(self, operator):
        self.operator = operator
        self.calls: list[Call] = []

    def __getattr__(self, name):
        if name == "operator":  # not yet set (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.operator, name)

    # ------------------------------------------------------------------ operator interface
    def belief(self, incoming: Mapping[str, Family], to: str, **kw) -> Family:
        """Forwarded (with any extra keyword, e.g. power EP's ``power``) and recorded."""
        q = self.operator.belief(incoming, to, **kw)
        self.calls.append(Call("belief", _common_batch(dict(incoming)), to, q))
        return q

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        msg = self.operator.message(incoming, to)
        inc = _common_batch(dict(incoming))
        self.calls.append(Call("message", inc, to, msg * inc[to]))
        return msg

    def log_partition(self, incoming, **kw):
        if not hasattr(self.operator, "log_partition"):
            raise AttributeError("the wrapped operator has no log_partition")
        return self.operator.log_partition(incoming, **kw)

    # ------------------------------------------------------------------ records
    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def n_messages(self) -> int:
        return int(sum(len(c.belief) if c.belief.shape else 1 for c in self.calls))

    def clear(self) -> None:
        self.calls.clear()

    def _select(self, to):
        if to is None:
            tos = sorted({c.to for c in self.calls})
            if len(tos) > 1:
                raise ValueError(f"calls went to several recipients {tos}: pass `to`")
            return list(self.calls)
        return [c for c in self.calls if c.to == to]

    def incoming(self, to: str | None = None) -> dict[str, Family]:
        """Recorded incoming messages, one concatenated batch per variable."""
        calls = self._select(to)
        if not calls:
            raise ValueError("nothing recorded" + (f" for to={to!r}" if to else ""))
        names = list(calls[0].incoming)
        return {
            v: type(calls[0].incoming[v]).concatenate([c.incoming[v].reshape(-1) for c in calls])
            for v in names
        }

    def beliefs(self, to: str | None = None) -> Family:
        """Recorded beliefs (projected, proper), concatenated in call order."""
        calls = self._select(to)
        if not calls:
            raise ValueError("nothing recorded" + (f" for to={to!r}" if to else ""))
        return type(calls[0].belief).concatenate([c.belief.reshape(-1) for c in calls])

    def __repr__(self):
        return f"RecordingOperator({self.operator!r}, n_calls={self.n_calls})"
