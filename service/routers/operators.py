"""Operators: list, describe, create (a background training job)."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends

from kjit.errors import quoted
from kjit.factors import FactorBuildError, FactorParamError, UnknownFactorError, get_factor, registered_factors
from kjit.training import TrainingSet

from .. import schemas
from ..deps import EntryDep, JobsDep, SettingsDep, StoreDep
from ..errors import ApiError
from ..jobs import QueueFull, scrub
from ..settings import Settings
from ..store import Conflict
from ..training import TrainSpec, sampler_from_ranges
from ..validation import body_dependency
from ..wire import beliefs_from, to_families
from .base import answers, failed, json_response, request_body

router = APIRouter()


@router.get("/v1/operators", tags=["operators"], summary="list the operators", response_model=schemas.OperatorList)
def list_operators(store: StoreDep):
    ops = []
    for n in store.names():
        e = store.entries.get(n)
        if e is not None:
            with e.lock.read():
                ops.append(e.summary())
    return {"operators": ops, "loading": sorted(store.loading), "failed": failed(store),
            "factors": list(registered_factors())}


@router.get("/v1/operators/{name}", tags=["operators"], response_model=None, responses=answers(schemas.OperatorDetail),
            summary="an operator: factor, direction, families, feature sizes, hyperparameters, counters, version")
def operator_detail(entry: EntryDep, settings: SettingsDep):
    d = entry.detail()
    d["limits"] = {"max_batch": settings.max_batch, "max_body_bytes": settings.max_body_bytes,
                   "max_oracle_batch": settings.max_oracle_batch}
    return json_response(d)


@router.post("/v1/operators", tags=["training"], status_code=202, response_model=None,
             responses=answers(schemas.Job, 202, "accepted: the job is queued", body=True, headers={
                 "Location": {"description": "the job: /v1/jobs/{id}", "schema": {"type": "string"}}}, **{
                 "409": {"model": schemas.ErrorResponse, "description": "the name is taken"}}),
             openapi_extra=request_body(schemas.TrainRequest),
             summary="train a new operator in the background (poll the job in the Location header)")
def create_operator(settings: SettingsDep, store: StoreDep, jobs: JobsDep,
                    req: Annotated[schemas.TrainRequest, Depends(body_dependency(schemas.TrainRequest))]):
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
    return json_response(job.as_dict(), 202, {"Location": f"/v1/jobs/{job.id}"})


# ------------------------------------------------------------------------------ the job's spec from a request
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
        raise ApiError(422, ["body", "to"], f"unknown recipient {quoted(req.to)}; the variables are "
                                            f"{', '.join(factor.variables)}", "unknown_recipient")
    inc = to_families(factor, src.incoming, settings.max_batch, loc=("body", "source", "incoming"))
    n = len(next(iter(inc.values())))
    if n < 4:
        raise ApiError(422, ["body", "source", "beliefs"], f"{n} initial pairs; at least 4 are needed", "too_short")
    beliefs = beliefs_from(src.beliefs, factor.families[req.to], n, ["body", "source", "beliefs"])
    # what the job would fail on, refused now (found by an audit: 202, then a failed job)
    with np.errstate(all="ignore"):
        coords = np.asarray(beliefs.to_coords(), float).reshape(n, -1)
    bad = np.flatnonzero(~np.all(np.isfinite(coords), axis=1))
    if bad.size:
        raise ApiError.many(422, [{"loc": ["body", "source", "beliefs", int(i)], "type": "value_error",
                                   "msg": f"belief {int(i)} has regression coordinates that are not finite numbers "
                                          f"({', '.join(factor.families[req.to].coord_names)}): it cannot be learned"}
                                  for i in bad[:10]])
    rows = np.concatenate([coords] + [np.stack([np.ravel(p) for p in m.params], axis=1) for m in inc.values()], axis=1)
    if len(np.unique(rows, axis=0)) < 2:
        raise ApiError(422, ["body", "source", "incoming"], "every pair is the same: at least 2 distinct pairs are "
                       "needed", "value_error")
    pairs = TrainingSet(factor.name, req.to, inc, beliefs, factor.params())
    return TrainSpec(factor="declared", to=req.to, factor_params=factor.params(), n_inner=req.n_inner,
                     n_outer=req.n_outer, threshold=req.threshold, kl_cap=req.kl_cap,
                     initial_batch=req.initial_batch,
                     random_state=req.random_state, oracle="client", pairs=pairs, n_jobs=settings.n_jobs)


def _spec_from_request(req: schemas.TrainRequest, settings: Settings) -> TrainSpec:
    if req.source.kind == "client":
        return _client_spec(req, settings)
    try:
        factor = get_factor(req.factor, **req.factor_params)
    except FactorParamError as exc:  # the factor names the parameter (a number sent as text, a bad range)
        raise ApiError(422, ["body", "factor_params", exc.param], str(exc), "value_error") from None
    except ValueError as exc:
        field = "factor" if isinstance(exc, (UnknownFactorError, FactorBuildError)) else "factor_params"
        raise ApiError(422, ["body", field], str(exc), "value_error") from None
    except TypeError as exc:
        raise ApiError(422, ["body", "factor_params"], f"factor {quoted(req.factor)}: {exc}", "value_error") from None
    if req.to not in factor.variables:
        raise ApiError(422, ["body", "to"], f"unknown recipient {quoted(req.to)} for factor {factor.name!r}; its variables "
                                            f"are {', '.join(factor.variables)}", "unknown_recipient")
    src = req.source
    spec = TrainSpec(factor=req.factor, to=req.to, factor_params=dict(req.factor_params), n_inner=req.n_inner,
                     n_outer=req.n_outer, threshold=req.threshold, kl_cap=req.kl_cap,
                     initial_batch=req.initial_batch,
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
            if req.to in factor.default_untrainable:
                raise ApiError(422, ["body", "to"], f"no operator for {factor.name!r} → {quoted(req.to)} can be trained "
                               f"from its default distribution: {factor.default_untrainable[req.to]}", "value_error")
            spec.distribution = "default"
        else:
            ranges = {v: {p: r.model_dump() for p, r in d.items()} for v, d in src.distribution.items()}
            try:
                sampler_from_ranges(factor, ranges)
            except ValueError as exc:
                path = str(exc).split(":", 1)[0].split(".")
                raise ApiError(422, ["body", "source", "distribution", *path], str(exc), "value_error") from None
            if all(r["low"] == r["high"] for d in ranges.values() for r in d.values()):
                raise ApiError(422, ["body", "source", "distribution"], "every range is a point (low = high): every "
                               "pair would be the same, and at least 2 distinct pairs are needed", "value_error")
            spec.distribution = ranges
    else:
        base = settings.training_dir.resolve()
        try:
            p = (base / src.path).resolve()
            p_is_file = p.is_file()
        except (ValueError, OSError) as exc:  # a NUL byte, a name too long (found in review: 500)
            raise ApiError(422, ["body", "source", "path"], f"{quoted(src.path)} is not a usable file name "
                                                            f"({type(exc).__name__})", "value_error") from None
        if not p.is_relative_to(base):
            raise ApiError(422, ["body", "source", "path"], f"{quoted(src.path)} is outside the training-set directory",
                           "value_error")
        if not p_is_file:
            raise ApiError(422, ["body", "source", "path"], f"no training-set file {quoted(src.path)} in the store's "
                                                            f"training-set directory", "value_error")
        # read now: a file that is not a training set of this factor and recipient is a 422, not a
        # 202 and a failed job (found by an audit: EOFError, KeyError, ... in the job's error)
        try:
            ts = TrainingSet.load(p)
            if (ts.factor, ts.to) != (factor.name, req.to):
                raise ValueError(f"the training set is for {ts.factor}→{ts.to}, not {factor.name}→{req.to}")
            factor.check_same((ts.factor, ts.factor_params), "the training set", "the operator")
            if len(ts) < 4:
                raise ValueError(f"the training set has {len(ts)} pairs; at least 4 are needed")
            factor.check_incoming(ts.incoming, req.to)  # (its variables and families)
            if not isinstance(ts.beliefs, factor.families[req.to]):
                raise ValueError(f"the training set's beliefs are {type(ts.beliefs).__name__} messages, not "
                                 f"{factor.families[req.to].__name__}")
        except (ValueError, OSError) as exc:
            raise ApiError(422, ["body", "source", "path"], scrub(str(exc), settings.store), "value_error") from None
        spec.training_set = str(p)
    return spec
