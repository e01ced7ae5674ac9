"""Pydantic schemas of the HTTP API (requests validated here, responses documented here).

Message batches travel column-wise, one object per variable, like ``Family.to_dict()``::

    {"family": "gaussian", "mean": [0.0, 2.0], "var": [1.0, 0.5]}
    {"family": "beta", "alpha": [2.0, 1.0], "beta": [1.0, 2.0]}
    {"family": "gamma", "shape": [3.0], "rate": [1.5]}
    {"family": "bernoulli", "p": [1.0]}

Numbers must be finite: JSON has no NaN or infinity; the tokens ``NaN``, ``Infinity`` and
``-Infinity`` that some encoders emit anyway, and literals that overflow a double (``1e400``),
are rejected with 422 and the path of the offending number (``allow_inf_nan=False``).
Numbers are strict: a string (``"1.5"``) or a boolean where a number is expected is a 422.
Parameters must be valid and within the range the math can carry (:data:`PARAM_MAX`,
:data:`POSITIVE_MIN`): message parameters at most ``1e100`` in magnitude, variances, α, β,
shapes and rates in ``[1e-100, 1e100]``, Bernoulli p in [0, 1].  Lists stop at their first
invalid element (``fail_fast``), so a long list of bad numbers costs one error, not one each.
The batch models are generated from the family registry (each family's ``json_columns``: a
column is ``"finite"`` (a bounded real), ``"positive"`` or ``"probability"``), so a new family
travels over HTTP with no edit here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from kjit.families import FAMILIES
from kjit.oracles import ORACLE_KINDS

#: largest magnitude of a message parameter: squares and products of two parameters stay finite
PARAM_MAX = 1e100
#: smallest positive parameter (variance, α, β, shape, rate): its reciprocal stays below PARAM_MAX
POSITIVE_MIN = 1e-100

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Param = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-PARAM_MAX, le=PARAM_MAX)]
#: a factor parameter that is text (e.g. ``projection``): no booleans or numbers as text
FactorText = Annotated[str, Field(strict=True, min_length=1, max_length=200)]
#: a name the client sends — a variable, a factor, a family (found by an audit: unbounded, a 15 MiB `to`
#: came back whole in its 422; messages quote at most 100 characters of it, kjit.errors.quoted); bounded as
#: a path is, not tighter (found in review: a client-declared factor's 230-character variable, accepted
#: before, made its operator unusable at 200); no pattern: which names are accepted is the factors' contract
Label = Annotated[str, Field(max_length=4096)]


# (a bound pydantic checks in Rust: a per-number Python validator cost ~0.3 us an element, ~0.1 ms
# of a 100-message request)
Positive = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=POSITIVE_MIN, le=PARAM_MAX)]
def _integral(x):
    """JSON Schema's ``integer`` includes ``100.0``: an integral float is that integer (strict
    mode would refuse it; strings and booleans still are refused)."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


Int = Annotated[int, BeforeValidator(_integral)]
Probability = Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]
NonEmpty = dict(min_length=1, fail_fast=True)


class _Strict(BaseModel):
    # strict: no "1.5" strings or booleans where numbers are expected (merged into subclasses' configs)
    model_config = ConfigDict(extra="forbid", strict=True)


# a family's json_columns kinds → the column's element type
_CONSTRAINTS = {"finite": Param, "positive": Positive, "probability": Probability}


def _batch_model(name: str, fam) -> type[BaseModel]:
    """The request model of one family's message batch, from its ``json_columns``."""
    if not fam.json_columns:
        raise ValueError(f"family {fam.__name__} declares no json_columns: it cannot travel over HTTP")
    fields: dict[str, Any] = {"family": (Literal[name], ...)}
    for col, kind in fam.json_columns.items():
        fields[col] = (list[_CONSTRAINTS[kind]], Field(**NonEmpty))
    doc = (fam.__doc__ or fam.__name__).strip().splitlines()[0]
    return create_model(f"{fam.__name__}Batch", __base__=_Strict, __doc__=f"{doc} (message batch)", **fields)


