"""The factor-module API (kjit.factors.base): rules tagged per recipient and looked up by the
quadrature oracle; a vectorised exact module plugged in with exact_rules(); power EP only where
a rule says so; a factor without rules is refused by QuadratureOracle."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kjit.factors import Factor, exact_rules, get_factor, registered_factors
from kjit.families import Gaussian
from kjit.oracles import QuadratureOracle


def _shift_module(calls):
    """A stand-in for a kjit.exact module: y = x + c with Gaussian messages, closed form."""

    def belief(to, incoming, projection="kl", c=0.0):
        calls.append((to, projection, c, incoming["x"].shape))
        x, y = incoming["x"], incoming["y"]
        if to == "x":
            om, ov, own = y.mean() - c, y.var(), x
        else:
            om, ov, own = x.mean() + c, x.var(), y
        prec = 1.0 / own.var() + 1.0 / ov
        return Gaussian((own.mean() / own.var() + om / ov) / prec, 1.0 / prec)

    def log_partition(incoming, c=0.0):
        x, y = incoming["x"], incoming["y"]
        s = x.var() + y.var()
        return -0.5 * (np.log(2 * np.pi * s) + (y.mean() - x.mean() - c) ** 2 / s)

    return types.SimpleNamespace(belief=belief, log_partition=log_partition)


def _factor_class(module):
    class Shift(Factor):
        name = "test_rules_shift"
        inputs = ("x",)
        output = "y"
        families = {"x": Gaussian, "y": Gaussian}
        _belief, _log_partition = exact_rules(module, ("x", "y"))

        def __init__(self, c=0.0):
            self.c = float(c)

        def params(self):
            return {"c": self.c}

        def sample(self, inputs, size, rng):
            return inputs["x"] + self.c

    return Shift


def test_exact_module_plugs_in_and_the_oracle_finds_its_rules():
    calls = []
    f = _factor_class(_shift_module(calls))(c=0.5)
    assert f.exact_recipients == ("x", "y") and not f.supports_power("x")
    oracle = QuadratureOracle(f)
    inc = {"x": Gaussian(np.array([[0.0, 1.0]]), np.array([[1.0, 2.0]])),
           "y": Gaussian(np.array([[2.0, -1.0]]), np.array([[0.5, 0.5]]))}
    q = oracle.belief(inc, "y")
    assert q.shape == (1, 2)
    assert calls[-1] == ("y", "kl", 0.5, (2,))  # the rule saw flat batches and the factor's params
    # independent check: precision-weighted combination of N(m_x + c, v_x) and N(m_y, v_y)
    mx, vx, my, vy = np.array([0.0, 1.0]), np.array([1.0, 2.0]), np.array([2.0, -1.0]), np.array([0.5, 0.5])
    v = 1 / (1 / vx + 1 / vy)
    np.testing.assert_allclose(q.mean()[0], v * ((mx + 0.5) / vx + my / vy), rtol=1e-14)
    np.testing.assert_allclose(q.var()[0], v, rtol=1e-14)
    msg = oracle.message(inc, "y")  # belief / incoming: the x message moved by c
    np.testing.assert_allclose(msg.mean()[0], mx + 0.5, rtol=1e-12)
    np.testing.assert_allclose(msg.var()[0], vx, rtol=1e-12)
    lz = oracle.log_partition(inc)
    assert lz.shape == (1, 2)
    np.testing.assert_allclose(lz[0], -0.5 * (np.log(2 * np.pi * (vx + vy)) + (my - mx - 0.5) ** 2 / (vx + vy)))
    with pytest.raises(ValueError, match="power EP is not supported for factor 'test_rules_shift' to 'x'"):
        oracle.belief(inc, "x", power=0.5)
    with pytest.raises(ValueError, match="power EP is not supported .* log partition"):
        oracle.log_partition(inc, power=0.5)


def test_no_rules_no_quadrature_oracle():
    class Plain(Factor):
        name = "test_rules_plain"
        inputs = ("x",)
        output = "y"
        families = {"x": Gaussian, "y": Gaussian}

    with pytest.raises(ValueError, match="QuadratureOracle has no rule for factor 'test_rules_plain'"):
        QuadratureOracle(Plain())


def test_builtin_factor_modules_carry_their_defaults():
    """What the service used to keep in tables now comes from each factor's module."""
    for name in ("logistic", "compound_gamma", "probit_noise"):
        assert name in registered_factors()
        f = get_factor(name)
        inc = f.default_incoming(7, np.random.default_rng(0))
        checked, shape = f.check_incoming(inc)
        assert shape == (7,)
        assert set(f.served) <= set(f.exact_recipients)
    assert get_factor("logistic").default_threshold == -8.95
    assert get_factor("compound_gamma").default_threshold == -6.0
    assert get_factor("logistic").served == ("x", "z") and get_factor("compound_gamma").served == ("tau",)
    assert get_factor("probit_noise").served == ()
