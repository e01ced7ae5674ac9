"""Errors shared by the oracles and the factors' exact rules."""

from __future__ import annotations

import math
import numbers
import os
import sys

import numpy as np

__all__ = ["OracleError", "LowESSError", "SamplerOutputError", "ConfigurationError", "OperatorUnavailableError",
           "gaussian_or_error", "rows_of_batch",
           "rows_within", "quoted", "QUOTE_LIMIT", "check_number", "user_stacklevel"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this: the first frame
    outside the kjit package, so a warning names the user's line — ``model.fit(X, y)`` or
    ``ep.run(...)`` — whichever of kjit's functions lie between; where every frame is kjit's (its
    command line), the caller of the warning's function."""
    f, level = sys._getframe(1), 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        f, level = f.f_back, level + 1
    return level if f is not None else 2


#: most characters of a caller's text an error message quotes
QUOTE_LIMIT = 100


def quoted(value, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters of it, then "…" — what a
    caller sent (a name, a path) is quoted, never echoed whole (found by an audit: a 15 MiB `to`
    came back whole in the service's 422)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "…"


class ConfigurationError(ValueError):
    """An error no retry and no skipped row can fix — an operator asked for a recipient it does not
    send to, a served operator that does not exist: the EP engines raise it at once instead of
    skipping every update and ending at ``max_iter`` with the prior (found in review: a mistyped
    operator name made ``fit()`` return the prior with no warning)."""


class OperatorUnavailableError(RuntimeError):
    """An operator that gave no answer at all — a server that cannot be reached or does not reply in
    time (:class:`kjit.client.RemoteOperator` raises a subclass): the EP engines stop asking it for the
    rest of a sweep after :data:`kjit.ep.engine.OPERATOR_FAILURE_ITERATIONS` such calls running (found
    by an audit: a sequential sweep asked a hung server once per site, each call waiting out its
    timeout and retries — ~200 hours for 1 000 sites before the run stopped)."""


class OracleError(RuntimeError):
    """An oracle could not produce a trustworthy message.  ``rows``: the failing positions of
    the batch when known (the EP engine then skips exactly those and asks again for the rest).
    ``cause``: a short name of what went wrong (a training set counts its dropped rows by it)."""

    #: what went wrong, in a few words (see :func:`kjit.training.make_training_set`'s ``failures``)
    cause = "oracle failed"

    def __init__(self, message: str = "", rows=None, cause: str | None = None):
        super().__init__(message)
        if rows is not None:
            self.rows = np.asarray(rows, dtype=int).ravel()
        if cause is not None:
            self.cause = cause


def rows_of_batch(exc: BaseException, rows) -> BaseException:
    """An error raised on the sub-batch ``rows`` of a batch names sub-batch positions in ``exc.rows``
    (e.g. LowESSError): rename them the batch's rows (``None`` where they cannot be mapped), so
    the EP engines skip exactly those.  Returns ``exc``."""
    r = getattr(exc, "rows", None)
    if r is not None:
        try:
            mapped = np.asarray(rows)[np.asarray(r, dtype=int).ravel()]
        except (TypeError, ValueError, IndexError):
            mapped = None
        exc.rows = mapped
        # the message numbers the sub-batch's rows: say which rows of the batch they are (found by an
        # audit: "rows [3]" in the text where .rows, and the batch, said row 4)
        if (mapped is not None and isinstance(exc, OracleError) and exc.args and isinstance(exc.args[0], str)
                and not np.array_equal(mapped, np.asarray(r, dtype=int).ravel())):
            shown = mapped[:10].tolist()
            exc.args = (f"{exc.args[0]} [the rows of a sub-batch; of the whole batch: rows {shown}"
                        f"{'…' if mapped.size > 10 else ''}]",) + exc.args[1:]
    return exc


def rows_within(rows, n: int):
    """An error's ``rows`` as the sorted distinct positions of a batch of ``n`` (an int array), or None
    (none named, not numbers, or any outside the batch)."""
    if rows is None:
        return None
    try:
        r = np.unique(np.asarray(rows, dtype=int).ravel())
    except (TypeError, ValueError):
        return None
    return r if r.size and r.min() >= 0 and r.max() < n else None


def gaussian_or_error(mean, var, what: str):
    """``Gaussian(mean, var)``, or an OracleError naming the rows whose moments are not a
    distribution (underflowed variance, overflowed mean) instead of a bare ValueError for the batch."""
    from .families import Gaussian

    bad = ~(np.isfinite(mean) & np.isfinite(var) & (var > 0))
    if np.any(bad):
        rows = np.flatnonzero(bad)
        raise OracleError(
            f"{what}: the tilted moments of rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''} are not a "
            "distribution in double precision (variance underflowed to 0 or a moment overflowed)", rows=rows)
    return Gaussian(mean, var)


class LowESSError(OracleError):
    """Importance sampling produced too small an effective sample size for some rows."""

    cause = "low effective sample size"

    def __init__(self, rows, ess, min_ess):
        self.rows = np.asarray(rows)
        self.ess = np.asarray(ess)
        self.min_ess = min_ess
        super().__init__(
            f"importance sampling failed for {self.rows.size} message(s): effective sample size "
            f"{float(np.min(self.ess)):.3g} < min_ess={min_ess} (rows {self.rows[:10].tolist()}"
            f"{'…' if self.rows.size > 10 else ''}); use a better proposal or more samples"
        )


class SamplerOutputError(OracleError):
    """A factor's sampler returned output values that are no value of its output's family: NaN (the
    factor is not defined at those inputs) or values outside the closure of the family's support (a
    negative draw for a Gamma output; ±inf is the end of an unbounded support, where an overflow
    rounds, and weighs 0).  ``factor``, ``variable``: the factor's and its output's names; ``rows``:
    the messages whose draws met them; ``cause``: "sampler returned NaN" or "sampler returned values
    outside the support" (the first named in the message).

    A value outside the support is an error of the sampler, not of the messages: the factor
    declares its output a variable of that family, and a message of that family gives such a value
    no density (found by an audit: the per-message sampler answered them — and NaN — with "effective
    sample size 0 … use a better proposal or more samples", for every row that met one)."""

    def __init__(self, message: str, rows, cause: str, factor: str, variable: str):
        super().__init__(message, rows=rows, cause=cause)
        self.factor = factor
        self.variable = variable


def check_number(name: str, value, low=None, high=None, *, low_open: bool = False, high_open: bool = False,
                 integer: bool = False):
    """One check of a numeric option (the EP engines' every option): ``value`` as a float (an int with ``integer``), or a
    ValueError naming ``name`` unless it is a real number (of integral value with ``integer``) — not text, not
    None, not a bool (``True`` is not 1 here), not an array (a 0-d one is its number) — finite and within
    ``[low, high]`` (``low_open`` / ``high_open``: that end excluded; ``None``: unbounded).

    Found by an audit: ``power="0.5"`` passed ``float()`` and crashed in the cavity with numpy's
    UFuncTypeError, ``damping=None`` / ``"0.5"`` with "ufunc 'isfinite' not supported", an array damping
    with "truth value … is ambiguous", and ``power=True`` ran as power 1."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
        value = value.item()
    kind = "an integer" if integer else "a finite real number"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be {kind}, got {quoted(value)} ({type(value).__name__})")
    num = float(value)
    if integer:
        if not (math.isfinite(num) and num == int(num)):
            raise ValueError(f"`{name}` must be {kind}, got {value!r}")
        num = int(num)
    lo_ok = low is None or (num > low if low_open else num >= low)
    hi_ok = high is None or (num < high if high_open else num <= high)
    if not (integer or math.isfinite(num)) or not (lo_ok and hi_ok):
        if low is not None and high is not None:
            where = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            where = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            where = f"{'<' if high_open else '<='} {high:g}"
        else:
            where = "finite"
        raise ValueError(f"`{name}` must be {kind} {where}, got {value!r}")
    return num