def message_batch_models() -> dict[str, type[BaseModel]]:
    """Family name → request model, for every family in :data:`kjit.families.FAMILIES`."""
    return {name: _batch_model(name, fam) for name, fam in FAMILIES.items()}


_BATCH_MODELS = message_batch_models()
globals().update({m.__name__: m for m in _BATCH_MODELS.values()})  # GaussianBatch, BetaBatch, …
MessageBatch = Annotated[Union[tuple(_BATCH_MODELS.values())], Field(discriminator="family")]

_EXAMPLE_INCOMING = {
    "x": {"family": "gaussian", "mean": [0.0, 2.0], "var": [1.0, 0.5]},
    "z": {"family": "beta", "alpha": [2.0, 1.0], "beta": [1.0, 2.0]},
}


class MessagesRequest(_Strict):
    """A batch of incoming messages (one batch per variable of the factor, equal lengths)."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"to": "x", "incoming": _EXAMPLE_INCOMING}]})
    to: Label = Field(description="recipient variable: the operator's direction")
    incoming: dict[Label, MessageBatch] = Field(description="variable name → batch of messages from it to the factor")


class ObservationsRequest(_Strict):
    """(incoming, belief) pairs computed elsewhere, to be added online to the operator."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "incoming": _EXAMPLE_INCOMING,
        "beliefs": {"family": "gaussian", "mean": [0.42, 2.1], "var": [0.83, 0.45]}}]})
    incoming: dict[Label, MessageBatch]
    beliefs: MessageBatch = Field(description="projected beliefs q on the recipient, one per row")


class FamilyColumns(BaseModel):
    """Parameters column-wise; a value that is not a finite number is null."""
    model_config = ConfigDict(extra="allow")
    family: str


class OutgoingMessages(FamilyColumns):
    """Outgoing messages q / m_in: parameters (null where not finite), natural parameters
    (column-wise: one list per natural parameter; exact, use these to rebuild improper messages)
    and properness."""
    natural: list[list[float | None]]
    is_proper: list[bool]


class CertificatesOut(BaseModel):
    """Per row, column-wise: what each answer can be trusted for (:mod:`kjit.certificates`)."""
    source: list[Literal["rule", "oracle", "learned"]] = Field(
        description="where each answer came from: `rule` (exact or hand-crafted rule), `oracle` (Monte Carlo "
                    "oracle), `learned` (the learned operator's prediction)")
    log_var: list[list[float | None]] | None = Field(
        description="log predictive variance per coordinate in `coords`, each weighted by how many times the "
                    "prediction's KL curvature in it exceeds the operator's learned one (beyond its fifth largest, "
                    "or between learned concentrations: kjit/curvature.py; 1 where learned; the uncertainty the threshold is applied to; null where none, e.g. oracle mode)")
    threshold: float | None = Field(description="the operator's threshold on log_var: above it, uncertain")
    ess: list[float | None] | None = Field(description="oracle answers: effective sample size (null: none)")
    mc_se: list[list[float | None]] | None = Field(
        description="oracle answers: Monte Carlo standard error per coordinate (null: none; exact rules have none)")
    projection: str = Field(description="the projection convention (`kl` or `moments`)")
    proper: list[bool] = Field(description="per row: the outgoing message is a proper distribution")
    version: int | None = Field(description="operator version the answers were computed from")
    coords: list[str]
    flagged: list[bool] | None = Field(
        None, description="per row: a learned answer the operator's just-in-time rule would consult whatever its "
                          "log_var (the outgoing precision's sign undetermined, or a message far from the training "
                          "data): never confident; null where no row is")


