"""The error the learned operators put into an EP posterior: error bars from operator draws.

A just-in-time rule judges one message at a time.  Where one variable receives many messages from
one learned operator (N data points on one parameter, a factor repeated over a graph), their errors
are nearly one shared error and add up in the posterior, while each message is as accurate as its
operator says (:mod:`kjit.draws`).  This module measures what they add up to, from the operators'
own uncertainty: every learned operator that can be drawn from its regression's posterior
(``draws(n, random_state)``: :class:`~kjit.operators.KernelOperator`, :class:`~kjit.operators.JITOperator`)
is replaced, from the sites of a finished run (its fixed point), by

- its posterior mean (the operator's own answers, every row, no oracle consulted): EP run to
  convergence gives the *reference* posterior;
- each of ``n_draws`` joint draws: EP run again from the same sites, one posterior per draw.

A variable's error bar is one standard deviation, over the draws, of its posterior mean's deviation from
the reference's, in reference posterior standard deviations (``mean_sd``), and of the log of its
posterior variance's ratio to the reference's (``log_var_sd``) — read as the 68.27 % quantile of the absolute
deviations, a draw whose EP run does not converge counted as the largest (:func:`_spread`): the error the
operators' uncertainty puts into the posterior, through EP's own response (a draw moves every message,
the cavities move with the sites, EP settles elsewhere).  Read with the estimate's own error: with
``n_draws`` = 16 it is within ±24 % (one sd) of its value.  The reference is EP with the learned answers
only: where the run replaced some with an oracle's (a JIT's consultations, ``on_uncertain="oracle"``), the
bars are of the all-learned posterior (conservative).

Not drawn: exact rules (their answers are exact), oracles (an importance sampler's Monte Carlo error is
not in the bars: every re-run gets a copy of its state before them, the same random stream) and operators
that cannot be drawn — named in ``not_drawn`` with the reason.  Draws whose EP run does not converge (diverges,
its operators fail on their numbers, or it reaches its iteration cap) are counted (``n_failed``) as the largest
deviations; a draw that fails otherwise (a connection, a server error, a served operator that changed version)
stops the bars (a RuntimeError; the engines say so in the status).  The run must have
converged (a ValueError otherwise), and so must EP with the operators' means (a RuntimeError otherwise).  Power EP is refused: a draw answers for the factor,
not for f^u.  Cost: 1 + ``n_draws`` EP runs, each from a fixed point.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..errors import ConfigurationError, check_number, user_stacklevel
from ..protocols import reports_uncertainty

__all__ = ["ErrorBars", "PosteriorErrorWarning", "graph_error_bars", "linear_error_bars"]


class PosteriorErrorWarning(UserWarning):
    """An EP posterior's error bars from its learned operators (``error_bars``) exceed ``error_tol``."""

#: outcomes of a draw's EP run whose posterior is compared (the others are failures: the last iterate of a run
#: that did not converge is no fixed point — e.g. every update skipped, the posterior still the sites' it started from)
_USABLE = ("converged",)

#: the quantile of the absolute deviations read as one standard deviation (P(|Z| ≤ 1) for a standard normal Z)
SPREAD_QUANTILE = 0.6826894921370859


@dataclass
class ErrorBars:
    """Error bars of an EP posterior from its learned operators' draws (see the module docstring)."""

    mean_sd: dict[str, float]      # per variable: sd of the posterior mean's deviation, in reference posterior sds
    log_var_sd: dict[str, float]   # per variable: sd of log(posterior variance / the reference's)
    n_draws: int
    n_failed: int                  # draws whose EP run did not converge (counted as the largest deviations)
    drawn: list                    # the operators' keys drawn
    not_drawn: dict                # key -> why not
    reference: dict                # per variable: (mean, variance) of the reference posterior
    status: str
    #: per draw used, per variable: (mean, variance)
    draws: list = field(default_factory=list, repr=False)

    @property
    def worst_mean_sd(self) -> float:
        """The largest ``mean_sd`` (0 with no variable)."""
        return max(self.mean_sd.values(), default=0.0)

    @property
    def worst_log_var_sd(self) -> float:
        return max(self.log_var_sd.values(), default=0.0)

    def summary(self) -> dict:
        """JSON-ready summary (an infinite bar — too many draws made EP fail — as None)."""
        def fin(x):
            return x if np.isfinite(x) else None

        return {"worst_mean_sd": fin(self.worst_mean_sd), "worst_log_var_sd": fin(self.worst_log_var_sd),
                "n_draws": self.n_draws, "n_failed": self.n_failed, "drawn": [list(k) if isinstance(k, tuple) else k
                                                                                for k in self.drawn],
                "not_drawn": {str(k): v for k, v in self.not_drawn.items()}, "status": self.status}


