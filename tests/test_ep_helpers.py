"""Reference operators and brute-force posteriors for the EP tests (no tests here).

Independent of kjit.oracles: a dense-grid operator for the logistic factor, the closed-form
truncated-Gaussian operator for the noisy probit factor, a conjugate Gaussian-likelihood operator
(on which EP is exact), a log-grid operator for the compound-gamma factor, and dense-grid /
importance-sampling posteriors of Bayesian logistic regression.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from kjit.factors import CompoundGamma, Logistic, ProbitNoise
from kjit.families import Beta, Gamma, Gaussian

# --------------------------------------------------------------------------- operators


class GridLogisticOperator:
    """proj[N(x; m, v) · Beta(σ(x); α, β)] on a dense uniform grid of ±L cavity s.d.

    The integrand is N(x) times a function analytic in a strip of half-width π around the real
    axis (σ has its poles at ±iπ) and bounded for α, β ≥ 1, so the trapezoid rule converges
    geometrically: with G = 2001 nodes over ±16 s.d. the moments are exact to round-off for the
    cavity variances met here (s.d. ≤ 30).
    """

    factor = Logistic()

    def __init__(self, n_grid: int = 2001, half_width: float = 16.0):
        self.t = np.linspace(-half_width, half_width, n_grid)
        self.dt = self.t[1] - self.t[0]

    def _weights(self, incoming):
        g, b = incoming["x"], incoming["z"]
        shape = np.broadcast_shapes(g.shape, b.shape)
        m = np.broadcast_to(g.mean(), shape).reshape(-1)
        sd = np.sqrt(np.broadcast_to(g.var(), shape)).reshape(-1)
        al = np.broadcast_to(b.alpha, shape).reshape(-1)
        be = np.broadcast_to(b.beta, shape).reshape(-1)
        if np.any(al < 1) or np.any(be < 1):
            raise NotImplementedError("grid operator needs α, β ≥ 1")
        x = m[:, None] + sd[:, None] * self.t[None, :]
        lw = (-0.5 * self.t**2 - 0.5 * np.log(2 * np.pi))[None, :] + Beta(al[:, None], be[:, None]).log_pdf_logit(x)
        return x, lw, shape

    def belief(self, incoming, to):
        if to != "x":
            raise NotImplementedError("grid operator answers to='x' only")
        x, lw, shape = self._weights(incoming)
        c = lw.max(axis=1, keepdims=True)
        w = np.exp(lw - c)
        w /= w.sum(axis=1, keepdims=True)
        mean = np.sum(w * x, axis=1)
        var = np.sum(w * (x - mean[:, None]) ** 2, axis=1)
        return Gaussian(mean.reshape(shape), var.reshape(shape))

    def message(self, incoming, to):
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming):
        x, lw, shape = self._weights(incoming)
        return (special.logsumexp(lw, axis=1) + np.log(self.dt)).reshape(shape)


def probit_tilted(m, v, p, eps):
    """Moments and log normaliser of N(f; m, v) · Σ_y Bern(y; p) (ε + (1−2ε) Θ(y f)).

    Z(m) = ε + c(1−p) + c(2p−1) Φ(m/s), c = 1 − 2ε; mean = m + v ∂log Z, var = v + v² ∂²log Z
    (the Gaussian-cavity moment identities), derivatives in closed form.
    """
    m, v, p = np.broadcast_arrays(*(np.asarray(a, float) for a in (m, v, p)))
    c = 1.0 - 2.0 * eps
    s = np.sqrt(v)
    z = m / s
    k = c * (2 * p - 1)
    Z = eps + c * (1 - p) + k * special.ndtr(z)
    phi = np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
    d1 = k * phi / s / Z                  # ∂ log Z / ∂m
    d2 = -k * z * phi / v / Z - d1 * d1   # ∂² log Z / ∂m²
    return m + v * d1, v + v * v * d2, np.log(Z)


class ClosedFormProbitOperator:
    """Closed-form EP operator for ProbitNoise(eps), recipient 'f'."""

    def __init__(self, eps):
        self.factor = ProbitNoise(eps)
        self.eps = eps

    def belief(self, incoming, to):
        if to != "f":
            raise NotImplementedError
        g, y = incoming["f"], incoming["y"]
        mean, var, _ = probit_tilted(g.mean(), g.var(), y.p, self.eps)
        return Gaussian(mean, var)

    def message(self, incoming, to):
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming):
        g, y = incoming["f"], incoming["y"]
        return probit_tilted(g.mean(), g.var(), y.p, self.eps)[2]


class GaussianLikelihoodOperator:
    """Conjugate factor N(y; x, noise) with y carried as the 'y' message Gaussian(y_obs, noise).

    belief = N(x; m, v) · N(y; x, s²) normalised; EP with it is exact (Bayesian linear regression).
    """

    def belief(self, incoming, to):
        g, obs = incoming["x"], incoming["y"]
        prec = 1.0 / g.var() + 1.0 / obs.var()
        mean = (g.mean() / g.var() + obs.mean() / obs.var()) / prec
        return Gaussian(mean, 1.0 / prec)

    def message(self, incoming, to):
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming):
        g, obs = incoming["x"], incoming["y"]
        return Gaussian(g.mean(), g.var() + obs.var()).log_pdf(obs.mean())


class GridCompoundGammaOperator:
    """proj[CompoundGamma(τ) · Gamma(τ; a, b)] on a dense grid in u = log τ."""

    def __init__(self, factor=None, n_grid: int = 20001):
        self.factor = factor or CompoundGamma()
        self.n_grid = n_grid

    def _grid(self, incoming):
        g = incoming["tau"]
        a = np.atleast_1d(g.shape_param).astype(float)
        b = np.atleast_1d(g.rate).astype(float)
        centre = np.log(a / b)
        # in u the density falls like e^{a u} to the left (τ^{a−1} · Jacobian, prior ~ const) and
        # like exp(−b e^u) to the right: cover e^{-45} on both sides
        lo = centre - 45.0 / a - 5.0
        hi = centre + np.log(45.0) + 3.0
        t = np.linspace(0.0, 1.0, self.n_grid)
        u = lo[:, None] + (hi - lo)[:, None] * t[None, :]
        tau = np.exp(u)
        lw = self.factor.log_density(tau) + Gamma(a[:, None], b[:, None]).log_pdf(tau) + u
        du = (hi - lo) * (t[1] - t[0])
        return u, tau, lw, du, g.shape

    def belief(self, incoming, to):
        u, tau, lw, du, shape = self._grid(incoming)
        w = np.exp(lw - lw.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        ess = np.stack([np.sum(w * tau, axis=1), np.sum(w * u, axis=1)], axis=-1)
        return Gamma.project(ess).reshape(shape)

    def message(self, incoming, to):
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming):
        u, tau, lw, du, shape = self._grid(incoming)
        return (special.logsumexp(lw, axis=1) + np.log(du)).reshape(shape)


class CountingOperator:
    """Wraps an operator; counts calls and batch sizes (to check batching)."""

    def __init__(self, op):
        self.op = op
        self.sizes = []
        self.factor = getattr(op, "factor", None)

    def belief(self, incoming, to):
        self.sizes.append(next(iter(incoming.values())).shape)
        return self.op.belief(incoming, to)

    def message(self, incoming, to):
        return self.op.message(incoming, to)

    def log_partition(self, incoming):
        return self.op.log_partition(incoming)


# --------------------------------------------------------------------------- problems


def logistic_problem(n, d, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(d)
    X = rng.standard_normal((n, d)) * scale
    y = (rng.random(n) < special.expit(X @ w)).astype(np.int64)
    return X, y


def log_lik_logistic(W, X, y):
    """Σ_i log p(y_i | w) for each row of W (k, d)."""
    t = W @ X.T  # (k, n)
    s = np.where(y == 1, 1.0, -1.0)
    return -np.sum(np.logaddexp(0.0, -s[None, :] * t), axis=1)


def grid_posterior_logistic(X, y, prior_var=1.0, n_grid=401, half_width=None):
    """Exact posterior moments (and log evidence) of Bayesian logistic regression, d ∈ {1, 2},
    by the trapezoid rule on a dense grid (spectrally accurate for this smooth integrand)."""
    X = np.asarray(X, float)
    d = X.shape[1]
    hw = half_width if half_width is not None else 8.0 * np.sqrt(prior_var)
    g = np.linspace(-hw, hw, n_grid)
    h = g[1] - g[0]
    if d == 1:
        W = g[:, None]
    elif d == 2:
        G1, G2 = np.meshgrid(g, g, indexing="ij")
        W = np.stack([G1.ravel(), G2.ravel()], axis=1)
    else:
        raise ValueError("grid posterior for d <= 2 only")
    lp = log_lik_logistic(W, X, y) - 0.5 * np.sum(W * W, axis=1) / prior_var - 0.5 * d * np.log(2 * np.pi * prior_var)
    c = lp.max()
    w = np.exp(lp - c)
    Z = w.sum()
    w /= Z
    mean = w @ W
    D = W - mean
    cov = (D * w[:, None]).T @ D
    log_z = c + np.log(Z) + d * np.log(h)
    return mean, cov, log_z


def is_posterior_logistic(X, y, prop_mean, prop_cov, n_samples, seed, prior_var=1.0):
    """Self-normalised importance sampling with a (widened) Student-t-free Gaussian proposal."""
    rng = np.random.default_rng(seed)
    d = X.shape[1]
    L = np.linalg.cholesky(prop_cov)
    Zs = rng.standard_normal((n_samples, d))
    W = prop_mean + Zs @ L.T
    log_q = -0.5 * np.sum(Zs * Zs, axis=1) - np.sum(np.log(np.diag(L)))
    log_p = log_lik_logistic(W, X, y) - 0.5 * np.sum(W * W, axis=1) / prior_var
    lw = log_p - log_q
    w = np.exp(lw - lw.max())
    w /= w.sum()
    ess = 1.0 / np.sum(w * w)
    mean = w @ W
    D = W - mean
    cov = (D * w[:, None]).T @ D
    return mean, cov, ess, W, w


def minka_bpm_ep(X, y01, eps, prior_var=1.0, n_sweeps=200):
    """Independent EP for the Bayes point machine with label noise, in weight space.

    Minka's thesis §5.4 updates: with cavity N(w; m_c, V_c) and s² = xᵀV_c x,
    z = y xᵀm_c / s, Z = ε + (1−2ε)Φ(z), α = y(1−2ε)φ(z) / (Z s),
    m = m_c + V_c x α,  V = V_c − (V_c x)(α xᵀm / s²)(V_c x)ᵀ,
    and the new site (τ_i, ν_i) on xᵀw from the new and cavity moments of xᵀw.
    The cavity is built directly from the prior and the other sites, Σ_{j≠i} (explicit sums and
    matrix inverses; no posterior marginals, no rank-one updates); sequential sweeps until no
    site parameter changes by more than 1e-13 (or ``n_sweeps``).
    """
    n, d = X.shape
    ypm = np.where(np.asarray(y01) == 1, 1.0, -1.0)
    tau = np.zeros(n)
    nu = np.zeros(n)
    c = 1.0 - 2.0 * eps
    for _ in range(n_sweeps):
        old_tau, old_nu = tau.copy(), nu.copy()
        for i in range(n):
            x = X[i]
            keep = np.arange(n) != i
            Pc = np.eye(d) / prior_var + (X[keep].T * tau[keep]) @ X[keep]
            Vc = np.linalg.inv(Pc)
            mc = Vc @ (X[keep].T @ nu[keep])
            Vcx = Vc @ x
            s2 = x @ Vcx
            if not s2 > 0:  # improper cavity (negative sites elsewhere): skip, as the engine does
                continue
            mu = x @ mc
            z = ypm[i] * mu / np.sqrt(s2)
            # log Z = log(ε + (1−2ε)Φ(z)), stable for ε = 0 and z ≪ 0
            log_z = np.logaddexp(np.log(eps) if eps > 0 else -np.inf, np.log(c) + special.log_ndtr(z))
            alpha = ypm[i] * np.exp(np.log(c) - 0.5 * z * z - 0.5 * np.log(2 * np.pi) - log_z) / np.sqrt(s2)
            m = mc + Vcx * alpha
            V = Vc - np.outer(Vcx, Vcx) * (alpha * (x @ m) / s2)
            pv = x @ V @ x
            pm = x @ m
            tau[i] = 1.0 / pv - 1.0 / s2
            nu[i] = pm / pv - mu / s2
        if max(np.max(np.abs(tau - old_tau)), np.max(np.abs(nu - old_nu))) < 1e-13:
            break
    V = np.linalg.inv(np.eye(d) / prior_var + (X.T * tau) @ X)
    return V @ (X.T @ nu), V
