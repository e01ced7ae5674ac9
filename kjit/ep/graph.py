"""Fully factorised EP on a factor graph of any registered factors (issue 15, the engine).

A :class:`FactorGraph` holds variables (each with a family and a proper prior message) and
factors from the registry whose variables are *bound* either to a graph variable or to a fixed
message (an observation, e.g. a count entering as a Gamma message, or a label as a Beta
message).  :class:`GraphEP` runs fully factorised EP on it: the posterior of each variable is
its prior times one *site* per (factor, bound variable), all in the family's natural
parameters, and one update of the site of factor j on variable v is

    cavity  = posterior_v / site_{j,v}               (for every variable of factor j)
    q       = operator.belief({cavities, fixed messages}, to=v)      (proj[f_j · Π cavities])
    site'   = q / cavity_v,     site ← site + (1 − damping) (site' − site)

Where each message comes from is the user's to say, per (factor name, recipient):
``operators={("gaussian", "tau"): jit, ("product", "z"): remote, ...}``; the default is the
factor's exact rule (``QuadratureOracle``).  Anything with ``belief(incoming, to)`` works: a
rule, an oracle, a learned/JIT operator, a ``RemoteOperator``.

Schedules.  ``"parallel"``: every site update of an iteration is computed from one state; the
factors of one *group* (same factor, same parameters, same operator, same binding pattern) are
asked in **one batched call per recipient**, so a remote operator gets one request per group
and recipient per sweep; the updates are applied together.  ``"sequential"``: factor by factor,
each update applied at once (batch size one).

Accounting, as in :class:`~kjit.ep.LinearEP`: an update is skipped (never clipped) when a
cavity is improper (``cavity``), the operator raised or gave a wrong answer (``operator_error``;
an exception with ``rows`` skips only those rows), the belief is improper or non-finite
(``invalid``), or it would make a variable's posterior improper (``improper``; in a parallel
iteration every update of that variable in the iteration is rejected).  Convergence: the largest
change of any variable's posterior in its family's coordinates — location in posterior standard
deviations, log spread, log parameters — is below ``tol`` with nothing skipped; the change is the
undamped one, the iteration's change divided by ``1 − damping`` (a damped step is that fraction of
the step to the proposals, to first order in the coordinates), so ``converged`` means within ``tol``
of the fixed point whatever the damping (found by an audit: the damped change stopped a probit
graph at damping 0.999 as "converged" 2.7e-3 posterior sd from the fixed point, tol 1e-6).  Divergence: a
non-finite site or posterior stops the run with the last finite state and ``outcome="diverged"``.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..certificates import certified, count_answers
from ..errors import ConfigurationError, OperatorUnavailableError, check_number, user_stacklevel
from .error_bars import ErrorBars, attach, graph_error_bars, learned_share, require_plain_ep
from .engine import (OPERATOR_FAILURE_ITERATIONS, ROW_RETRIES, UncertainAnswerError, UncertainAnswerWarning,
                     check_on_uncertain, count_failing, operator_failure, oracle_rows, runaway, uncertain_rows,
                     warn_unconverged)
from ..factors import Factor, get_factor
from ..families import Family, Gaussian
from ..protocols import answered_factor, reports_uncertainty

__all__ = ["FactorGraph", "GraphEP", "GraphResult", "GRAPH_SKIP_REASONS"]

GRAPH_SKIP_REASONS = ("cavity", "operator_error", "invalid", "improper")


def _scalar(msg: Family, what: str) -> Family:
    if not isinstance(msg, Family):
        raise ValueError(f"{what} must be a kjit Family message, got {type(msg).__name__}")
    if msg.shape not in ((), (1,)):
        raise ValueError(f"{what} must be a single message (shape ()), got shape {msg.shape}")
    msg = msg.reshape(())
    if not bool(msg.is_proper):
        raise ValueError(f"{what} must be a proper distribution")
    return msg


class FactorGraph:
    """Variables with priors, and factors from the registry with their variables bound."""

    def __init__(self):
        self.variables: dict[str, tuple[type[Family], Family]] = {}
        self.factors: list[tuple[Factor, dict[str, Any]]] = []

    def add_variable(self, name: str, prior: Family) -> str:
        """A variable of ``prior``'s family, with ``prior`` (a proper message) as its prior."""
        if not isinstance(name, str) or not name:
            raise ValueError("a variable name must be a non-empty string")
        if name in self.variables:
            raise ValueError(f"variable {name!r} already exists")
        prior = _scalar(prior, f"the prior of variable {name!r}")
        self.variables[name] = (type(prior), prior)
        return name

    def recipients(self) -> set:
        """The (factor name, factor variable) pairs EP sends messages to: those bound to a variable."""
        return {(f.name, fv) for f, bind in self.factors for fv, b in bind.items() if isinstance(b, str)}

    def multiplicity(self, factor: str, to: str) -> int:
        """The most messages one operator of (``factor``, ``to``) sends to a single graph variable:
        over the variables, the number of factors named ``factor`` whose ``to`` is bound to it
        (0 if none is)."""
        counts: dict[str, int] = {}
        for f, bind in self.factors:
            b = bind.get(to)
            if f.name == factor and isinstance(b, str):
                counts[b] = counts.get(b, 0) + 1
        return max(counts.values(), default=0)

    def jit_budget(self, factor: str, to: str, posterior_tol: float = 0.1) -> tuple[float, float]:
        """``(threshold, target_se)`` for a just-in-time operator of (``factor``, ``to``) whose
        errors must move no posterior mean by more than ``posterior_tol`` posterior standard
        deviations, when the errors of the messages one variable receives from it add up.

        Why: at an EP fixed point every site's belief on a variable is close to its posterior, so
        a belief whose mean is off by ε of its standard deviation moves the site's message, and
        the posterior mean, by ε posterior standard deviations; the ``m`` (:meth:`multiplicity`)
        messages a variable receives from one operator are answers to nearly the same question
        (their cavities differ by one site of ``m``), so a learned operator's errors there are
        one shared error, and add up to ``m ε`` rather than ``√m ε``.  Hence each answer must be
        within ε = ``posterior_tol`` / m: the operator consults its oracle where the epistemic
        standard deviation of a regressed coordinate exceeds ε (``threshold`` = 2 log ε on the
        log variance), and its oracle answers to a standard error ε (``target_se``, a per-message
        sampler's :class:`~kjit.oracles.MessageImportanceSampler` setting) — one noisy answer
        learned and reused for all m sites is a shared error too.  Measured on the Poisson–Gamma
        model (25 sites on the rate; ``benchmarks/ep_models.py --posterior-tol``), see there.
        The regressed coordinates are in the units of the operator's reference (for a Gaussian's
        mean, the reference belief's standard deviation, the belief's scale to first order) — for a
        Gaussian recipient.  For a Gamma or Beta they are log parameters, whose error moves the mean
        by more standard deviations the more concentrated the belief (√shape·δ for a Gamma): within the
        concentrations the operator has learned the budget's threshold is in those units and does not
        bound the posterior error (a UserWarning says so); beyond them the JIT weighs a coordinate's
        variance by how many times the prediction's KL curvature exceeds the learned one (beyond the fifth
        largest, or between learned concentrations: :meth:`~kjit.operators.KernelOperator.decision_log_weights`), so a belief more
        concentrated than those learned is consulted (found by an audit: a count of 1e9 was answered 14–60 sd off as
        confident; an audit measured Poisson–Gamma at ``posterior_tol`` 0.1 0.24 sd from exact-rule EP)."""
        if not (np.isfinite(posterior_tol) and posterior_tol > 0):
            raise ValueError(f"`posterior_tol` must be a positive number, got {posterior_tol!r}")
        m = self.multiplicity(factor, to)
        if m == 0:
            raise ValueError(f"no factor {factor!r} of this graph sends messages to a variable through {to!r}")
        family = next(f.families[to] for f, _ in self.factors if f.name == factor)
        if family is not Gaussian:
            warnings.warn(f"jit_budget({factor!r}, {to!r}): the recipient's messages are {family.__name__}, whose "
                          "regressed coordinates are log parameters: within the concentrations a learned operator "
                          "has seen, the budget's threshold is in those units and does not bound the posterior error "
                          "(it grows with the belief's concentration, e.g. √shape for a Gamma); beyond them the JIT "
                          "weighs the variance by the excess curvature", UserWarning, stacklevel=user_stacklevel())
        eps = posterior_tol / m
        return float(2.0 * np.log(eps)), float(eps)

    def add_factor(self, factor: Factor | str, bind: Mapping[str, str | Family], **params) -> int:
        """Add ``factor`` (an instance or a registered name built with ``params``) with each of its
        variables bound to a graph variable (by name) or to a fixed message.  Returns its index."""
        f = get_factor(factor, **params) if isinstance(factor, str) else factor
        if not isinstance(f, Factor):
            raise ValueError(f"`factor` must be a Factor or a registered name, got {factor!r}")
        unknown = [v for v in bind if v not in f.variables]
        missing = [v for v in f.variables if v not in bind]
        if unknown or missing:
            raise ValueError(f"factor {f.name!r} has variables {', '.join(f.variables)}; "
                             f"unknown in `bind`: {unknown}, missing: {missing}")
        out: dict[str, Any] = {}
        seen: set[str] = set()
        for fv in f.variables:
            b = bind[fv]
            fam = f.families[fv]
            if isinstance(b, str):
                if b not in self.variables:
                    raise ValueError(f"factor {f.name!r}: `{fv}` is bound to unknown variable {b!r}")
                if self.variables[b][0] is not fam:
                    raise ValueError(f"factor {f.name!r}: `{fv}` needs a {fam.__name__} variable, "
                                     f"{b!r} is {self.variables[b][0].__name__}")
                if b in seen:
                    raise ValueError(f"factor {f.name!r}: variable {b!r} is bound twice (fully factorised "
                                     "EP needs distinct variables per factor)")
                seen.add(b)
                out[fv] = b
            else:
                msg = _scalar(b, f"factor {f.name!r}: the fixed message of `{fv}`")
                if not isinstance(msg, fam):
                    raise ValueError(f"factor {f.name!r}: `{fv}` needs a {fam.__name__} message")
                out[fv] = msg
        if not seen:
            raise ValueError(f"factor {f.name!r} is bound to no graph variable")
        for g, _ in self.factors:
            # factors are told apart by name and parameters (operators' keys, groups of a sweep)
            if not g.same_as(f) and g.mismatch((f.name, f.params())) is None:
                raise ValueError(f"factor {f.name!r}: the graph has another factor of that name and parameters "
                                 f"({g!r}); an operator would answer for both: add the same factor object again, or give "
                                 f"them distinct names")
        self.factors.append((f, out))
        return len(self.factors) - 1


