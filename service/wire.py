"""Messages on the wire: a request's batches → :class:`kjit.families.Family` (a 422 naming every
bad field), and families → the JSON columns of a response."""

from __future__ import annotations

import numpy as np

from kjit.certificates import json_columns
from kjit.errors import quoted
from kjit.factors import Factor
from kjit.families import Family, family_name

from .errors import ApiError

__all__ = ["answer_columns", "to_families", "beliefs_from"]


def answer_columns(beliefs: Family, messages: Family, log_var) -> tuple[dict, dict, list | None]:
    """The columns of a messages response: the beliefs and the messages as ``{"family": ...,
    <parameter>: [n numbers]}``, the messages' natural parameters (``"natural"``: k lists) and
    ``is_proper``, and the (n, k) log variances as k lists (None if ``log_var`` is None); null for
    a number that is not finite."""
    n = len(beliefs)
    nat = messages.natural().reshape(n, -1)
    lv = None if log_var is None else np.asarray(log_var, dtype=float).reshape(n, -1)
    cols = [*(p.ravel() for p in beliefs.params), *(p.ravel() for p in messages.params), *nat.T,
            *(() if lv is None else lv.T)]
    lists = iter(json_columns(cols))
    q = {"family": family_name(beliefs), **{name: next(lists) for name in beliefs.param_names}}
    msg = {"family": family_name(messages), **{name: next(lists) for name in messages.param_names}}
    msg["natural"] = [next(lists) for _ in range(nat.shape[1])]
    msg["is_proper"] = np.asarray(messages.is_proper).reshape(n).tolist()
    return q, msg, None if lv is None else [next(lists) for _ in range(lv.shape[1])]


def to_families(factor: Factor, incoming: dict, max_batch: int, loc=("body", "incoming")) -> dict[str, Family]:
    """Validate a request's incoming batches against the factor; 422 naming every bad field."""
    errors = []
    loc = list(loc)
    for v in incoming:
        if v not in factor.variables:
            errors.append({"loc": loc + [v], "type": "unknown_variable",
                           "msg": f"{quoted(v)} is not a variable of factor {factor.name!r}; its variables are "
                                  f"{', '.join(factor.variables)}"})
    for v in factor.variables:
        if v not in incoming:
            errors.append({"loc": loc + [v], "type": "missing",
                           "msg": f"missing the messages from {v!r} (factor {factor.name!r} needs "
                                  f"{', '.join(factor.variables)})"})
    lengths = {}
    for v in factor.variables:
        if v not in incoming:
            continue
        m = incoming[v]
        fam = factor.families[v]
        want = family_name(fam)
        if m.family != want:
            errors.append({"loc": loc + [v, "family"], "type": "wrong_family",
                           "msg": f"factor {factor.name!r} takes {want} messages for {v!r}, got {m.family!r}"})
            continue
        cols = {p: getattr(m, p) for p in fam.param_names}
        first = fam.param_names[0]
        for p in fam.param_names[1:]:
            if len(cols[p]) != len(cols[first]):
                errors.append({"loc": loc + [v, p], "type": "length_mismatch",
                               "msg": f"{len(cols[p])} values, but {first!r} has {len(cols[first])}"})
        n = len(cols[first])
        if n > max_batch:
            errors.append({"loc": loc + [v, first], "type": "too_long",
                           "msg": f"batch of {n} messages exceeds the limit of {max_batch} per request "
                                  f"(KJIT_MAX_BATCH); split it"})
        lengths[v] = n
    if len(set(lengths.values())) > 1:
        ref = next(iter(lengths))
        for v, n in lengths.items():
            if n != lengths[ref]:
                errors.append({"loc": loc + [v], "type": "length_mismatch",
                               "msg": f"batch of {n} messages, but {ref!r} has {lengths[ref]}"})
    if errors:
        raise ApiError.many(422, errors)
    out = {}
    for v in factor.variables:
        fam = factor.families[v]
        try:
            out[v] = fam(*(getattr(incoming[v], p) for p in fam.param_names))
        except ValueError as exc:  # pragma: no cover - the schema already checked
            raise ApiError(422, loc + [v], str(exc), "value_error") from None
    return out


def beliefs_from(batch, fam, n: int, loc: list, recipient: str | None = None) -> Family:
    """A request's belief batch of family ``fam`` for ``n`` rows of incoming messages (on ``recipient``);
    a 422 naming the field."""
    want = family_name(fam)
    if batch.family != want:
        on = f"on {recipient!r}" if recipient else "on this recipient"
        raise ApiError(422, loc + ["family"], f"beliefs {on} are {want} messages, got {batch.family!r}",
                       "wrong_family")
    cols = [getattr(batch, p) for p in fam.param_names]
    errs = [{"loc": loc + [p], "type": "length_mismatch", "msg": f"{len(c)} values for {n} rows of incoming messages"}
            for p, c in zip(fam.param_names, cols) if len(c) != n]
    if errs:
        raise ApiError.many(422, errs)
    try:
        return fam(*cols)
    except ValueError as exc:
        raise ApiError(422, loc, str(exc), "value_error") from None
