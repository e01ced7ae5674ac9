"""Tests for kjit.factors (SPEC §2): built-in sampleable factors, validation, registry.

Tolerances: Monte-Carlo checks use 5 standard errors (binomial or sample-mean SE);
distributional checks use a KS test whose reference CDF is obtained by integrating
exp(log_density) numerically (never the sampler's own construction), with p > 1e-3 at
fixed seeds; float64 identities use a few eps times the size of the terms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, special, stats

from kjit import factors as F
from kjit.factors import (
    CompoundGamma,
    Factor,
    Logistic,
    ProbitNoise,
    SampledFactor,
    get_factor,
    register_factor,
    registered_factors,
)
from kjit.families import Bernoulli, Beta, Gamma, Gaussian
from kjit.oracles import sample_output

EPS = np.finfo(float).eps


@pytest.fixture
def clean_registry():
    """Restore the factor registry after a test that registers factors.

    There is no public ``unregister``; snapshotting the module's dict is the only way to
    keep tests independent of each other's registrations.
    """
    saved, errors = dict(F._REGISTRY), dict(F.base._PLUGIN_ERRORS)
    before = registered_factors()
    yield
    F._REGISTRY.clear()
    F._REGISTRY.update(saved)
    F.base._PLUGIN_ERRORS.clear()
    F.base._PLUGIN_ERRORS.update(errors)  # (a broken factory a test registered is remembered there)
    assert registered_factors() == before


# =========================================================================== Logistic
def test_logistic_structure():
    f = Logistic()
    assert f.inputs == ("x",) and f.output == "z" and f.variables == ("x", "z")
    assert f.families == {"x": Gaussian, "z": Beta}


def test_logistic_sampler_is_sigmoid():
    f = Logistic()
    rng = np.random.default_rng(0)
    x = rng.normal(0, 5, 1000)
    z = f.sample({"x": x}, 1000, rng)
    assert z.shape == (1000,)
    # 1/(1+e^{-x}) directly, accurate to a few ulp for |x| ≤ 30
    np.testing.assert_allclose(z, 1.0 / (1.0 + np.exp(-x)), rtol=4 * EPS * 10)
    # deterministic: the rng plays no part
    np.testing.assert_array_equal(z, f.sample({"x": x}, 1000, np.random.default_rng(99)))
    ext = f.sample({"x": np.array([-1000.0, -40.0, 0.0, 40.0, 1000.0])}, 5, rng)
    assert np.all(np.isfinite(ext)) and np.all((ext >= 0) & (ext <= 1))
    assert ext[2] == 0.5


def _log_sigmoid_ref(x):
    """log σ(x) by the branch formula: x − log1p(e^x) for x < 0, −log1p(e^{−x}) otherwise."""
    x = np.asarray(x, float)
    out = np.empty_like(x)
    neg = x < 0
    out[neg] = x[neg] - np.log1p(np.exp(x[neg]))
    out[~neg] = -np.log1p(np.exp(-x[~neg]))
    return out


def test_logistic_stable_suff_stats():
    f = Logistic()
    x = np.concatenate([np.linspace(-1000, 1000, 2001), [-1e-300, 0.0, 1e-300, 36.7, -36.7]])
    u = f.suff_stats("z", {"x": x, "z": special.expit(x)})
    assert u.shape == (x.size, 2)
    assert np.all(np.isfinite(u)) and np.all(u <= 0)
    # (log σ(x), log σ(−x)), each relative ≲ 4 eps
    np.testing.assert_allclose(u[:, 0], _log_sigmoid_ref(x), rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(u[:, 1], _log_sigmoid_ref(-x), rtol=1e-14, atol=1e-300)
    # asymptotics: log σ(x) → x for x → −∞ (and log σ(−x) → −e^{x}, tiny but not −inf)
    assert u[0, 0] == pytest.approx(-1000.0, rel=1e-15)
    # where z is not rounded to 0/1 (|x| ≤ 20) it equals Beta's u(z) = (log z, log(1−z))
    mid = np.abs(x) <= 20
    z = special.expit(x[mid])
    # log(1−z) from a rounded z: relative error ~eps/(1−z) ≤ eps·e^{20} ≈ 1e-7 at x=20
    np.testing.assert_allclose(u[mid], Beta.suff_stats(z), rtol=2e-7)
    # the x statistics are Gaussian's (x, x²)
    np.testing.assert_array_equal(f.suff_stats("x", {"x": x, "z": special.expit(x)}), Gaussian.suff_stats(x))


# =========================================================================== CompoundGamma
CG_PARAMS = [(1.0, 1.0, 1.0), (2.0, 3.0, 0.5), (0.7, 2.0, 4.0)]


def _cg_density_u(f):
    """Density of u = τ/(r1+τ) ∈ (0,1), from exp(log_density) and dτ/du = r1/(1−u)²."""

    def g(u):
        if u <= 0.0 or u >= 1.0:
            return 0.0
        tau = f.r1 * u / (1.0 - u)
        return math.exp(float(f.log_density(tau))) * f.r1 / (1.0 - u) ** 2

    return g


def _cg_cdf_at_sorted(f, tau_sorted):
    """F(τ_(i)) = ∫_0^{τ_(i)} exp(log_density) by quad on [0, τ_(1)] (integrable endpoint
    singularity when s2 < 1) plus 8-point Gauss–Legendre on each gap between consecutive
    order statistics in u-space (smooth there; gaps ~1/n so the rule is exact to round-off)."""
    g = _cg_density_u(f)
    u = tau_sorted / (f.r1 + tau_sorted)
    first = integrate.quad(g, 0.0, u[0], epsabs=1e-12, limit=200)[0]
    nodes, weights = np.polynomial.legendre.leggauss(8)
    a, b = u[:-1], u[1:]
    half, mid = (b - a) / 2, (a + b) / 2
    pts = mid[:, None] + half[:, None] * nodes[None, :]
    tau = f.r1 * pts / (1 - pts)
    dens = np.exp(f.log_density(tau)) * f.r1 / (1 - pts) ** 2
    gaps = (dens * weights).sum(1) * half
    return np.concatenate([[first], first + np.cumsum(gaps)])


def _ks_pvalue(cdf_vals):
    n = cdf_vals.size
    i = np.arange(1, n + 1)
    d = max(np.max(i / n - cdf_vals), np.max(cdf_vals - (i - 1) / n))
    return stats.kstwo.sf(d, n)


@pytest.mark.parametrize("params", CG_PARAMS)
def test_compound_gamma_log_density_integrates_to_one(params):
    f = CompoundGamma(*params)
    total = integrate.quad(_cg_density_u(f), 0, 1, epsabs=1e-12, epsrel=1e-12, limit=200)[0]
    # the u-density ∝ u^{s2−1}(1−u)^{s1−1} is integrable; quad reaches ~1e-11
    assert total == pytest.approx(1.0, abs=1e-9)


def test_compound_gamma_default_density_closed_form():
    # (1,1,1): p(τ) = 1/(1+τ)²
    f = CompoundGamma()
    assert (f.s1, f.r1, f.s2) == (1.0, 1.0, 1.0) and f.params() == {"s1": 1.0, "r1": 1.0, "s2": 1.0}
    t = np.array([0.01, 0.5, 1.0, 3.0, 100.0])
    np.testing.assert_allclose(f.log_density(t), -2 * np.log1p(t), rtol=1e-14)
    assert f.variables == ("tau",) and f.inputs == () and f.families == {"tau": Gamma}


@pytest.mark.parametrize("params", CG_PARAMS)
def test_compound_gamma_sampler_matches_log_density(params):
    f = CompoundGamma(*params)
    n = 20_000
    rng = np.random.default_rng(1)
    tau = f.sample({}, n, rng)
    assert tau.shape == (n,) and np.all(tau > 0)
    cdf = _cg_cdf_at_sorted(f, np.sort(tau))
    assert np.all(np.diff(cdf) >= 0) and cdf[-1] < 1
    assert _ks_pvalue(cdf) > 1e-3
    np.testing.assert_array_equal(tau, f.sample({}, n, np.random.default_rng(1)))


def test_compound_gamma_ks_has_power():
    # the same KS machinery rejects draws from a different compound gamma (r1 1 vs 1.5:
    # p ≈ 1e-172), so the acceptance above is informative
    tau = CompoundGamma(1.0, 1.0, 1.0).sample({}, 20_000, np.random.default_rng(2))
    wrong = CompoundGamma(1.0, 1.5, 1.0)
    assert _ks_pvalue(_cg_cdf_at_sorted(wrong, np.sort(tau))) < 1e-6


@pytest.mark.parametrize("name", ["s1", "r1", "s2"])
@pytest.mark.parametrize("value", [0.0, -1.0, np.nan, np.inf])
def test_compound_gamma_parameter_validation(name, value):
    kw = {"s1": 1.0, "r1": 1.0, "s2": 1.0, name: value}
    with pytest.raises(ValueError, match=f"`{name}`"):
        CompoundGamma(**kw)


# =========================================================================== ProbitNoise
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_probit_noise_flip_rate(eps):
    fac = ProbitNoise(eps)
    assert fac.variables == ("f", "y") and fac.families == {"f": Gaussian, "y": Bernoulli}
    assert fac.params() == {"eps": eps}
    n = 200_000
    rng = np.random.default_rng(3)
    f = rng.normal(0, 2, n)
    y = fac.sample({"f": f}, n, rng)
    assert y.shape == (n,) and set(np.unique(y)) <= {-1.0, 1.0}
    flipped = y != np.sign(f)
    # binomial(n, ε): 5 standard deviations (0 flips exactly when ε = 0)
    for mask in (np.ones(n, bool), f > 0, f < 0):  # the rate does not depend on the side
        k, m = flipped[mask].sum(), mask.sum()
        assert abs(k - m * eps) <= 5 * math.sqrt(m * eps * (1 - eps))
    if eps == 0:
        assert not flipped.any()


@pytest.mark.parametrize("eps", [-0.1, 0.5, 0.7, np.nan, np.inf])
def test_probit_noise_eps_validation(eps):
    with pytest.raises(ValueError, match="`eps`"):
        ProbitNoise(eps)


@pytest.mark.parametrize("name, param", [("compound_gamma", "s1"), ("compound_gamma", "s2"),
                                         ("gamma_rate", "shape"), ("probit_noise", "eps")])
@pytest.mark.parametrize("value", ["0.2", True, None, [0.2]])
def test_numeric_parameter_of_another_kind_is_named(name, param, value):
    """A numeric parameter given as text (the service's factor_params take text too), a boolean, None
    or a list: a ValueError naming the parameter and saying a number is expected — it was numpy's
    TypeError "ufunc 'isfinite' not supported for the input types" (a list: "truth value of an
    array is ambiguous"), naming neither."""
    with pytest.raises(ValueError, match=f"`{param}` must be a number") as info:
        get_factor(name, **{param: value})
    assert info.value.param == param  # (the service puts it in the error's location)
    assert get_factor(name, **{param: np.float64(0.2)}).params()[param] == 0.2  # numpy numbers are numbers
    assert get_factor(name, **{param: np.array(0.2)}).params()[param] == 0.2  # and so are 0-d arrays


# =========================================================================== check_incoming
def _logistic_incoming(n=3):
    return {"x": Gaussian(np.zeros(n), np.ones(n)), "z": Beta(np.full(n, 2.0), 1.0)}


def test_check_incoming_valid_and_scalar_broadcast():
    f = Logistic()
    inc, shape = f.check_incoming(_logistic_incoming(), to="x")
    assert shape == (3,) and set(inc) == {"x", "z"}
    # a scalar message (the Beta(2,1) label message) broadcasts to the batch
    inc, shape = f.check_incoming({"x": Gaussian(np.arange(5.0), 1.0), "z": Beta(2.0, 1.0)}, to="z")
    assert shape == (5,)
    assert inc["z"].shape == (5,) and inc["z"] == Beta(np.full(5, 2.0), np.ones(5))
    assert inc["x"] == Gaussian(np.arange(5.0), 1.0)
    # all scalars: batch shape ()
    _, shape = f.check_incoming({"x": Gaussian(0.0, 1.0), "z": Beta(1.0, 2.0)})
    assert shape == ()


def test_check_incoming_unknown_variable():
    inc = {**_logistic_incoming(), "w": Gaussian(0.0, 1.0)}
    with pytest.raises(ValueError, match="'w'"):
        Logistic().check_incoming(inc)


def test_check_incoming_missing_variable():
    inc = _logistic_incoming()
    del inc["z"]
    with pytest.raises(ValueError, match="'z'"):
        Logistic().check_incoming(inc)


def test_check_incoming_wrong_family():
    inc = {**_logistic_incoming(), "x": Beta(np.ones(3), 1.0)}
    with pytest.raises(ValueError, match=r"incoming\['x'\].*Gaussian"):
        Logistic().check_incoming(inc)


def test_check_incoming_mismatched_batch_shapes():
    inc = {"x": Gaussian(np.zeros(3), 1.0), "z": Beta(np.ones(4), 1.0)}
    with pytest.raises(ValueError, match="mismatched") as e:
        Logistic().check_incoming(inc)
    assert "x(3,)" in str(e.value) and "z(4,)" in str(e.value)


def test_check_incoming_unknown_to():
    with pytest.raises(ValueError, match="'y'"):
        Logistic().check_incoming(_logistic_incoming(), to="y")
    with pytest.raises(ValueError, match="'x'"):
        CompoundGamma().check_to("x")
    assert CompoundGamma().check_to("tau") == "tau"


def test_check_incoming_improper_and_non_mapping():
    bad = Gaussian(0.0, 1.0) / Gaussian(0.0, 0.5)  # negative precision
    with pytest.raises(ValueError, match="'x'.*improper"):
        Logistic().check_incoming({"x": bad, "z": Beta(2.0, 1.0)})
    with pytest.raises(ValueError, match="incoming"):
        Logistic().check_incoming([Gaussian(0.0, 1.0), Beta(2.0, 1.0)])


# =========================================================================== registry
def test_builtins_registered_and_get_factor():
    assert {"logistic", "compound_gamma", "probit_noise"} <= set(registered_factors())
    assert isinstance(get_factor("logistic"), Logistic)
    cg = get_factor("compound_gamma", s1=2.0, r1=3.0, s2=0.5)
    assert isinstance(cg, CompoundGamma) and cg.params() == {"s1": 2.0, "r1": 3.0, "s2": 0.5}
    assert get_factor("probit_noise", eps=0.2).eps == 0.2


def test_get_factor_unknown_name():
    with pytest.raises(ValueError, match="no_such_factor"):
        get_factor("no_such_factor")


def _product_factor(name="test_product"):
    return SampledFactor(
        name,
        inputs={"x": Gaussian, "y": Gaussian},
        output=("z", Gaussian),
        sampler=lambda v, rng: v["x"] * v["y"],
    )


def test_user_product_factor_registers_and_samples(clean_registry):
    register_factor(_product_factor())
    f = get_factor("test_product")
    assert "test_product" in registered_factors()
    assert f.variables == ("x", "y", "z") and f.families["z"] is Gaussian
    rng = np.random.default_rng(4)
    n = 100_000
    # x ~ N(1, 1/4), y ~ N(−2, 1) independent: z = x·y has
    # E z = μx μy = −2, Var z = σx²σy² + μx²σy² + μy²σx² = 0.25 + 1 + 1 = 2.25
    x, y = 1 + 0.5 * rng.standard_normal(n), -2 + rng.standard_normal(n)
    z = f.sample({"x": x, "y": y}, n, rng)
    np.testing.assert_array_equal(z, x * y)
    assert abs(z.mean() + 2.0) <= 5 * math.sqrt(2.25 / n)
    # SE(sample var) = σ² √((κ+2)/n); the excess kurtosis κ of x·y is ≈ 1.3 here (checked
    # with 1e7 draws), so √(8/n) over-covers it
    assert abs(z.var() - 2.25) <= 5 * 2.25 * math.sqrt(8 / n)
    np.testing.assert_array_equal(f.suff_stats("z", {"z": z})[:, 1], z**2)
    # the generic validation works on user factors too
    inc, shape = f.check_incoming(
        {"x": Gaussian(np.zeros(4), 1.0), "y": Gaussian(1.0, 2.0), "z": Gaussian(np.ones(4), 3.0)}, to="z"
    )
    assert shape == (4,)
    with pytest.raises(ValueError, match="'y'"):
        f.check_incoming({"x": Gaussian(0.0, 1.0), "z": Gaussian(0.0, 1.0)})


def test_user_softplus_factor_registers_and_samples(clean_registry):
    soft = SampledFactor(
        "test_softplus",
        inputs={"x": Gaussian},
        output=("z", Gamma),
        sampler=lambda v, rng: np.logaddexp(0.0, v["x"]),  # log(1 + e^x), overflow-free
    )
    register_factor(soft)
    f = get_factor("test_softplus")
    assert f is soft and f.families == {"x": Gaussian, "z": Gamma}
    x = np.array([-800.0, -30.0, -1.0, 0.0, 1.0, 30.0, 800.0])
    z = f.sample({"x": x}, x.size, np.random.default_rng(0))
    assert np.all(np.isfinite(z)) and np.all(z >= 0)
    mid = np.abs(x) <= 30
    np.testing.assert_allclose(z[mid], np.log1p(np.exp(x[mid])), rtol=1e-14)
    assert z[-1] == 800.0 and z[3] == pytest.approx(math.log(2), rel=1e-15)
    # Monte Carlo mean of softplus(x), x ~ N(0.5, 4), vs quadrature of the same expectation
    rng = np.random.default_rng(5)
    n = 100_000
    xs = rng.normal(0.5, 2.0, n)
    zs = f.sample({"x": xs}, n, rng)
    pdf = stats.norm(0.5, 2.0).pdf
    ez = integrate.quad(lambda t: np.logaddexp(0.0, t) * pdf(t), -40, 40, points=[0.5])[0]
    assert abs(zs.mean() - ez) <= 5 * zs.std() / math.sqrt(n)
    # Gamma is its output family: its positive draws have Gamma sufficient statistics
    assert np.all(np.isfinite(f.suff_stats("z", {"z": zs})))


def test_duplicate_registration_refused(clean_registry):
    register_factor(_product_factor())
    with pytest.raises(ValueError, match="test_product"):
        register_factor(_product_factor())
    with pytest.raises(ValueError, match="logistic"):
        register_factor(Logistic())
    # replace=True swaps it in
    new = _product_factor()
    register_factor(new, replace=True)
    assert get_factor("test_product") is new
    # a factory under an explicit name; its constructor parameters pass through get_factor
    class NamedProbit(ProbitNoise):
        name = "test_probit_factory"

    register_factor(lambda eps=0.0: NamedProbit(eps), name="test_probit_factory")
    assert get_factor("test_probit_factory", eps=0.25).eps == 0.25
    # but not one whose factor calls itself otherwise: operators save a factor by its own name and
    # would rebuild another factor (here the built-in probit_noise)
    register_factor(lambda eps=0.0: ProbitNoise(eps), name="test_probit_alias")
    with pytest.raises(ValueError, match="must be named 'test_probit_alias'"):
        get_factor("test_probit_alias", eps=0.25)
    with pytest.raises(ValueError):
        register_factor(lambda: Logistic())  # no name
    with pytest.raises(ValueError):
        register_factor(42, name="test_not_a_factor")


def test_registry_fixture_isolates(clean_registry):
    # nothing registered by another test leaks in
    assert not any(n.startswith("test_") for n in registered_factors())


def test_sampled_factor_validation():
    ok = dict(inputs={"x": Gaussian}, output=("z", Gaussian), sampler=lambda v, rng: v["x"])
    with pytest.raises(ValueError, match="name"):
        SampledFactor("", **ok)
    with pytest.raises(ValueError, match="'x'"):
        SampledFactor("t", inputs={"x": float}, output=("z", Gaussian), sampler=ok["sampler"])
    with pytest.raises(ValueError, match="'z'"):
        SampledFactor("t", inputs={"x": Gaussian}, output=("z", "gaussian"), sampler=ok["sampler"])
    with pytest.raises(ValueError, match="'x'"):
        SampledFactor("t", inputs={"x": Gaussian}, output=("x", Gaussian), sampler=ok["sampler"])
    bad = SampledFactor("t", inputs={"x": Gaussian}, output=("z", Gaussian), sampler=lambda v, rng: v["x"][:2])
    with pytest.raises(ValueError, match="shape"):  # (where every factor's draws are checked)
        sample_output(bad, {"x": np.zeros(5)}, 5, np.random.default_rng(0))


class _Drawn(Factor):
    name = "drawn_test"
    inputs, output = ("x",), "z"
    families = {"x": Gaussian, "z": Gaussian}

    def __init__(self, draw=None):
        self.draw = draw

    def sample(self, inputs, size, rng):
        return self.draw(inputs["x"])


@pytest.mark.parametrize("draw,match", [(lambda x: np.stack([x, x], 1), r"returned shape \(5, 2\), expected \(5,\)"),
                                        (lambda x: x[:2], r"returned shape \(2,\), expected \(5,\)"),
                                        (lambda x: 1.0, r"returned shape \(\), expected \(5,\)"),
                                        (lambda x: x + 0j, "returned complex128 values, not real numbers"),
                                        (lambda x: np.array(["a"] * 5), "returned <U1 values, not real numbers")])
def test_a_factor_subclass_s_draws_are_checked_as_a_sampled_factor_s(draw, match):
    """Audit (forty-fourth session): only a SampledFactor's draws were checked — a Factor subclass (the documented
    entry-point form) drawing (n, 2) met numpy's "cannot reshape" (the service job's error), complex draws lost
    their imaginary part.  Now sample_output, where both samplers draw, names the factor and what is wrong."""
    with pytest.raises(ValueError, match=rf"sampler of factor 'drawn_test' {match}"):
        sample_output(_Drawn(draw), {"x": np.zeros(5)}, 5, np.random.default_rng(0))
    assert sample_output(_Drawn(lambda x: x + 1), {"x": np.zeros(5)}, 5, np.random.default_rng(0)).tolist() == [1.0] * 5


@pytest.mark.parametrize("attrs,match", [
    ({"families": {"x": Gaussian}}, "variable 'z' has no family"),
    ({"families": {"x": "gaussian", "z": Gaussian}}, "variable 'x' has 'gaussian', not a Family subclass"),
    ({"families": {"x": Gaussian, "z": float}}, "variable 'z' has <class 'float'>, not a Family subclass"),
    ({"inputs": ("x", "z")}, r"its variables must be distinct: inputs \('x', 'z'\), output 'z'"),
    ({"output": ""}, "`output` must be the output variable's name"),
    ({"inputs": "x"}, "`inputs` must be a sequence of variable names")])
def test_a_plugin_s_declaration_is_checked_where_it_is_built(attrs, match):
    """Audit (forty-fourth session): a plugin whose output had no family was a KeyError at its first training (a 500
    from the service), a family given as "gaussian" an AttributeError, an output among the inputs answered; each is
    a FactorBuildError naming the factor and the mistake where the registered factor is built."""
    from kjit.factors.base import _PLUGIN_ERRORS, _REGISTRY, FactorBuildError

    cls = type("Declared", (_Drawn,), {"name": "declared_test", **attrs})
    register_factor(cls, replace=True)
    try:
        with pytest.raises(FactorBuildError, match=rf"factor 'declared_test': {match}"):
            get_factor("declared_test")
    finally:  # (a build error is remembered with the plugins' errors, which other tests read)
        _REGISTRY.pop("declared_test", None)
        _PLUGIN_ERRORS.pop("factory declared_test", None)


def test_base_factor_is_abstract():
    with pytest.raises(NotImplementedError):
        Factor().sample({}, 1, np.random.default_rng(0))


def test_mismatch_is_the_one_same_factor_comparison_and_names_the_parameter():
    """Factor.mismatch: None for the same factor — parameters by value, as JSON or an npz give them back —
    else the differing parameter with both values (found by an audit: only names were compared)."""
    import json

    from kjit.errors import ConfigurationError

    a = CompoundGamma(s1=1.0 / 3.0, r1=0.1, s2=7)
    back = json.loads(json.dumps(a.params()))
    npz = {k: np.asarray(v)[()] for k, v in a.params().items()}  # (numpy scalars, as read from an npz)
    for other in (a, CompoundGamma(**back), ("compound_gamma", back), ("compound_gamma", npz)):
        assert a.mismatch(other) is None and a.check_same(other) is None
    assert a.same_as(CompoundGamma(**back)) and not a.same_as(CompoundGamma(s1=1.0 / 3.0, r1=0.1, s2=7.5))
    why = a.mismatch(CompoundGamma(s1=1.0 / 3.0, r1=0.1, s2=7.5), "the set", "the operator")
    assert why == "the set and the operator are for different factors: 'compound_gamma' with `s2` 7.5 for the set, 7.0 for the operator"
    with pytest.raises(ConfigurationError, match="`r1` 0.2 for the other, 0.1 for this one"):
        a.check_same(("compound_gamma", {**back, "r1": 0.2}))
    assert "`s2` 7.0 for this one, none recorded for the other" in a.mismatch(("compound_gamma", {"s1": 1 / 3, "r1": 0.1}))
    assert "'logistic' for the other" in a.mismatch(("logistic", {}))
    assert "different factors" in a.mismatch(Logistic())
    # NaNs and nested values compare by value too
    assert F.param_mismatch({"p": [1, (2, float("nan"))], "q": {"k": (1,)}},
                            {"p": (1.0, [2.0, float("nan")]), "q": {"k": [1.0]}}) is None
    assert F.param_mismatch({"q": {"k": 1}}, {"q": {"k": 2}}) == "`q` {'k': 1} for the other, {'k': 2} for this one"
    # a sampled factor is only itself; its recorded (name, params) still compares
    s = SampledFactor("t_mismatch", inputs={"x": Gaussian}, output=("z", Gaussian), sampler=lambda v, rng: v["x"])
    s2 = SampledFactor("t_mismatch", inputs={"x": Gaussian}, output=("z", Gaussian), sampler=lambda v, rng: v["x"])
    assert s.same_as(s) and not s.same_as(s2) and "same object" in s.mismatch(s2)
    assert s.mismatch(("t_mismatch", {})) is None
    # a copied operator still answers for its sampled factor: a copy of one is itself
    import copy

    assert copy.deepcopy(s) is s and copy.copy(s) is s


def test_a_factory_registered_sampled_factor_trains_saves_and_loads(clean_registry, tmp_path):
    """A factory registration gives a new SampledFactor per get_factor; the factor check of the JIT and
    of make_training_set compares name and parameters (a SampledFactor is the same only as itself, so
    comparing the objects refused a saved JIT's oracle against its own operator — found in review)."""
    from kjit.errors import ConfigurationError
    from kjit.oracles import ImportanceSamplingOracle
    from kjit.operators import JITOperator, KernelOperator
    from kjit.persistence import load_operator, save_operator
    from kjit.training import make_training_set

    def make_shift():
        return SampledFactor("shift_factory", inputs={"x": Gaussian}, output=("z", Gaussian),
                             sampler=lambda v, rng: v["x"] + 1.0)

    register_factor(make_shift, name="shift_factory")
    f = get_factor("shift_factory")
    assert get_factor("shift_factory") is not f

    def inc(n, rng):
        return {"x": Gaussian(rng.normal(size=n), np.exp(rng.normal(size=n))),
                "z": Gaussian(rng.normal(size=n), np.exp(rng.normal(size=n)) + 1)}

    oracle = ImportanceSamplingOracle(f, n_samples=2000, random_state=0)
    ts = make_training_set("shift_factory", "z", inc, oracle, n=40, random_state=0)
    op = KernelOperator(f, "z", n_inner=20, n_outer=40, random_state=0).fit(ts)
    save_operator(JITOperator(op, oracle, threshold=-6.0), tmp_path / "jit.npz")
    back = load_operator(tmp_path / "jit.npz")
    test = inc(5, np.random.default_rng(1))
    np.testing.assert_array_equal(back.operator.predict(test)[0].mean(), op.predict(test)[0].mean())
    # built by the same registration: the same factor (a graph takes operators loaded apart); another
    # sampled factor of that name is not (its sampler may differ: x − 5 here), nor one built after the
    # registration was replaced
    assert back.factor.same_as(f) and get_factor("shift_factory").same_as(back.operator.factor)
    other = SampledFactor("shift_factory", inputs={"x": Gaussian}, output=("z", Gaussian),
                          sampler=lambda v, rng: v["x"] - 5.0)
    with pytest.raises(ConfigurationError, match="another sampled factor"):
        make_training_set(f, "z", inc, ImportanceSamplingOracle(other, n_samples=2000), n=5)
    with pytest.raises(ConfigurationError, match="another sampled factor"):
        JITOperator(op, ImportanceSamplingOracle(other, n_samples=2000), threshold=-6.0)
    register_factor(make_shift, name="shift_factory")  # (the same factory again: a no-op)
    assert get_factor("shift_factory").same_as(f)
    register_factor(lambda: make_shift(), name="shift_factory", replace=True)
    assert not get_factor("shift_factory").same_as(f)
