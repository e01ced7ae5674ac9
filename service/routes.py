"""HTTP routes.  State (settings, store, jobs, metrics) comes from ``request.app.state``
through the small dependencies below; request and response shapes are in :mod:`service.schemas`."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from typing import Annotated, Literal

import numpy as np
import pydantic_core
from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from kjit import __version__ as kjit_version
from kjit.factors import Factor, get_factor, registered_factors
from kjit.families import Family
from kjit.oracles import ClientOracle
from kjit.training import TrainingSet

from . import schemas
from .errors import ApiError, internal_error
from .settings import Settings
from .shared import SharedLogError
from .store import (Conflict, Entry, NotFound, NotReady, OperatorStore, OracleFailure, PersistError, Unprocessable,
                    body_hash, family_name)
from .jobs import QueueFull, scrub
from .locks import WouldBlock
from .training import TrainSpec, sampler_from_ranges
from .validation import bad_feature_rows, bad_output_rows, body_dependency, implausible_rows

router = APIRouter()
# The bearer token is checked by AuthMiddleware (before the body is read) and documented per operation by
# service.app (security as is_mutating decides it), not by a dependency: one fewer per request.

ERRORS = {
    400: {"model": schemas.ErrorResponse, "description": "the body is not JSON (its Content-Type names another media "
                                                         "type)"},
    401: {"model": schemas.ErrorResponse, "description": "missing or invalid bearer token"},
    404: {"model": schemas.ErrorResponse, "description": "unknown operator"},
    413: {"model": schemas.ErrorResponse, "description": "request body too large"},
    422: {"model": schemas.ErrorResponse, "description": "invalid request; `loc` names the field"},
    429: {"model": schemas.ErrorResponse, "description": "busy (oracle slots or training queue full); see Retry-After"},
    503: {"model": schemas.ErrorResponse, "description": "operator loading or update not persisted"},
}


def answers(model, status: int = 200, description: str = "OK", headers: dict | None = None, **more) -> dict:
    """OpenAPI ``responses``: the success answer's model (documentation only: the routes encode their answers
    themselves, and the Schemathesis contract test checks that they match) and the error answers."""
    ok = {"model": model, "description": description}
    if headers:
        ok["headers"] = headers
    return {status: ok, **{k: v for k, v in ERRORS.items() if k != 400 or more.pop("body", False)}, **more}


# ------------------------------------------------------------------------------ dependencies
# The cheap dependencies are ``async``: FastAPI runs a sync dependency in the thread pool, one
# thread hop each (measured: most of a one-message request's server time under load).
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> OperatorStore:
    return request.app.state.store


def _entry(store: OperatorStore, name: str) -> Entry:
    try:
        return store.get(name)
    except NotFound as exc:
        raise ApiError(404, ["path", "name"], str(exc), "not_found") from None
    except NotReady as exc:
        raise ApiError(503, ["path", "name"], scrub(str(exc), store.root), "not_ready", {"Retry-After": "1"}) from None


async def get_entry(request: Request, name: Annotated[str, Path(description="operator name")]) -> Entry:
    store: OperatorStore = request.app.state.store
    entry = store.entries.get(name)  # a served operator: a dict look-up, no I/O
    if entry is not None:
        return entry
    # unknown, loading, or (a replica) to be adopted from the shared store: may do I/O
    return await run_in_threadpool(_entry, store, name)


Mode = Literal["predict", "jit", "oracle"]


def _request_body(model) -> dict:
    """OpenAPI: the body is parsed by :func:`service.validation.parse_body`, not by FastAPI
    (bounded memory, strict numbers); the schema is registered in ``app.openapi``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


@contextmanager
def oracle_slot(request: Request):
    """One of ``KJIT_ORACLE_CONCURRENCY`` slots for oracle work; 429 after ``KJIT_ORACLE_WAIT`` s."""
    sem: threading.Semaphore = request.app.state.oracle_slots
    settings: Settings = request.app.state.settings
    if not sem.acquire(timeout=settings.oracle_wait):
        raise ApiError(429, [], f"the oracle is busy ({settings.oracle_concurrency} request(s) at a time, "
                                f"KJIT_ORACLE_CONCURRENCY); retry later", "oracle_busy", {"Retry-After": "2"})
    try:
        yield
    finally:
        sem.release()