@dataclass
class GraphIteration:
    iteration: int
    max_change: float  # largest change of a posterior in its coordinates, undamped: divided by 1 − damping
    seconds: float
    n_updated: int
    n_skipped: int
    skipped: dict[str, int]
    operator_calls: int
    errors: list[str] = field(default_factory=list)
    # answers received by source and quality (kjit.certificates.Certificates.counts)
    answers: dict[str, int] = field(default_factory=dict)
    n_uncertain: int = 0  # uncertain learned answers used as they were (on_uncertain="warn")
    n_oracle: int = 0     # uncertain learned answers replaced by an oracle's (on_uncertain="oracle")
    # per operator (id), its calls running that got no answer at all (OperatorUnavailableError): not asked again
    # this iteration at OPERATOR_FAILURE_ITERATIONS
    _unanswered: dict = field(default_factory=dict, repr=False, compare=False)
    # per (operator id, recipient): whether it gave an answer this iteration, and, for those asked without one, their
    # name (per pair: one object may serve two directions — GraphEP's default oracle serves every direction of its
    # factor — and answer one while failing the other: found in review)
    _answered: set = field(default_factory=set, repr=False, compare=False)
    _failed: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class GraphResult:
    beliefs: dict[str, Family]
    converged: bool
    outcome: str          # "converged", "max_iter", "diverged" or "operator_failed" (engine.OPERATOR_FAILURE_ITERATIONS)
    iterations: int
    status: str
    history: list[GraphIteration]
    seconds: float
    operator_calls: int
    log_evidence: float | None = None
    log_evidence_note: str = ""
    #: the final site messages, ``(factor index, factor variable) -> natural parameters``: what
    #: :meth:`GraphEP.run` (``init=``) continues from
    sites: dict | None = field(default=None, compare=False, repr=False)
    #: with ``GraphEP(error_bars=n)``: the posterior's error bars from its learned operators' draws
    #: (:mod:`kjit.ep.error_bars`); None without
    error_bars: ErrorBars | None = field(default=None, compare=False, repr=False)

    @property
    def skipped(self) -> dict[str, int]:
        return {k: int(sum(r.skipped[k] for r in self.history)) for k in GRAPH_SKIP_REASONS}

    @property
    def answers(self) -> dict[str, int]:
        """Operator answers received, by source and quality, over all iterations."""
        out: dict[str, int] = {}
        for r in self.history:
            for k, v in r.answers.items():
                out[k] = out.get(k, 0) + int(v)
        return out


