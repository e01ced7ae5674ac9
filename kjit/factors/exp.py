"""The exponential factor y = e^x (x Gaussian, y Gamma): Infer.NET's ExpOp, exactly.

The exact rule for both recipients is :mod:`kjit.exact.exp` (the delta integrates y out: a 1-D,
log-concave integral over x); the belief on x is Gaussian by moments, the belief on y a Gamma by
the KL projection (E[y], E[log y]) or, with ``projection="moments"``, by mean and variance.
Power EP is not available: the factor is the deterministic constraint δ(y − e^x).

Default training distribution (:func:`exp_incoming`): x message N(μ, v) with μ ~ U(−3, 3),
log10 v ~ U(−2, 0.5); y message Gamma(a, b) with log10 a ~ U(0, 1.5), log10 b ~ U(−1, 1).
"""

from __future__ import annotations

import numpy as np

from ..exact import exp as _exact
from ..families import Family, Gamma, Gaussian
from .base import Factor, check_projection, exact_rules, register_factor

__all__ = ["Exp", "exp_incoming"]


class Exp(Factor):
    """y = e^x, deterministic; x Gaussian, y Gamma.  ``projection`` of the Gamma belief on y."""

    name = "exp"
    inputs = ("x",)
    output = "y"
    families = {"x": Gaussian, "y": Gamma}
    no_power_reason = "the factor is the deterministic constraint δ(y − e^x), whose power is not a density"
    # served by default: x is the recipient of Poisson regression with a log link
    # (kjit.ep.PoissonRegression; the README's served-model example)
    served = ("x",)

    _belief, _log_partition = exact_rules(_exact, ("x", "y"), power=_exact.SUPPORTS_POWER)

    def __init__(self, projection: str = "kl"):
        self.projection = check_projection(projection)

    def params(self):
        return {"projection": self.projection}

    @staticmethod
    def default_incoming(n, rng):
        return exp_incoming(n, rng)

    def sample(self, inputs, size, rng):
        return _exact.sample(inputs, size, rng)

    def symmetry(self, incoming):
        # x -> x − c, y -> y·e^{−c} leave δ(y − e^x) unchanged up to e^{−c}: the frame puts x's
        # message mean at 0
        c = incoming["x"].mean()
        return {"x": (1.0, -c), "y": (np.exp(-c), 0.0)}


def exp_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    x = Gaussian(rng.uniform(-3.0, 3.0, n), 10.0 ** rng.uniform(-2.0, 0.5, n))
    y = Gamma(10.0 ** rng.uniform(0.0, 1.5, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    return {"x": x, "y": y}


register_factor(Exp)
