"""Review: PoissonRegression.log_evidence_ subtracted Σ log k! a second time.

The count enters as the normalised message Gamma(y; k + 1, 1) = y^k e^{−y} / Γ(k + 1), which is
exactly Poisson(k | y); the engine's evidence is already that of the Poisson model, and the
model's correction −Σ log Γ(k + 1) made it wrong by log k! per datum.  With one datum EP is
exact (its one site's cavity is the prior), so the evidence must match quadrature.
"""

import numpy as np
import pytest
from scipy import integrate, stats

from kjit.ep.models import PoissonRegression


@pytest.mark.parametrize("k", [0, 3, 7])
def test_poisson_regression_evidence_one_datum(k):
    a = 0.8
    model = PoissonRegression(prior_var=1.0).fit(np.array([[a]]), np.array([k]))
    Z, _ = integrate.quad(lambda w: stats.norm.pdf(w) * stats.poisson.pmf(k, np.exp(a * w)), -12, 12,
                          epsabs=0, epsrel=1e-12, limit=200)
    assert model.log_evidence_ == pytest.approx(np.log(Z), abs=1e-6)