_UNKNOWN = object()  # (answered_factor's answer for an operator that cannot say now)


def _checked(op, what: str, key, factor: Factor, checked: set, unknown: set):
    """``op`` (an entry ``what[key]`` of GraphEP's ``operators`` or ``oracles``) if it answers
    ``belief(incoming, to)`` for ``factor`` — not another factor of the name (other parameters, another
    sampled factor) — else a ConfigurationError naming it.  Found by audits: a wrong object ran 3 iterations
    and ended "operator_failed"; gamma_rate(shape=1) answered for shape 1.5, "converged", log Z 0.35 off;
    an oracle for probit_noise(eps=0) replaced eps=0.3's uncertain answers, means 1.596 for 0.638.
    A RemoteOperator's factor too, read from its server (found by an audit: an attribute-only check let a
    served gamma_rate(shape=1) answer for a shape-3 graph, "converged" 30 % off).  ``checked``: the
    (operator, factor) pairs checked in this run; ``unknown``: the operators that could not say their factor
    in this iteration (a server without an answer is asked again the next: found in review, asking at each
    look-up made a hung server's run 2.8× longer)."""
    if not callable(getattr(op, "belief", None)):
        raise ConfigurationError(f"`{what}[{key!r}]` must have a belief(incoming, to) method, got {type(op).__name__}")
    memo = (what, key, id(op), factor.name, json.dumps(factor.params(), sort_keys=True, default=repr))
    if memo in checked or id(op) in unknown:
        return op
    own = answered_factor(op, unknown=_UNKNOWN)
    if own is _UNKNOWN:
        unknown.add(id(op))
        return op
    if own is not None:
        why = factor.mismatch(own, f"`{what}[{key!r}]`", "the graph's factor")
        if why is not None:
            raise ConfigurationError(why)
    # a served operator's client-side oracle answers its uncertain rows: for the graph's factor too (found in
    # review: RemoteOperator compared only its variables' families)
    local = answered_factor(getattr(op, "local_oracle", None))
    if local is not None:
        why = factor.mismatch(local, f"the oracle of `{what}[{key!r}]`", "the graph's factor")
        if why is not None:
            raise ConfigurationError(why)
    checked.add(memo)
    return op


def _change(old: Family, new: Family) -> float:
    """Largest change between two beliefs of one family, scale-free (see the module docstring)."""
    d = np.abs(np.asarray(new.to_coords(), float) - np.asarray(old.to_coords(), float)).reshape(-1)
    j = type(new).spread_coord
    if j is not None:
        scale = np.exp(0.5 * float(np.asarray(new.to_coords()).reshape(-1)[j]))
        d = np.array([x / scale if i != j else x for i, x in enumerate(d)])
    return float(np.max(d))




