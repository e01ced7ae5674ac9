"""Validation beyond types: request bodies parsed within bounded memory, numbers the math can
carry, and observations that are plausible data (service/README.md, "Hostile input").

* :func:`parse_body` — the JSON body of a request, validated straight from its bytes by
  pydantic-core (strict numbers, lists that stop at their first bad element), after a cheap
  guard on how many values it holds: a body with more commas than the largest valid request
  could need, or more than :data:`MAX_KEYS` colons, is refused before anything is parsed, so a
  16 MiB body of bad numbers costs a byte count, not a parse tree.  A body that repeats a key
  within one object (:func:`duplicate_key`) is refused too: parsers disagree on which one counts.
* :func:`bad_feature_rows`, :func:`bad_output_rows` — rows whose random features or predicted
  belief are not finite (a message the operator cannot evaluate): 422 naming the rows.
* :func:`implausible_rows` — the observation rule: a belief is accepted if its standardised
  regression coordinates (what the operator regresses: relative coordinates, centred and
  scaled by the training targets' mean and spread) lie within ``max_z`` of 0 — the training
  targets of the default operators lie within about 5 — or, failing that, if a deterministic
  oracle for the factor gives, for the row's incoming messages, a belief within ``max_kl``
  nats (KL[oracle ‖ observed]) of it.  Anything else (an oracle that cannot answer included)
  is rejected, and the whole request with it.  So is a belief, however right, whose regression
  targets lie far outside the range the operator has learned (``KernelOperator.out_of_range_rows``):
  learning that one pair would move every prediction.  (A pair whose incoming messages lie beyond the
  operator's input margin — ``JITOperator.outside_rows(density=False)`` — is not checked: the request is
  acknowledged and the pair not learned, ``Entry.observe``; one below its density guard is checked like any
  other, and not learned either.)
"""

from __future__ import annotations

import copy
import json
import math
import re
from contextlib import nullcontext
from typing import Any, Awaitable, Callable, ContextManager, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kjit.errors import quoted
from kjit.factors.base import FactorCodeError
from kjit.families import Family
from kjit.operators import LEARN_RANGE_FACTOR, TargetsNotFiniteError
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler, QuadratureOracle
from kjit.reductions import all_finite

from .errors import ApiError, clean_errors

__all__ = ["parse_body", "duplicate_key", "bad_feature_rows", "bad_output_rows", "implausible_rows", "MAX_VALUES_PER_ROW",
           "NUMERIC_ERRORS"]

M = TypeVar("M", bound=BaseModel)

#: generous bound on the numbers one message row of a valid request needs (all incoming
#: parameters plus the belief's): the comma guard allows ``max_batch`` rows of this many
MAX_VALUES_PER_ROW = 16
#: most object keys (colons) in a body: a valid request has a few dozen; each unknown key
#: would otherwise cost pydantic an error object
MAX_KEYS = 1000
#: slack for the fixed part of a body (keys, family names, a training request's ranges)
_FIXED_VALUES = 1000

#: what numerical code raises on input it cannot carry (kjit validates with ValueError)
NUMERIC_ERRORS = (ValueError, ArithmeticError, np.linalg.LinAlgError)


def _raw_body(request: Request) -> bytes | None:
    """The body :class:`~service.middleware.BodyLimitMiddleware` read, from the request's state
    where it put it (``scope["state"]``; read there, not through ``request.state``, whose
    attribute access raises and catches an AttributeError first)."""
    state = request.scope.get("state")
    return None if state is None else state.get("raw_body")