def _why_not(op) -> str:
    """Why ``op`` is not drawn, from where its answers come (its certificates' source)."""
    source = getattr(op, "certificate_source", "rule")
    if source == "rule":
        return "an exact rule: its answers are taken as exact"
    if source == "oracle":
        return "an oracle: its Monte Carlo error is not drawn"
    return f"{type(op).__name__} cannot be drawn (no draws(n, random_state)): its error is not in the bars"


def _quiet(rerun, replacements):
    """One re-run, its warnings kept from the caller (what they would say is counted in the bars)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rerun(replacements)


#: what a draw's answer may raise where its numbers fail (a belief that is no distribution, a request the server
#: refuses by row): a failure of the draw, counted; anything else (a connection, a server error, an operator that
#: changed version) stops the error bars
_NUMERIC = (ValueError, ArithmeticError)


class _Watched:
    """A drawn operator as the re-runs call it: its answers as they are, and any exception that is not a failure of
    its numbers kept in ``errors`` (and raised, as the engines expect)."""

    certificate_source = "learned"

    def __init__(self, op, errors: list):
        self.op, self.errors = op, errors
        self.factor, self.to = getattr(op, "factor", None), getattr(op, "to", None)

    def belief(self, incoming, to=None):
        try:
            return self.op.belief(incoming, to)
        except _NUMERIC:
            raise
        except Exception as exc:
            self.errors.append(exc)
            raise


def _spread(deviations) -> float:
    """One standard deviation of the deviations (absolute values; a failed draw's is +inf): their
    :data:`SPREAD_QUANTILE` quantile — that of |N(0, σ²)| is σ — so draws that break EP count as the largest
    deviations instead of being left out (those are the draws whose errors are largest: leaving them out
    measured an audit's 60-message posterior, variance 2.7 times the exact one, with a bar of 0.11 on the log
    variance), and the bar is infinite once more than 1 − SPREAD_QUANTILE of the draws fail.  Over 16 draws the
    estimate averages 0.96 σ with a relative spread of 24 % (one sd; measured in review)."""
    d = np.sort(np.asarray(deviations, float))
    i = int(np.ceil(SPREAD_QUANTILE * d.size)) - 1  # (the lower order statistic at the quantile)
    return float(d[i])


def _frozen(operators: Mapping, drawn: Mapping) -> dict:
    """Copies, made now, of the operators not drawn whose answers are not an exact rule's: each re-run gets a fresh
    copy of this state, so that an oracle's random stream starts alike in every re-run (its Monte Carlo noise is
    no learned operator's error: found in review, a sampler's fresh noise made a 2.6e-5 sd bar 0.19) and an
    operator that learns (a JIT before its fit) learns in the copy.  One that cannot be copied stops the bars."""
    out = {}
    for key, op in operators.items():
        if key in drawn or getattr(op, "certificate_source", None) == "rule":
            continue
        try:
            out[key] = copy.deepcopy(op)
        except Exception as exc:  # noqa: BLE001 - e.g. a served operator in oracle mode (a connection)
            raise RuntimeError(f"the operator of {key!r} is not drawn and cannot be copied for the re-runs "
                               f"({type(exc).__name__}: {exc}): its answers would change between them") from None
    return out


def _error_bars(operators: Mapping, rerun: Callable, own: Callable, n_draws, random_state,
                converged: bool) -> ErrorBars:
    """The shared protocol.  ``operators``: key -> operator; ``rerun(replacements)``: EP from the run's sites with
    those operators replaced -> (outcome, {variable: (mean, variance)}); ``own()``: the run's own posteriors, in
    that form (the reference when nothing is drawn: no re-run then)."""
    n_draws = check_number("n_draws", n_draws, 1, integer=True)
    if not converged:
        raise ValueError("error bars are of a fixed point: the run did not converge (its outcome is not 'converged')")
    rng = np.random.default_rng(random_state)
    drawn, not_drawn = {}, {}
    for key, op in operators.items():
        fn = getattr(op, "draws", None)
        if not callable(fn):
            not_drawn[key] = _why_not(op)
            continue
        try:
            drawn[key] = fn(n_draws, rng, mean=True)
        except ConfigurationError:
            raise  # (a served operator that is no longer the one the run used: no bars of another model)
        except Exception as exc:  # noqa: BLE001 - the run stands; its bars name what they leave out
            # (a JIT before its first fit, a served operator in oracle mode or out of reach)
            not_drawn[key] = f"cannot be drawn: {type(exc).__name__}: {exc}"
    if not drawn:
        ref = own()
        zero = dict.fromkeys(ref, 0.0)
        why = "; ".join(f"{k}: {r}" for k, r in not_drawn.items())
        return ErrorBars(zero, dict(zero), 0, 0, [], not_drawn, ref,
                         "no operator drawn" + (f" ({why})" if why else ": no learned operator"))
    frozen = _frozen(operators, drawn)

    def run(i):
        errors: list = []
        ops = {**{k: copy.deepcopy(o) for k, o in frozen.items()},
               **{k: _Watched(d[i], errors) for k, d in drawn.items()}}
        outcome, post = _quiet(rerun, ops)
        for exc in errors:  # (a served operator redeployed as another model: said as such)
            if isinstance(exc, ConfigurationError):
                raise exc
        if errors:
            raise RuntimeError(f"a re-run's operator failed for a reason other than its numbers "
                               f"({type(errors[0]).__name__}: {errors[0]}): the bars would count it as an error")
        return outcome, post

    outcome, ref = run(0)
    if outcome not in _USABLE:
        raise RuntimeError(f"error bars: EP with the operators' posterior means from the run's sites ended {outcome!r}, "
                           "not converged: there is no reference posterior to measure the draws against")
    runs, failed = [], 0
    for i in range(n_draws):
        out, post = run(1 + i)
        if out in _USABLE:
            runs.append(post)
        else:
            failed += 1
    mean_sd, log_var_sd = {}, {}
    for v, (m0, v0) in ref.items():
        dm = [abs(p[v][0] - m0) / np.sqrt(v0) for p in runs] + [np.inf] * failed
        dl = [abs(np.log(p[v][1] / v0)) for p in runs] + [np.inf] * failed
        mean_sd[v], log_var_sd[v] = _spread(dm), _spread(dl)
    worst = max(mean_sd, key=mean_sd.get)
    status = (f"{n_draws} draw(s) of {len(drawn)} learned operator(s): the largest error bar "
              f"{mean_sd[worst]:.3g} posterior sd on the mean of {worst!r}")
    if failed:
        status += f"; {failed} draw(s) did not converge (counted as the largest deviations)"
    if not_drawn:
        status += f"; not drawn: {', '.join(map(str, not_drawn))}"
    return ErrorBars(mean_sd, log_var_sd, n_draws, failed, list(drawn), not_drawn, ref, status, runs)


def require_plain_ep(power: float, relax_c=None, what: str = "error bars") -> None:
    """A ValueError naming ``what`` unless the run is plain EP: a draw answers for the factor, not for f^u (power
    EP), and has no projection_kl (relaxed EP)."""
    if power != 1.0:
        raise ValueError(f"{what} need EP (power 1), not power EP (power={power:g}): a draw answers for the factor, "
                         "not for f^u")
    if relax_c is not None:
        raise ValueError(f"{what} need EP, not relaxed EP (relax_c): a draw has no projection_kl")


def graph_error_bars(ep, result, n_draws: int = 16, random_state=0) -> ErrorBars:
    """Error bars of a :class:`~kjit.ep.GraphEP` run's posterior (``result``, a :class:`~kjit.ep.GraphResult`
    of ``ep`` on its graph): see the module docstring.  Variables by name; their family's mean and variance."""
    require_plain_ep(ep.power)

    def rerun(replacements):
        other = copy.copy(ep)
        other.operators = {**ep.operators, **replacements}
        other.compute_evidence, other.error_bars, other.warn_unconverged = False, 0, False
        other._default_ops = dict(ep._default_ops)
        return res_summary(other.run(init=result))

    def res_summary(res):
        return res.outcome, {v: (float(np.asarray(b.mean())), float(np.asarray(b.var()))) for v, b in res.beliefs.items()}

    return _error_bars(ep.operators, rerun, lambda: res_summary(result)[1], n_draws, random_state,
                       bool(result.converged))


