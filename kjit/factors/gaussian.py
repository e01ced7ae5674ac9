"""The Gaussian factor with random mean and precision: x ~ N(m, 1/tau) (m, x Gaussian; tau Gamma).

Infer.NET's GaussianOp with a random precision.  The exact rule for every recipient is
:mod:`kjit.exact.gaussian` (m and x integrate out in closed form given tau: a 1-D integral over
log tau); beliefs on m and x are Gaussian by moments, the belief on tau a Gamma by the KL
projection (E[tau], E[log tau]) or, with ``projection="moments"``, by mean and variance
(Infer.NET's convention for a Gaussian's precision).  Power EP is supported: N(x; m, 1/tau)^u is
again Gaussian given tau.

Default training distribution (:func:`gaussian_incoming`): m and x messages N(μ, v) with
μ ~ U(−5, 5), log10 v ~ U(−1, 1); tau message Gamma(a, b) with log10 a ~ U(0, 1.5),
log10 b ~ U(−1, 1).

The reference of learned operators (:meth:`GaussianFactor.approximate_belief`): Gauss–Hermite quadrature of
the exact rule's integral on w's modes, checked by :meth:`GaussianFactor.reference_error`.
"""

from __future__ import annotations

import numpy as np

from ..exact import gaussian as _exact
from ..families import Family, Gamma, Gaussian
from .base import (Factor, capped_log_var, check_projection, exact_rules, gamma_from_log_nodes, gamma_stat_rounding,
                   gaussian_from_nodes, local_maxima, multi_centre_gauss_hermite, nan_like, reference_change,
                   reference_coords, register_factor)

__all__ = ["GaussianFactor", "gaussian_incoming"]

#: Gauss–Hermite nodes a mode of the reference (:meth:`GaussianFactor.approximate_belief`; measured there)
REFERENCE_NODES = 32
#: the reference's checks (:meth:`GaussianFactor.reference_error`): the finer rule's nodes a mode, and the
#: differently placed rule's nodes a mode and the widening of its modes' scales
FINER_NODES = 48
PLACED_NODES, PLACED_WIDEN = 40, 1.5


