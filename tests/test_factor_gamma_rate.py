"""The built-in `gamma_rate` factor (issue 13 §2): x ~ Gamma(shape, rate=r) through its factor module."""

from __future__ import annotations

import numpy as np
import pytest

from exact_factor_checks import (
    check_against_module, check_against_sampling, check_default_distribution, check_signature,
)
from kjit.exact import gamma_rate as exact
from kjit.factors import get_factor
from kjit.families import Gamma
from kjit.oracles import QuadratureOracle


def test_signature():
    f = check_signature("gamma_rate", ("r",), "x", {"r": Gamma, "x": Gamma}, {"shape": 1.0, "projection": "kl"})
    assert f.supports_power("r")
    with pytest.raises(ValueError, match="shape"):
        get_factor("gamma_rate", shape=0.0)
    with pytest.raises(ValueError, match="projection"):
        get_factor("gamma_rate", projection="mean")


@pytest.mark.parametrize("shape", [1.0, 0.4, 2.5])
def test_oracle_uses_the_exact_rule(shape):
    rng = np.random.default_rng(3)
    inc = {"r": Gamma(10 ** rng.uniform(0, 1, 5), 10 ** rng.uniform(-1, 1, 5)),
           "x": Gamma(10 ** rng.uniform(0, 1, 5), 10 ** rng.uniform(-1, 1, 5))}
    check_against_module("gamma_rate", exact, inc, shape=shape)
    check_against_module("gamma_rate", exact, inc, shape=shape, projection="moments")


def test_infer_net_case_under_both_projections():
    """Infer.NET's GammaFromShapeAndRate test: shape 2.5, rate ~ Gamma(3, rate 4), x constrained to
    Gamma(5, rate 6); posterior x Gamma(6.298, scale 0.1455), rate Gamma(5.325, scale 0.2112)
    under the moment-matching convention (its tolerance 1e-3)."""
    inc = {"r": Gamma(3.0, 4.0), "x": Gamma(5.0, 6.0)}
    mm = QuadratureOracle(get_factor("gamma_rate", shape=2.5, projection="moments"))
    qx, qr = mm.belief(inc, "x"), mm.belief(inc, "r")
    np.testing.assert_allclose([qx.shape_param, 1 / qx.rate], [6.298, 0.1455], rtol=1e-3)
    np.testing.assert_allclose([qr.shape_param, 1 / qr.rate], [5.325, 0.2112], rtol=1e-3)
    kl = QuadratureOracle(get_factor("gamma_rate", shape=2.5))
    np.testing.assert_allclose(float(kl.belief(inc, "x").shape_param), 6.328, atol=1e-3)
    np.testing.assert_allclose(float(kl.belief(inc, "r").shape_param), 5.356, atol=1e-3)


@pytest.mark.parametrize("shape", [1.0, 0.5])
def test_agrees_with_importance_sampling(shape):
    check_against_sampling("gamma_rate", {"r": Gamma(3.0, 4.0), "x": Gamma(5.0, 6.0)}, shape=shape,
                           projection="kl")


def test_sampler_and_default_distribution():
    f = get_factor("gamma_rate", shape=2.5)
    r = np.full(200_000, 4.0)
    x = f.sample({"r": r}, 200_000, np.random.default_rng(0))
    # Gamma(2.5, rate 4): mean 0.625, sd sqrt(2.5)/4; 5 standard errors
    assert abs(x.mean() - 0.625) < 5 * np.sqrt(2.5) / 4 / np.sqrt(x.size)
    check_default_distribution("gamma_rate")
    check_default_distribution("gamma_rate", shape=0.5)