class MessagesResponse(BaseModel):
    operator: str
    to: str
    mode: Literal["predict", "jit", "oracle"]
    version: int = Field(description="operator version the answer was computed from (after this request's own update)")
    n: int
    n_consulted: int
    coords: list[str] = Field(description="regression coordinates of the recipient family, the columns of log_var")
    factor: str | None = Field(None, description="the factor the operator answers for (as `GET /v1/operators/{name}`)")
    factor_params: dict[str, Any] | None = Field(
        None, description="its parameters: a client checks both against the factor it read when it started")
    projection: Literal["kl", "moments"] = Field(
        "kl", description="how the beliefs were projected: `kl` (match the family's expected sufficient statistics; "
                          "for a Gaussian, mean and variance) or `moments` (mean and variance; Infer.NET's convention "
                          "for Gamma beliefs of e.g. GammaFromShapeAndRate) — the factor's `projection` parameter")
    beliefs: FamilyColumns
    messages: OutgoingMessages
    log_var: list[list[float | None]] | None = Field(
        description="log predictive variance, column-wise: one list of n per coordinate in `coords`, each weighted "
                    "by how many times the prediction's KL curvature in it exceeds the operator's learned one "
                    "(beyond its fifth largest, or between learned concentrations: kjit/curvature.py; 1 where learned; "
                    "the uncertainty the JIT threshold is applied to); "
                    "null in oracle mode")
    consulted: list[bool] = Field(description="per row: the oracle answered")
    certificates: CertificatesOut | None = Field(None, description="per row: source, quality and propriety")
    uncertain: list[bool] | None = Field(
        None, description="mode=predict: per row, whether the operator's just-in-time rule would consult the oracle "
                          "(log variance above the threshold, or an outgoing message whose precision's sign the "
                          "prediction leaves undetermined) — the rows a client whose oracle runs on its side answers; "
                          "null in the other modes and for a draw")
    draw: int | Literal["mean"] | None = Field(
        None, description="the draws' path: the seed of the operator's draw that answered, or `mean` (its posterior "
                          "mean); null on the messages path")


class ObservationsResponse(BaseModel):
    operator: str
    accepted: int = Field(description="the pairs learned")
    not_learned: int = Field(0, description="the pairs acknowledged but not learned: their incoming messages lie "
                                            "outside the data the operator learned (below its `density_guard` "
                                            "or beyond its `input_margin`, in its detail), where one learned "
                                            "pair moves every prediction while every predictive variance stays "
                                            "small — or whose targets lie far outside what it learned once the "
                                            "update holds its lock (another update landed since the check)")
    version: int
    n_train: int = Field(description="the operator's training pairs at `version` (for a duplicate, at its first "
                                     "request's version)")
    duplicate: bool = Field(description="true when the Idempotency-Key was seen before: nothing was added again")


class MergeResponse(BaseModel):
    operator: str
    merged: int = Field(description="update records of other replicas applied by this request")
    version: int = Field(description="records of the shared log this replica's operator now reflects")
    shared_length: int = Field(description="records in the shared log when the merge ended")


class ParamRange(_Strict):
    low: Finite
    high: Finite
    scale: Literal["linear", "log"] = "linear"


OracleKind = Literal[ORACLE_KINDS]  # (kjit.oracles.make_oracle's names)
ORACLE_DOC = ("the operator's oracle (training pairs and just-in-time fallback): `auto` (default) — the factor's "
              "exact rule for the recipient if it has one (`quadrature`), else `message_sampler` (per-message "
              "importance sampling; any sampleable factor, plugins included); `importance_sampling`: one shared "
              "proposal (the paper's)")


class OracleSource(_Strict):
    kind: Literal["oracle"]
    n: Int = Field(ge=4, le=200_000, description="training pairs to draw and answer with the oracle")
    distribution: Literal["default"] | dict[Label, dict[Label, ParamRange]] = Field(
        "default", description="'default' (documented per factor) or, per variable and parameter, a range")
    oracle: OracleKind = Field("auto", description=ORACLE_DOC)
    n_samples: Int = Field(100_000, ge=100, le=5_000_000, description="importance-sampling particles "
                           "(message_sampler: the most particles spent on one message)")
    target_se: float = Field(1e-2, gt=0, le=1, allow_inf_nan=False, strict=True,
                             description="message_sampler: Monte Carlo standard error to reach per coordinate")


