"""Oracles: ground-truth EP messages for training pairs and for the just-in-time fallback.

Both oracles share the operator interface (batched: every message in ``incoming`` has the
same batch shape)::

    oracle.belief(incoming: dict[str, Family], to: str) -> Family   # q = proj[f · Π incoming]
    oracle.message(incoming, to) -> Family                          # q / incoming[to]

:class:`QuadratureOracle` — deterministic, for factors that carry exact rules (the "hand-crafted"
operator): the rules live in each factor's module (:mod:`kjit.factors`), built from the
level-panel quadrature of :mod:`kjit.quadrature` or in closed form; the oracle looks them up.

:class:`ImportanceSamplingOracle` — for any sampleable factor (SPEC §3, paper eq. 4): draw
x_in ~ proposal, x_out ~ f(· | x_in); weights w = Π_W m_{W→f}(x_W) / proposal(x_in),
self-normalised.  Because every message is an exponential family, log w for a whole batch is
one matrix product of natural parameters with sufficient statistics.  The effective sample
size of each message is kept in ``last_ess_``; a message whose ESS is below ``min_ess`` is an
oracle failure (:class:`LowESSError`), never a silent bad answer.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .certificates import Certificates, projection_convention
from .errors import LowESSError, OracleError, SamplerOutputError, check_number
from .factors.base import PASSED_THROUGH, Factor, FactorCodeError, factor_code_error
from .families import NUMERIC_KINDS, Family, kernel_limits
from .oracle_kinds import ORACLE_KINDS
from .protocols import Operator
from .quadrature import LOG_SQRT_2PI, two_piece_moments  # noqa: F401  (re-exported)

__all__ = [
    "two_piece_moments",
    "LOG_SQRT_2PI",
    "Oracle",
    "QuadratureOracle",
    "ImportanceSamplingOracle",
    "MessageImportanceSampler",
    "ClientOracle",
    "ORACLE_KINDS",
    "make_oracle",
    "LowESSError",
    "OracleError",
]


#: a row whose input messages put more than this share of their mass where the factor's sampler
#: returned NaN (where the factor is not defined) has no answer (ImportanceSamplingOracle)
UNDEFINED_MASS = 1e-6


def sample_output(factor: Factor, draws, n: int, rng) -> np.ndarray:
    """``factor.sample(draws, n, rng)`` as n real numbers: a user sampler's own exceptions named (FactorCodeError),
    and draws of another shape or of no real type refused naming the factor — any factor's (found by an audit: only a
    SampledFactor's were checked; a Factor subclass's (n, 2) draws met numpy's "cannot reshape", complex ones lost
    their imaginary part)."""
    try:
        raw = np.asarray(factor.sample(draws, n, rng))
    except PASSED_THROUGH:
        raise
    except Exception as exc:
        raise factor_code_error(factor, "sampler", exc) from exc
    if raw.dtype.kind not in NUMERIC_KINDS:
        raise ValueError(f"sampler of factor {factor.name!r} returned {raw.dtype} values, not real numbers")
    if raw.shape != (n,):
        raise ValueError(f"sampler of factor {factor.name!r} returned shape {raw.shape}, expected ({n},)")
    return raw.astype(float, copy=False)


def _raise_heavy_tails(factor, khat) -> None:
    """An OracleError naming the rows whose weights' Pareto k̂ exceeds :data:`PARETO_K_MAX`."""
    if khat is None:
        return
    heavy = np.flatnonzero(khat > PARETO_K_MAX)
    if heavy.size:
        raise OracleError(
            f"importance sampling cannot answer rows {heavy[:10].tolist()}{'…' if heavy.size > 10 else ''} of factor "
            f"{factor.name!r}: their weights are heavy-tailed (Pareto k̂ up to {float(np.max(khat[heavy])):.2f} > "
            f"{PARETO_K_MAX}: a few particles carry the estimate — a message's density is unbounded where they fall, "
            "or the proposal misses where the weight is), so the estimate's error is not what its effective sample "
            "size says", rows=heavy, cause="heavy-tailed weights")


class Oracle(Operator):
    """Common interface: subclasses implement ``_belief_flat`` (or ``_certified_flat``, which also
    reports the ESS and Monte Carlo standard errors of each answer for its certificate)."""

    factor: Factor
    certificate_source = "oracle"

    def _prepare(self, incoming, to):
        return self.factor.flat_incoming(incoming, to)

    def belief(self, incoming: Mapping[str, Family], to: str) -> Family:
        return self.certified(incoming, to)[0]

    def certified(self, incoming: Mapping[str, Family], to: str, **kw):
        """``(belief, Certificates)``: the answer with its source, ESS and standard errors
        (:mod:`kjit.certificates`); also kept in ``last_certificates_``."""
        flat, shape = self._prepare(incoming, to)
        q, ess, se = self._certified_flat(flat, to, **kw)
        return self._certify(q, flat, to, shape, ess, se)

    def _certify(self, q, flat, to, shape, ess=None, se=None):
        m = flat.get(to)
        cert = Certificates.uniform(self.certificate_source, q, m if m is not None and m.shape == q.shape else None,
                                    projection=projection_convention(self.factor), ess=ess, mc_se=se)
        q = q.reshape(shape)
        cert.of = q
        self.last_certificates_ = cert
        return q, cert

    def _certified_flat(self, flat, to):
        """``(belief, ESS or None, coordinate standard errors or None)`` for a flat batch."""
        return self._belief_flat(flat, to), None, None

    def _belief_flat(self, flat, to) -> Family:
        raise NotImplementedError


# ====================================================================== exact rules
class QuadratureOracle(Oracle):
    """Deterministic oracle from a factor's exact rules (the hand-crafted baseline operator).

    The rules live with the factor (:mod:`kjit.factors`: one per recipient, tagged with
    :func:`kjit.factors.rule`); this class only validates, flattens and reshapes.  For the
    built-in factors: relative error ≤ 1e-8 on the moments over means in ±50, variances
    1e-4..1e4, Beta α, β in 0.5..1000 and Gamma shape 1e-2..1e4 (tested against brute-force
    grids).  ``log_partition(incoming)`` gives log ∫ f Π m (messages normalised) for EP's
    evidence; ``power=u`` (power EP) where the factor's rule supports it.
    """

    def __init__(self, factor: Factor):
        if not isinstance(factor, Factor) or not factor.exact_recipients:
            raise ValueError(
                f"QuadratureOracle has no rule for factor {getattr(factor, 'name', factor)!r}; "
                "use ImportanceSamplingOracle for user factors"
            )
        self.factor = factor

    has_log_partition = True
    certificate_source = "rule"

    def __repr__(self):
        return f"QuadratureOracle({self.factor!r})"

    @property
    def supports_power(self) -> bool:
        return any(self.factor.supports_power(v) for v in self.factor.exact_recipients)

    def _belief_flat(self, flat, to, power=1.0):
        return self.factor.exact_belief(flat, to, power)

    def belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        return self.certified(incoming, to, power=power)[0]

    def _certified_flat(self, flat, to, power=1.0):
        return self._belief_flat(flat, to, power), None, None

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        flat, shape = self._prepare(incoming, to)
        return self.factor.exact_message(flat, to).reshape(shape)

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        """log ∫ f(x)^power Π_W m_{W→f}(x_W) dx for normalised incoming messages."""
        flat, shape = self._prepare(incoming, None)
        return self.factor.exact_log_partition(flat, power).reshape(shape)


