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

    def approximate_belief(self, incoming, to):
        """Gaussian stand-ins of the factor, the reference of a learned operator's relative targets.

        z: under the x and y messages z = x·y has mean m_x m_y and variance
        v_x v_y + m_x² v_y + m_y² v_x exactly; the Gaussian with those moments times z's message.
        x (y alike, exchanged): given x, z ~ N(x m_y, x² v_y + v_z) after integrating y out; with
        x² at its mean under x's message in the variance, S = v_z + v_y (m_x² + v_x), this is a
        Gaussian likelihood of x with precision m_y²/S and mean m_z/m_y, times x's message.
        Both are exact in the limits the factor becomes linear (v_x → 0 for z and y; v_y → 0 for
        z and x).  Measured on the factor suite's rank-one messages (5 000 pairs, D 125/250),
        mean log KL of the learned operator relative to them vs to the incoming message: x −7.63
        vs −6.48, y −7.81 vs −6.91, z −6.78 vs −3.91 (the approximations alone: −7.25, −7.16,
        −5.39).  Unvalidated: rows that overflow give non-finite parameters, which the operator
        refuses by name.
        """
        x, y, z = (incoming[v] for v in ("x", "y", "z"))
        to = self.check_to(to)
        with np.errstate(all="ignore"):
            if to == "z":
                mx, vx, my, vy = x.mean(), x.var(), y.mean(), y.var()
                V = vx * vy + mx * mx * vy + my * my * vx
                prec = 1.0 / V + 1.0 / z.var()
                mean = (mx * my / V + z.mean() / z.var()) / prec
            else:
                a, b = (x, y) if to == "x" else (y, x)
                S = z.var() + b.var() * (a.mean() ** 2 + a.var())
                prec = 1.0 / a.var() + b.mean() ** 2 / S
                mean = (a.mean() / a.var() + b.mean() * z.mean() / S) / prec
            return Gaussian._unchecked(mean, 1.0 / prec)

    def sample(self, inputs, size, rng):
        return _exact.sample(inputs, size, rng)


def product_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    x = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    y = Gaussian(rng.uniform(-5.0, 5.0, n), 10.0 ** rng.uniform(-1.0, 1.0, n))
    z = Gaussian(rng.uniform(-10.0, 10.0, n), 10.0 ** rng.uniform(-1.0, 2.0, n))
    return {"x": x, "y": y, "z": z}


register_factor(Product)