class FileSource(_Strict):
    kind: Literal["file"]
    path: str = Field(max_length=4096, description="training-set .npz (kjit.training.TrainingSet.save), relative to "
                                  "<store>/training-sets")
    oracle: OracleKind = Field("auto", description=ORACLE_DOC)
    n_samples: Int = Field(100_000, ge=100, le=5_000_000)
    target_se: float = Field(1e-2, gt=0, le=1, allow_inf_nan=False, strict=True)


class ClientSource(_Strict):
    """A factor the server has no code for: its variables and families, and the first batch of pairs
    its clients' oracle computed.  The operator's oracle stays on the clients (they send its
    answers as observations); the server never runs it."""
    kind: Literal["client"]
    variables: dict[Label, Label] = Field(description="variable name (an identifier) → message family name")
    output: Label = Field(description="the factor's output variable (one of `variables`)")
    incoming: dict[str, MessageBatch] = Field(description="the initial pairs' incoming messages, per variable")
    beliefs: MessageBatch = Field(description="the initial pairs' beliefs on `to`, computed by the client's oracle")


class TrainRequest(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "name": "my-logistic-x", "factor": "logistic", "to": "x",
        "source": {"kind": "oracle", "n": 1000}, "n_inner": 200, "n_outer": 300}]})
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$", description="name of the new operator")
    factor: Label
    factor_params: dict[Label, Union[Finite, FactorText]] = Field(
        default_factory=dict, description="the factor's parameters (`Factor.params()`): numbers, or strings such as "
                                          "`projection: \"moments\"`; omitted ones take the factor's defaults")
    to: Label
    source: Annotated[Union[OracleSource, FileSource, ClientSource], Field(discriminator="kind")]
    n_inner: Int = Field(300, ge=1, le=5000)
    n_outer: Int = Field(500, ge=2, le=5000)
    threshold: Finite | None = Field(None, description="JIT threshold; null: calibrated on held-out pairs")
    kl_cap: Finite | None = Field(
        1e-3, gt=0, description="a message whose predictive variances imply an expected KL above this (the "
                                "regression's noise taken out) is consulted in mode=jit and marked `uncertain` in "
                                "mode=predict whatever the threshold (kjit.operators.JITOperator, `kl_cap`); "
                                "default the calibration's target (service.training.KL_CAP); null: no cap")
    initial_batch: Int = Field(300, ge=2)
    random_state: Int = Field(0, ge=0)


class JobProgress(BaseModel):
    stage: str
    done: int
    total: int
    fraction: float