# ====================================================================== importance sampling
_LOG_W_FLOOR = -350.0

#: importance weights whose tail's Pareto shape k̂ exceeds this give estimates that cannot be trusted
#: (their variance is infinite for k ≥ ½, and the estimate's error then far exceeds what the ESS and
#: the delta method's standard errors say; Vehtari et al., "Pareto smoothed importance sampling")
PARETO_K_MAX = 0.7

#: the per-message sampler's answering round is the pilot of another when its standard errors
#: exceed the target this many times (a gross misjudgement by its own pilot, not noise)
REPILOT_FACTOR = 4.0



def pareto_khat(w) -> np.ndarray:
    """The shape k̂ of a generalised Pareto distribution fitted to the largest weights of each column
    of ``w`` (n, R) (weights ≥ 0): the M = ⌈min(n/5, 3√n)⌉ largest exceedances over the next one, by
    Zhang & Stephens' (2009) empirical Bayes estimate with the weakly informative prior of Vehtari et
    al. (PSIS), vectorised over the columns.  NaN for a column whose tail is flat (bounded weights
    equal at the top: no tail to speak of)."""
    w = np.asarray(w, dtype=float)
    n, R = w.shape
    M = int(np.ceil(min(0.2 * n, 3.0 * np.sqrt(n))))
    if M < 5 or R == 0:
        return np.full(R, np.nan)
    top = np.sort(np.partition(w, n - M - 1, axis=0)[n - M - 1:], axis=0)  # (M + 1, R), ascending
    x = (top[1:] - top[:1]).T  # (R, M) exceedances over the (M + 1)-th largest, ascending
    with np.errstate(all="ignore"):
        m = 30 + int(np.sqrt(M))
        b = 1.0 - np.sqrt(m / (np.arange(1, m + 1) - 0.5))  # (m,)
        b = b[None, :] / (3.0 * x[:, int(M / 4 + 0.5) - 1:int(M / 4 + 0.5)]) + 1.0 / x[:, -1:]  # (R, m)
        k = np.mean(np.log1p(-b[:, :, None] * x[:, None, :]), axis=2)  # (R, m)
        ell = M * (np.log(-b / k) - k - 1.0)
        wts = 1.0 / np.sum(np.exp(ell[:, None, :] - ell[:, :, None]), axis=2)
        wts = np.where(wts >= 10 * np.finfo(float).eps, wts, 0.0)
        wts = wts / np.sum(wts, axis=1, keepdims=True)
        b_post = np.sum(b * wts, axis=1)
        k_post = np.mean(np.log1p(-b_post[:, None] * x), axis=1)
        k_post = (M * k_post + 10.0 * 0.5) / (M + 10.0)
    return np.where(np.isfinite(k_post), k_post, np.nan)


