"""EP with Gaussian sites on linear predictors (SPEC §7).

Model: ``w ~ N(0, diag(prior_var))`` in R^d, linear predictors ``x_i = a_i^T w`` (rows of ``A``),
and one non-conjugate factor per row that links ``x_i`` to other, *fixed* messages (the observed
label, as a message).  The factor's messages to ``x_i`` come from an *operator*::

    operator.belief(incoming: dict[str, Family], to: str) -> Family   # proj[f · Π incoming]
    operator.log_partition(incoming) -> ndarray                         # optional (log evidence)

``incoming`` maps every variable of the factor to a batch of messages of one common shape
``(n,)``.  EP approximates each factor by a Gaussian site ``t_i(x_i) ∝ exp(h_i x_i − λ_i x_i²/2)``
(shift ``h_i``, precision ``λ_i``); the posterior is
``N(w; μ, Σ)``, ``Σ^{-1} = diag(1/prior_var) + A^T diag(λ) A``, ``Σ^{-1} μ = A^T h``.

One EP update of site i:

1. posterior marginal ``x_i ~ N(m_i, v_i)``, ``m_i = a_i^T μ``, ``v_i = a_i^T Σ a_i``;
2. cavity (the marginal with site i removed), computed without forming ``Σ_¬i``::

       v_¬i = v_i / (1 − λ_i v_i),   m_¬i = (m_i − v_i h_i) / (1 − λ_i v_i)

   it is a distribution only when ``1 − λ_i v_i > 0`` (otherwise the update is skipped);
3. ``q = operator.belief({x: N(m_¬i, v_¬i), **observed_i}, x)`` (the projected tilted
   distribution) and the proposed site ``q / cavity`` (natural parameters subtracted);
4. damping in natural parameters: ``site ← site + (1 − damping) · (proposal − site)``.

Improper or invalid updates are skipped, never clipped, and counted per iteration by reason:

``cavity``          non-positive or non-finite cavity variance;
``operator_error``  the operator raised (the whole batch it was asked is skipped, unless the
                    exception has a ``rows`` attribute naming the failing positions of the
                    batch, as the importance-sampling oracle's ``LowESSError`` does: then only
                    those are skipped and the rest is asked again) or returned a non-Gaussian /
                    wrongly shaped answer;
``invalid``         the belief is improper or non-finite, or the new site is non-finite;
``negative``        the new site precision is negative and ``allow_negative_sites`` is False;
``not_pd``          the update would make the posterior precision not positive definite.

Schedules: ``"parallel"`` updates all sites from one posterior, asking the operator for all
cavities in **one batched call** per iteration (what a remote operator needs); ``"sequential"``
updates site by site with rank-one updates of ``(μ, Σ)``, one operator call of batch size one
per site, and recomputes the posterior from the sites after every sweep (no drift).

Convergence: an iteration converges when the largest change of any site's natural parameters,
measured on the scale of the posterior marginal ``v_i`` of its predictor,
``max_i max(|Δh_i| √v_i, |Δλ_i| v_i)``, is below ``tol`` *and* no update was skipped.  The change
is the *undamped* one — from the site to its proposal ``q / cavity``, before damping (and before a
parallel iteration's step shrinkage) — so ``converged`` means within ``tol`` of the fixed point
whatever the damping: the damped step is only ``(1 − damping)`` times that distance, and a test on
it stopped heavily damped runs far from the fixed point (found by an audit: probit, damping 0.999,
tol 1e-6: "converged" with the sites 1.5e-3 off the fixed point in this measure).  The
scaling makes the test invariant to rescaling a row ``a_i`` and avoids a round-off floor: a
site's natural parameters are a difference of two precisions of order ``1/v_i`` (belief minus
cavity), so their absolute round-off is ``~1e-16 / v_i`` and an unscaled test cannot pass for
rows with small ``v_i``.  (``|Δλ_i| v_i`` is the change of the fraction of the marginal
precision that site i contributes; ``|Δh_i| √v_i`` the change of the site's pull on the
marginal mean in marginal standard deviations.)  The unscaled change is recorded too.  A run that stops at
``max_iter`` has ``converged=False`` and says so in ``status``.

Log evidence (where the operator has ``log_partition``): the standard EP estimate
``log Z_EP = Σ_i log s_i + log ∫ N(w; 0, Σ_0) Π_i exp(h_i x_i − λ_i x_i²/2) dw`` with site
normalisers ``s_i`` chosen so that ``∫ cavity_i · s_i exp(h_i x − λ_i x²/2) dx = Z_i``, where
``Z_i = exp(log_partition)`` is the tilted normaliser at the final cavities.  It is the log
marginal likelihood of the factor graph as given to the operator (messages normalised).

Variants (SPEC §7; the relaxed EP and Laplace propagation papers)
-----------------------------------------------------------------
Relaxed EP: Qi & Guo, "Message passing with relaxed moment matching", and its appendix; Laplace
propagation: Smola, Vishwanathan & Eskin, "Laplace propagation".

**Power EP** (``power=u``, 0 < u; u = 1 is EP).  The cavity removes only a fraction u of the
site, ``q^{\\u} ∝ q / t̃_i^u`` (on the marginal: ``v_¬ = v / (1 − u λ v)``,
``m_¬ = (m − u v h) / (1 − u λ v)``), the tilted distribution is ``q^{\\u} · f_i^u`` and the new
site is ``(proj[q^{\\u} f_i^u] / q^{\\u})^{1/u}`` (natural parameters divided by u — the
appendix's "v_i ← u v_i").  The operator must therefore answer for the *factor to the power u*:
the engine calls ``operator.belief(incoming, to, power=u)`` (and ``log_partition(incoming,
power=u)`` for the evidence) and requires ``operator.supports_power`` to be true.  A learned or
importance-sampling operator of ``f`` does not know ``f^u`` — it needs an operator trained on
``f^u`` (``f^u`` is sampleable only in special cases), so it is refused with a clear error.
Operators that do support it (:mod:`kjit.ep.operators`): ``ProbitNoiseOperator`` (closed form:
``f^u`` is still a two-piece step, weights ``(1−ε)^u`` and ``ε^u``, relaxed-EP appendix §4),
``LogisticOperator`` (``σ^u`` is the logistic factor with the label message raised to the power
u: quadrature) and ``LaplaceOperator`` (``u·log f``).  The evidence is Minka's power-EP estimate:
site normalisers with ``∫ q^{\\u} (s_i t̃_i)^u = Z_i(u)``.
A limitation of u > 1: the u-cavity is a distribution only where
``u λ_i v_i < 1``, i.e. where site i carries less than 1/u of its predictor's posterior precision.
A site that carries more — typically a conjugate Gaussian factor that dominates its predictor —
has an improper u-cavity at every iteration, its update is skipped (``cavity``) and the run never
reports convergence, though ``q^{\\u} f^u`` is still normalisable there (``f^u`` has Gaussian
tails) and the posterior may already be exact (found by an audit: Gaussian regression, 5 rows × 3
weights, u = 1.5–3: posterior mean exact to 4e-16, outcome "max_iter", evidence not computed).
Use u ≤ 1 for such factors.

**Relaxed EP** (``relax_c=c``).  Before the projection, the cavity is multiplied by a
relaxation factor ``r_i(x) ∝ exp(−b_i (x − m̃_i)² / 2)`` of precision ``b_i ≥ 0`` centred at the
current site mean ``m̃_i = h_i / λ_i`` (0 for an untouched site, as in the paper's GP algorithm,
eqs. 13–23), the relaxed tilted ``f_i · r_i · q^{\\i}`` is projected to ``q̃`` and the new site is
``q̃ / (r_i q^{\\i})`` — i.e. EP with the cavity replaced by the *relaxed cavity* ``r_i q^{\\i}``,
so it works with any operator.  ``b_i`` minimises the l1-penalised relaxed KL
``Q(b) = KL(p_b ‖ proj p_b) + c |b|``, ``p_b ∝ f_i r_i q^{\\i}`` (paper eq. 6, appendix eq. 21;
``KL = E_p[log f] − log Z_b − KL(proj p_b ‖ r_i q^{\\i})``), by a line search: a log-spaced grid of
``relax_grid`` values of ``b · v_¬`` in [1e-4, 1e4] plus ``b = 0`` (default 49: 6 per decade),
then, within the best grid point's neighbours, :data:`RELAX_GOLDEN_STEPS` steps of golden-section
search in ``log b`` and a parabola through three equally spaced points of the final bracket, taken
whatever it gives (a smooth function of the cavity, so EP can converge on it) — 18 batched
operator calls per update.  The operator must provide
``projection_kl(incoming, to)`` (``ProbitNoiseOperator`` and ``LogisticOperator`` do).  When the
KL's slope at ``b = 0`` is above ``−c`` (always, for a large ``c``) the search returns exactly
``b = 0`` and the update is EP's, bit for bit.  Per iteration the record holds ``n_relaxed``
(sites with ``b > 0``) and ``mean_relaxation`` (mean of ``b · v_¬`` over relaxed sites).  A line
search that fails (the objective raises, or is not finite even at ``b = 0``) gives those sites the
plain EP update: counted per iteration in ``n_relax_failed``, said in ``status`` and warned at the
end of the run (RuntimeWarning) — never silent.  The
evidence of a REP run is the EP formula at the final sites (relaxation factors not included).
Notes on the paper: (i) its appendix eq. 22, written out term by term, is exactly
``E_p[log f] − log Z_b − KL(q̃ ‖ r q^{\\i}) + c|b|`` — the objective used here; (ii) its GP
algorithm removes ``r`` from the site with a *plus* sign (eqs. 22–23: ``1/v_i = 1/v_{i,b} + b``),
which contradicts §4.1 (``q = q̃ / r``); we follow §4.1 (keeping ``r`` in the site made EP
diverge on the five-point example); (iii) ``b`` is a precision, so ``c`` is in nats per unit of
precision of the latent variable and depends on its scale: with unit-scale latents the KL a
relaxation can remove is ≲ 1 nat, so the paper's c = 10–20 leaves every site unrelaxed here
(REP = EP); relaxation starts around c ≲ 1.

**Relaxed EP: readings** (``relax_reading``, issue 18).  The paper admits several readings;
each is selectable, and each with ``c → ∞`` is EP bit for bit (the line search returns exactly
``r = 1``).  ``r_i`` acts on the cavity in natural parameters ``(r_h, r_λ)``:

``"projection_kl"`` (default; the one above)  r of precision ``b`` centred at the site mean,
    objective ``KL(p_b ‖ proj p_b) + c b``, site ``q̃ / (r q^{\\i})`` (§4.1: ``q = q̃ / r``).
``"appendix_q"``  the same r and site update, ``b`` chosen by the appendix's eq. 22 *as written*
    (``operator.appendix_relaxed_q``; the noisy probit only) ``+ c b``.  Eq. 22 is not the relaxed
    KL: it equals ``KL(p_b ‖ proj p_b) − ½ α h̃^{\\i} − ½ b ṽ − …`` (see
    :meth:`kjit.ep.operators.ProbitNoiseOperator.appendix_relaxed_q`).
``"appendix_site"``  the paper's GP algorithm as printed: eq. 22 line search, and eqs. 22–23 *put
    r back into the site* (``1/v_i = 1/v_{i,b} + b``, ``m_i/v_i = m_{i,b}/v_{i,b} + b m_i^old``),
    i.e. the site is ``q̃ / q^{\\i}`` and the new belief is ``q̃ = proj[t r q^{\\i}]`` itself.
    With the paper's initialisation (sites 1, b = 0) this is the engine's default start.
``"scaled_message"``  appendix §2 eq. 18: ``η_i = η τ_i^old``, r = ``t̃_i^η`` (both natural
    parameters of the old site scaled by one η ∈ {0} ∪ ±[1e-3, 10], log grid), objective
    ``KL(p_η ‖ proj p_η) + c |η| (|h_i| + |λ_i|/2)`` (the l1 norm of η_i on the features
    ``(x, x²)``), site as in §4.1.  An untouched site (``v_i = ∞``) cannot be relaxed.

Units of c: the objective is in nats.  In the three ``b`` readings ``c b`` has ``b`` a precision
of the latent, so ``c`` is nats × (latent units)²: its effect depends on the scale of the latent
(compare ``c`` with the cavity variance); the paper's c = 10–20 is far above what a unit-scale
latent's KL can repay.  In ``"scaled_message"`` ``η`` is dimensionless but ``|h| + |λ|/2`` mixes
units 1/x and 1/x², so ``c`` has no consistent unit at all: rescaling the latent changes the answer.

**Laplace propagation** needs no engine change: it is an operator
(``kjit.ep.operators.LaplaceOperator``) whose belief is the Laplace approximation of the tilted
distribution at its mode.

**Stopping rule** (``stop_rule``): a callable ``(record, mean, cov) -> bool`` that replaces the
site-change test (an iteration with skipped updates still never converges); e.g. the relaxed-EP
paper's ``R = ‖α_t − α_{t−1}‖ < 1e-3`` on the GP representer weights
(:class:`kjit.ep.gp.GPClassifier`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
from scipy import linalg
from scipy.linalg.blas import dger as _dger

from ..families import NUMERIC_KINDS, Family, Gaussian
from ..certificates import Certificates, above_threshold, certified, count_answers, last_certificates, outgoing_proper
from ..errors import ConfigurationError, OperatorUnavailableError, check_number, rows_of_batch, user_stacklevel
from ..protocols import (answered_factor, check_same_factor, has_log_partition, has_projection_kl, is_operator,
                         log_var_is_variance, reports_uncertainty, supports_power)
from .error_bars import attach, learned_share, linear_error_bars, require_plain_ep

__all__ = [
    "GaussianPosterior",
    "IterationRecord",
    "EPResult",
    "LinearEP",
    "SKIP_REASONS",
    "ON_UNCERTAIN",
    "UncertainAnswerError",
    "UncertainAnswerWarning",
    "check_number",
]

SKIP_REASONS = ("cavity", "operator_error", "invalid", "negative", "not_pd")
#: a run stops (``outcome="operator_failed"``, with a warning) after this many consecutive iterations
#: in which the operator failed every update it was asked — an unreachable server, a batch refused
#: whole: more iterations cannot help (found in review: a hung server kept a run going for hours and
#: ``fit()`` returned the prior quietly)
OPERATOR_FAILURE_ITERATIONS = 3
#: calls of one batch to one operator while each failure names rows to drop (each call drops at least one; the
#: rest are asked again): a server names the first refused row of each column only (its lists fail fast), so a
#: batch with 4 refused rows needs 5 calls (found by an audit: at LinearEP's 4 and GraphEP's 3 calls every row of
#: such a batch was skipped, every iteration, and the run ended operator_failed)
ROW_RETRIES = 16
#: ``damping="auto"``: iterations running in which the largest change stays above 0.9 × its best before the damping
#: is raised (an oscillating parallel EP stalls; a converging one gains 10 % within far fewer)
AUTO_DAMPING_PATIENCE = 10
#: ``damping="auto"``: the largest damping it raises to
AUTO_DAMPING_MAX = 0.95


def count_failing(failing: int, n_updated: int, operator_errors: int) -> int:
    """The run of consecutive iterations in which the operator failed every update it was asked."""
    return failing + 1 if n_updated == 0 and operator_errors > 0 else 0


def operator_failure(failing: int, iterations: int, errors, who: str, who_failed: str = "the operator") -> str:
    """The status of a run stopped by :data:`OPERATOR_FAILURE_ITERATIONS`, also warned (RuntimeWarning)."""
    status = (f"stopped at iteration {iterations}: {who_failed} failed every update of the last {failing} "
              f"iterations ({errors[0] if errors else 'no message'})")
    warnings.warn(f"{who}: {status}; the posterior is the last state it could update", RuntimeWarning, stacklevel=user_stacklevel())
    return status

# what the engine does with an answer whose log predictive variance exceeds the operator's
# threshold: use it and warn at the end of the run (counted per iteration in n_uncertain), raise
# UncertainAnswerError, or replace it by the oracle's answer
ON_UNCERTAIN = ("warn", "raise", "oracle")


class UncertainAnswerWarning(UserWarning):
    """EP used answers above the operator's uncertainty threshold (``on_uncertain="warn"``)."""


