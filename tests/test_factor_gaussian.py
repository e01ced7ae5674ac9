"""The built-in `gaussian` factor (issue 13 §2): x ~ N(m, 1/tau) through its factor module."""

from __future__ import annotations

import numpy as np
import pytest

from exact_factor_checks import (
    check_against_module, check_against_sampling, check_default_distribution, check_signature,
)
from kjit.exact import gaussian as exact
from kjit.factors import get_factor
from kjit.families import Gamma, Gaussian
from kjit.oracles import QuadratureOracle


def test_signature():
    f = check_signature("gaussian", ("m", "tau"), "x", {"m": Gaussian, "tau": Gamma, "x": Gaussian},
                        {"projection": "kl"})
    assert f.supports_power("tau") and f.supports_power("x")


@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_oracle_uses_the_exact_rule(projection):
    rng = np.random.default_rng(2)
    inc = {"m": Gaussian(rng.uniform(-3, 3, 5), 10 ** rng.uniform(-1, 1, 5)),
           "tau": Gamma(np.r_[0.5, 10 ** rng.uniform(0, 1.5, 4)], 10 ** rng.uniform(-1, 1, 5)),  # a shape < 1
           "x": Gaussian(rng.uniform(-3, 3, 5), 10 ** rng.uniform(-1, 1, 5))}
    check_against_module("gaussian", exact, inc, projection=projection)


@pytest.mark.parametrize("case", [
    {"m": Gaussian(0.5, 1.0), "tau": Gamma(3.0, 2.0), "x": Gaussian(1.0, 0.5)},
    {"m": Gaussian(-1.0, 0.3), "tau": Gamma(0.8, 1.0), "x": Gaussian(2.0, 2.0)},
])
def test_agrees_with_importance_sampling(case):
    check_against_sampling("gaussian", case)


def test_sampler_and_default_distribution():
    f = get_factor("gaussian")
    m, tau = np.full(200_000, 2.0), np.full(200_000, 4.0)
    x = f.sample({"m": m, "tau": tau}, 200_000, np.random.default_rng(0))
    # mean 2, sd 1/2: 5 standard errors
    assert abs(x.mean() - 2.0) < 5 * 0.5 / np.sqrt(x.size) and abs(x.std() - 0.5) < 5 * 0.5 / np.sqrt(2 * x.size)
    check_default_distribution("gaussian")


def test_power_ep_is_the_powered_rule():
    inc = {"m": Gaussian(0.5, 1.0), "tau": Gamma(3.0, 2.0), "x": Gaussian(1.0, 0.5)}
    oracle = QuadratureOracle(get_factor("gaussian"))
    for to in ("m", "tau", "x"):
        q = oracle.belief(inc, to, power=0.5)
        ref = exact.belief(to, inc, power=0.5)
        assert q.allclose(ref, rtol=0)