class ImportanceSamplingOracle(Oracle):
    """Self-normalised importance sampling for any sampleable factor (SPEC §3).

    Parameters
    ----------
    factor : Factor
    n_samples : particles per call (the paper uses 5×10^5); all messages of a batch share
        the particles, so a message's answer does not depend on the batch it came in.
    proposal : dict variable → scalar Family message for each input variable (default
        N(0, 200) for Gaussian inputs, as in the paper; Beta(1,1); Gamma(1, 0.1)).
    min_ess : messages whose effective sample size is below this raise :class:`LowESSError`.
    random_state : seed, SeedSequence or Generator; each particle draw advances it.
    chunk : messages per vectorised block (memory ≈ chunk × n_samples × 8 bytes).
    reuse : calls served by one particle draw (default 1: fresh particles for every call).
        Drawing 5×10^5 particles and their statistics is a fixed cost per call (~40–120 ms
        here, against ~7 ms per message); a caller that asks for a few messages at a time —
        a just-in-time operator consulting on its uncertain rows — pays mostly that.  With
        ``reuse`` = r, r consecutive calls share one draw: each answer is the same
        self-normalised estimate with the same variance, but the errors of answers within those
        r calls are correlated (as those of one batch always are).
    """

    def __init__(self, factor: Factor, n_samples: int = 500_000, proposal=None, min_ess: float = 50.0,
                 random_state=None, chunk: int = 16, reuse: int = 1):
        # (each named, integers of integral value: found by an audit, n_samples=2.9 ran as 2 and chunk=0 failed
        # with range()'s own error at the first call, chunk=-1 as a misleading low-ESS error)
        n_samples = check_number("n_samples", n_samples, 2, integer=True)
        min_ess = check_number("min_ess", min_ess, 1)
        reuse = check_number("reuse", reuse, 1, integer=True)
        chunk = check_number("chunk", chunk, 1, integer=True)
        self.reuse = int(reuse)
        self._pool = None          # (stats, log_r, U, undefined, aside) of the current draw
        self._pool_calls = 0       # calls it has served
        self._pool_rng_state = None  # generator state just before it was drawn
        self.factor = factor
        self.n_samples = int(n_samples)
        self.min_ess = float(min_ess)
        self.random_state = random_state
        self.chunk = int(chunk)
        proposal = dict(proposal or {})
        for v in factor.inputs:
            if v not in proposal:
                proposal[v] = factor.families[v].default_proposal()
            if not isinstance(proposal[v], factor.families[v]) or proposal[v].shape != ():
                raise ValueError(f"`proposal[{v!r}]` must be a scalar {factor.families[v].__name__} message")
        unknown = set(proposal) - set(factor.inputs)
        if unknown:
            raise ValueError(f"`proposal` names non-input variable(s) {sorted(unknown)}")
        self.proposal = proposal
        self._rng = np.random.default_rng(random_state)
        self.last_ess_ = None
        self.last_undefined_ = None
        self.last_khat_ = None

    def __repr__(self):
        return f"ImportanceSamplingOracle({self.factor!r}, n_samples={self.n_samples})"

    def get_params(self):
        return dict(factor=self.factor, n_samples=self.n_samples, proposal=self.proposal,
                    min_ess=self.min_ess, random_state=self.random_state, chunk=self.chunk, reuse=self.reuse)

    def with_random_state(self, random_state):
        return type(self)(**{**self.get_params(), "random_state": random_state})

    def _draw(self):
        """``(stats, log_r, undefined, aside)``: the particles' statistics and proposal log
        densities; (None when there are none) the inputs and ``log_r`` of the particles where the
        factor's sampler returned NaN, and the statistics and ``log_r`` of those whose statistics
        are not finite (:meth:`_unanswerable_rows`)."""
        f, n, rng = self.factor, self.n_samples, self._rng
        draws = {v: self.proposal[v].sample(n, rng) for v in f.inputs}
        draws[f.output] = sample_output(f, draws, n, rng)
        log_r = np.zeros(n)
        for v in f.inputs:
            log_r += self.proposal[v].log_pdf(draws[v])
        stats = {v: f.suff_stats(v, draws) for v in f.variables}
        if np.isfinite(log_r).all() and all(np.isfinite(u).all() for u in stats.values()):
            return stats, log_r, None, None  # the usual case, checked with whole-array reductions
        # particles whose statistics are not finite (a value rounded onto the boundary of its
        # support: a Beta variable at exactly 0 or 1, a Gamma one at 0) are set aside; they are
        # weightless for a message whose density vanishes there, and a row for which they are not
        # has no answer (found by an audit: gamma_rate of shape 1e-3 draws x = 0 for 47 % of the
        # particles, and dropping them answered Gamma(0.0031, 3.5) for Gamma(0.001, 2.5));
        # where the sampler returned NaN the factor is not defined: a row whose input messages
        # put mass there has no answer either (:meth:`_unanswerable_rows`)
        out = np.asarray(draws[f.output], dtype=float).reshape(n, -1)
        nan = np.isnan(out).any(axis=1)
        undefined = ({v: draws[v][nan] for v in f.inputs}, log_r[nan]) if nan.any() else None
        finite = np.isfinite(log_r)  # (a proposal density of 0 at its own draw: probability zero)
        keep = finite.copy()
        for u in stats.values():
            keep &= np.isfinite(u).all(axis=1)
        off = finite & ~keep & ~nan
        aside = ({v: u[off] for v, u in stats.items()}, log_r[off]) if off.any() else None
        if not keep.all():
            stats = {v: u[keep] for v, u in stats.items()}
            log_r = log_r[keep]
        return stats, log_r, undefined, aside

    def _unanswerable_rows(self, flat, undefined, aside, log_mass) -> np.ndarray:
        """Rows without an answer from these particles (:data:`UNDEFINED_MASS` decides both):

        * whose input messages put more than that share of their mass where the factor's sampler
          returned NaN, estimated from the same particles (Σ_p Π m(x_p) / r(x_p) / N over them,
          messages and proposal normalised): dropping them conditions the answer on where the
          factor is defined, a bias its ESS does not show (found by an audit: a sampler undefined
          for x < 0 answered N(0.82, 0.38) with ESS 25 600);
        * for which the particles whose statistics are not finite carry more than that share of
          the weight (``log_mass``: the log of the row's total weight on the others), each weighed
          in the limit (0 · ±inf = 0: a message whose density vanishes at the boundary gives them
          none, an unbounded one infinite weight)."""
        B = next(iter(flat.values())).size
        f = self.factor
        bad = np.zeros(B, dtype=bool)
        # (by chunks of rows, as the main loop: a (rows, particles) matrix at a time; the same
        # kernels as the main loop — η·u, or a family's log_kernel on rows with an infinite natural
        # parameter, an observed label — each term in its limit, 0 · ±inf = 0)
        etas = {v: flat[v].natural().reshape(B, -1) for v in f.variables}
        generic = ~np.all(np.concatenate([np.isfinite(e) for e in etas.values()], axis=1), axis=1)
        with np.errstate(all="ignore"):
            for s in range(0, B, self.chunk):
                sl = slice(s, min(B, s + self.chunk))
                if undefined is not None:
                    draws, log_r = undefined
                    lw = -log_r[:, None]
                    for v in f.inputs:
                        lw = lw + flat[v][sl].log_pdf(np.asarray(draws[v]).reshape(len(log_r), *([1] * flat[v].ndim)))
                    share = np.sum(np.exp(np.where(np.isnan(lw), np.inf, lw)), axis=0) / self.n_samples
                    bad[sl] |= ~(share <= UNDEFINED_MASS)
                if aside is not None:
                    st, log_r = aside
                    lw = -log_r[None, :]
                    for v in f.variables:
                        if generic[sl].any():
                            lw = lw + flat[v][sl].log_kernel(st[v], limits=True)
                            continue
                        lw = lw + kernel_limits(etas[v][sl], st[v])
                    share = np.sum(np.exp(np.where(np.isnan(lw), np.inf, lw) - log_mass[sl, None]), axis=1)
                    bad[sl] |= ~(share <= UNDEFINED_MASS)
        return np.flatnonzero(bad)

    def _particles(self):
        """``(stats, log_r, U, undefined, aside)`` for this call: a fresh draw every ``reuse`` calls.
        ``U`` stacks the particles' statistics of every variable and −log r (see
        :meth:`_estimate_flat`); ``undefined``, ``aside``: see :meth:`_draw`."""
        if self._pool is None or self._pool_calls >= self.reuse:
            rng_state = self._rng.bit_generator.state
            stats, log_r, undefined, aside = self._draw()
            f = self.factor
            U = np.empty((sum(s.shape[1] for s in stats.values()) + 1, len(log_r)))
            col = 0
            for v in f.variables:
                k = stats[v].shape[1]
                U[col: col + k] = stats[v].T
                col += k
            np.negative(log_r, out=U[col])
            self._pool, self._pool_calls, self._pool_rng_state = (stats, log_r, U, undefined, aside), 0, rng_state
        self._pool_calls += 1
        pool = self._pool
        if self.reuse == 1:
            self._pool = None  # nothing to keep: free the memory
        return pool

    def pool_state(self) -> dict:
        """Where the particle reuse stands (for saving): the generator state before the current
        draw and the calls it has served; :meth:`set_pool_state` redraws the same particles."""
        return {"calls": self._pool_calls if self._pool is not None else 0,
                "rng_state": self._pool_rng_state if self._pool is not None else None}

    def set_pool_state(self, state: Mapping) -> None:
        calls = int(state.get("calls", 0))
        if calls and state.get("rng_state") is not None:
            after = self._rng.bit_generator.state
            self._rng.bit_generator.state = state["rng_state"]
            self._pool = None
            self._particles()
            self._pool_calls = calls
            if self._rng.bit_generator.state != after:
                raise ValueError("the saved particle draw does not lead to the saved generator state")

    def estimate(self, incoming: Mapping[str, Family], to: str):
        """Tilted expectations of the sufficient statistics of ``to``, and the ESS.

        Returns ``(stats (n, k), ess (n,))`` for the flattened batch and never raises on a low
        ESS, so callers (e.g. training-set generation) can drop failed rows.  For a Gaussian
        recipient the second column is the (centred) variance, not E[x²].
        """
        flat, _ = self._prepare(incoming, to)
        return self._estimate_flat(flat, to)

    def _estimate_flat(self, flat, to):
        f = self.factor
        stats, log_r, U, undefined, aside = self._particles()
        B = next(iter(flat.values())).size
        u_to = stats[to]  # (N, k)
        N = len(log_r)
        centred = f.families[to].centred_estimate
        # log w = Σ_W η_W · u_W(x_W) − log r(x_in) (message normalisers cancel) is one matrix
        # product of the batch's natural parameters H (B, K+1) with the particles' statistics
        # U (K+1, N) = [u_W ..., −log r]; the weighted sums Σ w u_to are a second one (for a
        # Gaussian recipient u = (x, x²), and the variance is E x² − (E x)², recomputed centred
        # where that could lose digits), so a chunk of rows costs ~6 passes over its (rows, N)
        # weight matrix instead of the ~15 of elementwise temporaries.
        etas = [flat[v].natural().reshape(B, -1) for v in f.variables]
        H = np.concatenate(etas + [np.ones((B, 1))], axis=1)
        # rows with an infinite natural parameter (e.g. an observed Bernoulli label) take the
        # generic path, where 0 · ±inf counts as 0
        generic = ~np.all(np.isfinite(H), axis=1)
        out = np.empty((B, u_to.shape[1]))
        ess = np.empty(B)
        log_mass = np.empty(B)
        khat = np.full(B, np.nan)
        # rows whose weights can be unbounded (their Pareto k̂ is checked): an input's message against its proposal,
        # or the output's message, whose density is the weight
        unbounded = np.asarray(flat[f.output].unbounded_density(), bool).reshape(-1).copy()
        for v in f.inputs:
            unbounded |= np.asarray(flat[v].unbounded_ratio(self.proposal[v]), bool).reshape(-1)
        for s in range(0, B, self.chunk):
            sl = slice(s, min(B, s + self.chunk))
            if generic[sl].any():
                lw = -log_r[None, :]
                for v in f.variables:
                    lw = lw + flat[v][sl].log_kernel(stats[v])
            else:
                lw = H[sl] @ U
            top = np.max(lw, axis=1, keepdims=True)
            lw -= top
            # floor the relative log weights at −350: the particles below carry < e^-350 of the
            # largest weight each (< 1e-146 of the total together), and exp / products of values
            # that underflow towards subnormals are many times slower on x86
            np.maximum(lw, _LOG_W_FLOOR, out=lw)
            np.exp(lw, out=lw)
            s0 = np.sum(lw, axis=1)
            log_mass[sl] = top[:, 0] + np.log(s0)
            hv = np.flatnonzero(unbounded[sl])
            if hv.size:  # (a weight made of a bounded density and the proposal's ratio has a light tail)
                khat[s + hv] = pareto_khat(lw[hv].T)
            ess[sl] = s0 * s0 / np.einsum("ij,ij->i", lw, lw)
            mom = (lw @ u_to) / s0[:, None]  # Gaussian: u = (x, x²), so (E x, E x²)
            if centred:
                mean = mom[:, 0]
                var = mom[:, 1] - mean * mean
                # E[x²] − E[x]² loses ~ log10(mean²/var) digits: recompute the rows where that
                # could show against double precision the centred way (rare: |mean| > 1e3 sd)
                bad = ~(var > 1e-6 * mean * mean)
                if bad.any():
                    x = u_to[:, 0]
                    for i in np.flatnonzero(bad):
                        var[i] = np.dot(lw[i], (x - mean[i]) ** 2) / s0[i]
                out[sl, 0] = mean
                out[sl, 1] = var
            else:
                out[sl] = mom
        self.last_khat_ = khat
        ess[khat > PARETO_K_MAX] = 0.0
        self.last_undefined_ = None
        if undefined is not None or aside is not None:  # rows these particles cannot answer
            self.last_undefined_ = self._unanswerable_rows(flat, undefined, aside, log_mass)
            ess[self.last_undefined_] = 0.0
        self.last_ess_ = ess
        return out, ess

    def _belief_flat(self, flat, to):
        return self._certified_flat(flat, to)[0]

    def _certified_flat(self, flat, to):
        ess_stats, ess = self._estimate_flat(flat, to)
        _raise_heavy_tails(self.factor, self.last_khat_)
        bad = self.last_undefined_
        if bad is not None and bad.size:
            raise OracleError(
                f"importance sampling cannot answer rows {bad[:10].tolist()}{'…' if bad.size > 10 else ''} of factor "
                f"{self.factor.name!r}: more than {UNDEFINED_MASS:g} of their mass lies where its sampler returned "
                "NaN (the factor is not defined there) or where a variable's value rounds onto the boundary of its "
                "support (its statistics are not finite): dropping those particles would bias the answer", rows=bad)
        low = np.flatnonzero(~(ess >= self.min_ess))
        if low.size:
            raise LowESSError(low, ess[low], self.min_ess)
        fam = self.factor.families[to]
        if not np.all(fam.estimate_ok(ess_stats)):
            raise OracleError(f"importance-sampling estimate does not make a {fam.__name__} message "
                              "(e.g. a variance estimate that is not positive)")
        return fam.from_estimate(ess_stats), ess, None