class EPConvergenceWarning(UserWarning):
    """An EP run ended without converging: it reached ``max_iter`` or diverged (its ``status`` says which,
    with the last change; the posterior is the last state).  An operator that failed every update warns
    with a RuntimeWarning instead (:func:`operator_failure`)."""


def warn_unconverged(outcome: str, status: str, who: str, damping: float = 0.0) -> None:
    """:class:`EPConvergenceWarning` carrying ``status`` when ``outcome`` is ``"max_iter"`` or
    ``"diverged"``, at the caller's line outside kjit — a run's answer is never an unconverged
    posterior without a word; ``warn_unconverged=False`` on the engine or model (or a warnings filter
    on the class) silences it where non-convergence is expected and counted.  ``damping``: the run's,
    so that the hint suggests more of it than it had (ProbitClassifier's parallel default is 0.5 already)."""
    # (from 0.5 on, half the step the run took; never shown as 1, which the engines refuse — found in review)
    sug = 0.5 if damping < 0.5 else 1.0 - (1.0 - damping) / 2
    more = f"damping (e.g. damping={f'{round(sug, 6):g}' if round(sug, 6) < 1 else repr(sug)})"
    more = ("more " if damping > 0 else "") + more
    hint = {"max_iter": f"more sweeps (max_iter), {more} or schedule='sequential' may let it converge",
            "diverged": f"{more} or schedule='sequential' may keep it stable"}.get(outcome)
    if hint is not None:
        warnings.warn(f"{who}: {status} — {hint}; warn_unconverged=False silences this", EPConvergenceWarning,
                      stacklevel=user_stacklevel())


class UncertainAnswerError(RuntimeError):
    """An operator's answer was above its uncertainty threshold and ``on_uncertain="raise"``."""

    def __init__(self, message, rows=None):
        super().__init__(message)
        self.uncertain_rows = rows


def check_on_uncertain(policy) -> str:
    """``policy`` if it is one of :data:`ON_UNCERTAIN`, else a ValueError naming them."""
    if policy not in ON_UNCERTAIN:
        raise ValueError(f"`on_uncertain` must be one of {ON_UNCERTAIN}, got {policy!r}")
    return policy


def uncertain_rows(cert: Certificates | None, n: int) -> np.ndarray:
    """(n,) the answers of a batch of ``n`` that its certificates rate uncertain — learned, above the
    operator's threshold in some coordinate or flagged by its just-in-time rule
    (:attr:`Certificates.uncertain`); none where there are no certificates for the batch."""
    if cert is None or len(cert) != n:
        return np.zeros(n, dtype=bool)
    return np.asarray(cert.uncertain, dtype=bool)


def oracle_rows(q: Family, cert: Certificates | None, incoming: Mapping[str, Family], to: str, oracle, rows, **kw):
    """``(q, cert)`` of a flat batch with the rows ``rows`` answered by ``oracle`` instead (``kw``:
    passed to it, e.g. ``power=``), their certificates the oracle's.  An exception of the oracle names
    the batch's rows (:func:`~kjit.errors.rows_of_batch`); an answer that is not one message of
    ``q``'s family per row is a ValueError."""
    rows = np.asarray(rows, dtype=np.intp).reshape(-1)
    sub = {k: m[rows] for k, m in incoming.items()}
    try:
        q_or, cert_or = certified(oracle, sub, to, unknown_source="oracle", **kw)
    except Exception as exc:
        raise rows_of_batch(exc, rows)  # the sub-batch's rows named as the batch's
    if not isinstance(q_or, type(q)) or q_or.size != rows.size:
        raise ValueError(f"the oracle must answer {rows.size} {type(q).__name__} message(s), got "
                         f"{type(q_or).__name__} of shape {getattr(q_or, 'shape', None)}")
    q = q.ravel().with_rows(rows, q_or.ravel())
    if cert is not None and len(cert) == q.size and len(cert_or) == rows.size:
        cert = cert.replace(rows, cert_or)
        cert.proper[rows] = outgoing_proper(q_or.ravel(), sub[to].ravel())
    return q, cert

_SCHEDULES = ("parallel", "sequential")
#: relaxed-EP readings (see the module docstring, "Relaxed EP: readings")
RELAX_READINGS = ("projection_kl", "appendix_q", "appendix_site", "scaled_message")


class GaussianPosterior(NamedTuple):
    """Multivariate Gaussian ``N(mean, cov)``; unpacks as ``mean, cov = posterior``."""

    mean: np.ndarray
    cov: np.ndarray

    def marginals(self, X) -> Gaussian:
        """Distribution of ``X @ w`` row by row: ``N(X μ, diag(X Σ X^T))``."""
        X = np.atleast_2d(np.asarray(X, dtype=float))
        m = X @ self.mean
        v = np.einsum("ij,jk,ik->i", X, self.cov, X)
        return Gaussian(m, np.maximum(v, np.finfo(float).tiny))