class Job(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    status: Literal["queued", "running", "succeeded", "failed"]
    operator: str
    progress: JobProgress
    created: str
    started: str | None = None
    finished: str | None = None
    error: str | None = None
    request: dict[str, Any]
    result: dict[str, Any] | None = None


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    detail: list[ErrorItem] = Field(description="the first errors (at most 20)")
    error_count: int | None = Field(None, description="how many errors there were, when more than those listed")


# ------------------------------------------------------------------------------ answers of the GET routes
# (documentation of what the routes return; ``extra="allow"``: a field added later is not dropped)
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Health(_Open):
    status: Literal["ok"]
    kjit_version: str


class Ready(_Open):
    ready: bool
    operators: list[str]
    loading: list[str]
    failed: dict[str, str] = Field(description="operator → why it could not be loaded")
    missing_factors: dict[str, str] | None = Field(None, description="operator → the factor this server lacks")
    possible_loss: dict[str, str] | None = Field(
        None, description="operator → the last update record its load cut although the line was whole (it failed "
                          "its check): a write torn out of order, or an acknowledged update damaged on disk and lost")


class OperatorSummary(_Open):
    name: str
    factor: str
    factor_params: dict[str, Any]
    to: str
    inputs: list[str]
    families: dict[str, str]
    version: int
    n_train: int


class OperatorList(_Open):
    operators: list[OperatorSummary]
    loading: list[str]
    failed: dict[str, str]
    factors: list[str] = Field(description="the registered factors (what `POST /v1/operators` accepts as `factor` "
                                           "with an oracle or file source)")


class OperatorDetail(OperatorSummary):
    features: dict[str, Any]
    hyperparameters: dict[str, Any]
    threshold: float | None
    oracle: dict[str, Any]
    counters: dict[str, Any]
    updates: dict[str, Any]
    training: dict[str, Any]
    source: dict[str, Any]
    created: str | None
    kjit_version: str | None
    limits: dict[str, int]
    replication: dict[str, Any] | None = None
    audit: dict[str, Any] | None = Field(
        None, description="the background audit of this operator's learned answers against its oracle "
                          "(`KJIT_AUDIT_RATE`; service/audit.py): `enabled` (false when the server audits nothing "
                          "or the oracle stays on the clients), `audited_pairs`, `count`, `mean_kl`, `p95_kl`, "
                          "`max_kl`, `share_above_target`, `confident`, `confident_share_above_target`, "
                          "`kl_target`, `records`, `window`, `histogram_log10_kl` (`edges`, `counts`), `recent` "
                          "(`time`, `version`, `kl`, `confident` of the last 1 000), `threshold_changes`, and "
                          "`server` (the audit thread's rate, rows offered / picked / dropped / failed, CPU "
                          "seconds; null when the audit is off); `count` is 0 and the KL statistics and shares "
                          "are null before the first audit")
    threshold_note: str | None = Field(
        None, description="when the threshold lies below `threshold_floor` − log 2 (the least log variance an "
                          "answer has): that every message will be consulted, "
                          "and what to do (train on more pairs or larger features, or give a threshold); else why "
                          "the audit last lowered this operator's threshold (the `reason` of the last of "
                          "`audit.threshold_changes`); null if neither")
    threshold_floor: float | None = Field(
        None, description="the operator's noise floor (kjit.operators.JITOperator.threshold_floor): the least log "
                          "predictive variance of an answer however much is learned — below it every message is "
                          "consulted; null for an operator without one (epistemic uncertainty)")
    density_guard: dict[str, float] | None = Field(
        None, description="the operator's density guard (kjit.operators.JITOperator, `density_guard`): `value`, the "
                          "mean kernel value to the learned pairs below which a message lies outside the data the "
                          "operator learned, and `pairs`, the pairs learned when it was set (compared as a count: "
                          "value × pairs); such a message is consulted in mode=jit whatever its variance (unless the "
                          "factor's checked reference answers it outright: kjit.learn.jit.REFERENCE_MARGIN), marked "
                          "`uncertain` in mode=predict, and not learned, by mode=jit or as an observation "
                          "(`not_learned`); null for an operator without one (trained before the fortieth "
                          "session, or on fewer than 100 pairs)")
    input_margin: float | None = Field(
        None, description="the operator's input margin (kjit.operators.JITOperator, `input_margin`): a message "
                          "with a coordinate (a Gaussian's mean or log variance, a Beta's or Gamma's log "
                          "parameters) more than this many widths of the training pairs' range beyond it is outside "
                          "the data, treated as one below the density guard; null for an operator without one")
    kl_cap: float | None = Field(
        None, description="the operator's expected-KL cap (kjit.operators.JITOperator, `kl_cap`): a message whose "
                          "epistemic variances imply a larger expected KL at the predicted belief is consulted in "
                          "mode=jit and marked `uncertain` in mode=predict whatever its threshold; null for an "
                          "operator without one (created with none, or published without a training request; one "
                          "this service trained before the cap existed is served with it)")
    guard_note: str | None = Field(
        None, description="for an operator with neither a density guard nor an input margin (trained before the "
                          "fortieth session, or not by the service): what that means and what to do; null otherwise")
    decision_weighting: Literal["range+density", "range", "none"] | None = Field(
        None, description="what the just-in-time rule weighs the log variances against (kjit/curvature.py): "
                          "`range+density` — an answer more concentrated than the beliefs learned, or between "
                          "learned concentrations, has its variance weighted by how much more its errors cost; "
                          "`range` — an operator saved before the density was kept: concentrations between "
                          "learned ones are not weighted; `none` — saved before either: unweighted (refit it)")


class JobList(_Open):
    jobs: list[Job]
