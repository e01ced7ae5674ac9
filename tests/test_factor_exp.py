"""The built-in `exp` factor (issue 13 §2): y = e^x through its factor module."""

from __future__ import annotations

import numpy as np
import pytest

from exact_factor_checks import (
    check_against_module, check_against_sampling, check_default_distribution, check_signature,
)
from kjit.exact import exp as exact
from kjit.factors import get_factor
from kjit.families import Gamma, Gaussian
from kjit.oracles import QuadratureOracle


def test_signature():
    check_signature("exp", ("x",), "y", {"x": Gaussian, "y": Gamma}, {"projection": "kl"})


@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_oracle_uses_the_exact_rule(projection):
    inc = {"x": Gaussian(np.array([0.0, 1.0, -2.0, 0.5]), np.array([1.0, 0.1, 4.0, 100.0])),  # x-variance up to 100
           "y": Gamma(np.array([2.0, 1.0, 5.0, 1.5]), np.array([1.0, 0.5, 3.0, 1.0]))}
    check_against_module("exp", exact, inc, projection=projection)


@pytest.mark.parametrize("case", [
    {"x": Gaussian(0.0, 1.0), "y": Gamma(2.0, 1.0)},
    {"x": Gaussian(1.0, 0.2), "y": Gamma(5.0, 2.0)},
])
def test_agrees_with_importance_sampling(case):
    check_against_sampling("exp", case)


def test_sampler_and_default_distribution():
    f = get_factor("exp")
    x = np.array([-1.0, 0.0, 2.0])
    np.testing.assert_array_equal(f.sample({"x": x}, 3, np.random.default_rng(0)), np.exp(x))
    check_default_distribution("exp")


def test_power_ep_refused_with_the_reason():
    with pytest.raises(ValueError, match="deterministic constraint"):
        QuadratureOracle(get_factor("exp")).belief({"x": Gaussian(0.0, 1.0), "y": Gamma(2.0, 1.0)}, "x", power=0.5)
