"""Review: ProbitNoise(eps=0).log_concave claimed log-concavity for every row.

Θ(y f) is log-concave only for a known label.  Against a soft label message Bernoulli(p),
0 < p < 1, the factor on f is p Θ(f) + (1 − p) Θ(−f), a two-level step: the tilted belief can be
several times wider than the cavity.  respect_factor_bounds (used on every JIT oracle answer
and learned prediction) then clipped the exact answer to the cavity's variance.
"""

import numpy as np
from scipy import integrate, stats

from kjit.factors import ProbitNoise
from kjit.families import Bernoulli, Gaussian
from kjit.operators import respect_factor_bounds
from kjit.oracles import QuadratureOracle


def _tilted_var(m, v, p):
    """Variance of N(f; m, v) (p Θ(f) + (1 − p) Θ(−f)) by adaptive quadrature (independent check)."""
    g = lambda f, k: f**k * stats.norm.pdf(f, m, np.sqrt(v)) * np.where(f > 0, p, 1 - p)  # noqa: E731
    mom = [sum(integrate.quad(g, a, b, args=(k,), epsabs=0, epsrel=1e-12)[0] for a, b in ((-np.inf, 0), (0, np.inf)))
           for k in range(3)]
    mean = mom[1] / mom[0]
    return mom[2] / mom[0] - mean**2


def test_soft_label_is_not_log_concave_and_not_clipped():
    f = ProbitNoise(0.0)
    m, v, p = np.array([-3.2, 1.0]), np.array([1.0, 1.0]), np.array([0.999, 1.0])
    inc = {"f": Gaussian(m, v), "y": Bernoulli(p)}
    np.testing.assert_array_equal(f.log_concave("f", inc), [False, True])
    exact = QuadratureOracle(f).belief(inc, "f")
    ref = _tilted_var(-3.2, 1.0, 0.999)
    assert ref > 3.0  # the belief is much wider than the cavity (variance 1)
    np.testing.assert_allclose(exact.var()[0], ref, rtol=1e-6)
    q, clipped = respect_factor_bounds(f, "f", inc, exact)
    assert not clipped[0]
    np.testing.assert_allclose(q.var()[0], ref, rtol=1e-6)