class GaussianFactor(Factor):
    """x ~ N(m, 1/tau); m, x Gaussian, tau Gamma.  ``projection`` of the Gamma belief on tau."""

    name = "gaussian"
    inputs = ("m", "tau")
    output = "x"
    families = {"m": Gaussian, "tau": Gamma, "x": Gaussian}

    _belief, _log_partition = exact_rules(_exact, ("m", "tau", "x"), power=_exact.SUPPORTS_POWER)

    def __init__(self, projection: str = "kl"):
        self.projection = check_projection(projection)

    def params(self):
        return {"projection": self.projection}

    @staticmethod
    def default_incoming(n, rng):
        return gaussian_incoming(n, rng)

    def sample(self, inputs, size, rng):
        return _exact.sample(inputs, size, rng)

    def approximate_belief(self, incoming, to):
        """A near-exact belief, the reference of a learned operator's relative targets (the factor at power 1, as
        operators use it): Gauss–Hermite quadrature of the exact rule's 1-D integral in u = log τ
        (:mod:`kjit.exact.gaussian`: the same integrand :func:`~kjit.exact.gaussian.log_weight`), with
        :data:`REFERENCE_NODES` nodes on each of w's two highest modes (:meth:`_modes`; one mode: on it twice)
        combined by the balance heuristic (:func:`~kjit.factors.base.multi_centre_gauss_hermite`).  m, x: the
        w-mixture of their Gaussian posteriors given τ (:func:`~kjit.exact.gaussian.node_moments`), as the exact
        rule; τ: a Gamma by the factor's ``projection`` (:func:`~kjit.factors.base.gamma_from_log_nodes`).  A τ
        message of shape beyond :data:`~kjit.exact.gaussian.KNOWN_PRECISION_SHAPE` gets the exact rule's closed
        form.  Rows with no finite answer take Laplace's at the highest mode (a log-normal τ; m, x given τ there).

        Measured against the exact rule (adaptive panels), 3 000 fresh default messages (seed 777), KL median /
        p99 / max: m 2.3e-20 / 2.3e-10 / 2.2e-6, τ 1.2e-17 / 3.4e-9 / 6.8e-5, x 1.7e-20 / 1.5e-10 / 1.0e-5;
        20 000 (seed 778): m 4.0e-20 / 1.1e-9 / 1.3e-4, τ 2.2e-17 / 2.4e-8 / 7.5e-4, x 3.2e-20 / 1.2e-9 / 4.0e-5
        (1.6e-3 / 6.1e-2 / 1.1e-2 before review found modes merged away: :data:`~kjit.factors.base.MAX_SCALE_GROWTH`)
        — the largest on broad skewed w (small shape, D ≫ S), seen by :meth:`reference_error`.  ~18 µs a
        message against the exact rule's 110–420.  Nodes a mode 16 / 24 / 32 / 48 on the 3 000: largest KL
        2.5e-3 / 3.8e-5 / 2.2e-6 / 1e-7 (m), 3.2e-3 / 3.7e-4 / 6.8e-5 / 1.1e-5 (τ); the modes' scales widened
        (×1.5, ×2) were worse at 16 nodes (τ 2.4e-2, 8.6e-2)."""
        to = self.check_to(to)
        return self._gauss_hermite(incoming, to, REFERENCE_NODES)

    def _modes(self, incoming):
        """``(flat parameters (m_m, v_m, a, b, m_x, v_x, S, D), log w, centres (B, 2), scales (B, 2), known)``:
        w's two highest local maxima in u = log τ (:func:`~kjit.factors.base.local_maxima` among the Gamma
        message's mode and the cubic's candidates, :func:`kjit.exact.gaussian.stationary_candidates`), each
        with the scale 1/√(−(log w)'') there, and the rows whose τ message is a known precision (their
        parameters set to a benign 1, 1 here, as the exact rule does)."""
        mm, vm, a, b, mx, vx = (p.ravel() for p in np.broadcast_arrays(*(np.asarray(p, dtype=float) for p in (
            incoming["m"].mean(), incoming["m"].var(), incoming["tau"].shape_param, incoming["tau"].rate,
            incoming["x"].mean(), incoming["x"].var()))))
        S, D = vm + vx, (mx - mm) ** 2
        known, a_r, b_r = _exact._known_precision(a, b)
        u0 = np.log(a_r / b_r)
        cols = [q[:, None] for q in (a_r, u0, np.log(S), D)]

        def log_w(t):
            return _exact.log_weight(t, cols[0], 0.0, cols[1], cols[2], cols[3], 0.0)

        with np.errstate(all="ignore"):
            cand, _, lo, hi = _exact.stationary_candidates(a_r, b_r, S, D, 1.0, reversed_too=True)
            cand = np.concatenate([np.clip(u0, lo, hi)[:, None], cand], axis=1)
            sc = _exact.curvature_scale(cand, b_r[:, None], S[:, None], D[:, None], 1.0)
            centres, scales, _ = local_maxima(log_w, cand, sc)
        return (mm, vm, a, b, mx, vx, S, D), log_w, centres, scales, known

    def _gauss_hermite(self, incoming, to, nodes, widen: float = 1.0, fallback: bool = True, modes=None):
        """:meth:`approximate_belief`'s rule with ``nodes`` nodes a centre, the centres' scales times ``widen``;
        rows where it has no finite answer take Laplace's at the highest mode (``fallback``) or NaN parameters.
        ``modes``: :meth:`_modes` of ``incoming`` when the caller has them."""
        shape = np.broadcast_shapes(*(m.shape for m in incoming.values()))
        (mm, vm, a, b, mx, vx, S, D), log_w, centres, scales, known = modes or self._modes(incoming)
        with np.errstate(all="ignore"):
            t, lw = multi_centre_gauss_hermite(log_w, centres, widen * scales, nodes)
            c1, s1 = centres[:, 0], scales[:, 0]
            if known.any():
                a_k, b_k, _ = _exact._narrow_tau(a, b, S, D, 1.0)
            if to == "tau":
                back = Gamma.from_log_normal(c1, capped_log_var(c1, s1 * s1), self.projection)
                q = gamma_from_log_nodes(t, lw, self.projection, back if fallback else nan_like(back))
                if known.any():
                    q = Gamma._unchecked(np.where(known, a_k, q.shape_param), np.where(known, b_k, q.rate))
                return q.reshape(shape)
            if known.any():  # one node at the tilted τ's mean
                t = np.where(known[:, None], np.log(a_k / b_k)[:, None], t)
                lw = np.where(known[:, None], np.where(np.arange(t.shape[1]) == 0, 0.0, -np.inf), lw)
                c1 = np.where(known, np.log(a_k / b_k), c1)
            par = [q[:, None] for q in (mm, vm, mx, vx, S)]
            mu, var = _exact.node_moments(t, to, *par, 1.0)
            m1, v1 = _exact.node_moments(c1[:, None], to, *par, 1.0)
            back = Gaussian._unchecked(m1[:, 0], v1[:, 0])
            q = gaussian_from_nodes(lw, mu, var, back if fallback else nan_like(back))
        return q.reshape(shape)

    def reference_error(self, incoming, to, revision=None, reference=None):
        """The squared change of :meth:`approximate_belief`, in coordinates relative to it (Gaussian: mean in its
        standard deviations, log variance; Gamma: log shape, log rate), under two other rules, the larger: a finer
        rule (:data:`FINER_NODES` nodes a mode) and one whose nodes are placed differently (the modes' scales
        widened by :data:`PLACED_WIDEN`, :data:`PLACED_NODES` a mode), neither falling back (+inf where either
        has no finite answer); for τ at least the rounding of the Gamma statistic that every rule on nodes shares
        (:func:`~kjit.factors.base.gamma_stat_rounding`: found on τ messages of shape 9e13, where both rules
        agreed to 4e-16 on a reference 1e-4 nats off; the closed form of known precisions has none).

        Measured against the exact rule's KL (fresh default messages; share of rows estimated at most 1e-4 /
        1e-3 / 1e-2, the largest KL among them): 3 000 (seed 777) m 0.9997 / 1.0 / 1.0, 1.5e-6 / 2.2e-6 / 2.2e-6;
        τ 0.9967 / 0.9987 / 0.9997, 7.9e-6 / 4.8e-5 / 4.8e-5; x 0.9997 / 1.0 / 1.0, 1.0e-5 / 1.0e-5 / 1.0e-5;
        20 000 (seed 778, after review's fixes of :func:`~kjit.factors.base.local_maxima`) m 0.9996 / 0.9999 / 1.0,
        1.4e-5 / 1.3e-4 / 1.3e-4; τ 0.9960 / 0.9986 / 0.9997, 6.2e-6 / 5.3e-5 / 1.6e-4; x 0.9995 / 1.0 / 1.0, 7.2e-6 /
        2.0e-5 / 4.0e-5 — an estimate that holds
        to 1e-2 (:attr:`reference_check_holds`; at 1e-1 too, 2.5e-2 on τ, but the band (1e-2, 1e-1] held 0 / 10
        / 2 of the 20 000 rows).  On a harder distribution (means ±30, variances 1e-4–1e2, shapes 0.1–1 000,
        rates 1e-3–1e3; 3 000 rows) rows at most 1e-4 / 1e-2: KL ≤ 1e-5 / 1e-5 (m), 6e-6 / 1e-4 (τ), 2e-5 /
        9e-4 (x).  The finer rule alone held as well on both; the placed rule, less accurate itself, leaves fewer rows
        below 1e-12 (3 000 default: 88 / 61 / 88 % on m / τ / x against 95 / 78 / 95 %), as many at 1e-4."""
        to = self.check_to(to)
        if revision is not None and int(revision) != self.approximation_revision:
            return None
        modes = self._modes(incoming)
        if reference is None:
            reference = reference_coords(self._gauss_hermite(incoming, to, REFERENCE_NODES, modes=modes),
                                         self.families[to])
        fine = self._gauss_hermite(incoming, to, FINER_NODES, fallback=False, modes=modes)
        placed = self._gauss_hermite(incoming, to, PLACED_NODES, PLACED_WIDEN, fallback=False, modes=modes)
        err = np.maximum(reference_change(self, incoming, to, fine, reference),
                         reference_change(self, incoming, to, placed, reference))
        if to == "tau":  # (the statistic's rounding, shared by every rule on nodes; not the closed form's)
            err = np.maximum(err, np.where(modes[-1][:, None], 0.0, gamma_stat_rounding(fine)))
        return err

    #: the largest estimated squared error at which :meth:`reference_error` has been measured to hold (see there)
    reference_check_holds = 1e-2

    def symmetry(self, incoming):
        # x, m -> (· − c)/s and τ -> s²τ leave N(x; m, 1/τ) unchanged up to the factor s:
        # the frame puts m's message at 0 and τ's mean at 1 (units of the data's sd)
        c = incoming["m"].mean()
        s = np.sqrt(1.0 / incoming["tau"].mean())
        return {"m": (1.0 / s, -c / s), "x": (1.0 / s, -c / s), "tau": (s**2, 0.0)}


def gaussian_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    m = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    tau = Gamma(10.0 ** rng.uniform(0.0, 1.5, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    x = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    return {"m": m, "tau": tau, "x": x}


register_factor(GaussianFactor)
