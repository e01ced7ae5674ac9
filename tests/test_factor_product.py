"""The built-in `product` factor (issue 13 §2): z = x·y through its factor module."""

from __future__ import annotations

import numpy as np
import pytest

from exact_factor_checks import (
    check_against_module, check_against_sampling, check_default_distribution, check_signature,
)
from kjit.exact import product as exact
from kjit.factors import get_factor
from kjit.families import Gaussian
from kjit.oracles import QuadratureOracle


def test_signature():
    check_signature("product", ("x", "y"), "z", {"x": Gaussian, "y": Gaussian, "z": Gaussian}, {})


def test_oracle_uses_the_exact_rule():
    rng = np.random.default_rng(1)
    inc = {v: Gaussian(rng.uniform(-3, 3, 6), 10 ** rng.uniform(-1, 1, 6)) for v in ("x", "y", "z")}
    inc["x"] = Gaussian(np.r_[0.0, inc["x"].mean()[1:]], inc["x"].var())  # an input centred at 0
    check_against_module("product", exact, inc)


@pytest.mark.parametrize("case", [
    {"x": (1.0, 0.5), "y": (2.0, 0.2), "z": (0.0, 10.0)},
    {"x": (0.0, 1.0), "y": (1.5, 0.3), "z": (2.0, 0.5)},
])
def test_agrees_with_importance_sampling(case):
    check_against_sampling("product", {v: Gaussian(*p) for v, p in case.items()})


def test_sampler_and_default_distribution():
    f = get_factor("product")
    x, y = np.array([1.0, -2.0, 0.5]), np.array([3.0, 0.5, -4.0])
    np.testing.assert_array_equal(f.sample({"x": x, "y": y}, 3, np.random.default_rng(0)), x * y)
    check_default_distribution("product")


def test_power_ep_refused_with_the_reason():
    inc = {v: Gaussian(1.0, 1.0) for v in ("x", "y", "z")}
    with pytest.raises(ValueError, match="deterministic constraint"):
        QuadratureOracle(get_factor("product")).belief(inc, "z", power=0.5)
