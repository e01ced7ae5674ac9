"""What the API shows of an operator (``GET /v1/operators`` and ``GET /v1/operators/{name}``)."""

from __future__ import annotations

import json

from kjit.families import family_name
from kjit.oracles import ClientOracle, ImportanceSamplingOracle, MessageImportanceSampler

from ..training import below_floor_note, unguarded_note

__all__ = ["summary", "detail", "oracle_kind"]


def oracle_kind(oracle) -> str:
    """The name a request uses for this oracle (``source.oracle`` of ``POST /v1/operators``)."""
    if isinstance(oracle, ClientOracle):
        return "client"
    if isinstance(oracle, MessageImportanceSampler):
        return "message_sampler"
    if isinstance(oracle, ImportanceSamplingOracle):
        return "importance_sampling"
    return "quadrature"


def _finite(x) -> float | None:
    return float(x) if x is not None and float(x) == float(x) and abs(float(x)) != float("inf") else None


def summary(entry) -> dict:
    """Name, factor, direction, families, version, training pairs (the caller holds the shared lock)."""
    jit = entry.jit
    fam = jit.factor.families
    return {
        "name": entry.name, "factor": jit.factor.name, "factor_params": jit.factor.params(),
        "to": jit.to, "inputs": [v for v in jit.factor.variables if v != jit.to],
        "families": {v: family_name(fam[v]) for v in jit.factor.variables},
        "version": entry.version, "n_train": int(jit.operator.n_train_),
    }


def detail(entry) -> dict:
    """Everything about one operator: features, hyperparameters, threshold, oracle, audit, counters,
    updates, how it was made, replication."""
    audit = entry.audit
    with entry.lock.read():
        jit, op = entry.jit, entry.jit.operator
        d = summary(entry)
        d.update({
            "features": {"n_inner": op.n_inner, "n_outer": op.n_outer, "treatment": op.treatment, "target": op.target},
            "hyperparameters": json.loads(json.dumps(op.hyperparameters(), default=lambda o: o.tolist())),
            "threshold": jit.threshold,
            "decision_weighting": op.decision_weighting,
            "density_guard": (None if _finite(jit.density_guard) is None else
                              {"value": jit.density_guard, "pairs": float(jit.guard_rows_)}),
            "input_margin": jit.input_margin,
            "kl_cap": getattr(jit, "kl_cap", None),
            "guard_note": unguarded_note(jit),
            "oracle": {"kind": oracle_kind(jit.oracle)},
            "audit": {"enabled": audit is not None and not isinstance(jit.oracle, ClientOracle),
                      "audited_pairs": entry.audited_pairs,
                      **entry.audit_stats.summary(audit.kl_target if audit is not None else None),
                      "server": audit.summary() if audit is not None else None},
            "threshold_floor": _finite(jit.threshold_floor()),
            "threshold_note": below_floor_note(jit) or (entry.audit_stats.threshold_changes[-1]["reason"]
                                                        if entry.audit_stats.threshold_changes else None),
            "counters": jit.counters(),
            "updates": {"version": entry.version, "observed_pairs": entry.observed_pairs,
                        "learned_pairs": entry.learned_pairs, "audited_pairs": entry.audited_pairs,
                        "log_generation": entry.log.gen,
                        "records_since_snapshot": entry.version - entry.snapshot_version},
            "training": entry.meta.get("training", {}),
            "source": entry.meta.get("source", {}),
            "created": entry.meta.get("created"),
            "kjit_version": entry.meta.get("kjit_version"),
        })
        if entry.shared is not None:
            d["replication"] = {"shared_store": entry.shared.url, "base_sha256": entry.base_hash,
                                "version": entry.version}
    return d