def linear_error_bars(ep, A, observed, result, n_draws: int = 16, random_state=0) -> ErrorBars:
    """Error bars of a :class:`~kjit.ep.LinearEP` run's posterior (``result`` of ``ep.run(A, observed)``): see
    the module docstring.  Variables are the weights, ``"w[i]"``, with their marginal means and variances."""
    require_plain_ep(ep.power, ep.relax_c)
    sites = (result.site_shift, result.site_precision)

    def rerun(replacements):
        other = copy.copy(ep)
        other.operator = replacements["operator"]
        if isinstance(replacements["operator"], _Watched):  # (a draw: no threshold, no oracle)
            other.oracle, other.uncertainty_threshold, other.on_uncertain = None, None, "warn"
        other.compute_evidence, other.callback, other.error_bars, other.warn_unconverged = False, None, 0, False
        return res_summary(other.run(A, observed, init_sites=sites))

    def res_summary(res):
        var = np.diag(res.cov)
        return res.outcome, {f"w[{i}]": (float(res.mean[i]), float(var[i])) for i in range(len(var))}

    return _error_bars({"operator": ep.operator}, rerun, lambda: res_summary(result)[1], n_draws, random_state,
                       bool(result.converged))


def attach(ep, result, compute: Callable, who: str, shared: int = 0) -> None:
    """After an engine's run: with ``ep.error_bars`` draws, compute the run's error bars (``compute(n_draws)``),
    keep them on ``result.error_bars``, add a sentence to its status and warn :class:`PosteriorErrorWarning`
    when the largest error bar on a mean exceeds ``ep.error_tol`` (an infinite one — too many draws made EP
    fail — included).  A run that did not converge has none (its status says so).  Without error bars, where
    one variable receives ``shared`` ≥ 2 messages from one learned operator, the status says that their errors
    add up and how to measure the sum — unless the run's counted answers include no learned one (a just-in-time
    operator that asked its oracle every time)."""
    n = ep.error_bars
    if not n:
        answers = result.answers
        if shared >= 2 and not (answers and answers.get("learned", 0) == 0):
            result.status += (f"; up to {shared} messages to one variable come from one learned operator: their errors "
                              "add up, which no per-message rule sees (error_bars=16 measures the posterior's)")
        return
    if not result.converged:
        result.status += "; error bars not computed: the run did not converge"
        return
    try:
        bars = compute(n)
    except RuntimeError as exc:  # (EP with the operators' means did not converge from the run's sites)
        result.status += f"; error bars not computed: {exc}"
        warnings.warn(f"{who}: {exc}", PosteriorErrorWarning, stacklevel=user_stacklevel())
        return
    result.error_bars = bars
    if not bars.drawn:
        if any(not r.startswith("an exact rule") for r in bars.not_drawn.values()):
            result.status += f"; error bars: {bars.status}"  # (an operator whose error is not in them)
        return
    v = max(bars.mean_sd, key=bars.mean_sd.get)
    msg = (f"the learned operators' error bar on the mean of {v!r} is {bars.mean_sd[v]:.3g} posterior sd "
           f"({bars.n_draws} draws" + (f", {bars.n_failed} made EP fail" if bars.n_failed else "") + ")")
    if bars.mean_sd[v] > ep.error_tol:
        result.status += f"; {msg}, above error_tol={ep.error_tol:g}"
        warnings.warn(f"{who}: {msg}, above error_tol={ep.error_tol:g}: the posterior's error from its learned "
                      "operators' uncertainty (see result.error_bars)", PosteriorErrorWarning, stacklevel=user_stacklevel())
    else:
        result.status += f"; {msg}"


def learned_share(operators, counts) -> int:
    """The most messages one variable receives from one learned operator: ``counts`` (key -> that count) over the
    ``operators`` (key -> operator) whose answers may be learned — one that can be drawn, or that reports an
    uncertainty (a just-in-time or served operator)."""
    return max((counts.get(k, 0) for k, op in operators.items()
                if callable(getattr(op, "draws", None)) or reports_uncertainty(op)), default=0)
