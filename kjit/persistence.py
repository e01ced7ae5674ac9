"""Save and load operators as versioned files of plain arrays plus JSON metadata.

The file format (``.npz``, written atomically; a JSON header; loaded with ``allow_pickle=False``)
is :mod:`kjit.state`, which the components (features, BLR, operators) use for their own state
dicts; this module adds the operator classes on top, so the arrows point one way:
``state`` ← ``features``/``blr`` ← ``operators`` ← ``persistence``.
"""

from __future__ import annotations

import os

from .operators import OPERATOR_KINDS
from .state import FORMAT, FORMAT_VERSION, StateReader, atomic_write, dumps_state, loads_state

__all__ = ["save_operator", "load_operator", "dumps_state", "loads_state", "StateReader", "FORMAT",
           "FORMAT_VERSION"]

_atomic_write = atomic_write  # the historical private name


def save_operator(operator, path) -> None:
    """Write ``operator`` (anything with ``state_dict()``) to ``path`` atomically (fsync + rename)."""
    atomic_write(path, dumps_state(type(operator).__name__, operator.state_dict()))


def load_operator(path):
    """Load an operator saved by :func:`save_operator`."""
    with open(path, "rb") as fh:
        data = fh.read()
    kind, state = loads_state(data, source=os.fspath(path))
    try:
        cls = OPERATOR_KINDS[kind]
    except KeyError:
        raise ValueError(f"{path}: unknown operator kind {kind!r}") from None
    return cls.from_state_dict(state)
