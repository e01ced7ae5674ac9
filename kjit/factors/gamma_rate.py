"""The Gamma factor with a random rate: x ~ Gamma(shape, rate=r) (r, x Gamma; ``shape`` fixed, default 1).

Infer.NET's GammaFromShapeAndRateOp.  The exact rule for both recipients is
:mod:`kjit.exact.gamma_rate` (either variable integrates out in closed form: a 1-D, log-concave
integral); beliefs are Gamma by the KL projection (E[v], E[log v]) or, with
``projection="moments"``, by mean and variance (Infer.NET's convention for this factor).
Power EP is supported (the powered factor keeps the conjugate structure).

Default training distribution (:func:`gamma_rate_incoming`): r and x messages Gamma(a, b) with
log10 a ~ U(0, 1.5), log10 b ~ U(−1, 1) (a ≥ 1 keeps the tilted distribution proper for every
shape > 0).
"""

from __future__ import annotations

import numpy as np

from ..exact import gamma_rate as _exact
from ..families import Family, Gamma
from .base import Factor, check_projection, exact_rules, register_factor

__all__ = ["GammaRate", "gamma_rate_incoming"]


class GammaRate(Factor):
    """x ~ Gamma(shape, rate=r); r, x Gamma.  ``projection`` of the Gamma beliefs."""

    name = "gamma_rate"
    inputs = ("r",)
    output = "x"
    families = {"r": Gamma, "x": Gamma}

    _belief, _log_partition = exact_rules(_exact, ("r", "x"), power=_exact.SUPPORTS_POWER)

    def __init__(self, shape: float = 1.0, projection: str = "kl"):
        if not (np.isfinite(shape) and shape > 0):
            raise ValueError(f"GammaRate: `shape` must be finite and > 0, got {shape!r}")
        self.shape = float(shape)
        self.projection = check_projection(projection)

    def params(self):
        return {"shape": self.shape, "projection": self.projection}

    @staticmethod
    def default_incoming(n, rng):
        return gamma_rate_incoming(n, rng)

    def sample(self, inputs, size, rng):
        return _exact.sample(inputs, size, rng, shape=self.shape)

    def symmetry(self, incoming):
        # x -> k·x, r -> r/k leave Gamma(x; shape, r) unchanged up to 1/k: the frame gives x's
        # message mean 1
        k = 1.0 / incoming["x"].mean()
        return {"x": (k, 0.0), "r": (1.0 / k, 0.0)}


def gamma_rate_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    r = Gamma(10.0 ** rng.uniform(0.0, 1.5, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    x = Gamma(10.0 ** rng.uniform(0.0, 1.5, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    return {"r": r, "x": x}


register_factor(GammaRate)
