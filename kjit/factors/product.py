"""The product factor z = x·y (x, y, z Gaussian): Infer.NET's GaussianProductOp, exactly.

The exact rule for every recipient is :mod:`kjit.exact.product` (a 1-D integral once y and z are
integrated out given x); beliefs are Gaussian by moments.  Power EP is not available: the factor
is the deterministic constraint δ(z − x·y), whose power is not a density.

Default training distribution (:func:`product_incoming`): x and y messages N(μ, v) with
μ ~ U(−5, 5), log10 v ~ U(−1, 1); z message N(μ, v) with μ ~ U(−10, 10), log10 v ~ U(−1, 2).
"""

from __future__ import annotations

import numpy as np

from ..exact import product as _exact
from ..families import Family, Gaussian
from .base import Factor, exact_rules, register_factor

__all__ = ["Product", "product_incoming"]


class Product(Factor):
    """z = x·y, deterministic; x, y, z Gaussian."""

    name = "product"
    inputs = ("x", "y")
    output = "z"
    families = {"x": Gaussian, "y": Gaussian, "z": Gaussian}
    no_power_reason = "the factor is the deterministic constraint δ(z − x·y), whose power is not a density"

    _belief, _log_partition = exact_rules(_exact, ("x", "y", "z"), power=_exact.SUPPORTS_POWER)

    @staticmethod
    def default_incoming(n, rng):
        return product_incoming(n, rng)

    def sample(self, inputs, size, rng):
        return _exact.sample(inputs, size, rng)


def product_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    x = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    y = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    z = Gaussian(rng.uniform(-10.0, 10.0, n), 10.0 ** rng.uniform(-1.0, 2.0, n))
    return {"x": x, "y": y, "z": z}


register_factor(Product)