def canonical_hash(req) -> str:
    """Hash of the request's canonical JSON (sorted keys, floats as parsed): re-serialising the
    same request gives the same Idempotency-Key fingerprint."""
    text = json.dumps(req.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return body_hash(text.encode())


def _row_errors(rows, where: list, what: str, type_: str) -> ApiError:
    return ApiError.many(422, [{"loc": where + [int(i)], "type": type_, "msg": f"row {int(i)}: {what}"}
                               for i in rows])


# ------------------------------------------------------------------------------ conversion
def _floats(a) -> list:
    a = np.asarray(a, dtype=float).ravel()
    if np.isfinite(a).all():
        return a.tolist()
    return [float(x) if np.isfinite(x) else None for x in a]


def columns(m: Family) -> dict:
    return {"family": family_name(m), **{n: _floats(p) for n, p in zip(m.param_names, m.params)}}


def _cols(a) -> list:
    """(n, k) array → k lists of n numbers (column-wise, like the parameters; null if not finite)."""
    a = np.asarray(a, dtype=float)
    return [_floats(a[:, j]) for j in range(a.shape[1])]


def to_families(factor: Factor, incoming: dict, max_batch: int, loc=("body", "incoming")) -> dict[str, Family]:
    """Validate a request's incoming batches against the factor; 422 naming every bad field."""
    errors = []
    loc = list(loc)
    for v in incoming:
        if v not in factor.variables:
            errors.append({"loc": loc + [v], "type": "unknown_variable",
                           "msg": f"{v!r} is not a variable of factor {factor.name!r}; its variables are "
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


def _check_to(entry: Entry, store: OperatorStore, to: str) -> None:
    factor = entry.jit.factor
    if to not in factor.variables:
        raise ApiError(422, ["body", "to"], f"unknown recipient {to!r} for factor {factor.name!r}; its variables are "
                                            f"{', '.join(factor.variables)}", "unknown_recipient")
    if to != entry.jit.to:
        others = [n for n in store.names() if (e := store.entries.get(n)) is not None
                  and e.jit.factor.name == factor.name and e.jit.to == to]
        hint = f"; operator {others[0]!r} sends to {to!r}" if others else ""
        raise ApiError(422, ["body", "to"], f"operator {entry.name!r} sends messages to {entry.jit.to!r}, not "
                                            f"{to!r}{hint}", "wrong_recipient")


def _json(payload, status: int = 200, headers=None) -> Response:
    # pydantic_core's encoder: ~10x faster than json.dumps on long float lists, and exact (shortest
    # round-trip repr); non-finite values were mapped to null above, "null" is only a safety net
    return Response(pydantic_core.to_json(payload, inf_nan_mode="null"), status_code=status,
                    media_type="application/json", headers=headers)


def _failed(store: OperatorStore) -> dict:
    """Why operators failed, without the server's paths (the full text is in the log)."""
    return {k: scrub(v, store.root) for k, v in dict(store.failed).items()}


# ------------------------------------------------------------------------------ health
@router.get("/health", tags=["health"], summary="liveness: the process answers", response_model=schemas.Health)
async def health():  # on the event loop: answers even when the thread pool is busy
    return {"status": "ok", "kjit_version": kjit_version}


@router.get("/ready", tags=["health"], summary="readiness: every operator of the store is loaded",
            response_model=None, responses={200: {"model": schemas.Ready, "description": "every operator is loaded"},
                                            503: {"model": schemas.Ready,
                                                  "description": "still loading, or an operator failed to load"}})
def ready(store: Annotated[OperatorStore, Depends(get_store)]):
    waiting = store.loading | store.retry
    body = {"ready": store.loaded and not store.failed and not waiting, "operators": store.names(),
            "loading": sorted(waiting), "failed": _failed(store)}
    if store.missing_factors:  # operator → the factor it needs that this server does not have
        body["missing_factors"] = dict(store.missing_factors)
    return _json(body, 200 if body["ready"] else 503)


# ------------------------------------------------------------------------------ operators
@router.get("/v1/operators", tags=["operators"], summary="list the operators", response_model=schemas.OperatorList)
def list_operators(store: Annotated[OperatorStore, Depends(get_store)]):
    ops = []
    for n in store.names():
        e = store.entries.get(n)
        if e is not None:
            with e.lock.read():
                ops.append(e.summary())
    return {"operators": ops, "loading": sorted(store.loading), "failed": _failed(store),
            "factors": list(registered_factors())}


@router.get("/v1/operators/{name}", tags=["operators"], response_model=None,
            responses=answers(schemas.OperatorDetail),
            summary="an operator: factor, direction, families, feature sizes, hyperparameters, counters, version")
def operator_detail(entry: Annotated[Entry, Depends(get_entry)], settings: Annotated[Settings, Depends(get_settings)]):
    d = entry.detail()
    d["limits"] = {"max_batch": settings.max_batch, "max_body_bytes": settings.max_body_bytes,
                   "max_oracle_batch": settings.max_oracle_batch}
    return _json(d)


@router.post(
    "/v1/operators/{name}/messages", tags=["messages"], response_model=None,
    responses=answers(schemas.MessagesResponse, body=True),
    openapi_extra=_request_body(schemas.MessagesRequest),
    summary="outgoing messages and beliefs for a batch of incoming messages",
    description=(
        "`mode=predict`: the learned operator answers every row (never the oracle; read-only).\n\n"
        "`mode=jit` (default): rows whose log predictive variance exceeds the operator's threshold in any "
        "coordinate go to the oracle, whose answers are returned and learned (durably, before the response; "
        "needs the token when one is configured).\n\n"
        "`mode=oracle`: the oracle answers every row; nothing is learned (needs the token when one is "
        "configured; at most KJIT_MAX_ORACLE_BATCH rows, KJIT_ORACLE_CONCURRENCY requests at a time).\n\n"
        "`beliefs` are the projected beliefs q; `messages` are q / incoming[to], whose natural parameters are "
        "always given (an outgoing message can be improper; then its parameters are not a distribution and "
        "`is_proper` is false)."),
)
async def messages(
    request: Request,
    entry: Annotated[Entry, Depends(get_entry)],
    req: Annotated[schemas.MessagesRequest, Depends(body_dependency(schemas.MessagesRequest))],
    mode: Annotated[Mode, Query(description="predict | jit | oracle")] = "jit",
):
    # A small read-only batch is answered on the event loop (two small matrix-vector products:
    # less than the thread hops it would otherwise cost), unless an update holds or waits for
    # the operator's lock — then, and for everything else, in the thread pool.
    settings: Settings = request.app.state.settings
    if mode == "predict" and _rows(req) <= INLINE_ROWS:
        try:
            return _messages(request, entry, settings, req, mode, wait=False)
        except WouldBlock:
            pass
    return await run_in_threadpool(_messages, request, entry, settings, req, mode)


#: largest ``mode=predict`` batch answered on the event loop
INLINE_ROWS = 16


def _rows(req: schemas.MessagesRequest) -> int:
    """The longest column of the request (its rows, if valid)."""
    return max((len(c) for b in req.incoming.values() for c in b.__dict__.values() if isinstance(c, list)),
               default=0)


def _messages(request: Request, entry: Entry, settings: Settings, req: schemas.MessagesRequest, mode: str,
              wait: bool = True) -> Response:
    store = request.app.state.store
    metrics = request.app.state.metrics
    if mode != "predict" and isinstance(entry.jit.oracle, ClientOracle):
        raise ApiError(422, ["query", "mode"], f"operator {entry.name!r} has no oracle on the server (its clients run "
                                               f"it): use mode=predict and send the oracle's answers to "
                                               f"/v1/operators/{entry.name}/observations", "no_server_oracle")
    _check_to(entry, store, req.to)
    inc = to_families(entry.jit.factor, req.incoming, settings.max_batch)
    n_rows = len(next(iter(inc.values())))
    if mode == "oracle" and n_rows > settings.max_oracle_batch:
        v = entry.jit.factor.variables[0]
        raise ApiError(422, ["body", "incoming", v, entry.jit.factor.families[v].param_names[0]],
                       f"batch of {n_rows} messages exceeds the limit of {settings.max_oracle_batch} per "
                       f"mode=oracle request (KJIT_MAX_ORACLE_BATCH); split it", "too_long")
    try:
        uncertain = None
        if mode == "oracle":
            with oracle_slot(request):
                q, logvar, consulted, version, n_learned, cert, uncertain = entry.predict_certified(inc, mode)
        else:  # mode=predict also marks the rows the just-in-time rule would consult ("uncertain")
            q, logvar, consulted, version, n_learned, cert, uncertain = entry.predict_certified(inc, mode, wait=wait)
    except OracleFailure as exc:
        raise ApiError(422, ["body", "incoming"], f"the oracle failed on these messages: {exc}", "oracle_failed") from None
    except Unprocessable as exc:
        rows = bad_feature_rows(entry.jit.operator, inc)
        if rows:
            raise _row_errors(rows, ["body", "incoming"], "the operator cannot evaluate these messages (their "
                              "random features are not finite numbers)", "not_computable") from None
        raise ApiError(422, ["body", "incoming"], f"these messages cannot be answered: {exc}", "not_computable") from None
    except PersistError as exc:
        if exc.unknown:
            raise ApiError(503, [], f"{exc}; the oracle's answers may or may not have been learned",
                           "outcome_unknown") from None
        raise ApiError(503, [], f"{exc}; nothing was learned", "not_persisted") from None
    if mode != "jit":  # (read-only modes; a jit answer was learned already, and is finite: from_coords checks)
        rows = bad_output_rows(q, logvar)
        if rows:
            raise _row_errors(rows, ["body", "incoming"], "the answer for these messages is not a finite belief",
                              "not_computable")
    msg = q / inc[entry.jit.to]
    n = len(q)
    n_cons = int(np.count_nonzero(consulted))
    metrics.messages.labels(entry.name, mode).inc(n)
    if n_cons:
        metrics.consultations.labels(entry.name).inc(n_cons)
    if n_learned:
        metrics.updates.labels(entry.name, "jit").inc(n_learned)
        metrics.records.labels(entry.name).inc()
    out_msgs = columns(msg)
    out_msgs["natural"] = _cols(msg.natural().reshape(n, -1))
    out_msgs["is_proper"] = np.asarray(msg.is_proper).tolist()
    payload = {
        "operator": entry.name, "to": entry.jit.to, "mode": mode, "version": version, "n": n, "n_consulted": n_cons,
        "coords": list(entry.jit.family.coord_names),
        # the factor's projection convention (a factor parameter where it offers a choice)
        "projection": str(entry.jit.factor.params().get("projection", "kl")),
        "beliefs": columns(q), "messages": out_msgs,
        "log_var": None if logvar is None else _cols(logvar),
        "consulted": np.asarray(consulted).tolist(),
        "certificates": cert.to_json(),  # per row: source, quality, propriety (kjit.certificates)
        "uncertain": None if uncertain is None else np.asarray(uncertain).tolist(),
    }
    return _json(payload)


@router.post(
    "/v1/operators/{name}/observations", tags=["messages"], response_model=None,
    responses=answers(schemas.ObservationsResponse, body=True, **{
        "409": {"model": schemas.ErrorResponse, "description": "Idempotency-Key reused with another body"}}),
    openapi_extra=_request_body(schemas.ObservationsRequest),
    summary="add (incoming, belief) pairs computed elsewhere (online update, durable before the response)",
    description=("Send an `Idempotency-Key` header (any unique string, e.g. a UUID) to make retries safe: a request "
                 "whose key was seen before adds nothing and returns the first response with `duplicate: true`."),
)
def observations(
    request: Request,
    entry: Annotated[Entry, Depends(get_entry)],
    settings: Annotated[Settings, Depends(get_settings)],
    req: Annotated[schemas.ObservationsRequest, Depends(body_dependency(schemas.ObservationsRequest))],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
):
    factor = entry.jit.factor
    inc = to_families(factor, req.incoming, settings.max_batch)
    want = family_name(entry.jit.family)
    if req.beliefs.family != want:
        raise ApiError(422, ["body", "beliefs", "family"],
                       f"operator {entry.name!r} learns {want} beliefs on {entry.jit.to!r}, got {req.beliefs.family!r}",
                       "wrong_family")
    fam = entry.jit.family
    cols = [getattr(req.beliefs, p) for p in fam.param_names]
    errs = []
    for p, c in zip(fam.param_names[1:], cols[1:]):
        if len(c) != len(cols[0]):
            errs.append({"loc": ["body", "beliefs", p], "type": "length_mismatch",
                         "msg": f"{len(c)} values, but {fam.param_names[0]!r} has {len(cols[0])}"})
    n_inc = len(next(iter(inc.values())))
    if len(cols[0]) != n_inc:
        errs.append({"loc": ["body", "beliefs", fam.param_names[0]], "type": "length_mismatch",
                     "msg": f"{len(cols[0])} beliefs for {n_inc} rows of incoming messages"})
    if errs:
        raise ApiError.many(422, errs)
    beliefs = fam(*cols)
    jit = entry.jit
    rows = bad_feature_rows(jit.operator, inc)
    if rows:
        raise _row_errors(rows, ["body", "incoming"], "the operator cannot evaluate these messages (their random "
                          "features are not finite numbers)", "not_computable")
    bad = implausible_rows(jit, inc, beliefs, settings.observation_max_z, settings.observation_max_kl,
                           slot=lambda: oracle_slot(request))
    if bad:
        raise ApiError.many(422, [{"loc": ["body", "beliefs", i], "type": "implausible_belief",
                                   "msg": f"row {i}: not a belief the factor can produce from these incoming "
                                          f"messages: {why}"} for i, why in bad])
    try:
        version, accepted, dup = entry.observe(inc, beliefs, idempotency_key,
                                               canonical_hash(req) if idempotency_key else None)
    except Conflict as exc:
        raise ApiError(409, ["header", "Idempotency-Key"], str(exc), "idempotency_conflict") from None
    except PersistError as exc:
        if exc.unknown:
            raise ApiError(503, [], f"{exc}; retry with the same Idempotency-Key to apply it exactly once",
                           "outcome_unknown") from None
        raise ApiError(503, [], f"{exc}; nothing was added", "not_persisted") from None
    except Unprocessable as exc:  # the operator was rebuilt from the store: nothing was added
        raise ApiError(422, ["body"], f"these observations cannot be learned: {exc}", "not_computable") from None
    except Exception as exc:  # the operator was rebuilt from the store: nothing was added
        raise internal_error("the update failed and was rolled back", exc, type_="update_failed") from None
    metrics = request.app.state.metrics
    if not dup:
        metrics.updates.labels(entry.name, "observations").inc(accepted)
        metrics.records.labels(entry.name).inc()
    with entry.lock.read():
        n_train = int(entry.jit.operator.n_train_)
    return _json({"operator": entry.name, "accepted": accepted, "version": version, "n_train": n_train,
                  "duplicate": dup})


@router.post(
    "/v1/operators/{name}/merge", tags=["replicas"], response_model=None,
    responses=answers(schemas.MergeResponse, **{
        "409": {"model": schemas.ErrorResponse, "description": "this server is not a replica"}}),
    summary="replicas: apply the other replicas' updates from the shared store now",
    description=("A replica (`KJIT_SHARED_STORE`) merges every `KJIT_MERGE_INTERVAL` seconds on its own and before "
                 "every update it takes; this applies the shared log's records up to its current end now. "
                 "Replicas at the same `version` predict bit for bit identically."),
)
def merge(entry: Annotated[Entry, Depends(get_entry)]):
    try:
        merged = entry.merge()
        length = entry.shared.length(entry.name)
    except Conflict as exc:
        raise ApiError(409, ["path", "name"], str(exc), "not_replicated") from None
    except SharedLogError as exc:
        raise ApiError(503, [], f"the shared store is unavailable: {exc}", "shared_store_unavailable") from None
    except ValueError as exc:
        raise internal_error("the shared log could not be applied; the operator is reported failed", exc, 503,
                             "shared_log_damaged") from None
    return _json({"operator": entry.name, "merged": merged, "version": entry.version, "shared_length": length})


# ------------------------------------------------------------------------------ training jobs
def _beliefs_from(batch, fam, n: int, loc: list) -> Family:
    """A request's belief batch of family ``fam`` for ``n`` rows; 422 naming the field."""
    want = family_name(fam)
    if batch.family != want:
        raise ApiError(422, loc + ["family"], f"beliefs on this recipient are {want} messages, got {batch.family!r}",
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


def _client_spec(req: schemas.TrainRequest, settings: Settings) -> TrainSpec:
    """``source.kind == "client"``: a factor known by its variables and families (no code here)."""
    src = req.source
    if req.factor_params:
        raise ApiError(422, ["body", "factor_params"], "a factor declared by its variables takes no parameters",
                       "value_error")
    try:
        factor = get_factor("declared", label=req.factor, variables=dict(src.variables), output=src.output)
    except ValueError as exc:
        path = str(exc).split(":", 1)[0].split(".")
        loc = ["body", "factor"] if path == ["label"] else ["body", "source", *path]
        raise ApiError(422, loc, str(exc), "value_error") from None
    if req.to not in factor.variables:
        raise ApiError(422, ["body", "to"], f"unknown recipient {req.to!r}; the variables are "
                                            f"{', '.join(factor.variables)}", "unknown_recipient")
    inc = to_families(factor, src.incoming, settings.max_batch, loc=("body", "source", "incoming"))
    n = len(next(iter(inc.values())))
    if n < 4:
        raise ApiError(422, ["body", "source", "beliefs"], f"{n} initial pairs; at least 4 are needed", "too_short")
    beliefs = _beliefs_from(src.beliefs, factor.families[req.to], n, ["body", "source", "beliefs"])
    pairs = TrainingSet(factor.name, req.to, inc, beliefs, factor.params())
    return TrainSpec(factor="declared", to=req.to, factor_params=factor.params(), n_inner=req.n_inner,
                     n_outer=req.n_outer, threshold=req.threshold, initial_batch=req.initial_batch,
                     random_state=req.random_state, oracle="client", pairs=pairs, n_jobs=settings.n_jobs)


def _spec_from_request(req: schemas.TrainRequest, settings: Settings) -> TrainSpec:
    if req.source.kind == "client":
        return _client_spec(req, settings)
    try:
        factor = get_factor(req.factor, **req.factor_params)
    except ValueError as exc:
        field = "factor" if "unknown factor" in str(exc) else "factor_params"
        raise ApiError(422, ["body", field], str(exc), "value_error") from None
    except TypeError as exc:
        raise ApiError(422, ["body", "factor_params"], f"factor {req.factor!r}: {exc}", "value_error") from None
    if req.to not in factor.variables:
        raise ApiError(422, ["body", "to"], f"unknown recipient {req.to!r} for factor {factor.name!r}; its variables "
                                            f"are {', '.join(factor.variables)}", "unknown_recipient")
    src = req.source
    spec = TrainSpec(factor=req.factor, to=req.to, factor_params=dict(req.factor_params), n_inner=req.n_inner,
                     n_outer=req.n_outer, threshold=req.threshold, initial_batch=req.initial_batch,
                     random_state=req.random_state, oracle=src.oracle, n_samples=src.n_samples,
                     target_se=src.target_se, n_jobs=settings.n_jobs)
    try:
        spec.oracle = spec.resolved_oracle(factor)  # "auto" → the kind chosen, recorded with the operator
        spec.build_oracle(factor)
    except ValueError as exc:
        raise ApiError(422, ["body", "source", "oracle"], str(exc), "value_error") from None
    if src.kind == "oracle":
        spec.n = src.n
        if src.distribution == "default":
            if factor.default_incoming is None:
                raise ApiError(422, ["body", "source", "distribution"],
                               f"no default distribution for factor {factor.name!r}; give per-parameter ranges",
                               "value_error")
            spec.distribution = "default"
        else:
            ranges = {v: {p: r.model_dump() for p, r in d.items()} for v, d in src.distribution.items()}
            try:
                sampler_from_ranges(factor, ranges)
            except ValueError as exc:
                path = str(exc).split(":", 1)[0].split(".")
                raise ApiError(422, ["body", "source", "distribution", *path], str(exc), "value_error") from None
            spec.distribution = ranges
    else:
        base = settings.training_dir.resolve()
        p = (base / src.path).resolve()
        if not p.is_relative_to(base):
            raise ApiError(422, ["body", "source", "path"], f"{src.path!r} is outside the training-set directory",
                           "value_error")
        if not p.is_file():
            raise ApiError(422, ["body", "source", "path"], f"no training-set file {src.path!r} in the store's "
                                                            f"training-set directory", "value_error")
        spec.training_set = str(p)
    return spec


@router.post("/v1/operators", tags=["training"], status_code=202, response_model=None,
             responses=answers(schemas.Job, 202, "accepted: the job is queued", body=True, headers={
                 "Location": {"description": "the job: /v1/jobs/{id}", "schema": {"type": "string"}}}, **{
                 "409": {"model": schemas.ErrorResponse, "description": "the name is taken"}}),
             openapi_extra=_request_body(schemas.TrainRequest),
             summary="train a new operator in the background (poll the job in the Location header)")
def create_operator(request: Request, settings: Annotated[Settings, Depends(get_settings)],
                    req: Annotated[schemas.TrainRequest, Depends(body_dependency(schemas.TrainRequest))]):
    store: OperatorStore = request.app.state.store
    jobs = request.app.state.jobs
    errs = []
    n = getattr(req.source, "n", None)
    for loc, value, limit, env in ((["body", "source", "n"], n, settings.max_train_n, "KJIT_MAX_TRAIN_N"),
                                   (["body", "n_inner"], req.n_inner, settings.max_n_inner, "KJIT_MAX_N_INNER"),
                                   (["body", "n_outer"], req.n_outer, settings.max_n_outer, "KJIT_MAX_N_OUTER"),
                                   (["body", "source", "n_samples"],
                                    getattr(req.source, "n_samples", None)
                                    if getattr(req.source, "oracle", None) in ("importance_sampling",
                                                                               "message_sampler", "auto") else None,
                                    settings.max_n_samples, "KJIT_MAX_N_SAMPLES")):
        if value is not None and value > limit:
            errs.append({"loc": loc, "type": "too_large",
                         "msg": f"{value} exceeds this server's limit of {limit} ({env})"})
    if errs:
        raise ApiError.many(422, errs)
    if store.exists(req.name):
        raise ApiError(409, ["body", "name"], f"an operator named {req.name!r} already exists", "name_taken")
    spec = _spec_from_request(req, settings)
    try:
        record = req.model_dump()
        if spec.pairs is not None:  # the job record keeps the pairs' count, not the pairs
            record["source"] = {k: v for k, v in record["source"].items() if k not in ("incoming", "beliefs")}
            record["source"]["n_pairs"] = len(spec.pairs)
        job = jobs.submit(req.name, spec, record, max_pending=settings.max_queued_jobs)
    except Conflict as exc:
        raise ApiError(409, ["body", "name"], str(exc), "name_taken") from None
    except QueueFull as exc:
        raise ApiError(429, [], str(exc), "queue_full", {"Retry-After": "30"}) from None
    return _json(job.as_dict(), 202, {"Location": f"/v1/jobs/{job.id}"})


@router.get("/v1/jobs", tags=["training"], response_model=schemas.JobList,
            summary="training jobs (their records are kept in the store across restarts)")
def list_jobs(request: Request):
    return {"jobs": [j.as_dict() for j in request.app.state.jobs.list()]}


@router.get("/v1/jobs/{job_id}", tags=["training"], response_model=None, responses=answers(schemas.Job),
            summary="a training job: status and progress")
def job_status(job_id: str, request: Request):
    job = request.app.state.jobs.get(job_id)
    if job is None:
        raise ApiError(404, ["path", "job_id"], f"unknown job {job_id!r}", "not_found")
    return _json(job.as_dict())


# ------------------------------------------------------------------------------ metrics
@router.get("/metrics", tags=["health"], summary="Prometheus metrics (text format)",
            response_class=Response)
def metrics(request: Request):
    from .metrics import CONTENT_TYPE

    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
