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
"""

from __future__ import annotations

import numpy as np

from ..exact import gaussian as _exact
from ..families import Family, Gamma, Gaussian
from .base import Factor, check_projection, exact_rules, register_factor

__all__ = ["GaussianFactor", "gaussian_incoming"]


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