def _count(rec, cert, n: int) -> None:
    """Count a batch's answers by source and quality into the iteration record."""
    if rec is not None and cert is not None and len(cert) == n:
        count_answers(rec.answers, cert)


def sum_answers(parts) -> dict[str, int]:
    """Sum answer counts (dicts of :meth:`kjit.certificates.Certificates.counts`)."""
    out: dict[str, int] = {}
    for d in parts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


@dataclass
class IterationRecord:
    """What happened in one EP iteration (a full sweep over the sites)."""

    iteration: int
    max_change: float          # largest scaled change of an applied site, undamped (site → proposal): max(|Δh| √v, |Δλ| v)
    seconds: float             # wall time of the iteration
    n_skipped: int             # updates skipped, all reasons
    skipped: dict[str, int]    # updates skipped, by reason (see SKIP_REASONS)
    n_updated: int             # sites whose update was applied
    operator_calls: int        # calls to operator.belief in this iteration
    operator_seconds: float    # time spent inside the operator
    max_change_raw: float = 0.0  # largest unscaled |Δh| or |Δλ| of an applied site, undamped
    step_scale: float = 1.0    # parallel: extra step shrinkage needed to keep Σ positive definite
    errors: list[str] = field(default_factory=list)  # operator exception messages (first few)
    n_uncertain: int = 0       # answers used whose log predictive variance exceeded the threshold
    n_oracle: int = 0          # uncertain answers replaced by the oracle (on_uncertain="oracle")
    n_zeroed: int = 0          # negative message precisions within the answer's error of 0, used as 0
    n_relaxed: int = 0         # relaxed EP: sites updated with a relaxation b > 0
    mean_relaxation: float = 0.0  # relaxed EP: mean of b · v_cavity over the relaxed sites
    n_relax_failed: int = 0    # relaxed EP: sites given the plain EP update because the line search failed
    # answers received by source and quality (kjit.certificates.Certificates.counts: rule, oracle,
    # learned, learned_confident, learned_uncertain, learned_unrated, improper)
    answers: dict[str, int] = field(default_factory=dict)
    _relax_count: int = field(default=0, repr=False, compare=False)
    # operator calls running that got no answer at all (OperatorUnavailableError): a sequential sweep stops asking
    # at OPERATOR_FAILURE_ITERATIONS
    _unanswered: int = field(default=0, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "max_change": self.max_change,
            "max_change_raw": self.max_change_raw,
            "seconds": self.seconds,
            "n_skipped": self.n_skipped,
            "skipped": dict(self.skipped),
            "n_updated": self.n_updated,
            "operator_calls": self.operator_calls,
            "operator_seconds": self.operator_seconds,
            "step_scale": self.step_scale,
            "errors": list(self.errors),
            "n_uncertain": self.n_uncertain,
            "n_oracle": self.n_oracle,
            "n_zeroed": self.n_zeroed,
            "n_relaxed": self.n_relaxed,
            "mean_relaxation": self.mean_relaxation,
            "n_relax_failed": self.n_relax_failed,
            "answers": dict(self.answers),
        }


@dataclass
class EPResult:
    """Outcome of an EP run.

    ``site_shift`` (h) and ``site_precision`` (λ) are the Gaussian sites
    ``exp(h_i x_i − λ_i x_i²/2)``; ``posterior`` is ``N(mean, cov)`` of the weights.
    """

    posterior: GaussianPosterior
    site_shift: np.ndarray
    site_precision: np.ndarray
    converged: bool
    iterations: int
    status: str
    history: list[IterationRecord]
    log_evidence: float | None
    log_evidence_note: str
    seconds: float
    operator_calls: int
    schedule: str
    outcome: str = "converged"   # "converged", "max_iter", "diverged" or "operator_failed" (status says more)
    diverged_at: int | None = None  # the iteration whose update was refused as divergent
    damping: float = 0.0  # the damping the run ended with (LinearEP(damping="auto") raises it where the run stalls)
    #: with ``LinearEP(error_bars=n)``: the posterior's error bars from the operator's draws
    #: (:mod:`kjit.ep.error_bars`); None without
    error_bars: Any = None

    @property
    def n_uncertain(self) -> int:
        """Answers used above the operator's uncertainty threshold, over all iterations."""
        return int(sum(r.n_uncertain for r in self.history))

    @property
    def skipped(self) -> dict[str, int]:
        """Skipped updates by reason, summed over all iterations."""
        return {k: int(sum(r.skipped.get(k, 0) for r in self.history)) for k in SKIP_REASONS}

    @property
    def answers(self) -> dict[str, int]:
        """Operator answers received, by source and quality, over all iterations (see
        :meth:`kjit.certificates.Certificates.counts`)."""
        return sum_answers(r.answers for r in self.history)

    @property
    def mean(self) -> np.ndarray:
        return self.posterior.mean

    @property
    def cov(self) -> np.ndarray:
        return self.posterior.cov

    @property
    def n_skipped(self) -> int:
        """Skipped updates summed over all iterations."""
        return int(sum(r.n_skipped for r in self.history))

    @property
    def max_changes(self) -> np.ndarray:
        return np.array([r.max_change for r in self.history])

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (no arrays)."""
        return {
            "converged": self.converged,
            "outcome": self.outcome,
            "diverged_at": self.diverged_at,
            "iterations": self.iterations,
            "status": self.status,
            "n_uncertain": self.n_uncertain,
            "answers": self.answers,
            "skipped": self.skipped,
            "seconds": self.seconds,
            "operator_calls": self.operator_calls,
            "n_skipped": self.n_skipped,
            "log_evidence": self.log_evidence,
            "error_bars": None if self.error_bars is None else self.error_bars.summary(),
            "schedule": self.schedule,
            "damping": self.damping,
            "history": [r.as_dict() for r in self.history],
        }


# ---------------------------------------------------------------------------- helpers
class _PosteriorState:
    """Posterior from prior precision and sites, by Cholesky of the precision."""

    __slots__ = ("mean", "cov", "chol")

    def __init__(self, mean, cov, chol):
        self.mean, self.cov, self.chol = mean, cov, chol


def _posterior_from_sites(A, prior_prec, h, lam):
    """Return a _PosteriorState or None when the precision is not positive definite."""
    with np.errstate(all="ignore"):
        P = A.T @ (lam[:, None] * A)
        P[np.diag_indices_from(P)] += prior_prec
        b = A.T @ h
    if not np.all(np.isfinite(P)) or not np.all(np.isfinite(b)):
        return None
    try:
        L = linalg.cholesky(P, lower=True, check_finite=False)
    except linalg.LinAlgError:
        return None
    if not np.all(np.diag(L) > 0):
        return None
    with np.errstate(all="ignore"):
        mean = linalg.cho_solve((L, True), b, check_finite=False)
        Linv = linalg.solve_triangular(L, np.eye(P.shape[0]), lower=True, check_finite=False)
        cov = Linv.T @ Linv
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(cov))):
        return None  # a finite precision can still give an overflowing mean (sites ~1e306)
    return _PosteriorState(mean, cov, L)


#: iterations running a large site must grow (by more than 1 %, its increment not shrinking) to be judged a runaway
DIVERGENCE_STREAK = 30


def runaway(size, before, before_increment, streak, large_at, damping: float = 0.0):
    """One iteration of the divergence test's growth reading, per site (scalars or arrays): ``(runaway, streak,
    increment)``.  A site above ``large_at`` is a runaway when it more than doubled since the last iteration, where
    it was above ``large_at`` too, or when it grew by more than 1 % of (1 − ``damping``) with an increment no smaller
    than the last in each of :data:`DIVERGENCE_STREAK` iterations running.  A site approaching a large fixed point,
    damped by d, grows by S·d^k·(1 − d) at iteration k — more than 1 % for ~70 iterations at d = 0.99 (found by an
    audit: a precise measurement under damping 0.95 / 0.99 was called diverged at iterations 32 / 41) — but its
    increments shrink by d every iteration; a runaway's (geometric, ratio > 1) do not.  Damped, a runaway grows by
    about (1 − d)(R − 1) an iteration, so the 1 % is scaled by 1 − d (found in review: contradictory probit labels
    under damping 0.999 grew 0.4 % an iteration and ran 20 000 iterations to a site 5e37 times its prior)."""
    large = size > large_at
    increment = size - before
    step = large & (size > (1.0 + 0.01 * (1.0 - damping)) * before) & (increment >= before_increment)
    streak = np.where(step, streak + 1, 0)
    fast = large & (before > large_at) & (size > 2.0 * before)
    return fast | (streak >= DIVERGENCE_STREAK), streak, increment


class _DivergenceTest:
    """Why an iteration's result is divergent, or None (:meth:`cause`): non-finite sites or posterior, or a site
    whose precision is above ``limit`` times its predictor's prior precision and either above ``limit`` times its
    posterior marginal precision too (sites growing against each other while the posterior they sum to does not)
    or growing as a runaway does (:func:`runaway`: sites and posterior growing together).  Large against the prior
    alone is no divergence: one precise datum carries that much (found by an audit: Poisson regression with a
    count of 2e8 under a prior variance of 1e4, a site 2e12 times the prior's precision after one exact update,
    was stopped as diverged and the prior returned)."""

    def __init__(self, A, prior_prec, limit):
        self.A, self.limit = A, limit
        # prior marginal variance of each predictor: the unit in which a site precision is large
        self.v0 = np.einsum("ij,j,ij->i", A, 1.0 / prior_prec, A)
        n = len(self.v0)
        self.size, self.increment, self.streak = np.zeros(n), np.zeros(n), np.zeros(n, int)

    def cause(self, h, lam, state, damping: float = 0.0):
        if state is None:
            return "the posterior precision is not positive definite"
        if not (np.all(np.isfinite(h)) and np.all(np.isfinite(lam))):
            return "non-finite site parameters"
        if not (np.all(np.isfinite(state.mean)) and np.all(np.isfinite(state.cov))):
            return "non-finite posterior"
        limit = self.limit
        with np.errstate(all="ignore"):
            size = np.abs(lam) * self.v0
            grows, streak, increment = runaway(size, self.size, self.increment, self.streak, limit, damping)
            against = np.zeros(len(size), bool)
            if np.any(size > limit):
                against = (size > limit) & (np.abs(lam) * _marginals(self.A, state)[1] > limit)
        bad = against | grows
        if np.any(bad):
            i = int(np.argmax(np.where(bad, size, -np.inf)))
            how = "and its posterior marginal precision" if against[i] else "and was still growing"
            return (f"site {i}'s precision is {size[i]:.3g} times its predictor's prior precision {how} "
                    f"(divergence_limit {limit:g})")
        self.size, self.increment, self.streak = size, increment, streak
        return None


def _marginals(A, state):
    """Posterior marginals of every x_i = a_i^T w: mean and variance, stable via the Cholesky."""
    with np.errstate(all="ignore"):
        m = A @ state.mean
        W = linalg.solve_triangular(state.chol, A.T, lower=True, check_finite=False)
        v = np.einsum("ij,ij->j", W, W)
    return m, v


def _cavity(m, v, h, lam, power=1.0):
    """Cavity mean/variance and a validity mask (see module docstring); ``power`` u removes
    the fraction u of the site (power EP)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if power == 1.0:
            denom = 1.0 - lam * v
            mc = (m - v * h) / denom
        else:
            denom = 1.0 - power * lam * v
            mc = (m - power * v * h) / denom
        vc = v / denom
    ok = (denom > 0) & np.isfinite(vc) & (vc > 0) & np.isfinite(mc)
    return mc, vc, ok


