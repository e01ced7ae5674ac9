"""Messages through an operator (``mode=predict|jit|oracle``) and observations to learn from."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from kjit.draws import SEED_MAX
from kjit.errors import quoted, rows_within
from kjit.oracles import ClientOracle

from .. import schemas
from ..deps import EntryDep, MetricsDep, OracleSlotDep, SettingsDep, StoreDep
from ..errors import ApiError, internal_error
from ..locks import WouldBlock
from ..metrics import Metrics
from ..middleware import trusted
from ..settings import Settings
from ..store import Conflict, Entry, OperatorStore, OracleFailure, PersistError, Unprocessable
from ..validation import bad_feature_rows, bad_output_rows, body_dependency, implausible_rows
from ..wire import answer_columns, beliefs_from, to_families
from .base import answers, canonical_hash, json_response, request_body, row_errors

router = APIRouter(tags=["messages"])

Mode = Literal["predict", "jit", "oracle"]

#: largest ``mode=predict`` batch answered on the event loop
INLINE_ROWS = 16


@router.post(
    "/v1/operators/{name}/messages", response_model=None,
    responses=answers(schemas.MessagesResponse, body=True),
    openapi_extra=request_body(schemas.MessagesRequest),
    summary="outgoing messages and beliefs for a batch of incoming messages",
    description=(
        "`mode=predict`: the learned operator answers every row (never the oracle; read-only).\n\n"
        "`mode=jit` (default): of the rows whose log predictive variance exceeds the operator's threshold in any "
        "coordinate, the fewest (most uncertain first) after whose learning every row is under it go to the oracle, "
        "whose answers are returned and learned (durably, before the response); the others are answered by the "
        "operator that learned them, and checked (needs the token when one is configured; at most "
        "KJIT_MAX_ORACLE_BATCH rows).\n\n"
        "`mode=oracle`: the oracle answers every row; nothing is learned (needs the token when one is "
        "configured; at most KJIT_MAX_ORACLE_BATCH rows, KJIT_ORACLE_CONCURRENCY requests at a time).\n\n"
        "`beliefs` are the projected beliefs q; `messages` are q / incoming[to], whose natural parameters are "
        "always given (an outgoing message can be improper; then its parameters are not a distribution and "
        "`is_proper` is false)."),
)
async def messages(
    request: Request,
    entry: EntryDep,
    settings: SettingsDep,
    store: StoreDep,
    metrics: MetricsDep,
    oracle_slot: OracleSlotDep,
    req: Annotated[schemas.MessagesRequest, Depends(body_dependency(schemas.MessagesRequest))],
    mode: Annotated[Mode, Query(description="predict | jit | oracle")] = "jit",
):
    return await answer(entry, settings, store, metrics, oracle_slot, req, mode, audit=trusted(request.scope))




@router.post(
    "/v1/operators/{name}/draws/mean/messages", response_model=None,
    responses=answers(schemas.MessagesResponse, body=True),
    openapi_extra=request_body(schemas.MessagesRequest),
    summary="beliefs and outgoing messages of the operator's posterior mean, as its draws are answered",
    description=(
        "The operator's own answers (the posterior mean of its weights; `mode=predict`'s beliefs) through the "
        "draws' path: read-only, never offered to the continuous audit, no log variance — the reference of a "
        "client's EP error bars (kjit.ep.error_bars, `RemoteOperator.draws`). No token needed."),
)
async def mean_messages(
    entry: EntryDep,
    settings: SettingsDep,
    store: StoreDep,
    metrics: MetricsDep,
    oracle_slot: OracleSlotDep,
    req: Annotated[schemas.MessagesRequest, Depends(body_dependency(schemas.MessagesRequest))],
):
    return await answer(entry, settings, store, metrics, oracle_slot, req, "predict", draw=MEAN)


#: ``draw`` of :func:`answer` for the posterior mean (the draws' path without a seed)
MEAN = "mean"


@router.post(
    "/v1/operators/{name}/draws/{seed}/messages", response_model=None,
    responses=answers(schemas.MessagesResponse, body=True),
    openapi_extra=request_body(schemas.MessagesRequest),
    summary="beliefs and outgoing messages of one draw of the operator from its regression's posterior",
    description=(
        "The answers of the operator whose weights are one draw from its regression's posterior (coef + R Z, with "
        "R R^T the weights' posterior covariance and Z standard normal from `seed`): the same draw for the same "
        "seed and `version`, so an EP run can be repeated with it — what a client's EP error bars re-run EP with "
        "(kjit.ep.error_bars, `RemoteOperator.draws`). Read-only, like `mode=predict`: no log variance, nothing "
        "learned, no token needed."),
)
async def draw_messages(
    entry: EntryDep,
    settings: SettingsDep,
    store: StoreDep,
    metrics: MetricsDep,
    oracle_slot: OracleSlotDep,
    req: Annotated[schemas.MessagesRequest, Depends(body_dependency(schemas.MessagesRequest))],
    seed: Annotated[int, Path(ge=0, le=SEED_MAX, description="the draw's seed (a non-negative integer)")],
):
    return await answer(entry, settings, store, metrics, oracle_slot, req, "predict", draw=seed)


async def answer(entry: Entry, settings: Settings, store: OperatorStore, metrics: Metrics, oracle_slot,
                 req: schemas.MessagesRequest, mode: str, audit: bool = True, draw: int | str | None = None) -> Response:
    """The messages route's answer (also :mod:`service.fastpath`'s, which calls it without FastAPI);
    ``audit``: whether the continuous audit may take its rows (:func:`trusted`); ``draw``: the seed of a
    draw of the operator (mode=predict)."""
    if draw is not None:  # (in the thread pool: a version's first draw factors the covariance)
        return await run_in_threadpool(partial(_messages, entry, settings, store, metrics, oracle_slot, req, mode,
                                               draw=draw))
    # A small read-only batch is answered on the event loop (two small matrix-vector products:
    # less than the thread hops it would otherwise cost), unless an update holds or waits for
    # the operator's lock — then, and for everything else, in the thread pool.
    args = (entry, settings, store, metrics, oracle_slot, req, mode)
    if mode == "predict" and _rows(req) <= INLINE_ROWS:
        try:
            return _messages(*args, wait=False, audit=audit)
        except WouldBlock:
            pass
    return await run_in_threadpool(partial(_messages, *args, audit=audit))


def _rows(req: schemas.MessagesRequest) -> int:
    """The longest column of the request (its rows, if valid)."""
    return max((len(c) for b in req.incoming.values() for c in b.__dict__.values() if isinstance(c, list)),
               default=0)


def _check_to(entry: Entry, store: OperatorStore, to: str) -> None:
    factor = entry.jit.factor
    if to not in factor.variables:
        raise ApiError(422, ["body", "to"], f"unknown recipient {quoted(to)} for factor {factor.name!r}; its variables are "
                                            f"{', '.join(factor.variables)}", "unknown_recipient")
    if to != entry.jit.to:
        others = [n for n in store.names() if (e := store.entries.get(n)) is not None
                  and e.jit.factor.same_as(factor) and e.jit.to == to]
        hint = f"; operator {others[0]!r} sends to {quoted(to)}" if others else ""
        raise ApiError(422, ["body", "to"], f"operator {entry.name!r} sends messages to {entry.jit.to!r}, not "
                                            f"{quoted(to)}{hint}", "wrong_recipient")


def _messages(entry: Entry, settings: Settings, store: OperatorStore, metrics: Metrics, oracle_slot,
              req: schemas.MessagesRequest, mode: str, wait: bool = True, audit: bool = True,
              draw: int | str | None = None) -> Response:
    if mode != "predict" and isinstance(entry.jit.oracle, ClientOracle):
        raise ApiError(422, ["query", "mode"], f"operator {entry.name!r} has no oracle on the server (its clients run "
                                               f"it): use mode=predict and send the oracle's answers to "
                                               f"/v1/operators/{entry.name}/observations — what "
                                               f"kjit.client.RemoteOperator(url, name, oracle=your_oracle) does",
                     "no_server_oracle")
    _check_to(entry, store, req.to)
    inc = to_families(entry.jit.factor, req.incoming, settings.max_batch)
    n_rows = len(next(iter(inc.values())))
    if mode in ("oracle", "jit") and n_rows > settings.max_oracle_batch:
        # (a jit request's oracle work and its greedy selection grow with its rows, under the operator's
        # write lock: 10 000 uncertain rows held it 130 s — found by an audit)
        v = entry.jit.factor.variables[0]
        raise ApiError(422, ["body", "incoming", v, entry.jit.factor.families[v].param_names[0]],
                       f"batch of {n_rows} messages exceeds the limit of {settings.max_oracle_batch} per "
                       f"mode={mode} request (KJIT_MAX_ORACLE_BATCH); split it", "too_long")
    try:
        if draw is not None:
            q, version, cert = entry.draw_belief(inc, None if draw == MEAN else draw)
            logvar, consulted, n_learned, uncertain = None, np.zeros(n_rows, dtype=bool), 0, None
        elif mode == "oracle":
            with oracle_slot():
                q, logvar, consulted, version, n_learned, cert, uncertain = entry.predict_certified(inc, mode,
                                                                                                     audit=audit)
        else:  # mode=predict also marks the rows the just-in-time rule would consult ("uncertain")
            q, logvar, consulted, version, n_learned, cert, uncertain = entry.predict_certified(inc, mode, wait=wait,
                                                                                                 audit=audit)
    except OracleFailure as exc:
        rows = rows_within(exc.rows, n_rows)
        if rows is not None:  # by row: a client (the EP engines) can skip just those and ask again for the rest
            raise row_errors(rows, ["body", "incoming"], f"the oracle failed on this message: {exc}",
                             "oracle_failed") from None
        raise ApiError(422, ["body", "incoming"], f"the oracle failed on these messages: {exc}", "oracle_failed") from None
    except Unprocessable as exc:
        rows = bad_feature_rows(entry.jit.operator, inc)
        if rows:
            raise row_errors(rows, ["body", "incoming"], "the operator cannot evaluate these messages (their "
                             "random features are not finite numbers)", "not_computable") from None
        rows = rows_within(exc.rows, n_rows)
        if rows is not None:  # by row, as the oracle's failures: a client can skip just those
            raise row_errors(rows, ["body", "incoming"], f"these messages cannot be answered: {exc}",
                             "not_computable") from None
        raise ApiError(422, ["body", "incoming"], f"these messages cannot be answered: {exc}", "not_computable") from None
    except PersistError as exc:
        if exc.unknown:
            raise ApiError(503, [], f"{exc}; the oracle's answers may or may not have been learned",
                           "outcome_unknown") from None
        raise ApiError(503, [], f"{exc}; nothing was learned", "not_persisted") from None
    if mode != "jit":  # (read-only modes; a jit answer was learned already, and is finite: from_coords checks)
        rows = bad_output_rows(q, logvar)
        if rows:
            raise row_errors(rows, ["body", "incoming"], "the answer for these messages is not a finite belief",
                             "not_computable")
    msg = q / inc[entry.jit.to]
    n = len(q)
    n_cons = int(np.count_nonzero(consulted))
    # (a draw's rows under their own label: found by an audit, they were counted as mode=predict's)
    metrics.child(metrics.messages, entry.name, "draw" if draw is not None else mode).inc(n)
    if n_cons:
        metrics.consultations.labels(entry.name).inc(n_cons)
    if n_learned:
        metrics.updates.labels(entry.name, "jit").inc(n_learned)
        metrics.records.labels(entry.name).inc()
    beliefs, out_msgs, log_var = answer_columns(q, msg, logvar)
    payload = {
        "operator": entry.name, "to": entry.jit.to, "mode": mode, "version": version, "n": n, "n_consulted": n_cons,
        # the factor answered for: a client checks it against the one it read when it started (found by an audit:
        # a server redeployed with probit_noise eps 0.3 under the same name answered a client built for eps 0.05)
        "factor": entry.jit.factor.name, "factor_params": entry.jit.factor.params(),
        "coords": list(entry.jit.family.coord_names),
        # the factor's projection convention (a factor parameter where it offers a choice)
        "projection": str(entry.jit.factor.params().get("projection", "kl")),
        "beliefs": beliefs, "messages": out_msgs, "log_var": log_var,
        "consulted": np.asarray(consulted).tolist(),
        "certificates": cert.to_json(),  # per row: source, quality, propriety (kjit.certificates)
        "uncertain": None if uncertain is None else np.asarray(uncertain).tolist(),
        "draw": draw,
    }
    return json_response(payload)


@router.post(
    "/v1/operators/{name}/observations", response_model=None,
    responses=answers(schemas.ObservationsResponse, body=True, **{
        "409": {"model": schemas.ErrorResponse, "description": "Idempotency-Key reused with another body"}}),
    openapi_extra=request_body(schemas.ObservationsRequest),
    summary="add (incoming, belief) pairs computed elsewhere (online update, durable before the response)",
    description=("Send an `Idempotency-Key` header (any unique string, e.g. a UUID) to make retries safe: a request "
                 "whose key was seen before adds nothing and returns the first response with `duplicate: true`."),
)
def observations(
    entry: EntryDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    oracle_slot: OracleSlotDep,
    req: Annotated[schemas.ObservationsRequest, Depends(body_dependency(schemas.ObservationsRequest))],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
):
    if idempotency_key is not None and not idempotency_key.strip():
        # (found by an audit: an empty key was taken, never remembered — every retry applied again, another body
        # under it no 409)
        raise ApiError(422, ["header", "Idempotency-Key"], "an empty Idempotency-Key is no key: send a unique "
                       "string (e.g. a UUID), or no header", "value_error")
    body_hash = canonical_hash(req) if idempotency_key else None
    if idempotency_key is not None:
        # a key applied before gets its first answer before this request is checked again: the checks (the
        # batch limit, the plausibility rule) may have changed since (a restart with a smaller
        # KJIT_MAX_BATCH refused a retry its first request had applied — found in review)
        try:
            with entry.lock.read():
                seen = entry.keys.seen(idempotency_key, body_hash)
        except Conflict as exc:
            raise ApiError(409, ["header", "Idempotency-Key"], str(exc), "idempotency_conflict") from None
        if seen is not None:
            n_rows = len(getattr(req.beliefs, entry.jit.family.param_names[0], None) or [])
            return _observed(entry, *seen, True, n_rows)
    factor = entry.jit.factor
    inc = to_families(factor, req.incoming, settings.max_batch)
    n_inc = len(next(iter(inc.values())))
    beliefs = beliefs_from(req.beliefs, entry.jit.family, n_inc, ["body", "beliefs"], recipient=entry.jit.to)
    jit = entry.jit
    # the rows beyond the operator's input margin are acknowledged and never learned (Entry.observe): not checked
    # either — not their plausibility, not their features (found in review, and again by a hostile-input audit: a
    # far one could refuse the whole request it would not be learned from).  Those below its density guard are
    # checked: learning elsewhere can move a row above the guard before the lock
    far = np.asarray(jit.outside_rows(inc, density=False), bool).reshape(-1)
    rows = [r for r in bad_feature_rows(jit.operator, inc) if not far[r]]
    if rows:
        raise row_errors(rows, ["body", "incoming"], "the operator cannot evaluate these messages (their random "
                         "features are not finite numbers)", "not_computable")
    idx = np.flatnonzero(~far)
    bad = []
    if idx.size:
        sub = ((inc, beliefs) if idx.size == n_inc else
               ({v: m.ravel()[idx] for v, m in inc.items()}, beliefs.ravel()[idx]))
        bad = [(int(idx[i]), why, kind) for i, why, kind in
               implausible_rows(jit, *sub, settings.observation_max_z, settings.observation_max_kl, slot=oracle_slot)]
    if bad:
        raise ApiError.many(422, [{"loc": ["body", "beliefs", i], "type": kind,
                                   "msg": f"row {i}: {why}"} for i, why, kind in bad])
    try:
        version, accepted, dup, n_train = entry.observe(inc, beliefs, idempotency_key, body_hash)
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
    if not dup and (accepted or idempotency_key is not None):  # (nothing learned and no key: no record written)
        metrics.updates.labels(entry.name, "observations").inc(accepted)
        metrics.records.labels(entry.name).inc()
    return _observed(entry, version, accepted, n_train, dup, len(beliefs))


def _observed(entry: Entry, version: int, accepted: int, n_train: int | None, dup: bool, n_rows: int) -> Response:
    """An observation's answer: ``n_train`` the operator's pairs at ``version``, taken under the lock that
    applied it (a second read after the update could see another request's update: found by an audit, 115
    of 160 answers under four writers); where that is not known (a key kept by an older server's
    snapshot, a record recovered from the log), the current count."""
    if n_train is None:
        with entry.lock.read():
            n_train = int(entry.jit.operator.n_train_)
    return json_response({"operator": entry.name, "accepted": accepted, "not_learned": max(n_rows - accepted, 0),
                          "version": version, "n_train": n_train, "duplicate": dup})