class GraphEP:
    """Fully factorised EP on a :class:`FactorGraph` (see the module docstring).

    Parameters
    ----------
    graph : the factor graph.
    operators : ``{(factor name, recipient): operator}``; missing entries use
        ``QuadratureOracle(factor)`` (the factor's exact rule).  An operator answers
        ``belief(incoming, to)`` for a batch.
    damping : fraction of the old site kept, in [0, 1).
    max_iter, tol : iteration cap and convergence tolerance on the undamped change (module docstring).
    schedule : ``"parallel"`` (default) or ``"sequential"``.
    compute_evidence : after the run, the EP log evidence (``GraphResult.log_evidence``) where every
        operator has a ``log_partition`` (EP only, not power EP).
    divergence_limit : the run stops as diverged, with the last state, when a site's natural
        parameters exceed this many times (1 + the largest natural parameter of its variable's prior
        or posterior) — sites growing against each other while the posterior they sum to does not —
        or exceed this many times (1 + the prior's) and either more than doubled since the last
        iteration (having exceeded it then too) or grew by more than 1 %, its increment not shrinking, in each
        of :data:`~kjit.ep.engine.DIVERGENCE_STREAK` iterations running — sites and posterior growing together (a site
        approaching a large fixed point, even damped, grows by ever smaller increments: ``engine.runaway``).
    power : power EP's u > 0 (1 = EP): the cavity removes the fraction u of each site, the operator
        answers for f^u (``belief(incoming, to, power=u)``; operators must have ``supports_power``:
        the exact rules of logistic, probit_noise, gaussian, gamma_rate do, product and exp refuse
        with the reason), and the new site is (q / cavity)^(1/u).  With u > 1 a site that carries more than
        1/u of its variable's posterior precision has an improper u-cavity and is skipped at every iteration,
        so such a run never reports convergence (as :class:`~kjit.ep.LinearEP`'s: see its module docstring).
    on_uncertain : what to do with a learned answer its certificates rate uncertain (above its
        operator's threshold in some coordinate, or flagged by the operator's just-in-time rule — a
        ``JITOperator``, a ``RemoteOperator`` in ``mode="predict"``; a bare ``KernelOperator``'s answers
        carry no threshold and are counted unrated: wrap it in a JITOperator), as
        :class:`~kjit.ep.LinearEP`'s: ``"warn"`` (default: use it, count it per iteration in
        ``n_uncertain``, say so in ``status`` and warn once with ``UncertainAnswerWarning``),
        ``"raise"`` (``UncertainAnswerError``) or ``"oracle"`` (ask the oracle of its (factor,
        recipient) for those rows instead; counted in ``n_oracle``).
    oracles : ``{(factor name, recipient): oracle}`` for ``on_uncertain="oracle"``; default the
        operator's own ``oracle`` (JITOperator; a RemoteOperator's is the server's ``mode=oracle``),
        else the factor's exact rule where it has one for the recipient.  A (factor, recipient) whose
        operator reports uncertainty and has none of these is a ValueError when the run starts.
    error_bars : after a converged run, the posterior's error bars from this many draws of its learned
        operators (:mod:`kjit.ep.error_bars`: EP re-run from the fixed point with each draw; costs 1 +
        ``error_bars`` runs from a fixed point), kept on ``GraphResult.error_bars`` and summarised in the
        status.  0 (default): none.  The errors of the messages one variable receives from one learned
        operator add up, and no per-message rule sees their sum (``on_uncertain`` judges one message).
    error_tol : with ``error_bars``, a :class:`~kjit.ep.error_bars.PosteriorErrorWarning` (and a status
        sentence) when an error bar on a posterior mean exceeds this many posterior standard deviations.
    warn_unconverged : default True: a run that reaches ``max_iter`` or diverges warns with
        :class:`~kjit.ep.engine.EPConvergenceWarning` (its status), as :class:`~kjit.ep.LinearEP`'s.
    """

    def __init__(self, graph: FactorGraph, operators: Mapping | None = None, damping: float = 0.0,
                 max_iter: int = 100, tol: float = 1e-6, schedule: str = "parallel", compute_evidence: bool = True,
                 power: float = 1.0, divergence_limit: float = 1e12, on_uncertain: str = "warn",
                 oracles: Mapping | None = None, error_bars: int = 0, error_tol: float = 0.1,
                 warn_unconverged: bool = True):
        if not isinstance(graph, FactorGraph):
            raise ValueError("`graph` must be a FactorGraph")
        if schedule not in ("parallel", "sequential"):
            raise ValueError(f"`schedule` must be 'parallel' or 'sequential', got {schedule!r}")
        self.graph = graph
        self.operators = dict(operators or {})
        # (one check for every numeric option: kjit.errors.check_number)
        self.damping = check_number("damping", damping, 0.0, 1.0, high_open=True)
        self.max_iter = check_number("max_iter", max_iter, 1, integer=True)
        self.tol = check_number("tol", tol, 0.0)
        self.schedule = schedule
        self.compute_evidence = bool(compute_evidence)
        self.power = check_number("power", power, 0.0, low_open=True)
        self.divergence_limit = check_number("divergence_limit", divergence_limit, 0.0, low_open=True)
        self.on_uncertain = check_on_uncertain(on_uncertain)
        self.oracles = dict(oracles or {})
        self.error_bars = check_number("error_bars", error_bars, 0, integer=True)
        self.error_tol = check_number("error_tol", error_tol, 0.0, low_open=True)
        if self.error_bars:
            require_plain_ep(self.power, what="`error_bars`")
        self.warn_unconverged = bool(warn_unconverged)
        self._default_ops: dict = {}
        self._factors_checked: set = set()  # (_checked's: this run's)
        self._factor_unknown: set = set()  # (_checked's: this iteration's)

    # ------------------------------------------------------------------ operators and groups
    def _operator(self, factor: Factor, to: str):
        op = self._operator_for(factor, to)
        if self.power != 1.0:
            from ..protocols import supports_power

            if not supports_power(op):
                reason = getattr(factor, "no_power_reason", None)
                raise ValueError(f"power EP (power={self.power:g}) needs an operator for ({factor.name!r}, {to!r}) "
                                 f"that answers for f^u; {type(op).__name__} has none"
                                 + (f" ({factor.name}: {reason})" if reason else ""))
        return op

    def _operator_for(self, factor: Factor, to: str):
        key = (factor.name, to)
        if key in self.operators:
            return _checked(self.operators[key], "operators", key, factor, self._factors_checked,
                            self._factor_unknown)
        pkey = (factor.name, json.dumps(factor.params(), sort_keys=True))
        if pkey not in self._default_ops:
            from ..oracles import QuadratureOracle

            try:
                self._default_ops[pkey] = QuadratureOracle(factor)
            except ValueError as exc:
                raise ValueError(f"no operator given for ({factor.name!r}, {to!r}) and the factor has no exact rule: "
                                 f"{exc}") from None
        return self._default_ops[pkey]

    def _oracle(self, factor: Factor, to: str):
        """The oracle of uncertain answers of (``factor``, ``to``) (see ``oracles``), or None."""
        key = (factor.name, to)
        if key in self.oracles:
            return _checked(self.oracles[key], "oracles", key, factor, self._factors_checked,
                            self._factor_unknown)
        own = getattr(self._operator_for(factor, to), "oracle", None)
        if own is not None:
            return own
        if factor.has_exact(to):
            from ..oracles import QuadratureOracle

            pkey = ("oracle", factor.name, json.dumps(factor.params(), sort_keys=True))
            if pkey not in self._default_ops:
                self._default_ops[pkey] = QuadratureOracle(factor)
            return self._default_ops[pkey]
        return None

    def _groups(self, idx):
        """Factors ``idx`` grouped by (factor name and parameters, binding pattern)."""
        groups: dict = {}
        for j in idx:
            f, bind = self.graph.factors[j]
            pattern = tuple((fv, isinstance(b, str)) for fv, b in bind.items())
            key = (f.name, json.dumps(f.params(), sort_keys=True), pattern)
            groups.setdefault(key, []).append(j)
        return list(groups.values())

    # ------------------------------------------------------------------ run
    def run(self, init: GraphResult | None = None) -> GraphResult:
        """EP on the graph from flat site messages, or from the sites of ``init``: a result of EP on this
        graph (checked by its sites' keys and shapes only), e.g. with other operators — exact-rule EP
        continued from a learned operator's fixed point stays there if it is one of the exact rules' (a
        bimodal posterior has several)."""
        g = self.graph
        if not g.factors:
            raise ValueError("the graph has no factors")
        # every run checks its operators' factors afresh (found in review: a run after a served operator was
        # replaced, on the same GraphEP, skipped the check its client's refusal had asked for)
        self._factors_checked.clear()
        self._factor_unknown.clear()
        # a key that matches no (factor, bound variable) of the graph would be silently unused
        # (a typo runs the exact rule instead of the operator given)
        known = g.recipients()
        unknown = [k for k in self.operators if k not in known]
        if unknown:
            raise ValueError(f"`operators` has key(s) {unknown} that match no (factor name, recipient) of the graph; "
                             f"its recipients are {sorted(known)}")
        unknown = [k for k in self.oracles if k not in known]
        if unknown:
            raise ValueError(f"`oracles` has key(s) {unknown} that match no (factor name, recipient) of the graph; "
                             f"its recipients are {sorted(known)}")
        for f, bind in g.factors:  # every (factor, recipient) has an operator (and power where asked)
            for fv, b in bind.items():
                if isinstance(b, str):
                    op = self._operator(f, fv)
                    if (f.name, fv) in self.oracles:
                        self._oracle(f, fv)  # (checked before the run, as the operators are)
                    if (self.on_uncertain == "oracle" and reports_uncertainty(op)
                            and self._oracle(f, fv) is None):
                        raise ValueError(f'on_uncertain="oracle" needs an oracle for ({f.name!r}, {fv!r}): its operator '
                                         f"{type(op).__name__} has none and the factor no exact rule for {fv!r}; pass "
                                         f"`oracles`={{({f.name!r}, {fv!r}): ...}}")
        names = list(g.variables)
        prior_nat = {v: np.asarray(g.variables[v][1].natural(), float).reshape(-1) for v in names}
        # sites: (factor index, factor variable) -> natural parameters (zeros: a flat message)
        sites = {(j, fv): np.zeros_like(prior_nat[b]) for j, (f, bind) in enumerate(g.factors)
                 for fv, b in bind.items() if isinstance(b, str)}
        if init is not None:
            given = getattr(init, "sites", None)
            if given is None or set(given) != set(sites) or any(np.shape(given[k]) != sites[k].shape for k in sites):
                raise ValueError("`init` must be a GraphResult of EP on this graph (its sites: one per factor and "
                                 "bound variable)")
            if not all(np.all(np.isfinite(given[k])) for k in sites):
                raise ValueError("`init` has non-finite site messages")
            sites = {k: np.array(given[k], dtype=float) for k in sites}
        post = self._posteriors(prior_nat, sites)
        if init is not None:
            bad = [v for v in names if not bool(np.all(g.variables[v][0].from_natural(post[v]).is_proper))]
            if bad:
                raise ValueError(f"`init`'s sites give an improper posterior on {', '.join(map(repr, bad[:5]))}: "
                                 "it is not a result of EP on this graph")
        history: list[GraphIteration] = []
        converged, diverged, calls = False, None, 0
        failing = 0  # consecutive iterations in which the operators failed every update they were asked
        dead: dict = {}  # per (operator id, recipient): [its name, iterations running it answered nothing it was asked]
        gone: list = []  # those of them at OPERATOR_FAILURE_ITERATIONS
        t_start = time.perf_counter()
        # divergence (divergence_limit): a site large against its variable's prior and posterior, or
        # large against the prior and still growing — not merely large against the prior: a precise
        # measurement far from 0 has a site of natural parameter mean/variance ~ 2e12, which the
        # prior's scale alone called divergent (found by an audit: N(2e4, 1e-8) reported "diverged",
        # the prior returned)
        prior_scale = {v: float(np.max(np.abs(p))) for v, p in prior_nat.items()}
        streak = dict.fromkeys(sites, 0)  # iterations running a large site grew by > 1 % (engine.runaway)
        increment = dict.fromkeys(sites, 0.0)  # its last growth
        for it in range(1, self.max_iter + 1):
            t0 = time.perf_counter()
            self._factor_unknown.clear()
            prev = (sites, post)
            rec = GraphIteration(it, 0.0, 0.0, 0, 0, dict.fromkeys(GRAPH_SKIP_REASONS, 0), 0)
            beliefs_old = self._beliefs(post)
            if self.schedule == "parallel":
                new_sites = self._sweep(range(len(g.factors)), post, sites, rec)
                sites, post = self._apply(prior_nat, sites, new_sites, rec)
            else:
                for j in range(len(g.factors)):
                    new_sites = self._sweep([j], post, sites, rec)
                    sites, post = self._apply(prior_nat, sites, new_sites, rec)
            rec.seconds = time.perf_counter() - t0
            calls += rec.operator_calls
            history.append(rec)
            cause = None
            for (j, fv), site in sites.items():
                v = g.factors[j][1][fv]
                lim = self.divergence_limit
                with np.errstate(invalid="ignore", over="ignore"):
                    size, before = float(np.max(np.abs(site))), float(np.max(np.abs(prev[0][(j, fv)])))
                    against = size > lim * (1.0 + max(prior_scale[v], float(np.max(np.abs(post[v])))))
                    # (a streak, not one doubling: a slow runaway — 1.8× an iteration — went unseen,
                    # found in review; a damped approach to a large fixed point also grows at first, its
                    # increments shrinking; and a fast one: a runaway whose next cavities are improper
                    # freezes at once, caught at sweep 8)
                    grows, streak[(j, fv)], increment[(j, fv)] = runaway(
                        size, before, increment[(j, fv)], streak[(j, fv)], lim * (1.0 + prior_scale[v]), self.damping)
                    growing = bool(grows)
                if not np.all(np.isfinite(site)) or against or growing:
                    cause = (f"the site of factor {j} ({g.factors[j][0].name}) on {v!r} grew beyond "
                             f"divergence_limit={lim:g} times its variable's "
                             + ("prior and was still growing" if growing and not against else "prior or posterior"))
                    break
            if cause is None and not all(np.all(np.isfinite(post[v])) for v in names):
                cause = "a non-finite posterior"
            if cause is not None:  # keep the last finite state
                diverged = (it, cause)
                sites, post = prev
                break
            beliefs = self._beliefs(post)
            # the undamped change (module docstring, "Convergence")
            rec.max_change = max(_change(beliefs_old[v], beliefs[v]) for v in names) / (1.0 - self.damping)
            rec.n_skipped = int(sum(rec.skipped.values()))
            if rec.n_skipped == 0 and rec.max_change < self.tol:
                converged = True
                break
            failing = count_failing(failing, rec.n_updated, rec.skipped["operator_error"])
            # one operator that answered nothing it was asked, iterations running, while others answered: its
            # sites stay frozen and the run cannot converge (found in review: such a graph ran to max_iter)
            for k in list(dead):
                if k not in rec._failed or k in rec._answered:
                    del dead[k]
            for k, name in rec._failed.items():
                if k not in rec._answered:
                    dead[k] = [name, dead.get(k, [name, 0])[1] + 1]
            gone = [d for d in dead.values() if d[1] >= OPERATOR_FAILURE_ITERATIONS]
            if failing >= OPERATOR_FAILURE_ITERATIONS or gone:
                break  # (as LinearEP: more iterations cannot help)
        n = len(history)
        failed = diverged is None and not converged and (failing >= OPERATOR_FAILURE_ITERATIONS or bool(gone))
        if failed and failing < OPERATOR_FAILURE_ITERATIONS:
            names = ", ".join(sorted(d[0] for d in gone))
            errs = [e for e in history[-1].errors if any(e.startswith(d[0] + ":") for d in gone)] or history[-1].errors
            outcome, status = "operator_failed", operator_failure(
                gone[0][1], n, errs, "graph EP", who_failed=f"the operator(s) of {names}")
        elif failed:
            outcome, status = "operator_failed", operator_failure(failing, n, history[-1].errors, "graph EP")
        elif diverged is not None:
            outcome, status = "diverged", f"diverged at iteration {diverged[0]}: {diverged[1]}; the beliefs are the last finite state"
        elif converged:
            outcome, status = "converged", f"converged after {n} iteration(s) (max change {history[-1].max_change:.3g} < tol {self.tol:g})"
        else:
            outcome, status = "max_iter", (f"stopped at max_iter={self.max_iter} without convergence (last max change "
                                           f"{history[-1].max_change:.3g}, {history[-1].n_skipped} update(s) skipped)")
        n_unc = int(sum(r.n_uncertain for r in history))
        if n_unc:
            msg = f"{n_unc} answer(s) its operators' certificates rate uncertain were used"
            status += f"; {msg}"
            warnings.warn(f"graph EP: {msg} (on_uncertain='warn'; pass on_uncertain='oracle' to replace them or "
                          "'raise' to stop)", UncertainAnswerWarning, stacklevel=user_stacklevel())
        if not self.compute_evidence:
            log_z, note = None, "not computed"
        elif self.power != 1.0:
            log_z, note = None, "not computed for power EP"
        elif diverged is not None:  # (the last finite state of a divergent run is no fixed point)
            log_z, note = None, "not computed: EP diverged"
        else:
            log_z, note = self._log_evidence(prior_nat, sites, post)
        if log_z is not None and not converged:
            note += "; EP did not converge, so this is the estimate at the last iterate"
        result = GraphResult(self._beliefs(post), converged, outcome, n, status, history,
                             time.perf_counter() - t_start, calls, log_z, note, {k: s.copy() for k, s in sites.items()})
        shared = learned_share(self.operators, {k: g.multiplicity(*k) for k in self.operators})
        attach(self, result, lambda n_draws: graph_error_bars(self, result, n_draws), "graph EP", shared)
        result.seconds = time.perf_counter() - t_start
        if self.warn_unconverged:
            warn_unconverged(outcome, status, "graph EP", self.damping)
        return result

    def _log_evidence(self, prior_nat, sites, post):
        """The EP estimate of log ∫ Π priors Π factors (messages normalised), Minka's formula for a
        fully factorised approximation: with A(η) = log ∫ exp(η·u) (``Family.log_normalizer``),

            log Z = Σ_v [A(post_v) − A(prior_v)] + Σ_j [log Z_j − Σ_{v∈j} (A(post_v) − A(cavity_{j,v}))]

        where Z_j = ∫ f_j Π cavities (``operator.log_partition`` at the final cavities, fixed
        messages included).  None (with the reason) when an operator has no log partition or a
        final cavity is improper."""
        from ..protocols import has_log_partition

        g = self.graph

        def A(v, nat):
            fam = g.variables[v][0]
            m = fam.from_natural(nat)
            return float(fam(*[np.asarray(p, float) for p in m.params]).log_normalizer())

        try:
            total = sum(A(v, post[v]) - A(v, prior_nat[v]) for v in post)
            for members in self._groups(range(len(g.factors))):
                f, bind0 = g.factors[members[0]]
                bound = [fv for fv, b in bind0.items() if isinstance(b, str)]
                op = self._operator(f, bound[0])
                if not has_log_partition(op):
                    return None, f"the operator of ({f.name!r}, {bound[0]!r}) has no log_partition"
                incoming = {}
                for fv, b in bind0.items():
                    if isinstance(b, str):
                        nat = np.stack([post[g.factors[j][1][fv]] - sites[(j, fv)] for j in members])
                        m = f.families[fv].from_natural(nat)
                        if not np.all(m.is_proper):
                            return None, f"a final cavity of factor {f.name!r} on {fv!r} is improper"
                        incoming[fv] = type(m)(*[np.asarray(p, float) for p in m.params])
                        for j, row in zip(members, nat):
                            v = g.factors[j][1][fv]
                            total -= A(v, post[v]) - A(v, row)
                    else:
                        incoming[fv] = type(b).concatenate([g.factors[j][1][fv].reshape((1,)) for j in members])
                with np.errstate(all="ignore"):
                    log_zj = np.asarray(op.log_partition(incoming), dtype=float)
                if log_zj.shape != (len(members),) or not np.all(np.isfinite(log_zj)):
                    return None, f"log_partition of {f.name!r} returned non-finite values or a wrong shape"
                total += float(np.sum(log_zj))
        except Exception as exc:  # noqa: BLE001 - the run's result stands without its evidence
            # (an OracleError or a remote operator's error escaped run() and lost the finished run:
            # found by an audit)
            return None, f"not computable: {type(exc).__name__}: {exc}"
        if not np.isfinite(total):
            return None, "log evidence is not finite"
        return float(total), "EP estimate (fully factorised; tilted normalisers from log_partition at the final cavities)"

    def _posteriors(self, prior_nat, sites):
        post = {v: p.copy() for v, p in prior_nat.items()}
        for (j, fv), s in sites.items():
            post[self.graph.factors[j][1][fv]] += s
        return post

    def _beliefs(self, post):
        return {v: self.graph.variables[v][0].from_natural(post[v]) for v in post}

    def _sweep(self, idx, post, sites, rec):
        """Proposed sites for the factors ``idx`` from the state ``(post, sites)``: {(j, fv): natural}."""
        g = self.graph
        proposals = {}
        for members in self._groups(idx):
            f, bind0 = g.factors[members[0]]
            bound = [fv for fv, b in bind0.items() if isinstance(b, str)]
            # cavities of every bound variable, and their propriety
            cav = {}
            ok = np.ones(len(members), dtype=bool)
            for fv in bound:
                fam = f.families[fv]
                nat = np.stack([post[g.factors[j][1][fv]] - self.power * sites[(j, fv)] for j in members])
                with np.errstate(all="ignore"):
                    m = fam.from_natural(nat)
                    good = np.asarray(m.is_proper, bool) & np.all(np.isfinite(nat), axis=1)
                cav[fv] = (nat, m)
                ok &= good
            rec.skipped["cavity"] += int(np.count_nonzero(~ok)) * len(bound)
            rows = np.flatnonzero(ok)
            if rows.size == 0:
                continue
            incoming = {}
            for fv, b in bind0.items():
                if isinstance(b, str):
                    nat = cav[fv][0][rows]
                    incoming[fv] = f.families[fv].from_natural(nat)
                    # a proper cavity from natural parameters: rebuild from its own parameters so
                    # operators see ordinary (validated) messages
                    incoming[fv] = type(incoming[fv])(*[np.asarray(p, float) for p in incoming[fv].params])
                else:
                    incoming[fv] = type(b).concatenate([g.factors[j][1][fv].reshape((1,)) for j in np.asarray(members)[rows]])
            for to in bound:
                op = self._operator(f, to)
                live = np.arange(rows.size)
                q = None
                if rec._unanswered.get(id(op), 0) >= OPERATOR_FAILURE_ITERATIONS:
                    # (no answer to that many calls running — a server down or hung: not asked again this
                    # iteration, each call would wait out its timeout and retries; found by an audit)
                    rec.skipped["operator_error"] += live.size
                    rec._failed.setdefault((id(op), to), f"{f.name}→{to}")
                    if len(rec.errors) < 5:
                        rec.errors.append(f"{f.name}→{to}: the operator did not answer {OPERATOR_FAILURE_ITERATIONS} "
                                          f"calls running: {live.size} more updates not asked this iteration")
                    continue
                for _attempt in range(ROW_RETRIES):
                    sub = {k: m[live] for k, m in incoming.items()}
                    rec.operator_calls += 1
                    try:
                        with np.errstate(all="ignore"):
                            q, cert = self._certified(op, f, to, sub, live.size, rec)
                        if cert is not None and len(cert) == live.size:
                            count_answers(rec.answers, cert)
                        rec._unanswered[id(op)] = 0
                        if id(op) in self._factor_unknown:  # (it answers now: its factor is checked at once —
                            self._factor_unknown.discard(id(op))  # found in review, unchecked to the iteration's end)
                            self._operator_for(f, to)
                        break
                    except (ConfigurationError, UncertainAnswerError):
                        raise  # (a wrong recipient or operator name: no skip or retry can fix it)
                    except Exception as exc:  # skip and report, as LinearEP does
                        if len(rec.errors) < 5:
                            rec.errors.append(f"{f.name}→{to}: {type(exc).__name__}: {exc}")
                        # (an error the operator did answer with ends the run of calls without one)
                        rec._unanswered[id(op)] = (rec._unanswered.get(id(op), 0) + 1
                                                   if isinstance(exc, OperatorUnavailableError) else 0)
                        bad = getattr(exc, "rows", None)
                        bad = None if bad is None else np.unique(np.asarray(bad, int).ravel())
                        if bad is None or bad.size == 0 or bad.size >= live.size or bad.min() < 0 or bad.max() >= live.size:
                            rec.skipped["operator_error"] += live.size
                            q = None
                            break
                        rec.skipped["operator_error"] += bad.size
                        live = np.delete(live, bad)
                else:  # (every call failed, each naming rows: the rest are not answered either)
                    rec.skipped["operator_error"] += live.size
                if q is None:
                    rec._failed.setdefault((id(op), to), f"{f.name}→{to}")
                    continue
                fam = f.families[to]
                if not isinstance(q, fam) or q.shape != (live.size,):
                    rec._failed.setdefault((id(op), to), f"{f.name}→{to}")
                    rec.skipped["operator_error"] += live.size
                    if len(rec.errors) < 5:
                        rec.errors.append(f"{f.name}→{to}: the operator returned {type(q).__name__} of shape "
                                          f"{getattr(q, 'shape', None)}, expected {fam.__name__} of shape ({live.size},)")
                    continue
                rec._answered.add((id(op), to))
                with np.errstate(all="ignore"):
                    qn = np.asarray(q.natural(), float).reshape(live.size, -1)
                    good = np.asarray(q.is_proper, bool) & np.all(np.isfinite(qn), axis=1)
                rec.skipped["invalid"] += int(np.count_nonzero(~good))
                for r, qrow, gd in zip(live, qn, good):
                    if gd:
                        j = members[rows[r]]
                        proposals[(j, to)] = (qrow - cav[to][0][rows[r]]) / self.power
        return proposals

    def _certified(self, op, factor: Factor, to: str, incoming, n: int, rec):
        """``(q, cert)`` of ``op`` for the batch ``incoming`` of ``n`` rows, its uncertain learned
        answers handled by ``on_uncertain`` (counted in ``rec``)."""
        kw = {} if self.power == 1.0 else {"power": self.power}
        q, cert = certified(op, incoming, to, **kw)
        unc = uncertain_rows(cert, n)
        if not unc.any():
            return q, cert
        rows = np.flatnonzero(unc)
        if self.on_uncertain == "raise":
            raise UncertainAnswerError(
                f"{rows.size} answer(s) of {type(op).__name__} for ({factor.name!r}, {to!r}) are uncertain: a log "
                f"predictive variance above its threshold {cert.threshold}, or flagged by its just-in-time rule "
                f'(rows {rows[:10].tolist()} of the batch); on_uncertain="raise"', rows=rows)
        oracle = self._oracle(factor, to) if self.on_uncertain == "oracle" else None
        if oracle is not None and isinstance(q, Family) and q.shape == (n,):
            q, cert = oracle_rows(q, cert, incoming, to, oracle, rows, **kw)
            rec.n_oracle += rows.size
            return q, cert
        rec.n_uncertain += rows.size  # "warn": used as they are, and counted
        return q, cert

    def _apply(self, prior_nat, sites, proposals, rec):
        """Damped updates; a variable whose posterior would be improper keeps its old sites."""
        g = self.graph
        new = dict(sites)
        step = 1.0 - self.damping
        for key, s in proposals.items():
            new[key] = sites[key] + step * (s - sites[key])
        post = self._posteriors(prior_nat, new)
        for v, nat in post.items():
            with np.errstate(all="ignore"):
                ok = bool(np.all(np.isfinite(nat))) and bool(g.variables[v][0].from_natural(nat).is_proper)
            if not ok:
                keys = [k for k in proposals if g.factors[k[0]][1][k[1]] == v]
                rec.skipped["improper"] += len(keys)
                for k in keys:
                    new[k] = sites[k]
        rec.n_updated += sum(1 for k in proposals if new[k] is not sites[k])
        return new, self._posteriors(prior_nat, new)