def _rank_one_update(S, s, alpha):
    """``S + alpha · s sᵀ`` in place for a Fortran-ordered ``S`` (BLAS dger), else a new array.

    The result may be non-symmetric at round-off level (dger forms ``s_i (alpha s_j)``); the
    sequential sweep recomputes the posterior from the sites at its end, so this never drifts.
    """
    if S.flags.f_contiguous and S.dtype == np.float64:
        return _dger(alpha, s, s, a=S, overwrite_a=1)
    return S + alpha * np.outer(s, s)


#: golden-section steps of relaxed EP's line search within the best grid point's neighbours (the
#: bracket shrinks to 0.618^15 ≈ 7e-4 of its two grid steps in log b), before its final parabola
RELAX_GOLDEN_STEPS = 15


def _relaxed_cavity(cm, cv, rh, rl):
    """Cavity N(cm, cv) times the relaxation exp(r_h x − r_λ x² / 2): mean, variance and a
    properness mask (unchanged, bit for bit, where r_h = r_λ = 0)."""
    with np.errstate(all="ignore"):
        pr = 1.0 / cv + rl
        zero = (rl == 0) & (rh == 0)
        mr = np.where(zero, cm, (cm / cv + rh) / pr)
        vr = np.where(zero, cv, 1.0 / pr)
        proper = zero | ((pr > 0) & np.isfinite(mr) & np.isfinite(vr))
    return mr, vr, proper


def _log_gauss_integral(mc, vc, h, lam):
    """log ∫ N(x; mc, vc) exp(h x − λ x²/2) dx (requires 1/vc + λ > 0)."""
    p = 1.0 / vc + lam
    b = mc / vc + h
    return -0.5 * np.log(vc) - 0.5 * np.log(p) + 0.5 * b * b / p - 0.5 * mc * mc / vc


def _real_array(what: str, x) -> np.ndarray:
    """``x`` as a float array, or a ValueError naming ``what`` where it is not real numbers (a cast would drop
    an imaginary part with only numpy's ComplexWarning, or read strings as numbers)."""
    x = np.asarray(x)
    if x.dtype.kind not in NUMERIC_KINDS:
        raise ValueError(f"`{what}` must be real numbers, got an array of {x.dtype}")
    return x.astype(float, copy=False)


def _as_messages(observed: Mapping[str, Family], n: int) -> dict[str, Family]:
    if not isinstance(observed, Mapping):
        raise ValueError("`observed` must be a mapping from variable name to a message batch")
    out = {}
    for k, msg in observed.items():
        if not isinstance(msg, Family):
            raise ValueError(f"`observed[{k!r}]` must be a kjit Family message, got {type(msg).__name__}")
        if msg.shape not in ((), (n,)):
            raise ValueError(
                f"`observed[{k!r}]` must have batch shape ({n},) (one message per row of A) or (), "
                f"got {msg.shape}"
            )
        out[k] = msg.broadcast_to((n,)) if msg.shape == () else msg
    return out


def _index(messages: Mapping[str, Family], idx) -> dict[str, Family]:
    return {k: m[idx] for k, m in messages.items()}