def parse_body(model: type[M], request: Request, max_batch: int) -> M:
    """Validate the raw request body as ``model``; 422 with bounded, located errors."""
    raw = _raw_body(request)
    if raw is None:  # pragma: no cover - BodyLimitMiddleware always sets it
        raw = b""
    ctype = None
    for k, v in request.scope["headers"]:
        if k == b"content-type":  # (the first, as before)
            ctype = v.decode("latin-1")
            break
    if ctype is not None and not _is_json(ctype):
        raise ApiError(400, ["header", "content-type"], f"the body must be JSON (Content-Type: application/json), "
                                                         f"got {ctype.split(';')[0].strip()[:60]!r}", "not_json")
    limit = max_batch * MAX_VALUES_PER_ROW + _FIXED_VALUES
    n_commas = raw.count(b",")
    if n_commas > limit:
        raise ApiError(422, ["body"], f"the body holds more than {limit} values (the largest valid request, "
                                      f"{max_batch} rows, needs fewer); split it", "too_many_values")
    n_keys = raw.count(b":")
    if n_keys > MAX_KEYS:
        raise ApiError(422, ["body"], f"the body holds more than {MAX_KEYS} object keys (a valid request has a few "
                                      f"dozen)", "too_many_keys")
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError.many(422, clean_errors(exc.errors(include_url=False, include_input=False), ["body"]))
    loc = duplicate_key(raw)
    if loc is not None:
        raise ApiError(422, ["body", *loc], f"the key {quoted(loc[-1])} appears more than once in the same object: "
                                            f"which one is meant is ambiguous (send each key once)", "duplicate_key")
    return parsed


#: a JSON array of numbers only (no keys inside): what :func:`duplicate_key` need not parse
_NUMBER_ARRAY = re.compile(rb"\[[-+0-9.eE,\s]*\]")


def duplicate_key(raw: bytes) -> list | None:
    """The location (keys and list indices from the top) of the first key that a JSON text repeats
    within one object, or None.  pydantic keeps the last of repeated keys and other parsers the
    first, so such a body means different things to a proxy and to this server: it is refused.
    Python's parser reads the body again with its arrays of numbers emptied first (they hold no
    keys, and are most of a body: ~6 µs for one message, 1.4 ms for 10 000 against pydantic's
    2.3 ms; found in review: 12 ms when they were parsed too); emptying rewrites two equal keys
    alike, so it can only add a repeat (``"a[1]"``, ``"a[2]"``), which the whole text then
    confirms.  None for a text it cannot read."""
    skeleton = _NUMBER_ARRAY.sub(b"[]", raw)
    # an EP client's requests differ in their numbers only: the skeleton's verdict is remembered
    # (a few hundred short skeletons; 66 000 instructions a one-message request otherwise)
    clean = _CLEAN_SKELETONS.get(skeleton)
    if clean is None:
        clean = _repeated_key(skeleton) is None
        if len(skeleton) <= 4096:
            if len(_CLEAN_SKELETONS) >= 256:
                _CLEAN_SKELETONS.clear()
            _CLEAN_SKELETONS[skeleton] = clean
    return None if clean else _repeated_key(raw)


_CLEAN_SKELETONS: dict[bytes, bool] = {}


