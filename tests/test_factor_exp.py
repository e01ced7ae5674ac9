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


@pytest.mark.parametrize("scale", [1e10, 1e20, 1e50, 1e100])
def test_a_far_broad_x_message_keeps_its_slope(scale):
    """x ~ N(s, s) with y ~ Gamma(1, 1): near the tilted density's mode (x ≈ 0) x's message is
    e^{x·m/v − x²/(2v)} = e^x up to a constant and 1e-s, so the tilted density is e^{x − e^x}: x is the
    log of an Exp(1) variable, mean −γ (Euler's constant) and variance π²/6 — a closed form.  The rule
    expanded (x − m)² directly and lost the slope for s ≥ 1e20 (found by a hostile-input audit: mean 0,
    variance 0.37 — as if the message were flat, KL 1.4).  log Z = −m²/(2v) − ½ log(2πv) + log ∫ e^{x − e^x} dx,
    the last term 0.  Tolerances: the rule's panels resolve the integrand to ~1e-12 relative."""
    inc = {"x": Gaussian(np.array([scale]), np.array([scale])), "y": Gamma(np.array([1.0]), np.array([1.0]))}
    q = exact.belief("x", inc)
    np.testing.assert_allclose(q.mean(), -np.euler_gamma, rtol=1e-9)
    np.testing.assert_allclose(q.var(), np.pi**2 / 6, rtol=1e-9)
    np.testing.assert_allclose(exact.log_partition(inc), -0.5 * scale - 0.5 * np.log(2 * np.pi * scale), rtol=1e-12)
    y = exact.belief("y", inc)  # y = e^x ~ Exp(1) = Gamma(1, 1) exactly
    np.testing.assert_allclose([y.shape_param[0], y.rate[0]], [1.0, 1.0], rtol=1e-9)


def test_a_message_narrower_than_doubles_resolve_is_refused_by_row():
    """x ~ N(−1e100, 1e100): the tilted density sits at −1e100 with width 1e50, where doubles are ~1e84
    apart — no node grid exists; the rule used to answer variance 3.8e168.  Refused, naming the row."""
    from kjit.errors import OracleError
    inc = {"x": Gaussian(np.array([0.0, -1e100]), np.array([1.0, 1e100])), "y": Gamma(np.array([1.0, 1.0]),
                                                                                       np.array([1.0, 1.0]))}
    with pytest.raises(OracleError, match="resolution of doubles") as err:
        exact.belief("x", inc)
    assert err.value.rows.tolist() == [1]
    assert np.isfinite(exact.belief("x", {v: m[:1] for v, m in inc.items()}).var()).all()


def test_a_far_message_keeps_a_finite_log_partition_and_a_narrow_one_is_answered():
    """Found in review of the rule above: (m − c)² overflowed past |m − c| ~ 1.3e154 and log Z came out −inf for
    x ~ N(1e160, 1e160) (now −m²/(2v) − ½ log(2πv), as in the test above); and the refusal's cut at 1e-12 of the
    mode refused x ~ N(−30, 1e-23) (width 3e-12 at −30, resolved by doubles), which the rule answers: there
    y's message is flat (e^x ~ 1e-13), so the belief is x's message itself."""
    inc = {"x": Gaussian(np.array([1e160]), np.array([1e160])), "y": Gamma(np.array([1.0]), np.array([1.0]))}
    np.testing.assert_allclose(exact.log_partition(inc), -0.5e160 - 0.5 * np.log(2 * np.pi * 1e160), rtol=1e-12)
    narrow = {"x": Gaussian(np.array([-30.0]), np.array([1e-23])), "y": Gamma(np.array([1.0]), np.array([1.0]))}
    q = exact.belief("x", narrow)
    np.testing.assert_allclose(q.mean(), -30.0, rtol=1e-14)
    np.testing.assert_allclose(q.var(), 1e-23, rtol=1e-5)