# ---------------------------------------------------------------------------- engine
class LinearEP:
    """EP for ``w ~ N(0, prior_var I)``, ``x_i = a_i^T w`` and operator-given factors on ``x_i``.

    Parameters
    ----------
    operator:
        Object with ``belief(incoming, to)`` (batched; see module docstring) and optionally
        ``log_partition(incoming)``.
    site_var:
        Name of the factor variable that is the linear predictor (``"x"`` for ``Logistic``,
        ``"f"`` for ``ProbitNoise``).
    prior_var:
        Prior variance of each weight: a positive scalar or a length-d array.
    damping:
        In ``[0, 1)``: the fraction of the old site kept, in natural parameters
        (0 = undamped EP); or ``"auto"``: undamped until the run stalls — its largest change not 10 % below
        its best for :data:`AUTO_DAMPING_PATIENCE` iterations running, what an oscillating parallel EP does —,
        then 0.5, then half the remaining step each time it stalls again (at most 0.95); the result's
        ``damping`` is where it ended.
    max_iter, tol:
        Iteration cap and convergence tolerance on the largest absolute change of a site natural
        parameter ``(h_i, λ_i)`` in one iteration, scaled by the posterior marginal variance
        ``v_i`` of the predictor: ``max(|Δh_i| √v_i, |Δλ_i| v_i)``, the change from the site to its undamped proposal (see module
        docstring).
    schedule:
        ``"parallel"`` (one batched operator call per iteration) or ``"sequential"``.
    allow_negative_sites:
        Keep site updates with negative precision (if the posterior stays positive definite).
        Default False: skip them (counted as ``negative``).
    compute_evidence:
        After the run, ask ``operator.log_partition`` (if it exists) for the tilted normalisers
        at the final cavities and compute the EP log evidence.
    callback:
        Called as ``callback(record, result_so_far_mean, result_so_far_cov)`` after each iteration.
    power:
        Power EP's u > 0 (default 1 = EP); needs an operator with ``supports_power`` (see the
        module docstring).
    relax_c:
        Relaxed EP's l1 weight c > 0 (default None = no relaxation); needs an operator with
        ``projection_kl``.
    relax_grid:
        Number of log-spaced grid values of ``b · v_¬`` in the relaxed-EP line search (≥ 3).
    stop_rule:
        Optional ``(record, mean, cov) -> bool`` replacing the ``tol`` test (see module docstring).
    on_uncertain:
        What to do with an answer whose log predictive variance (the operator's ``predict``:
        KernelOperator, JITOperator, RemoteOperator) exceeds the threshold in some coordinate:
        ``"warn"`` (default: use it, count it per iteration in ``n_uncertain``, say so in
        ``status`` and warn once with :class:`UncertainAnswerWarning`), ``"raise"``
        (:class:`UncertainAnswerError`) or ``"oracle"`` (ask ``oracle`` for those rows instead).
    uncertainty_threshold:
        The threshold; default the operator's own ``threshold`` (JIT and served operators have
        one; without either nothing is counted).
    oracle:
        For ``on_uncertain="oracle"``; default the operator's own ``oracle`` (JITOperator; a
        RemoteOperator's is the server's ``mode=oracle``).
    divergence_limit:
        An iteration that makes a site's precision exceed this many times the prior precision of
        its predictor and either this many times the predictor's posterior marginal precision or growing as a
        runaway grows (:func:`runaway`), or any site or the posterior non-finite, is divergent: the run stops
        with the last finite state and ``outcome="diverged"`` (status says the iteration and cause).
    answer_rtol, sign_z:
        A belief wider than the cavity by a relative ``≤ sign_z · sd + answer_rtol · min(1, power)``
        (``sd``: the answer's predictive standard deviation of log v, when reported) is used as a
        message of precision 0 instead of being skipped as negative (see ``_propose``).
    error_bars:
        After a converged run, the posterior's error bars from this many draws of the operator, if it is a
        learned one that can be drawn (:mod:`kjit.ep.error_bars`; costs 1 + ``error_bars`` runs from the
        fixed point), on ``EPResult.error_bars``, summarised in the status; 0 (default): none.  The errors
        of the n answers the weights receive add up, and no per-message rule sees their sum.
    error_tol:
        With ``error_bars``, a :class:`~kjit.ep.error_bars.PosteriorErrorWarning` (and a status sentence)
        when an error bar on a weight's posterior mean exceeds this many posterior standard deviations.
    warn_unconverged:
        Default True: a run that reaches ``max_iter`` or diverges warns with :class:`EPConvergenceWarning`
        (its status); False for callers that count unconverged runs themselves (the error bars' draws).
    """

    def __init__(
        self,
        operator,
        site_var: str = "x",
        prior_var=1.0,
        damping: float = 0.0,
        max_iter: int = 100,
        tol: float = 1e-6,
        schedule: str = "parallel",
        allow_negative_sites: bool = False,
        compute_evidence: bool = True,
        callback: Callable | None = None,
        power: float = 1.0,
        relax_c: float | None = None,
        relax_grid: int = 49,
        relax_reading: str = "projection_kl",
        stop_rule: Callable | None = None,
        on_uncertain: str = "warn",
        uncertainty_threshold: float | None = None,
        oracle=None,
        divergence_limit: float = 1e12,
        answer_rtol: float = 1e-8,
        sign_z: float = 2.0,
        error_bars: int = 0,
        error_tol: float = 0.1,
        warn_unconverged: bool = True,
    ):
        self.operator = operator
        self.on_uncertain = on_uncertain
        self.uncertainty_threshold = uncertainty_threshold
        self.oracle = oracle
        self.divergence_limit = divergence_limit
        self.answer_rtol = answer_rtol
        self.sign_z = sign_z
        self.site_var = site_var
        self.prior_var = prior_var
        self.damping = damping
        self.max_iter = max_iter
        self.tol = tol
        self.schedule = schedule
        self.allow_negative_sites = allow_negative_sites
        self.compute_evidence = compute_evidence
        self.callback = callback
        self.power = power
        self.relax_c = relax_c
        self.relax_grid = relax_grid
        self.relax_reading = relax_reading
        self.stop_rule = stop_rule
        self.error_bars = error_bars
        self.error_tol = error_tol
        self.warn_unconverged = bool(warn_unconverged)

    # ------------------------------------------------------------------ validation
    def _check_options(self, d):
        if not is_operator(self.operator):
            raise ValueError("`operator` must have a `belief(incoming, to)` method (kjit.protocols.MessageOperator)")
        if not isinstance(self.site_var, str) or not self.site_var:
            raise ValueError("`site_var` must be a non-empty string")
        pv = np.asarray(self.prior_var, dtype=float)
        if pv.ndim > 1 or (pv.ndim == 1 and pv.shape[0] != d):
            raise ValueError(f"`prior_var` must be a scalar or a length-{d} array, got shape {pv.shape}")
        if not np.all(np.isfinite(pv) & (pv > 0)):
            raise ValueError("`prior_var` must be finite and > 0")
        # every numeric option through one check, whichever variant runs (an option the run does not use
        # is still refused when invalid: found by an audit, relax_reading="bogus" and relax_grid=-4 ran
        # silently without relax_c)
        if not (isinstance(self.damping, str) and self.damping == "auto"):
            check_number("damping", self.damping, 0.0, 1.0, high_open=True)
        check_number("max_iter", self.max_iter, 1, integer=True)
        check_number("tol", self.tol, 0.0)
        check_number("error_bars", self.error_bars, 0, integer=True)
        check_number("error_tol", self.error_tol, 0.0, low_open=True)
        if self.error_bars:
            require_plain_ep(self.power, self.relax_c, what="`error_bars`")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"`schedule` must be one of {_SCHEDULES}, got {self.schedule!r}")
        u = check_number("power", self.power, 0.0, low_open=True)
        if u != 1.0 and not supports_power(self.operator):
            raise ValueError(
                f"power EP (power={u:g}) needs an operator for the factor to the power u: "
                "operator.belief(incoming, to, power=u) with operator.supports_power = True "
                f"({type(self.operator).__name__} has none). Use kjit.ep.operators."
                "ProbitNoiseOperator / LogisticOperator / LaplaceOperator, or an operator trained on f^u"
            )
        check_number("relax_grid", self.relax_grid, 3, integer=True)
        if not isinstance(self.relax_reading, str) or self.relax_reading not in RELAX_READINGS:
            raise ValueError(f"`relax_reading` must be one of {RELAX_READINGS}, got {self.relax_reading!r}")
        if self.relax_c is not None:
            check_number("relax_c", self.relax_c, 0.0, low_open=True)
            if not has_projection_kl(self.operator):
                raise ValueError(
                    "relaxed EP needs operator.projection_kl(incoming, to) = KL(tilted ‖ proj tilted) "
                    f"for its line search; {type(self.operator).__name__} has none "
                    "(kjit.ep.operators.ProbitNoiseOperator and LogisticOperator have it)"
                )
            if self.relax_reading.startswith("appendix"):
                if not callable(getattr(self.operator, "appendix_relaxed_q", None)):
                    raise ValueError(
                        f"relax_reading={self.relax_reading!r} needs operator.appendix_relaxed_q (the paper's "
                        f"eq. 22 for the noisy probit; kjit.ep.operators.ProbitNoiseOperator); "
                        f"{type(self.operator).__name__} has none")
                if u != 1.0:
                    raise ValueError(f"relax_reading={self.relax_reading!r} is defined for power = 1 only")
        if self.stop_rule is not None and not callable(self.stop_rule):
            raise ValueError("`stop_rule` must be None or a callable (record, mean, cov) -> bool")
        check_on_uncertain(self.on_uncertain)
        if self.uncertainty_threshold is not None:
            check_number("uncertainty_threshold", self.uncertainty_threshold)
        if self.on_uncertain == "oracle" and self._oracle() is None:
            raise ValueError(
                'on_uncertain="oracle" needs an oracle: pass `oracle=` (e.g. a QuadratureOracle) or use an '
                f"operator that carries one (JITOperator, RemoteOperator); {type(self.operator).__name__} has none"
            )
        if self.oracle is not None:
            # (found by an audit: an oracle for probit_noise(eps=0.3) answered every uncertain site of an eps=0.05
            # model, "converged" at eps=0.3's posterior, with no word)
            check_same_factor(self.oracle, self.operator, "`oracle`", "the operator")
        elif getattr(self.operator, "local_oracle", None) is not None:
            # (a served operator's client-side oracle, which RemoteOperator checks by variables and families only:
            # found in review)
            check_same_factor(self.operator.local_oracle, self.operator, "the operator's oracle", "the operator")
        for name in ("divergence_limit", "answer_rtol", "sign_z"):
            check_number(name, getattr(self, name), 0.0, low_open=True)
        return np.broadcast_to(1.0 / pv, (d,)).astype(float)

    def _check_appendix(self, observed, n):
        """Before the run: the appendix readings' objective (``operator.appendix_relaxed_q``) must accept
        this model's messages — the noisy probit's needs ε > 0 and hard labels.  Otherwise every line search
        would fail and each update fall back to plain EP: found by an audit, ``relax_reading="appendix_q"``
        with ε = 0 returned EP's answer, ``n_relaxed`` 0, "converged", with no warning."""
        incoming = {self.site_var: Gaussian._unchecked(np.zeros(n), np.ones(n)), **observed}
        try:
            with np.errstate(all="ignore"):
                self.operator.appendix_relaxed_q(incoming, np.zeros(n), np.zeros(n), np.zeros(n), np.ones(n))
        except Exception as exc:
            raise ValueError(
                f"relax_reading={self.relax_reading!r} cannot be used on this model: the operator's "
                f"appendix_relaxed_q refuses its messages ({type(exc).__name__}: {exc}), so relaxed EP would be "
                "plain EP at every update; use relax_reading='projection_kl' or 'scaled_message'") from exc

    # ------------------------------------------------------------------ operator call
    def _oracle(self):
        return self.oracle if self.oracle is not None else getattr(self.operator, "oracle", None)

    def _threshold(self):
        if self.uncertainty_threshold is not None:
            return float(self.uncertainty_threshold)
        thr = getattr(self.operator, "threshold", None)
        try:
            return None if thr is None else float(thr)
        except (TypeError, ValueError):
            return None

    def _query(self, incoming, rec):
        """The operator's beliefs for one batch, with the spread coordinate's log predictive
        variance where the operator reports one (``predict``), NaN elsewhere; answers above the
        uncertainty threshold are counted and handled by ``on_uncertain``."""
        n = len(next(iter(incoming.values())))
        logvar_spread = np.full(n, np.nan)
        if self.power != 1.0:
            q, cert = certified(self.operator, incoming, self.site_var, power=float(self.power))
            _count(rec, cert, n)
            return q, logvar_spread
        if not reports_uncertainty(self.operator):
            q, cert = certified(self.operator, incoming, self.site_var)
            _count(rec, cert, n)
            return q, logvar_spread
        out = self.operator.predict(incoming, self.site_var)
        q, logvar = out[0], np.asarray(out[1], dtype=float)
        consulted = np.asarray(out[2], dtype=bool).reshape(n) if len(out) > 2 else np.zeros(n, dtype=bool)
        thr = self._threshold()
        cert = last_certificates(self.operator, q)
        weigh = getattr(self.operator, "decision_log_weights", None)
        if thr is not None and weigh is not None and logvar.ndim == 2 and logvar.shape[0] == n:
            # a bare learned operator reports its predictive variance; a threshold applies to it weighted as
            # the just-in-time rule weighs it (a JIT's or a served operator's answer is weighted already):
            # one threshold, one meaning — calibrate_threshold's (found in review: two rows at weighted
            # −8.0 / −7.6 passed a threshold of −8.5 as confident)
            logvar = logvar + weigh(incoming, q)
            if cert is not None and len(cert) == n:
                cert = cert.with_(log_var=logvar)
        if cert is None and logvar.ndim == 2 and logvar.shape[0] == n:
            # an operator that reports uncertainty but no certificates: learned where not consulted
            try:
                oracle_src = getattr(self._oracle(), "certificate_source", "oracle")
                cert = Certificates(np.where(consulted, oracle_src, "learned"), Gaussian.coord_names,
                                    log_var=logvar, threshold=thr,
                                    proper=outgoing_proper(q.ravel(), incoming[self.site_var].ravel()))
            except (ValueError, TypeError, AttributeError):
                cert = None
        elif cert is not None and self.uncertainty_threshold is not None:
            cert = cert.with_(threshold=thr)  # the engine's threshold decides what is confident here
        if logvar.ndim != 2 or logvar.shape[0] != n:
            _count(rec, cert, n)
            return q, logvar_spread
        j = Gaussian.spread_coord
        # (an uncertainty in other units — a learned KL — is no spread: the answer is taken as exact there)
        logvar_spread = np.where(consulted | (not log_var_is_variance(self.operator)), np.nan, logvar[:, j])
        if thr is None:
            _count(rec, cert, n)
            return q, logvar_spread
        # uncertain: above the threshold, or flagged by the operator's own rule (a served operator's
        # density guard or undetermined sign, which its certificates carry)
        flagged = cert.flagged if cert is not None and len(cert) == n else False
        unc = ~consulted & (above_threshold(logvar, thr) | flagged)
        if not unc.any():
            _count(rec, cert, n)
            return q, logvar_spread
        if self.on_uncertain == "raise":
            raise UncertainAnswerError(
                f"{int(unc.sum())} answer(s) of {type(self.operator).__name__} are uncertain: a log predictive "
                f"variance above its threshold {thr:g}, or flagged by its just-in-time rule (rows "
                f"{np.flatnonzero(unc)[:10].tolist()} of the batch); "
                'on_uncertain="raise"', rows=np.flatnonzero(unc))
        if self.on_uncertain == "oracle":
            rows = np.flatnonzero(unc)
            q, cert = oracle_rows(q, cert if cert is not None and len(cert) == n else None, incoming,
                                  self.site_var, self._oracle(), rows)
            logvar_spread[rows] = np.nan
            rec.n_oracle += rows.size
            _count(rec, cert, n)
            return q, logvar_spread
        rec.n_uncertain += int(unc.sum())  # "warn" / "use": used as they are, and counted
        _count(rec, cert, n)
        return q, logvar_spread

    def _ask(self, cav_m, cav_v, observed, idx, skipped, errors, rec=None):
        """Beliefs for the sites ``idx`` with cavities ``(cav_m, cav_v)`` (already indexed by
        ``idx``); returns (mean, var, ok, sd of log var) arrays of length ``len(idx)``."""
        rec = rec if rec is not None else self._new_record()
        k = len(idx)
        qm, qv = np.zeros(k), np.ones(k)
        sd = np.full(k, np.nan)
        ok = np.zeros(k, dtype=bool)
        live = np.arange(k)  # positions (within idx) still to be answered
        for _attempt in range(ROW_RETRIES):
            incoming = {self.site_var: Gaussian._unchecked(cav_m[live], cav_v[live])}
            incoming.update(_index(observed, idx[live]))
            try:
                with np.errstate(all="ignore"):
                    q, lv = self._query(incoming, rec)
                rec._unanswered = 0
                break
            except (UncertainAnswerError, ConfigurationError):
                raise  # (a wrong recipient or operator name: no skip or retry can fix it)
            except Exception as exc:  # an operator failure must not end the run: skip and report
                if len(errors) < 5:
                    errors.append(f"{type(exc).__name__}: {exc}")
                # (an error the operator did answer with — a 500, a refusal — ends the run of calls without one)
                rec._unanswered = rec._unanswered + 1 if isinstance(exc, OperatorUnavailableError) else 0
                # an error that names the failing rows of the batch (e.g. the importance-sampling
                # oracle's LowESSError.rows): skip just those and ask again for the rest
                rows = getattr(exc, "rows", None)
                try:
                    rows = np.unique(np.asarray(rows, dtype=int).ravel()) if rows is not None else None
                except (TypeError, ValueError):
                    rows = None
                if rows is None or rows.size == 0 or rows.size >= live.size or rows.min() < 0 or rows.max() >= live.size:
                    skipped["operator_error"] += live.size
                    return qm, qv, ok, sd
                skipped["operator_error"] += rows.size
                live = np.delete(live, rows)
        else:
            skipped["operator_error"] += live.size
            return qm, qv, ok, sd
        k_live = live.size
        if not isinstance(q, Gaussian) or q.shape != (k_live,):
            skipped["operator_error"] += k_live
            if len(errors) < 5:
                errors.append(
                    f"operator returned {type(q).__name__} of shape {getattr(q, 'shape', None)}, "
                    f"expected Gaussian of shape ({k_live},)"
                )
            return qm, qv, ok, sd
        m_live, v_live = np.asarray(q.mean(), float), np.asarray(q.var(), float)
        good = np.isfinite(m_live) & np.isfinite(v_live) & (v_live > 0)
        skipped["invalid"] += int(k_live - np.count_nonzero(good))
        qm[live] = np.where(good, m_live, 0.0)
        qv[live] = np.where(good, v_live, 1.0)
        ok[live] = good
        sd[live] = np.exp(0.5 * lv)
        return qm, qv, ok, sd

    # ------------------------------------------------------------------ relaxed EP
    def _relaxation(self, s_rel, cv, ms, h, lam):
        """Natural parameters ``(r_h, r_λ)`` of the relaxation factor and its l1 penalty for the
        line-search variable ``s_rel`` (per reading; see the module docstring)."""
        if self.relax_reading == "scaled_message":  # r = t̃_old^η: η (h_old, λ_old), η = s_rel
            eta = s_rel
            return eta * h, eta * lam, np.abs(eta) * (np.abs(h) + 0.5 * np.abs(lam))
        b = s_rel / cv  # r = exp(−b (x − m̃)² / 2): (b m̃, b)
        return b * ms, b, b

    def _relax_objective(self, cm, cv, ms, h, lam, v, s_rel, rows, observed, idx):
        """Penalised objective at the line-search values ``s_rel`` for the sites ``rows``."""
        rh, rl, pen = self._relaxation(s_rel, cv[rows], ms[rows], h[rows], lam[rows])
        with np.errstate(all="ignore"):
            if self.relax_reading.startswith("appendix"):
                incoming = {self.site_var: Gaussian._unchecked(cm[rows], cv[rows])}
                incoming.update(_index(observed, idx[rows]))
                kl = self.operator.appendix_relaxed_q(incoming, rl, ms[rows], lam[rows], v[rows])
            else:
                mr, vr, proper = _relaxed_cavity(cm[rows], cv[rows], rh, rl)
                incoming = {self.site_var: Gaussian._unchecked(mr, np.where(proper, vr, 1.0))}
                incoming.update(_index(observed, idx[rows]))
                if self.power == 1.0:
                    kl = self.operator.projection_kl(incoming, self.site_var)
                else:
                    kl = self.operator.projection_kl(incoming, self.site_var, power=float(self.power))
                kl = np.where(proper, np.asarray(kl, dtype=float).reshape(-1), np.nan)
            kl = np.asarray(kl, dtype=float).reshape(-1)
            if kl.shape != rl.shape:
                raise ValueError(f"the relaxation objective has shape {kl.shape}, expected {rl.shape}")
            q = np.where(np.isfinite(kl), kl, np.inf) + float(self.relax_c) * pen
        return q

    def _relax_grid(self):
        n = int(self.relax_grid)
        if self.relax_reading == "scaled_message":  # η ∈ {0} ∪ ±[1e-3, 10] (log-spaced)
            e = np.logspace(-3.0, 1.0, n)
            return np.concatenate([[0.0], e, -e]), False
        return np.concatenate([[0.0], np.logspace(-4.0, 4.0, n)]), True

    def _relax(self, cm, cv, h, lam, v, observed, idx, rec):
        """Relaxed EP: choose the relaxation per site by line search; return the relaxed
        cavities and the relaxation's natural parameters.

        ``cm, cv, h, lam, v`` (cavity, old site, posterior marginal variance) are already
        indexed by ``idx``.  Returns ``(mr, vr, r_h, r_λ)``; ``r = 0`` (no relaxation) gives
        back the cavity bit for bit.  If the objective fails the sites are not relaxed (plain
        EP update), counted in ``rec.n_relax_failed`` and the error recorded (the run's status and a
        warning say so).
        """
        k = len(idx)
        with np.errstate(divide="ignore", invalid="ignore"):
            ms = np.where(lam != 0, h / lam, np.where(h == 0, 0.0, cm))
        ms = np.where(np.isfinite(ms), ms, cm)
        grid, refine = self._relax_grid()
        G = grid.size
        try:
            rows = np.repeat(np.arange(k), G)
            Q = self._relax_objective(cm, cv, ms, h, lam, v, np.tile(grid, k), rows, observed, idx).reshape(k, G)
            j = np.argmin(Q, axis=1)  # first minimum: 0 wins ties
            s_best = grid[j]
            q_best = Q[np.arange(k), j]
            if not np.all(np.isfinite(q_best)):
                raise ValueError("no admissible relaxation (the objective is not finite even at 0)")
            # the minimum in log b within the best grid point's neighbours: golden-section search
            # (batched over the sites, one call per step) to a bracket ~1e-3 of its width, then the
            # vertex of a parabola through three equally spaced points of it, taken whatever it gives.
            # A single parabolic step kept only where it lowered Q made b a discontinuous function of
            # the cavity and EP cycled (found by an audit: a 3-cycle where the paper's algorithm
            # converges, b up to 7 % off its minimiser); golden search run to the end chose among
            # points whose Q differs by rounding where Q is flat, and EP did not settle to 1e-8
            # (found in review: logistic, relax_c 0.003)
            lg = np.log(grid[1:]) if refine else None
            ref = np.flatnonzero((j >= 2) & (j <= G - 2)) if refine else np.zeros(0, int)
            if ref.size:
                step = lg[1] - lg[0]
                centre = lg[j[ref] - 1]
                lo, hi = centre - step, centre + step
                ratio = 0.5 * (np.sqrt(5.0) - 1.0)

                def objective(x):
                    return self._relax_objective(cm, cv, ms, h, lam, v, np.exp(x), ref, observed, idx)

                x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
                f1, f2 = objective(x1), objective(x2)
                for _ in range(RELAX_GOLDEN_STEPS):
                    # the minimum is in [lo, x2] (keep x1 as the new x2) or in [x1, hi] (x2 as x1)
                    left = ~(f1 > f2)  # (NaN-free: the objective is +inf where not finite)
                    hi = np.where(left, x2, hi)
                    lo = np.where(left, lo, x1)
                    x_new = np.where(left, hi - ratio * (hi - lo), lo + ratio * (hi - lo))
                    f_new = objective(x_new)
                    x1, f1, x2, f2 = (np.where(left, x_new, x2), np.where(left, f_new, f2),
                                      np.where(left, x1, x_new), np.where(left, f1, f_new))
                mid = 0.5 * (x1 + x2)
                fm = objective(mid)
                hw = 0.5 * (x2 - x1)
                with np.errstate(all="ignore"):
                    curv = f1 - 2.0 * fm + f2
                    vertex = mid + hw * (f1 - f2) / (2.0 * curv)
                best = np.where((curv > 0) & np.isfinite(vertex), np.clip(vertex, lo, hi), mid)
                ok = np.isfinite(fm) & np.isfinite(f1) & np.isfinite(f2)
                s_best[ref] = np.where(ok, np.exp(best), s_best[ref])
        except Exception as exc:  # relaxation failed: fall back to the EP update, counted and reported
            if len(rec.errors) < 5:
                rec.errors.append(f"relaxation line search: {type(exc).__name__}: {exc}")
            rec.n_relax_failed += k
            s_best = np.zeros(k)
        rh, rl, _ = self._relaxation(s_best, cv, ms, h, lam)
        mr, vr, _ = _relaxed_cavity(cm, cv, rh, rl)
        relaxed = s_best != 0
        rec.n_relaxed += int(np.count_nonzero(relaxed))
        if relaxed.any():
            tot = rec.mean_relaxation * rec._relax_count + float(np.sum(np.abs(s_best[relaxed])))
            rec._relax_count += int(np.count_nonzero(relaxed))
            rec.mean_relaxation = tot / rec._relax_count
        return mr, vr, rh, rl

    def _propose(self, cm, cv, qm, qv, h_old, lam_old, ok, skipped, sd=None, rec=None, keep=None, damping=None):
        """Damped new sites, the mask of acceptable ones (before the PD check) and the undamped
        proposals ``(h_p, λ_p)`` (the old site where not acceptable), which the convergence test measures.

        A belief wider than the cavity by less than its own error — ``0 < log(v_q / v_cav) ≤
        sign_z · sd``, ``sd`` the answer's predictive standard deviation of log v_q, or
        ``answer_rtol`` for answers that report none (oracles: their relative accuracy) — is
        a message whose precision is indistinguishable from 0: it is used with precision 0
        (``v_q = v_cav``, the shift kept) instead of being skipped as negative every iteration.

        Power EP scales ``answer_rtol`` by ``min(1, u)``: the answer ``proj[q^{\\u} f^u]`` moves
        ``log v`` from the u-cavity's by ``d = log(v_q / v_cav) ≈ −u λ v_cav`` (λ the site precision
        it implies, ``(1/v_q − 1/v_cav) / u``), an O(u) move that the rules compute to a relative
        accuracy (closed form, quadrature of ``f^u``), so their error in ``d`` is ``answer_rtol · u``
        for u < 1, not ``answer_rtol``.  Unscaled, every site with ``u |λ| v_cav ≤ answer_rtol`` —
        all of them as u → 0 — was taken for precision 0: found by an audit, u = 1e-8 zeroed the
        genuinely negative site (λ = −0.16) of a mislabelled point, posterior mean 3.4e-2 off the
        reference power EP, reported converged.
        """
        sd = np.full(qv.shape, np.nan) if sd is None else sd
        with np.errstate(all="ignore"):
            tol = self.sign_z * np.where(np.isfinite(sd), sd, 0.0) + self.answer_rtol * min(1.0, float(self.power))
            d = np.log(qv) - np.log(cv)
            zero = ok & (d > 0) & (d <= tol)
        if zero.any():
            qv = np.where(zero, cv, qv)
            if rec is not None:
                rec.n_zeroed += int(np.count_nonzero(zero))
        with np.errstate(all="ignore"):
            lam_p = 1.0 / qv - 1.0 / cv
            h_p = qm / qv - cm / cv
            if self.power != 1.0:  # power EP: (q / cavity)^(1/u)
                lam_p = lam_p / self.power
                h_p = h_p / self.power
            if keep is not None:  # relaxed EP, reading "appendix_site": the site keeps r
                h_p = h_p + keep[0]
                lam_p = lam_p + keep[1]
        fin = np.isfinite(lam_p) & np.isfinite(h_p)
        bad = ok & ~fin
        skipped["invalid"] += int(np.count_nonzero(bad))
        ok = ok & fin
        # (``damping``: the run's — "auto" raises it; a local, not the engine's: one engine may run in two threads)
        g = 1.0 - ((0.0 if isinstance(self.damping, str) else float(self.damping)) if damping is None else damping)
        lam_n = np.where(ok, lam_old + g * (lam_p - lam_old), lam_old)
        h_n = np.where(ok, h_old + g * (h_p - h_old), h_old)
        if not self.allow_negative_sites:
            neg = ok & (lam_n < 0)
            skipped["negative"] += int(np.count_nonzero(neg))
            ok = ok & ~neg
        return h_n, lam_n, ok, np.where(ok, h_p, h_old), np.where(ok, lam_p, lam_old)

    def _check_variables(self, observed, n):
        """A ConfigurationError, before the first update, where the operator says its factor (``answered_factor``;
        a served one's from its server) and ``site_var`` or ``observed`` do not fit it: a recipient it has not, an
        observed variable it has not or lacks, a message of another family.  Found by an audit: a mistyped
        ``site_var`` or observed name ran three iterations and returned the prior as "operator_failed" (the
        README says such a run raises at once)."""
        factor = answered_factor(self.operator)
        if factor is None:
            return
        probe = {self.site_var: Gaussian._unchecked(np.zeros(n), np.ones(n)), **observed}
        try:
            factor.check_incoming(probe, self.site_var)
        except ValueError as exc:
            raise ConfigurationError(f"{type(self.operator).__name__} answers for factor {factor.name!r} "
                                     f"(site_var={self.site_var!r}, observed {sorted(observed)}): {exc}") from None

    # ------------------------------------------------------------------ run
    def run(self, A, observed: Mapping[str, Family], init_sites=None) -> EPResult:
        """Run EP on design matrix ``A`` (n × d) with fixed messages ``observed`` (batch (n,)).

        ``init_sites``: optional ``(shift, precision)`` arrays to start from (default zeros,
        i.e. the prior).
        """
        A = _real_array("A", A)
        if A.ndim != 2 or A.shape[0] < 1 or A.shape[1] < 1:
            raise ValueError(f"`A` must be a non-empty 2-D array (n, d), got shape {A.shape}")
        if not np.all(np.isfinite(A)):
            raise ValueError("`A` must be finite")
        n, d = A.shape
        prior_prec = self._check_options(d)
        observed = _as_messages(observed, n)
        if self.site_var in observed:
            raise ValueError(f"`observed` must not contain the site variable {self.site_var!r}")
        self._check_variables(observed, n)
        if self.relax_c is not None and self.relax_reading.startswith("appendix"):
            self._check_appendix(observed, n)
        if init_sites is None:
            h = np.zeros(n)
            lam = np.zeros(n)
        else:
            if not isinstance(init_sites, (tuple, list)) or len(init_sites) != 2:
                raise ValueError("`init_sites` must be a pair (shift, precision) of arrays, one value per row of A")
            h, lam = (_real_array(f"init_sites[{k}]", s) for k, s in enumerate(init_sites))
            for k, s in enumerate((h, lam)):
                if s.shape not in ((), (n,)):
                    raise ValueError(f"`init_sites[{k}]` must have shape ({n},) (one per row of A), got {s.shape}")
            h, lam = (np.array(np.broadcast_to(s, (n,))) for s in (h, lam))
            if not (np.all(np.isfinite(h)) and np.all(np.isfinite(lam))):
                raise ValueError("`init_sites` must be finite")
        state = _posterior_from_sites(A, prior_prec, h, lam)
        if state is None:
            raise ValueError("`init_sites` give a posterior precision that is not positive definite")

        history: list[IterationRecord] = []
        converged = False
        diverged = None  # (iteration, cause)
        calls = 0
        t_start = time.perf_counter()
        step = self._parallel_iteration if self.schedule == "parallel" else self._sequential_sweep
        divergence = _DivergenceTest(A, prior_prec, self.divergence_limit)
        failing = 0  # consecutive iterations in which the operator failed every update it was asked
        auto = isinstance(self.damping, str)
        damping = 0.0 if auto else float(self.damping)
        best, stalled, raised = np.inf, 0, []  # ("auto": the best change, iterations since 10 % below it)
        for it in range(1, int(self.max_iter) + 1):
            t0 = time.perf_counter()
            h_new, lam_new, state_new, rec = step(A, prior_prec, observed, h, lam, state, damping)
            rec.iteration = it
            rec.seconds = time.perf_counter() - t0
            history.append(rec)
            calls += rec.operator_calls
            failing = count_failing(failing, rec.n_updated, rec.skipped.get("operator_error", 0))
            if failing >= OPERATOR_FAILURE_ITERATIONS:
                break  # (an unreachable server, every row refused: more iterations cannot help)
            cause = divergence.cause(h_new, lam_new, state_new, damping)
            if cause is not None:  # keep the last finite state and stop
                diverged = (it, cause)
                break
            h, lam, state = h_new, lam_new, state_new
            if self.callback is not None:
                self.callback(rec, state.mean.copy(), state.cov.copy())
            if rec.n_skipped == 0:
                if self.stop_rule is None:
                    done = rec.max_change < self.tol
                else:
                    done = self.stop_rule(rec, state.mean, state.cov)
                    if np.ndim(done) != 0:  # (an array met numpy's "truth value is ambiguous"; None still reads False)
                        raise TypeError(f"`stop_rule` must return True or False, got {type(done).__name__}")
                    done = bool(done)
                if done:
                    converged = True
                    break
            if auto and rec.n_skipped == 0:  # (an iteration that skipped updates — an operator's blip — says nothing
                # of a stall: its largest change is over the updates made; found in review, one blip set best to 0)
                stalled = 0 if rec.max_change < 0.9 * best else stalled + 1
                best = min(best, rec.max_change)
                if stalled >= AUTO_DAMPING_PATIENCE and damping < AUTO_DAMPING_MAX:
                    damping = min(AUTO_DAMPING_MAX, 0.5 if damping < 0.5 else 1.0 - (1.0 - damping) / 2)
                    raised.append((it, damping))
                    best, stalled = np.inf, 0
        iterations = len(history)
        last = history[-1]
        failed = diverged is None and not converged and failing >= OPERATOR_FAILURE_ITERATIONS
        if failed:
            status = operator_failure(failing, iterations, last.errors, f"EP with {type(self.operator).__name__}")
        elif diverged is not None:
            status = (f"diverged at iteration {diverged[0]}: {diverged[1]}; the posterior is the last finite "
                      f"state (after iteration {diverged[0] - 1})")
        elif converged and self.stop_rule is not None:
            status = f"converged after {iterations} iteration(s) (stop_rule satisfied; max site change {last.max_change:.3g})"
        elif converged:
            status = f"converged after {iterations} iteration(s) (max site change {last.max_change:.3g} < tol {self.tol:g})"
        else:
            status = (
                f"stopped at max_iter={int(self.max_iter)} without convergence "
                f"(last max site change {last.max_change:.3g}, tol {self.tol:g}, "
                f"{last.n_skipped} update(s) skipped in the last iteration)"
            )
        if raised:
            status += "; damping raised (\"auto\") to " + ", ".join(f"{d:g} at iteration {i}" for i, d in raised)
        n_fell = int(sum(r.n_relax_failed for r in history))
        if n_fell:
            first = next((e for r in history for e in r.errors if e.startswith("relaxation line search")), "")
            msg = (f"{n_fell} relaxed-EP update(s) fell back to the plain EP update: the relaxation's line "
                   f"search failed ({first})")
            status += f"; {msg}"
            warnings.warn(f"EP with {type(self.operator).__name__}: {msg}", RuntimeWarning, stacklevel=user_stacklevel())
        n_unc = int(sum(r.n_uncertain for r in history))
        if n_unc:
            msg = (f"{n_unc} answer(s) above the operator's uncertainty threshold "
                   f"({self._threshold():g}) were used")
            status += f"; {msg}"
            warnings.warn(f"EP with {type(self.operator).__name__}: {msg} (on_uncertain='warn'; pass "
                          "on_uncertain='oracle' to replace them or 'raise' to stop)", UncertainAnswerWarning,
                          stacklevel=user_stacklevel())
        if diverged is not None and self.compute_evidence:
            # (the last finite state of a divergent run is no fixed point: its "evidence" was a
            # finite number for a model whose true evidence is 0 — found by an audit)
            log_z, note = None, "not computed: EP diverged"
        else:
            log_z, note = self._log_evidence(A, prior_prec, observed, h, lam, state)
        if log_z is not None and not converged:
            note += "; EP did not converge, so this is the estimate at the last iterate"
        outcome = ("diverged" if diverged is not None else "converged" if converged
                   else "operator_failed" if failed else "max_iter")
        result = EPResult(
            posterior=GaussianPosterior(state.mean, state.cov),
            site_shift=h,
            site_precision=lam,
            converged=converged,
            iterations=iterations,
            status=status,
            history=history,
            log_evidence=log_z,
            log_evidence_note=note,
            seconds=time.perf_counter() - t_start,
            operator_calls=calls,
            schedule=self.schedule,
            outcome=outcome,
            diverged_at=None if diverged is None else diverged[0],
            damping=damping,
        )
        attach(self, result, lambda n_draws: linear_error_bars(self, A, observed, result, n_draws),
               f"EP with {type(self.operator).__name__}", learned_share({"op": self.operator}, {"op": n}))
        result.seconds = time.perf_counter() - t_start
        if self.warn_unconverged:
            warn_unconverged(outcome, status, f"EP with {type(self.operator).__name__}", damping)
        return result

    # ------------------------------------------------------------------ schedules
    def _new_record(self):
        return IterationRecord(
            iteration=0, max_change=0.0, seconds=0.0, n_skipped=0,
            skipped=dict.fromkeys(SKIP_REASONS, 0), n_updated=0,
            operator_calls=0, operator_seconds=0.0,
        )

    def _parallel_iteration(self, A, prior_prec, observed, h, lam, state, damping=None):
        rec = self._new_record()
        skipped = rec.skipped
        m, v = _marginals(A, state)
        cm, cv, ok = _cavity(m, v, h, lam, self.power)
        # (a row of zeros — x_i = 0 whatever w — carries no information: never updated, and no skip)
        skipped["cavity"] += int(np.count_nonzero(~ok & np.any(A != 0, axis=1)))
        idx = np.flatnonzero(ok)
        qm = np.zeros_like(m)
        qv = np.ones_like(m)
        sd = np.full_like(m, np.nan)
        keep = None
        if idx.size:
            t0 = time.perf_counter()
            if self.relax_c is not None:
                cm, cv = cm.copy(), cv.copy()
                cm[idx], cv[idx], rh, rl = self._relax(cm[idx], cv[idx], h[idx], lam[idx], v[idx], observed, idx, rec)
                if self.relax_reading == "appendix_site":
                    keep = (np.zeros_like(m), np.zeros_like(m))
                    keep[0][idx], keep[1][idx] = rh, rl
            qm_i, qv_i, ok_i, sd_i = self._ask(cm[idx], cv[idx], observed, idx, skipped, rec.errors, rec)
            rec.operator_seconds += time.perf_counter() - t0
            rec.operator_calls += 1
            qm[idx], qv[idx], sd[idx] = qm_i, qv_i, sd_i
            ok[idx] = ok_i
        h_n, lam_n, ok, h_p, lam_p = self._propose(cm, cv, qm, qv, h, lam, ok, skipped, sd, rec, keep, damping)
        # each update alone must keep the posterior positive definite: 1 + Δλ v > 0
        with np.errstate(invalid="ignore"):
            single = 1.0 + (lam_n - lam) * v > 0
        bad = ok & ~single
        skipped["not_pd"] += int(np.count_nonzero(bad))
        ok = ok & single
        # jointly: shrink the step until the posterior is positive definite
        new_state = None
        scale = 1.0
        for _ in range(30):
            h_try = np.where(ok, h + scale * (h_n - h), h)
            lam_try = np.where(ok, lam + scale * (lam_n - lam), lam)
            new_state = _posterior_from_sites(A, prior_prec, h_try, lam_try)
            if new_state is not None or not ok.any():
                break
            scale *= 0.5
        if new_state is None:  # give up on the whole iteration
            skipped["not_pd"] += int(np.count_nonzero(ok))
            ok[:] = False
            h_try, lam_try, new_state = h, lam, state
        rec.step_scale = scale
        if ok.any():  # the undamped change (site → proposal): see "Convergence" in the module docstring
            dh = np.abs(h_p[ok] - h[ok])
            dl = np.abs(lam_p[ok] - lam[ok])
            rec.max_change = float(np.max(np.maximum(dh * np.sqrt(v[ok]), dl * v[ok])))
            rec.max_change_raw = float(np.max(np.maximum(dh, dl)))
        rec.n_updated = int(np.count_nonzero(ok))
        rec.n_skipped = int(sum(skipped.values()))
        return h_try, lam_try, new_state, rec

    def _sequential_sweep(self, A, prior_prec, observed, h, lam, state, damping=None):
        rec = self._new_record()
        skipped = rec.skipped
        h0, lam0 = h, lam
        h = h.copy()
        lam = lam.copy()
        mu = state.mean.copy()
        # Fortran order, so the rank-one updates run in place (BLAS dger on the same buffer)
        Sigma = np.asfortranarray(0.5 * (state.cov + state.cov.T))
        applied = []  # (site, new shift, new precision, scaled change, raw change), in order
        for i in range(A.shape[0]):
            if rec._unanswered >= OPERATOR_FAILURE_ITERATIONS:
                # (no answer to that many calls running — a server down or hung: the other sites are not asked
                # this sweep, each would wait out its timeout and retries; found by an audit)
                skipped["operator_error"] += A.shape[0] - i
                if len(rec.errors) < 5:
                    rec.errors.append(f"the operator did not answer {rec._unanswered} calls running: the sweep's "
                                      f"other {A.shape[0] - i} sites were not asked")
                break
            a = A[i]
            s = Sigma @ a
            m_i = float(a @ mu)
            v_i = float(a @ s)
            cm, cv, ok = _cavity(np.array([m_i]), np.array([v_i]), h[i : i + 1], lam[i : i + 1], self.power)
            if not ok[0]:
                skipped["cavity"] += int(np.any(a != 0))  # (a row of zeros: no information, no skip)
                continue
            t0 = time.perf_counter()
            keep = None
            if self.relax_c is not None:
                cm, cv, rh, rl = self._relax(cm, cv, h[i : i + 1], lam[i : i + 1], np.array([v_i]), observed,
                                             np.array([i]), rec)
                if self.relax_reading == "appendix_site":
                    keep = (rh, rl)
            qm, qv, ok, sd = self._ask(cm, cv, observed, np.array([i]), skipped, rec.errors, rec)
            rec.operator_seconds += time.perf_counter() - t0
            rec.operator_calls += 1
            if not ok[0]:
                continue
            h_n, lam_n, ok, h_p, lam_p = self._propose(cm, cv, qm, qv, h[i : i + 1], lam[i : i + 1], ok, skipped, sd,
                                                       rec, keep, damping)
            if not ok[0]:
                continue
            dlam = float(lam_n[0] - lam[i])
            dh = float(h_n[0] - h[i])
            # the undamped change (site → proposal), for the convergence test
            uh, ul = abs(float(h_p[0] - h[i])), abs(float(lam_p[0] - lam[i]))
            denom = 1.0 + dlam * v_i
            if not (denom > 0 and np.isfinite(denom)):
                skipped["not_pd"] += 1
                continue
            # rank-one update of the posterior (Sherman–Morrison)
            mu = mu + s * ((dh - dlam * m_i) / denom)
            Sigma = _rank_one_update(Sigma, s, -dlam / denom)
            h[i] = h_n[0]
            lam[i] = lam_n[0]
            applied.append((i, h_n[0], lam_n[0], max(uh * np.sqrt(v_i), ul * v_i), max(uh, ul)))
        # recompute the posterior from the sites (no drift from the rank-one updates)
        new_state = _posterior_from_sites(A, prior_prec, h, lam)
        k = len(applied)
        if new_state is None:
            # round-off let Σ leave the positive-definite cone: keep the longest prefix of the
            # sweep's updates that gives a positive-definite precision (bisection)
            def prefix(k):
                hh, ll = h0.copy(), lam0.copy()
                for i, hn, ln, _, _ in applied[:k]:
                    hh[i], ll[i] = hn, ln
                return hh, ll, _posterior_from_sites(A, prior_prec, hh, ll)

            lo, hi = 0, k  # prefix lo is fine (lo = 0 is the old state), prefix hi is not
            best = (h0, lam0, state)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                hh, ll, st = prefix(mid)
                if st is None:
                    hi = mid
                else:
                    lo, best = mid, (hh, ll, st)
            skipped["not_pd"] += k - lo
            k = lo
            h, lam, new_state = best
        rec.n_updated = k
        rec.max_change = float(max((c[3] for c in applied[:k]), default=0.0))
        rec.max_change_raw = float(max((c[4] for c in applied[:k]), default=0.0))
        rec.n_skipped = int(sum(skipped.values()))
        return h, lam, new_state, rec

    # ------------------------------------------------------------------ evidence
    def _log_evidence(self, A, prior_prec, observed, h, lam, state):
        if not self.compute_evidence:
            return None, "not computed (compute_evidence=False)"
        if not has_log_partition(self.operator):
            return None, "operator has no log_partition"
        u = float(self.power)
        m, v = _marginals(A, state)
        cm, cv, ok = _cavity(m, v, h, lam, u)
        zero = ~np.any(A != 0, axis=1)
        if zero.any():
            return None, (f"not computed: {int(zero.sum())} row(s) of A are all zero (rows "
                          f"{', '.join(map(str, np.flatnonzero(zero)[:5]))}): the factor's value at x = 0 is no "
                          "tilted normaliser the operator gives")
        if not ok.all():
            return None, f"{int(np.count_nonzero(~ok))} cavity(ies) improper at the final sites"
        incoming = {self.site_var: Gaussian._unchecked(cm, cv), **observed}
        try:
            with np.errstate(all="ignore"):
                if u == 1.0:
                    log_zi = np.asarray(self.operator.log_partition(incoming), dtype=float)
                else:
                    log_zi = np.asarray(self.operator.log_partition(incoming, power=u), dtype=float)
        except Exception as exc:
            return None, f"operator.log_partition failed: {type(exc).__name__}: {exc}"
        if log_zi.shape != m.shape or not np.all(np.isfinite(log_zi)):
            return None, "operator.log_partition returned non-finite values or a wrong shape"
        with np.errstate(all="ignore"):
            if u == 1.0:
                log_si = log_zi - _log_gauss_integral(cm, cv, h, lam)
            else:  # power EP: ∫ cavity_u · (s_i t̃_i)^u = Z_i(u)
                log_si = (log_zi - _log_gauss_integral(cm, cv, u * h, u * lam)) / u
            # log ∫ N(w; 0, Σ0) exp(b^T w − w^T Q w / 2) dw = ½ log|Σ| − ½ log|Σ0| + ½ b^T μ
            b = A.T @ h
            logdet_sigma = -2.0 * float(np.sum(np.log(np.diag(state.chol))))
            logdet_sigma0 = -float(np.sum(np.log(prior_prec)))
            log_gauss = 0.5 * logdet_sigma - 0.5 * logdet_sigma0 + 0.5 * float(b @ state.mean)
            val = float(np.sum(log_si) + log_gauss)
        if not np.isfinite(val):
            return None, "log evidence is not finite"
        note = "EP estimate (tilted normalisers from operator.log_partition at the final cavities)"
        if u != 1.0:
            note = f"power-EP estimate (u={u:g}; tilted normalisers of f^u at the final u-cavities)"
        elif self.relax_c is not None:
            note += "; relaxed EP: the EP formula at the final sites (relaxation factors not included)"
        return val, note