def _repeated_key(raw: bytes) -> list | None:
    found: list = []

    def hook(pairs):
        d = dict(pairs)
        if len(d) != len(pairs) and not found:
            seen: set = set()
            for k, _ in pairs:
                if k in seen:
                    found.append((d, k))
                    break
                seen.add(k)
        return d

    try:
        tree = json.loads(raw, object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return None
    if not found:
        return None
    target, key = found[0]
    path = _path_to(tree, target)
    return None if path is None else [*path, key]


def _path_to(node, target) -> list | None:
    """Keys and indices leading from ``node`` to the object ``target`` (by identity), or None."""
    if node is target:
        return []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, child in items:
        if isinstance(child, (dict, list)):
            sub = _path_to(child, target)
            if sub is not None:
                return [k, *sub]
    return None


#: bodies up to this size are parsed on the event loop (tens of µs: cheaper than a thread hop);
#: larger ones in the thread pool, so a big parse never holds up other requests
INLINE_PARSE_BYTES = 32 * 1024


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type (parameters such as ``charset`` ignored); a request
    without a Content-Type is read as JSON too."""
    mt = content_type.split(";", 1)[0].strip().lower()
    return mt in ("application/json", "") or (mt.startswith("application/") and mt.endswith("+json"))


def body_dependency(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: small bodies parsed inline, large ones in the thread pool."""

    async def dep(request: Request) -> M:
        raw = _raw_body(request)
        max_batch = request.app.state.settings.max_batch
        if raw is not None and len(raw) <= INLINE_PARSE_BYTES:
            return parse_body(model, request, max_batch)
        return await run_in_threadpool(parse_body, model, request, max_batch)

    dep.__name__ = f"parse_{model.__name__}"
    return dep


def _row_finite(a: np.ndarray, n: int) -> np.ndarray:
    a = np.asarray(a, dtype=float).reshape(n, -1)
    return np.isfinite(a).all(axis=1)


def bad_feature_rows(operator, incoming: dict[str, Family]) -> list[int]:
    """Rows whose random features are not finite (e.g. moments that overflow)."""
    factor = operator.factor
    inc, shape = factor.check_incoming(incoming, operator.to)
    n = math.prod(shape)
    try:
        with np.errstate(all="ignore"):
            msgs = operator.feature_inputs(inc)
            # a row whose canonical frame overflows has an improper mapped message (the features
            # refuse those): that row is bad, the others are evaluated
            ok = np.logical_and.reduce([np.asarray(m.is_proper, bool).reshape(n) for m in msgs])
            # and a row whose reference of relative targets (the factor's approximation) overflows
            ok &= operator.reference_ok(inc)
            bad = ~ok
            if ok.any():
                rows = np.flatnonzero(ok)
                psi = operator.features_.transform(tuple(m[rows] for m in msgs))
                bad[rows] = ~_row_finite(psi, rows.size)
    except FactorCodeError:  # the factor's own code failed (its approximation): not the features — the
        return []            # caller says the factor's words
    except NUMERIC_ERRORS:  # cannot tell the rows apart: none of them can be evaluated
        return list(range(n))
    return np.flatnonzero(bad).tolist()


def bad_output_rows(q: Family, logvar) -> list[int]:
    """Rows whose belief coordinates or log variance are not finite."""
    n = q.size
    coords = q.to_coords()  # (of a proper belief: no floating-point warning)
    if all_finite(coords) and (logvar is None or all_finite(np.asarray(logvar, dtype=float))):
        return []  # (every answer of a healthy operator: one check each)
    ok = _row_finite(coords, n)
    if logvar is not None:
        ok &= _row_finite(logvar, n)
    return np.flatnonzero(~ok).tolist()


def spot_oracle(jit) -> Any:
    """An oracle for the served operator's recipient that shares no state with the served one: the factor's exact
    rule where it has one for that recipient, else a private copy of the served sampler (a factor with rules for
    other recipients only refused every observation the check reached as "the oracle cannot check it" — audit)."""
    if isinstance(jit.oracle, (ImportanceSamplingOracle, MessageImportanceSampler)):
        if jit.factor.has_exact(jit.to):
            return QuadratureOracle(jit.factor)
        return copy.deepcopy(jit.oracle)
    return jit.oracle


def _spot_kl(oracle, sub: dict[str, Family], obs: Family, to: str) -> tuple[np.ndarray, list[str | None]]:
    """Per row, KL[oracle's belief ‖ observed belief] (+inf where the oracle cannot answer) and why it could not
    (None where it did).  An oracle that names the rows it failed on (OracleError.rows: a sampler's low effective
    sample size) is asked again without them: one such row made every row of the request uncheckable (audit)."""
    n = len(obs)
    kl, why = np.full(n, np.inf), [None] * n
    rows = np.arange(n)
    for _ in range(2):
        try:
            with np.errstate(all="ignore"):
                ref = oracle.belief({v: m[rows] for v, m in sub.items()}, to)
                kl[rows] = np.asarray(ref.kl(obs[rows]), float).ravel()
            return kl, why
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - the oracle cannot vouch for these rows
            named = getattr(exc, "rows", None)
            failed = rows if named is None else rows[np.asarray(named, int)]
            for i in failed:
                why[int(i)] = f"the oracle cannot check it ({type(exc).__name__})"
            if named is None:
                return kl, why
            rows = np.setdiff1d(rows, failed)
            if not rows.size:
                return kl, why
    for i in rows:  # (failed again on the rest)
        why[int(i)] = why[int(i)] or "the oracle cannot check it"
    return kl, why


_NOT_PRODUCIBLE = "not a belief the factor can produce from these incoming messages: "
_IMPLAUSIBLE = "implausible_belief"


def implausible_rows(jit, incoming: dict[str, Family], beliefs: Family, max_z: float,
                     max_kl: float, slot: Callable[[], ContextManager] | None = None) -> list[tuple[int, str, str]]:
    """``(row, why, type)`` for the observations the rule in the module docstring rejects (``why``: a
    sentence; ``type``: ``implausible_belief``, or ``not_learnable`` for a pair too far outside what the
    operator has learned); ``slot``: a context manager held while the oracle checks the rows beyond
    ``max_z``."""
    op = jit.operator
    n = len(beliefs)
    with np.errstate(all="ignore"):
        try:
            Y = op.regression_targets(incoming, beliefs)
        except TargetsNotFiniteError as exc:
            return [(int(i), _NOT_PRODUCIBLE + "its regression coordinates are not finite numbers", _IMPLAUSIBLE)
                    for i in exc.rows]
        except NUMERIC_ERRORS as exc:
            return [(0, _NOT_PRODUCIBLE + f"the beliefs cannot be regressed: {exc}", _IMPLAUSIBLE)]
        Z = (np.asarray(Y, float).reshape(n, -1) - op.y_mean_) / op.y_scale_
    finite = np.isfinite(Z).all(axis=1)
    bad = [(int(i), _NOT_PRODUCIBLE + "its regression coordinates are not finite numbers", _IMPLAUSIBLE)
           for i in np.flatnonzero(~finite)]
    far = np.flatnonzero(finite & (np.abs(np.where(np.isfinite(Z), Z, 0.0)).max(axis=1) > max_z))
    if far.size:
        sub = {v: m.ravel()[far] for v, m in incoming.items()}
        obs = beliefs.ravel()[far]
        with (slot() if slot is not None else nullcontext()):
            kl, why = _spot_kl(spot_oracle(jit), sub, obs, jit.to)
        for j, i in enumerate(far):
            if not (kl[j] <= max_kl):
                zmax = float(np.max(np.abs(Z[i])))
                reason = why[j] or (f"its standardised regression coordinates reach {zmax:.3g} (> {max_z:g}) "
                                    f"and the oracle's belief for its incoming messages is {kl[j]:.3g} nats "
                                    f"away (> {max_kl:g})")
                bad.append((int(i), _NOT_PRODUCIBLE + reason, _IMPLAUSIBLE))
    # a plausible pair far outside what the operator has learned moves every prediction, however right it
    # is (KernelOperator.targets_out_of_range): refused too, as not_learnable (an implausible one says so)
    refused = {i for i, *_ in bad}
    beyond = finite & np.asarray(op.targets_out_of_range(np.asarray(Y, float).reshape(n, -1)), bool)
    bad += [(int(i), f"a belief this operator cannot learn: its regression targets lie more than {LEARN_RANGE_FACTOR:g} "
                     "times the learned range's width outside the range it has learned (learning it would move every "
                     "prediction; mode=oracle answers such messages)", "not_learnable")
            for i in np.flatnonzero(beyond) if int(i) not in refused]
    return sorted(bad)