# ====================================================================== per-message importance sampling
class MessageImportanceSampler(Oracle):
    """Importance sampling with a proposal of its own for every message, for any sampleable factor.

    For row i of a batch the inputs are drawn from their own incoming messages, the output from
    the factor given them, and the particle is weighted by the output's incoming message::

        x_in ~ Π_W m_W[i] (W an input),   x_out ~ f(· | x_in),   w = m_out[i](x_out)

    so the weights carry only the output's message, and a narrow input message costs nothing (the
    paper's shared fixed proposal N(0, 200) — :class:`ImportanceSamplingOracle` — loses its ESS
    there).  Self-normalised estimates of E[u(x_to)], projected onto the recipient's family.  A
    factor without inputs (compound gamma) draws from the factor and weights by its one message.

    The particle count adapts per message: a pilot round of ``n_initial`` particles estimates the
    Monte Carlo standard error of every projected coordinate, and sets the size of a fresh
    answering round (n_initial/4 · ``growth``^j, the smallest at least 1.1 × the count that brings
    the largest standard error to ``target_se`` — or, with ``target_ess``, the ESS to it — and the
    ESS to 1.5 × ``min_ess``; within ``max_samples``), which answers with what it finds: rows meet
    the target about, not always (measured on logistic messages: 86 % within it, 94 % within
    1.5 ×).  Answering with the round whose own standard errors met the target selected rounds
    whose estimates lean one way (+0.39 standard errors, found by an audit), and cost twice the
    particles.  An answering round whose ESS is under ``min_ess``, or whose standard errors exceed
    :data:`REPILOT_FACTOR` × the target (its pilot misjudged the weights), is the pilot of another;
    the cap answers whatever it finds.  Standard errors are the
    delta method's (the projection's Jacobian, by central differences, applied to the
    self-normalised covariance Σ w̃² (u − ū)(u − ū)ᵀ) in the family's coordinates — log
    parameters, and for a Gaussian the mean in units of the belief's standard deviation and the
    log variance.  A row whose ESS stays under ``min_ess`` at the cap is a :class:`LowESSError`
    naming the rows; one that met ``min_ess`` but not ``target_se`` is answered, and its standard
    error is reported.  Rows whose weights are heavy-tailed (:func:`pareto_khat`), whose inputs
    cannot be sampled or whose estimate is not finite are :class:`OracleError` naming them.

    After each call: ``last_ess_`` (n,), ``last_se_`` (n, k), ``last_n_samples_`` (n,) — per
    message of the flattened batch.  Work is vectorised over (particles × rows) in chunks of at
    most ``chunk_elements`` particles (a row needing more is a chunk of its own): small enough that
    a chunk's dozen temporaries stay near the cache — 2·10^6 was 2.2× slower than 1.6·10^4 and
    1.9× slower than 6.6·10^4 on 100 messages (``benchmarks/sampler_chunks.py``), the arrays' page
    faults and memory traffic outweighing the per-chunk Python.
    """

    has_log_partition = True

    def __init__(self, factor: Factor, target_se: float = 1e-2, min_ess: float = 50.0, target_ess: float | None = None,
                 n_initial: int = 2000, max_samples: int = 256_000, growth: int = 2,
                 chunk_elements: int = 16_384, random_state=None):
        target_se = check_number("target_se", target_se, 0.0, low_open=True)
        min_ess = check_number("min_ess", min_ess, 1)
        if target_ess is not None:
            target_ess = check_number("target_ess", target_ess, min_ess)
        n_initial = check_number("n_initial", n_initial, 10, integer=True)
        max_samples = check_number("max_samples", max_samples, n_initial, integer=True)
        growth = check_number("growth", growth, 2, integer=True)
        chunk_elements = check_number("chunk_elements", chunk_elements, 1, integer=True)
        self.factor = factor
        self.target_se = float(target_se)
        self.min_ess = float(min_ess)
        self.target_ess = None if target_ess is None else float(target_ess)
        self.n_initial = int(n_initial)
        self.max_samples = int(max_samples)
        self.growth = int(growth)
        self.chunk_elements = int(chunk_elements)
        self.random_state = random_state
        self._rng = np.random.default_rng(random_state)
        self._unsampleable: set[int] = set()
        self._bad_output: dict[int, dict] = {}
        self.last_unsampleable_ = np.zeros(0, dtype=int)
        self.last_bad_output_ = np.zeros(0, dtype=int)
        self.last_khat_ = None

    def get_params(self):
        return dict(factor=self.factor, target_se=self.target_se, min_ess=self.min_ess, target_ess=self.target_ess,
                    n_initial=self.n_initial, max_samples=self.max_samples, growth=self.growth,
                    chunk_elements=self.chunk_elements, random_state=self.random_state)

    def with_random_state(self, random_state):
        """The same sampler drawing from ``random_state``: what :func:`kjit.training.make_training_set` gives each
        chunk (found by an audit: without it every chunk, and a service's held-out pairs, drew the generator's
        one stream — joblib workers each a pickled copy of its state — and ``random_state`` reproduced nothing)."""
        return type(self)(**{**self.get_params(), "random_state": random_state})

    def __repr__(self):
        return (f"MessageImportanceSampler({self.factor!r}, target_se={self.target_se:g}, min_ess={self.min_ess:g}, "
                f"max_samples={self.max_samples})")

    # ------------------------------------------------------------------ one round
    def _draw(self, flat, rows, n, to):
        """Particles for ``rows`` (n each): (stats of ``to`` (n, R, k), log weights (n, R)).  Rows
        whose input draws left their family's support are added to ``self._unsampleable``."""
        f = self.factor
        R = rows.size
        draws = {}
        for v in f.inputs:
            d = flat[v][rows].sample(n, self._rng).reshape(n, R)  # row fastest
            inside = flat[v].in_support(d)
            if not inside.all():
                # an extreme message's draws can round onto its support's boundary (Gamma(1e-3, 1)
                # gives 0 for 47 % of them), where the factor may not be defined (found by an audit:
                # a bare ValueError for the whole batch): those rows have no answer; their draws are
                # replaced by their message's mean to sample the others
                bad = ~inside.all(axis=0)
                self._unsampleable.update(rows[bad].tolist())
                d = np.where(inside, d, np.broadcast_to(np.asarray(flat[v][rows].mean(), float), d.shape))
            draws[v] = d.reshape(-1)
        x_out = np.asarray(self._sample_output(draws, rows, n), dtype=float).reshape(n * R)
        # draws that are no value of the output's family (NaN, outside its support) leave their rows
        # without an answer, named (see _note_bad_output); the others are weighted as usual
        valid = self.factor.families[f.output].in_closed_support(x_out).reshape(n, R)
        draws[f.output] = x_out
        m_out = flat[f.output][rows]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            lw = m_out.log_pdf(x_out.reshape(n, R))
            u = f.suff_stats(to, draws).reshape(n, R, -1)
            # ±inf, the end of an unbounded support an overflow rounds onto (e^x for x > 709.8, a user's
            # x³): a proper message's density vanishes there, so the weight is 0, the limit — exact
            # (found by an audit: a Gaussian's, recomputed from the statistics, was inf − inf: no weight
            # for the row, "effective sample size 0 … use a better proposal or more samples")
            at_inf = np.isinf(x_out.reshape(n, R)) & valid
            lw[at_inf] = -np.inf
            off = ~np.isfinite(lw) & valid & ~at_inf
            if off.any():
                # the output's message at values where it is not finite, by the factor's own statistics
                # of the output (exact where the value rounded onto the support's boundary: a logistic
                # z = σ(x) at 1 for x > 36.7, an exp y = e^x at 0 for x < −745 or at inf for x > 709.8 —
                # those particles were dropped: N(34.8, 1.8) for N(36, 4) at ESS 4e4, found by an
                # audit); +inf (an unbounded density at the boundary) leaves the row without weight
                i, j = np.nonzero(off)
                flat_idx = i * R + j
                sub = {v: np.asarray(d)[flat_idx] for v, d in draws.items()}
                lw[i, j] = m_out[j].log_pdf_stats(f.suff_stats(f.output, sub))
        invalid_rows = ~valid.all(axis=0)
        lw = np.where(np.isnan(lw) | (lw == np.inf), np.inf, lw)  # (propagates to no weight in _round)
        # a row where the factor's sampler returned NaN is outside where the sampler is defined:
        # dropping those particles would bias the answer while its ESS looked healthy (found in
        # review: a sampler undefined for x < 0 gave KL 20 answers with ESS 13 000) — the row gets
        # no weight and no answer, and SamplerOutputError names it (so does one whose draws left the
        # output's support)
        if invalid_rows.any():
            self._note_bad_output(rows, n, x_out.reshape(n, R), valid)
            lw[:, invalid_rows] = -np.inf
        if not np.isfinite(u).all():  # statistics of ``to`` at particles without weight count as 0
            u = np.where(np.isneginf(lw)[..., None], np.where(np.isfinite(u), u, 0.0), u)
        return u, lw

    def _sample_output(self, draws, rows, n):
        """The factor's output for the input ``draws`` of ``rows`` (n each, row fastest).  A user
        sampler's exception is a FactorCodeError naming the rows whose draws raise it alone (each row
        sampled again by itself to find them; all of them if none does)."""
        f, R = self.factor, rows.size
        try:
            return sample_output(f, draws, n * R, self._rng)
        except FactorCodeError as exc:
            if exc.rows is not None:
                raise
            failing = []
            for j in range(R if R > 1 else 0):
                one = {v: np.asarray(d).reshape(n, R)[:, j] for v, d in draws.items()}
                try:
                    sample_output(f, one, n, self._rng)
                except FactorCodeError:
                    failing.append(int(rows[j]))
                except (ValueError, ArithmeticError, OracleError):
                    pass
            raise exc.with_rows(failing or rows) from exc.__cause__

    def _note_bad_output(self, rows, n, x_out, valid) -> None:
        """Record the rows of a round whose output draws (``x_out`` (n, R)) are no value of the output's
        family (``valid`` False): per row, the count of NaN / outside draws and the first outside one
        (:meth:`_raise_bad_output`)."""
        nan = np.isnan(x_out)
        out = ~valid & ~nan
        for j in np.flatnonzero(~valid.all(axis=0)):
            row = int(rows[j])
            rec = self._bad_output.setdefault(row, {"nan": 0, "outside": 0, "n": 0, "example": None})
            rec["nan"] += int(nan[:, j].sum())
            rec["outside"] += int(out[:, j].sum())
            rec["n"] += n
            if rec["example"] is None and out[:, j].any():
                rec["example"] = float(x_out[np.argmax(out[:, j]), j])

    def _raise_bad_output(self) -> None:
        """A :class:`SamplerOutputError` naming the factor, its output, what its sampler returned and
        the rows, if any row met such a draw (see :meth:`_note_bad_output`)."""
        if not self._bad_output:
            return
        f = self.factor
        fam = f.families[f.output]
        rows = np.array(sorted(self._bad_output), dtype=int)
        parts, causes = [], []
        for kind, what, cause in (
                ("nan", "NaN (where the factor is not defined)", "sampler returned NaN"),
                ("outside", f"values outside the {fam.__name__} support {fam.closed_support}",
                 "sampler returned values outside the support")):
            hit = [int(r) for r in rows if self._bad_output[r][kind]]
            if not hit:
                continue
            share = [self._bad_output[r][kind] / self._bad_output[r]["n"] for r in hit]
            example = next((self._bad_output[r]["example"] for r in hit if self._bad_output[r]["example"] is not None),
                           None)
            amount = (f"{share[0]:.2%} of its draws" if len(hit) == 1 else
                      f"{min(share):.2%} to {max(share):.2%} of a row's draws")
            parts.append(f"{what} on the draws of rows {hit[:10]}{'…' if len(hit) > 10 else ''} ({amount}"
                         f"{'' if example is None else f'; e.g. {example:.6g}'})")
            causes.append(cause)
        raise SamplerOutputError(
            f"factor {f.name!r}: its sampler returned, for its output {f.output!r} (declared a {fam.__name__} "
            f"variable), " + "; and ".join(parts) + ": these messages have no answer (the draws are the sampler's "
            "own, given draws from the rows' input messages — more particles or another proposal cannot help: fix "
            "the sampler, or send messages where it is defined)",
            rows=rows, cause=causes[0], factor=f.name, variable=f.output)

    def _round(self, flat, rows, n, to):
        """Estimates for ``rows`` with n fresh particles each: (ess stats (R, k), covariance of
        their estimator (R, k, k), ESS (R,), log mean weight (R,), Pareto k̂ of the weights (R,),
        NaN where no particle has weight or the weights' tail is flat)."""
        R = rows.size
        per = max(1, self.chunk_elements // n)
        k = None
        out = []
        for s in range(0, R, per):
            sub = rows[s:s + per]
            u, lw = self._draw(flat, sub, n, to)
            m = np.max(lw, axis=0)
            ok = np.isfinite(m)
            w = np.exp(lw - np.where(ok, m, 0.0)[None, :])
            w[:, ~ok] = 0.0
            s0 = np.sum(w, axis=0)
            with np.errstate(invalid="ignore", divide="ignore"):
                wn = w / s0[None, :]
                k_ = u.shape[-1]
                mu = np.stack([np.sum(wn * u[..., a], axis=0) for a in range(k_)], axis=-1)
                d = u - mu[None]
                w2 = wn * wn
                cov = np.empty((sub.size, k_, k_))
                for a in range(k_):  # k is 1 or 2: explicit sums beat a general einsum here
                    wd = w2 * d[..., a]
                    for b in range(a, k_):
                        cov[:, a, b] = cov[:, b, a] = np.sum(wd * d[..., b], axis=0)
                ess = 1.0 / np.sum(w2, axis=0)
                log_z = np.log(s0 / n) + m
            ess = np.where(ok, ess, 0.0)
            if self.factor.families[to].centred_estimate:
                # (E x, var) with the variance computed centred, and the covariance of that
                # estimator (influence functions x − ū and (x − ū)² − var): rebuilding E x² =
                # var + ū² and projecting would cancel ~log10(ū²/var) digits (|mean| ≫ sd)
                with np.errstate(invalid="ignore"):
                    d0 = d[..., 0]
                    var = np.sum(wn * d0 ** 2, axis=0)
                    dc = np.stack([d0, d0 ** 2 - var[None]], axis=-1)
                    for a in range(k_):
                        wd = w2 * dc[..., a]
                        for b in range(a, k_):
                            cov[:, a, b] = cov[:, b, a] = np.sum(wd * dc[..., b], axis=0)
                mu = np.stack([mu[:, 0], var], axis=-1)
            # the Pareto k̂ of every row's weights (found by an audit: computed only where the output's message,
            # the weight, has an unbounded density — but bounded weights can be heavy-tailed in a sample too:
            # exp → y at x N(1.97, 0.19), y Gamma(17.3, 0.166) answered 9 reported standard errors off at ESS 58,
            # k̂ 1.55); the adaptive loop gives such a row more particles where its weights are bounded
            khat = np.full(sub.size, np.nan)
            if ok.any():
                khat[ok] = pareto_khat(w[:, ok])
            out.append((mu, cov, ess, log_z, khat))
            k = u.shape[-1]
        cat = [np.concatenate([o[i] for o in out]) for i in range(5)]
        return cat[0].reshape(R, k), cat[1].reshape(R, k, k), cat[2], cat[3], cat[4]

    def _coord_se(self, fam, ess_stats, cov):
        """Standard errors of the projected coordinates (delta method, Jacobian by central differences)."""
        R, k = ess_stats.shape
        # centred families' stats are (mean, variance): their own from_estimate projects them
        project = fam.from_estimate if fam.centred_estimate else fam.project
        base = project(ess_stats).to_coords()
        J = np.empty((R, k, k))
        sd = np.sqrt(np.maximum(np.einsum("rkk->rk", cov), 0.0))
        for j in range(k):
            h = np.maximum(1e-4 * sd[:, j], 1e-9 * np.maximum(np.abs(ess_stats[:, j]), 1e-300))
            e = np.zeros(k)
            e[j] = 1.0
            try:
                plus = project(ess_stats + h[:, None] * e).to_coords()
                minus = project(ess_stats - h[:, None] * e).to_coords()
                J[:, :, j] = (plus - minus) / (2 * h[:, None])
            except ValueError:  # the perturbation left the family's domain: one-sided
                plus = project(ess_stats + h[:, None] * e).to_coords()
                J[:, :, j] = (plus - base) / h[:, None]
        var = np.einsum("rij,rjl,ril->ri", J, cov, J)
        se = np.sqrt(np.maximum(var, 0.0))
        j = fam.spread_coord
        if j is not None:  # location coordinates in units of the belief's standard deviation
            scale = np.exp(0.5 * base[:, j])
            for c in range(k):
                if c != j:
                    se[:, c] = se[:, c] / scale
        return base, se

    def _answer_size(self, need) -> np.ndarray:
        """Particle counts of answering rounds for rows needing ``need``: n_initial/4 · growth^j, the
        smallest at least 1.1 × ``need`` (a few sizes, so rows share vectorised rounds), within the cap."""
        base = max(10, self.n_initial // 4)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            j = np.ceil(np.log(np.maximum(1.1 * np.asarray(need, float), base) / base) / np.log(self.growth))
        j = np.where(np.isfinite(j), j, 64)
        return np.minimum(base * np.power(float(self.growth), np.minimum(j, 64)), self.max_samples).astype(np.int64)

    # ------------------------------------------------------------------ estimate
    def estimate(self, incoming: Mapping[str, Family], to: str):
        """``(expected sufficient statistics (n, k), ESS (n,), coordinate SE (n, k), particles (n,),
        log partition (n,))`` for the flattened batch; never raises on a low ESS."""
        flat, _ = self._prepare(incoming, to)
        stats, *rest = self._estimate_flat(flat, to)
        if self.factor.families[to].centred_estimate:  # (mean, variance) → (E x, E x²)
            stats = np.stack([stats[:, 0], stats[:, 1] + stats[:, 0] ** 2], axis=-1)
        return (stats, *rest)

    def _estimate_flat(self, flat, to):
        """As :meth:`estimate`, but a centred family's stats are (mean, centred variance)."""
        fam = self.factor.families[to]
        B = next(iter(flat.values())).size
        k = fam.n_stats
        stats = np.full((B, k), np.nan)
        se = np.full((B, k), np.inf)
        ess = np.zeros(B)
        n_used = np.zeros(B, dtype=np.int64)
        log_z = np.full(B, -np.inf)
        self._unsampleable = set()
        self._bad_output = {}
        khat = np.full(B, np.nan)
        # the weights are the output's message: unbounded only where its density is
        unbounded = np.asarray(flat[self.factor.output].unbounded_density(), bool).reshape(-1)
        # A pilot round of n_initial particles sets each row's size for a fresh answering round,
        # which answers with what it finds (its standard errors reported): accepting a round because
        # its own standard errors came out small selects the rounds whose estimates lean one way
        # (+0.39 standard errors in log shape on gaussian → τ, found by an audit; accepting answering
        # rounds within 1.5 × the target still left +0.2).  Only a round whose ESS is below min_ess,
        # or whose standard errors exceed REPILOT_FACTOR × the target (its pilot misjudged the
        # weights, not noise), is the pilot of another; the cap answers whatever it finds.
        size = np.full(B, self.n_initial, dtype=np.int64)
        piloted = np.zeros(B, dtype=bool)
        todo = np.arange(B)
        while todo.size:
            again = []
            for n in np.unique(size[todo]):
                grp = todo[size[todo] == n]
                mu, cov, e, lz, kh = self._round(flat, grp, int(n), to)
                stats[grp], ess[grp], n_used[grp], log_z[grp], khat[grp] = mu, e, n, lz, kh
                heavy = kh > PARETO_K_MAX
                # (heavy-tailed weights: no answer whatever the particles where the weight, the output's message,
                # has an unbounded density; bounded weights have a finite variance — more particles)
                hopeless_tail = heavy & unbounded[grp]
                good = e >= self.min_ess
                se_t = np.full((grp.size, k), np.inf)
                if good.any():
                    try:
                        _, se_t[good] = self._coord_se(fam, mu[good], cov[good])
                    except ValueError:
                        pass  # a projection failed: these rows get more particles
                se[grp] = se_t
                worst = np.max(se_t, axis=1)
                # the next round's need, and (an answering round whose standard errors exceed the
                # target many times over found what its pilot missed — heavier weights) whether this
                # one is the pilot of another
                if self.target_ess is not None:
                    need = n * self.target_ess / np.maximum(e, 1.0)
                    misjudged = e < self.target_ess / REPILOT_FACTOR**2
                else:
                    with np.errstate(over="ignore", invalid="ignore"):
                        need = np.where(good, n * (worst / self.target_se) ** 2, n * self.growth)
                    need = np.maximum(need, n * 1.5 * self.min_ess / np.maximum(e, 1.0))
                    misjudged = ~(worst <= REPILOT_FACTOR * self.target_se)
                # (heavy-tailed bounded weights: more particles each round, to the cap, whichever the target —
                # found in review: under target_ess a row whose ESS met it kept its size, round after round)
                need = np.where(heavy, np.maximum(need, n * self.growth), need)
                # rows without an answer whatever the particles: not finite (a weighted particle whose
                # statistic is not: a round without weight is given more — found by an audit: a pilot drawing no
                # weighted particle, P 2.3e-4 each at 2 000, was refused where the cap's 256 000 answered),
                # heavy-tailed unbounded weights, or inputs that cannot be sampled
                hopeless = (~np.all(np.isfinite(mu), axis=1) & (e > 0)) | hopeless_tail
                if self._unsampleable:
                    hopeless |= np.isin(grp, np.fromiter(self._unsampleable, dtype=int))
                if self._bad_output:  # (no weight, whatever the particles: no further rounds)
                    hopeless |= np.isin(grp, np.fromiter(self._bad_output, dtype=int))
                final = hopeless | (piloted[grp] & good & ~heavy & ~misjudged) | (n >= self.max_samples)
                rest = grp[~final]
                piloted[rest] = True
                size[rest] = self._answer_size(need[~final])
                again.append(rest)
            todo = np.concatenate(again) if again else np.zeros(0, dtype=int)
        self.last_unsampleable_ = np.array(sorted(self._unsampleable), dtype=int)
        if self.last_unsampleable_.size:
            stats[self.last_unsampleable_], ess[self.last_unsampleable_] = np.nan, 0.0
            log_z[self.last_unsampleable_] = np.nan
        self.last_bad_output_ = np.array(sorted(self._bad_output), dtype=int)
        if self.last_bad_output_.size:
            stats[self.last_bad_output_], ess[self.last_bad_output_] = np.nan, 0.0
            log_z[self.last_bad_output_] = np.nan
        self.last_khat_ = khat
        heavy = khat > PARETO_K_MAX
        ess[heavy], log_z[heavy] = 0.0, np.nan  # (no answer: estimate() reports them failed)
        self.last_ess_, self.last_se_, self.last_n_samples_ = ess, se, n_used
        return stats, ess, se, n_used, log_z

    def _belief_flat(self, flat, to):
        return self._certified_flat(flat, to)[0]

    def _refuse_unanswered(self, ess) -> None:
        """The OracleError naming the rows of the last estimate without an answer: a sampler output that is not
        one, inputs that cannot be sampled, heavy-tailed weights, an ESS under ``min_ess``."""
        self._raise_bad_output()
        bad = self.last_unsampleable_
        if bad.size:
            raise OracleError(
                f"per-message importance sampling: the input messages of rows {bad[:10].tolist()}"
                f"{'…' if bad.size > 10 else ''} give draws on the boundary of their support (underflow of an "
                f"extreme message), where factor {self.factor.name!r} cannot be sampled", rows=bad,
                cause="input draws on the support's boundary")
        _raise_heavy_tails(self.factor, self.last_khat_)
        low = np.flatnonzero(~(ess >= self.min_ess))
        if low.size:
            raise LowESSError(low, ess[low], self.min_ess)

    def _certified_flat(self, flat, to):
        stats, ess, se, _, _ = self._estimate_flat(flat, to)
        self._refuse_unanswered(ess)
        fam = self.factor.families[to]
        bad = np.flatnonzero(~(np.all(np.isfinite(stats), axis=1) & np.asarray(fam.estimate_ok(stats), bool)))
        if bad.size:  # a weighted particle whose statistic is not finite, or not a member's statistics
            raise OracleError(
                f"per-message importance sampling: the estimates of rows {bad[:10].tolist()}"
                f"{'…' if bad.size > 10 else ''} are not a {fam.__name__} message's statistics (a statistic "
                "that is not finite at a weighted particle, e.g. a draw on the boundary of the support)", rows=bad)
        try:
            if fam.centred_estimate:  # stats are (mean, centred variance)
                return fam.from_estimate(stats), ess, se
            return fam.project(stats), ess, se
        except ValueError as exc:
            raise OracleError(f"per-message importance sampling: the estimate cannot be projected: {exc}") from None

    def log_partition(self, incoming: Mapping[str, Family]) -> np.ndarray:
        """log ∫ f Π m (normalised messages) = log E_{x_in ~ Π m_in}[m_out(x_out)], estimated
        with the particles of the output's recipient rule.  Rows without an answer are an OracleError naming them,
        as :meth:`belief`'s (found by an audit: exp at x N(0, 0.01), y Gamma(400, 4) gave −1 323.8 at ESS 1.04 for
        the exact −772.7, and a sampler's NaN passed as NaN)."""
        flat, shape = self._prepare(incoming, None)
        _, ess, _, _, log_z = self._estimate_flat(flat, self.factor.output)
        self._refuse_unanswered(ess)
        bad = np.flatnonzero(~np.isfinite(log_z))
        if bad.size:
            raise OracleError(f"per-message importance sampling: the log partition of rows {bad[:10].tolist()}"
                              f"{'…' if bad.size > 10 else ''} is not a finite number", rows=bad)
        return log_z.reshape(shape)


# ====================================================================== oracle elsewhere
class ClientOracle(Oracle):
    """The oracle of an operator whose oracle runs on its clients (a served operator of a factor
    the server has no code for, :class:`kjit.factors.declared.DeclaredFactor`): asking it is an
    :class:`OracleError` saying so.  The operator learns from the pairs its clients send."""

    has_log_partition = False

    def __init__(self, factor: Factor):
        self.factor = factor

    def __repr__(self):
        return f"ClientOracle({self.factor!r})"

    def _belief_flat(self, flat, to):
        label = getattr(self.factor, "label", self.factor.name)
        raise OracleError(f"the oracle of factor {label!r} runs on its clients, not here: ask for predictions "
                          f"(mode=predict) and send the oracle's answers as observations")


# ====================================================================== oracles by name
#: the oracles a training run can name (``kjit train --oracle``, the service's ``oracle``): see kjit.oracle_kinds


def resolve_oracle_kind(kind: str, factor: Factor, to: str) -> str:
    """``kind`` with ``"auto"`` resolved: ``"quadrature"`` where the factor has an exact rule for
    ``to``, else ``"message_sampler"`` (any factor that can be sampled)."""
    if kind == "auto":
        return "quadrature" if factor.has_exact(to) else "message_sampler"
    if kind not in ORACLE_KINDS:
        raise ValueError(f"unknown oracle {kind!r}; known: {', '.join(ORACLE_KINDS)}")
    return kind


def make_oracle(kind: str, factor: Factor, to: str, *, n_samples: int = 100_000, target_se: float = 1e-2,
                random_state=None) -> Oracle:
    """The oracle ``kind`` (:data:`ORACLE_KINDS`) for the messages to ``to``.  ``n_samples``: the
    shared-proposal sampler's particles per call, the per-message sampler's cap per message (its
    pilot round: min(2 000, n_samples)); ``target_se``: the per-message sampler's standard error per
    coordinate.  ``quadrature`` for a recipient without an exact rule is a ValueError naming the
    alternatives."""
    kind = resolve_oracle_kind(kind, factor, to)
    if kind == "quadrature":
        if not factor.has_exact(to):
            raise ValueError(f"factor {factor.name!r} has no exact rule for {to!r} (it has: "
                             f"{', '.join(factor.exact_recipients) or 'none'}): the quadrature oracle cannot "
                             f"answer it; use the oracle 'message_sampler' (importance sampling per message from "
                             f"the factor's sampler) or 'auto'")
        return QuadratureOracle(factor)
    if kind == "message_sampler":
        n_initial = min(2000, int(n_samples))
        return MessageImportanceSampler(factor, target_se=target_se, n_initial=n_initial,
                                        max_samples=max(int(n_samples), n_initial), random_state=random_state)
    return ImportanceSamplingOracle(factor, n_samples=n_samples, random_state=random_state)
