"""Exact EP rules of kjit.exact (product, gaussian, gamma_rate, exp) against independent computations.

References (:mod:`kjit.exact.reference`): each belief is recomputed through a *different
reduction* of the same tilted integral (product: over the other input; gaussian: over d = x − m;
gamma_rate: r's belief through the integral over x and vice versa; exp: the same integral) by a
*different engine* (scipy's adaptive Gauss–Kronrod ``quad_vec``, epsrel 1e-13).

Agreement is asserted to ≤ 1e-8 relative in the beliefs' parameters (a Gaussian mean relative to
max(|mean|, sd)); the references agree with the rules to ~1e-12 on these cases.  Limit where the
reference (and double precision) does not allow 1e-8: a Gamma belief of shape ≳ 1e7 (Gamma.project
solves log a − ψ(a) = s with s ≈ 1/(2a), whose two terms cancel to ~1e-16·log a absolute), so the
nearly-point-mass cases here keep shapes ≈ 1e6.  Also: a direct Monte Carlo check of each log
partition with its standard error (through each module's own sampler), Infer.NET's
GammaFromShapeAndRate test, power EP, and bad input.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjit.exact import FACTORS, exp, gamma_rate, gaussian, product
from kjit.exact.reference import (
    exp_reference,
    gamma_rate_reference,
    gaussian_reference,
    product_reference,
    rel_error,
)
from kjit.families import Beta, Gamma, Gaussian
from kjit.oracles import OracleError

TOL = 1e-8


def rel_gaussian(q, mean, var):
    return rel_error(q, Gaussian(mean, var))


rel_gamma = rel_error



# ------------------------------------------------------------------------------ product
PRODUCT_CASES = [
    # (m_x, v_x, m_y, v_y, m_z, v_z)
    (1.0, 1.0, 2.0, 1.0, 1.0, 1.0),
    (0.0, 1.0, 1.0, 1.0, 3.0, 0.1),          # x centred at 0, z far: bimodal in x
    (0.0, 1e-8, 1.0, 1.0, 0.0, 1.0),         # x centred at 0 and nearly a point mass
    (0.0, 1.0, 0.0, 1.0, 0.0, 1e-6),         # both inputs at 0, z ≈ 0 observed: spike at 0
    (0.0, 1.0, 0.0, 1.0, 0.0, 1e-12),        # the same, sharper: 1/|x| over 6 decades
    (2.0, 1e-10, 3.0, 1e-10, 6.0, 1e-6),     # nearly point masses
    (0.0, 100.0, 1.0, 1.0, 0.0, 1.0),        # very broad x
    (0.0, 1e4, 1.0, 1.0, 50.0, 0.01),        # very broad x, z pinned
    (3.0, 1.0, -2.0, 0.5, -6.0, 1e-4),
    (-1.0, 0.3, 0.0, 1e-6, 2.0, 4.0),        # y centred at 0 and narrow
    # z pins x·y: the mode in x is 137 message-sds away and 1e-6 wide (its eigenvalue candidate is
    # a root to a few ulps, with no sign change of the derivative between neighbouring candidates)
    (-71.168077, 0.267166, -92.602331, 5.835669e-09, -65.138699, 2.854301e-09),
    (0.0, 8.510313e-05, -69.722766, 0.000393, 70.17345, 1.20962e-08),
    (0.0, 1643.368064, -93.920435, 4.207354e-06, 3.54203, 5.474675e-06),
    # z contradicts both narrow inputs: the tilted mode is a compromise 42 sds from y's message
    (2.223845, 3.805854e-06, 11.214668, 9.51317e-05, -1.024772, 1.54934e-06),
    (-2.602098, 1.745142e-07, 14.385335, 9.611835e-06, 10.786842, 9.527347e-07),  # mode beyond both peaks
    (0.0, 0.000216, 0.0, 5.65336e-08, -11.489999, 1.331671e-05),  # x y = −11.5 from two inputs at 0: ±21.8
]


@pytest.mark.parametrize("case", PRODUCT_CASES)
def test_product_against_other_reduction(case):
    mx, vx, my, vy, mz, vz = case
    inc = {"x": Gaussian(mx, vx), "y": Gaussian(my, vy), "z": Gaussian(mz, vz)}
    lz, ref = product_reference(*case)
    for to in "xyz":
        q = product.belief(to, inc)
        assert isinstance(q, Gaussian) and q.shape == ()
        assert rel_gaussian(q, *ref[to]) <= TOL, (to, q, ref[to])
    assert abs(float(product.log_partition(inc)) - lz) <= TOL * max(1.0, abs(lz))


def test_product_batch_matches_rows_and_shape():
    cases = np.array(PRODUCT_CASES[:12]).T
    inc = {"x": Gaussian(cases[0], cases[1]), "y": Gaussian(cases[2], cases[3]), "z": Gaussian(cases[4], cases[5])}
    inc2 = {k: v.reshape(3, 4) for k, v in inc.items()}
    for to in "xyz":
        q = product.belief(to, inc2)
        assert q.shape == (3, 4)
        for i, row in enumerate(PRODUCT_CASES[:12]):
            one = product.belief(to, {k: Gaussian(row[2 * j], row[2 * j + 1]) for j, k in enumerate("xyz")})
            # equal to rounding (the geometric panels depend on the batch's widest row)
            assert rel_gaussian(q.reshape(-1)[i], float(one.mean()), float(one.var())) <= 1e-12
    assert product.log_partition(inc2).shape == (3, 4)
    # a scalar message broadcasts against a batch
    q = product.belief("z", {"x": Gaussian(np.zeros(3), 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)})
    assert q.shape == (3,)


# ------------------------------------------------------------------------------ gaussian
GAUSSIAN_CASES = [
    # (m_m, v_m, a, b, m_x, v_x, power)
    (0.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0),
    (0.0, 1.0, 0.3, 0.5, 5.0, 0.1, 1.0),        # tau shape < 1
    (0.0, 1.0, 0.05, 0.01, 0.0, 1.0, 1.0),      # tau shape ≪ 1, very broad tau
    (3.0, 1e-6, 1e3, 1e3, -2.0, 1e-6, 1.0),     # nearly point-mass m and x
    (0.0, 1.0, 1e6, 1e6, 0.5, 1.0, 1.0),        # nearly point-mass tau
    (0.0, 100.0, 0.5, 1e-3, 0.0, 1.0, 1.0),     # broad m, broad tau
    (0.0, 1.0, 5.0, 1.0, 30.0, 1.0, 1.0),       # data far from the prior precision: bimodal in tau
    (1.0, 0.01, 0.1, 10.0, -1.0, 0.01, 1.0),
    (7.813793, 0.085445, 2325.259916, 9.441593, -9.28621, 1.108487e-07, 1.0),  # m, x 57 noise sds apart
    (12.008909, 3.84023e-05, 34976.885144, 233.599329, -11.319658, 0.144061, 1.0),
    (0.0, 1.178928e-08, 2.590133, 23.312267, 0.0, 2.033704e-08, 1.0),  # S tiny: the mode's bracket ~1e-9 wide
    (0.0, 1.0, 2.0, 2.0, 1.0, 1.0, 0.5),        # power EP
    (0.0, 1.0, 0.3, 0.5, 5.0, 0.1, 2.0),
]


@pytest.mark.parametrize("case", GAUSSIAN_CASES)
def test_gaussian_against_other_reduction(case):
    mm, vm, a, b, mx, vx, alpha = case
    inc = {"m": Gaussian(mm, vm), "tau": Gamma(a, b), "x": Gaussian(mx, vx)}
    lz, ref = gaussian_reference(*case)
    for to in ("m", "x"):
        q = gaussian.belief(to, inc, power=alpha)
        assert isinstance(q, Gaussian)
        assert rel_gaussian(q, *ref[to]) <= TOL, (to, q, ref[to])
    q = gaussian.belief("tau", inc, power=alpha)
    assert isinstance(q, Gamma)
    assert rel_gamma(q, ref["tau"]) <= TOL, (q, ref["tau"])
    got = float(gaussian.log_partition(inc, power=alpha))
    assert abs(got - lz) <= TOL * max(1.0, abs(lz))


@pytest.mark.parametrize("case", [GAUSSIAN_CASES[1], GAUSSIAN_CASES[4], GAUSSIAN_CASES[6]])
def test_gaussian_tau_moment_matching(case):
    mm, vm, a, b, mx, vx, alpha = case
    inc = {"m": Gaussian(mm, vm), "tau": Gamma(a, b), "x": Gaussian(mx, vx)}
    _, ref = gaussian_reference(*case, projection="moments")
    q = gaussian.belief("tau", inc, projection="moments", power=alpha)
    assert rel_gamma(q, ref["tau"]) <= TOL, (q, ref["tau"])


# ------------------------------------------------------------------------------ gamma_rate
GAMMA_RATE_CASES = [
    # (a_r, b_r, a_x, b_x, shape, power)
    (3.0, 4.0, 5.0, 6.0, 2.5, 1.0),
    (0.5, 1.0, 2.0, 3.0, 0.3, 1.0),        # shape < 1
    (1.0, 1.0, 0.8, 0.1, 0.4, 1.0),        # shape < 1 and x shape < 1 (c = 0.2)
    (100.0, 10.0, 1.0, 1.0, 1.0, 1.0),
    (1e6, 1e6, 2.0, 1.0, 1.0, 1.0),        # nearly point-mass r
    (2.0, 1.0, 1e6, 1e5, 0.5, 1.0),        # nearly point-mass x
    (0.05, 0.01, 0.5, 0.01, 3.0, 1.0),     # very broad r and x
    (3.0, 4.0, 5.0, 6.0, 2.5, 0.5),        # power EP
    (0.5, 1.0, 2.0, 3.0, 0.8, 3.0),
]


@pytest.mark.parametrize("case", GAMMA_RATE_CASES)
@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_gamma_rate_against_other_reduction(case, projection):
    ar, br, ax, bx, s, alpha = case
    inc = {"r": Gamma(ar, br), "x": Gamma(ax, bx)}
    lz, ref = gamma_rate_reference(*case, projection=projection)
    for to in ("r", "x"):
        q = gamma_rate.belief(to, inc, projection=projection, power=alpha, shape=s)
        assert isinstance(q, Gamma)
        assert rel_gamma(q, ref[to]) <= TOL, (to, q, ref[to])
    got = float(gamma_rate.log_partition(inc, power=alpha, shape=s))
    assert abs(got - lz) <= TOL * max(1.0, abs(lz))


def test_gamma_rate_infer_net_case():
    """Infer.NET's GammaFromShapeAndRate test: shape 2.5, rate ~ Gamma(3, rate 4), x constrained to
    Gamma(5, rate 6).  Moment matching (Infer.NET's convention) gives x Gamma(6.298, scale 0.1455)
    and rate Gamma(5.325, scale 0.2112) (its tolerance 1e-3); the KL projection differs."""
    inc = {"r": Gamma(3.0, 4.0), "x": Gamma(5.0, 6.0)}
    qx = gamma_rate.belief("x", inc, projection="moments", shape=2.5)
    qr = gamma_rate.belief("r", inc, projection="moments", shape=2.5)
    np.testing.assert_allclose([qx.shape_param, 1 / qx.rate], [6.298, 0.1455], rtol=1e-3)
    np.testing.assert_allclose([qr.shape_param, 1 / qr.rate], [5.325, 0.2112], rtol=1e-3)
    kx = gamma_rate.belief("x", inc, shape=2.5)
    kr = gamma_rate.belief("r", inc, shape=2.5)
    np.testing.assert_allclose([kx.shape_param, kr.shape_param], [6.328, 5.356], atol=1e-3)
    # the two projections share the mean and differ in shape
    np.testing.assert_allclose(kx.mean(), qx.mean(), rtol=1e-12)
    assert abs(float(kx.shape_param) - float(qx.shape_param)) > 0.02


def test_gamma_rate_improper_tilted_is_an_oracle_error_naming_rows():
    # c = shape − 1 + a_x = 0.3 − 1 + 0.5 < 0: x^(c−1) is not integrable at 0
    inc = {"r": Gamma(np.ones(3), 1.0), "x": Gamma(np.array([2.0, 0.5, 2.0]), 1.0)}
    with pytest.raises(OracleError, match=r"rows \[1\]") as err:
        gamma_rate.belief("r", inc, shape=0.3)
    assert err.value.rows.tolist() == [1]
    with pytest.raises(OracleError, match="improper"):
        gamma_rate.log_partition(inc, shape=0.3)


# ------------------------------------------------------------------------------ exp
EXP_CASES = [
    # (m, v, a, b)
    (0.0, 1.0, 1.0, 1.0),
    (1.0, 100.0, 2.0, 0.1),          # x-variance 100
    (-2.0, 100.0, 3.0, 1e-3),        # x-variance 100, broad y
    (2.0, 100.0, 1.0, 1e-8),         # x-variance 100, very broad y
    (0.5, 30.0, 0.05, 0.01),         # y shape ≪ 1
    (3.0, 1e-6, 2.0, 1.0),           # nearly point-mass x (belief on y: shape ≈ 1e6)
    (0.0, 1.0, 1e6, 1e6),            # nearly point-mass y
    (-5.0, 4.0, 0.5, 50.0),
]


@pytest.mark.parametrize("case", EXP_CASES)
@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_exp_against_quad_vec(case, projection):
    m, v, a, b = case
    inc = {"x": Gaussian(m, v), "y": Gamma(a, b)}
    lz, ref = exp_reference(*case, projection=projection)
    qx = exp.belief("x", inc, projection=projection)
    assert rel_gaussian(qx, *ref["x"]) <= TOL, (qx, ref["x"])
    qy = exp.belief("y", inc, projection=projection)
    assert rel_gamma(qy, ref["y"]) <= TOL, (qy, ref["y"])
    assert abs(float(exp.log_partition(inc)) - lz) <= TOL * max(1.0, abs(lz))


def test_exp_gamma_belief_beyond_double_range_is_an_oracle_error_naming_rows():
    # x ~ N(−15, 5540) with y shape 0.04: the tilted x sits near −5300, so E[y] ≈ e^{−5300}
    inc = {"x": Gaussian(np.array([0.0, -15.23571]), np.array([1.0, 5540.510672])),
           "y": Gamma(np.array([2.0, 0.043635]), np.array([1.0, 41.393732]))}
    qx = exp.belief("x", inc)
    assert qx.mean()[1] < -5000 and np.all(qx.var() > 0)
    for projection in ("kl", "moments"):
        with pytest.raises(OracleError, match=r"rows \[1\]"):
            exp.belief("y", inc, projection=projection)


# ------------------------------------------------------------------------------ Monte Carlo, samplers
MC_CASES = [
    ("product", {"x": Gaussian(0.5, 1.0), "y": Gaussian(1.0, 0.5), "z": Gaussian(0.5, 1.0)}, {}),
    ("gaussian", {"m": Gaussian(0.0, 1.0), "tau": Gamma(0.7, 0.5), "x": Gaussian(1.0, 0.5)}, {}),
    ("gamma_rate", {"r": Gamma(3.0, 2.0), "x": Gamma(2.0, 1.5)}, {"shape": 0.7}),
    ("exp", {"x": Gaussian(0.0, 2.0), "y": Gamma(2.0, 1.0)}, {}),
]


@pytest.mark.parametrize("name,inc,params", MC_CASES, ids=[c[0] for c in MC_CASES])
def test_log_partition_and_output_mean_by_direct_monte_carlo(name, inc, params):
    """Z = E[m_out(out)] over inputs drawn from their messages and the output from the module's
    sampler; the output's tilted mean E[out m_out(out)] / Z likewise.  Within 5 standard errors."""
    mod = FACTORS[name]
    rng = np.random.default_rng(7)
    n = 400_000
    ins = {v: inc[v].sample(n, rng)[:, ] for v in mod.INPUTS}
    out = mod.sample(ins, n, rng, **params)
    w = np.exp(inc[mod.OUTPUT].log_pdf(out))
    z_mc, z_se = w.mean(), w.std() / np.sqrt(n)
    z = float(np.exp(mod.log_partition(inc, **params)))
    assert abs(z - z_mc) <= 5 * z_se
    mean_mc = np.sum(w * out) / np.sum(w)
    resid = (out - mean_mc) * w / w.mean()
    se = resid.std() / np.sqrt(n)
    q = mod.belief(mod.OUTPUT, inc, **params)
    assert abs(float(q.mean()) - mean_mc) <= 5 * se


def test_samplers_shapes_and_validation():
    rng = np.random.default_rng(0)
    assert product.sample({"x": np.ones(4), "y": np.arange(4.0)}, 4, rng).tolist() == [0, 1, 2, 3]
    assert exp.sample({"x": np.zeros(3)}, 3, rng).tolist() == [1, 1, 1]
    x = gaussian.sample({"m": 2.0, "tau": 1e12}, 5, rng)
    assert x.shape == (5,) and np.allclose(x, 2.0, atol=1e-4)
    g = gamma_rate.sample({"r": np.full(200_000, 2.0)}, 200_000, rng, shape=3.0)
    assert abs(g.mean() - 1.5) < 5 * np.sqrt(3.0 / 4.0 / 200_000)
    with pytest.raises(ValueError, match="'y'"):
        product.sample({"x": np.ones(2)}, 2, rng)
    with pytest.raises(ValueError, match="tau"):
        gaussian.sample({"m": np.zeros(2), "tau": np.array([1.0, -1.0])}, 2, rng)
    with pytest.raises(ValueError, match="'r'"):
        gamma_rate.sample({"r": np.array([np.nan])}, 1, rng)
    with pytest.raises(ValueError, match="shape"):
        gamma_rate.sample({"r": np.ones(1)}, 1, rng, shape=0.0)


# ------------------------------------------------------------------------------ power EP
@pytest.mark.parametrize("mod,inc", [
    (product, {"x": Gaussian(0.0, 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)}),
    (exp, {"x": Gaussian(0.0, 1.0), "y": Gamma(1.0, 1.0)}),
])
def test_power_refused_for_deterministic_factors(mod, inc):
    assert not mod.SUPPORTS_POWER
    with pytest.raises(NotImplementedError, match="not a density"):
        mod.belief(mod.OUTPUT, inc, power=0.5)
    with pytest.raises(NotImplementedError, match="deterministic"):
        mod.log_partition(inc, power=2.0)
    assert mod.belief(mod.OUTPUT, inc, power=1.0).allclose(mod.belief(mod.OUTPUT, inc), rtol=0)


def test_power_tends_to_cavity_as_power_goes_to_zero():
    inc = {"m": Gaussian(0.3, 1.0), "tau": Gamma(2.0, 3.0), "x": Gaussian(1.0, 2.0)}
    for v in ("m", "tau", "x"):
        q = gaussian.belief(v, inc, power=1e-7)
        assert q.allclose(inc[v], rtol=1e-5)
    inc = {"r": Gamma(2.0, 3.0), "x": Gamma(4.0, 2.0)}
    for v in ("r", "x"):
        assert gamma_rate.belief(v, inc, power=1e-7, shape=2.0).allclose(inc[v], rtol=1e-5)


# ------------------------------------------------------------------------------ bad input
ALL = [
    (product, {"x": Gaussian(0.0, 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)}),
    (gaussian, {"m": Gaussian(0.0, 1.0), "tau": Gamma(2.0, 1.0), "x": Gaussian(0.0, 1.0)}),
    (gamma_rate, {"r": Gamma(2.0, 1.0), "x": Gamma(2.0, 1.0)}),
    (exp, {"x": Gaussian(0.0, 1.0), "y": Gamma(2.0, 1.0)}),
]


def _bad_messages(fam):
    if fam is Gaussian:
        return [
            (Gaussian._unchecked(np.array([0.0, np.nan]), 1.0), "non-finite"),
            (Gaussian.from_natural(np.array([[1.0, 0.5]])), "improper"),   # negative precision
            (Gaussian._unchecked(0.0, -1.0), "improper"),
            (Gamma(1.0, 1.0), "must be a Gaussian"),
        ]
    return [
        (Gamma._unchecked(np.array([1.0, np.nan]), 1.0), "non-finite"),
        (Gamma._unchecked(0.0, 1.0), "improper"),
        (Gamma._unchecked(-1.0, 1.0), "improper"),
        (Gamma._unchecked(1.0, -2.0), "improper"),
        (Beta(1.0, 1.0), "must be a Gamma"),
    ]


@pytest.mark.parametrize("mod,inc", ALL, ids=[m.NAME for m, _ in ALL])
def test_bad_input_is_a_value_error_naming_the_variable(mod, inc):
    for var, fam in mod.FAMILIES.items():
        for bad, what in _bad_messages(fam):
            broken = {**inc, var: bad}
            for call in (lambda: mod.belief(mod.OUTPUT, broken), lambda: mod.log_partition(broken)):
                with pytest.raises(ValueError, match=what) as err:
                    call()
                assert f"'{var}'" in str(err.value)
        missing = {k: v for k, v in inc.items() if k != var}
        with pytest.raises(ValueError, match=f"'{var}'"):
            mod.belief(mod.OUTPUT, missing)
    with pytest.raises(ValueError, match="'w'"):
        mod.belief(mod.OUTPUT, {**inc, "w": Gaussian(0.0, 1.0)})
    with pytest.raises(ValueError, match="`to`='nope'"):
        mod.belief("nope", inc)
    with pytest.raises(ValueError, match="projection"):
        mod.belief(mod.OUTPUT, inc, projection="ep")
    with pytest.raises(ValueError, match="power"):
        mod.belief(mod.OUTPUT, inc, power=-1.0)
    with pytest.raises(ValueError, match="power"):
        mod.belief(mod.OUTPUT, inc, power=np.nan)
    with pytest.raises(ValueError, match="mapping"):
        mod.belief(mod.OUTPUT, [1, 2])
    first = next(iter(mod.FAMILIES))
    shaped = {**inc, first: inc[first].broadcast_to((3,))}
    other = [v for v in mod.FAMILIES if v != first][0]
    shaped[other] = inc[other].broadcast_to((2,))
    with pytest.raises(ValueError, match="do not broadcast"):
        mod.belief(mod.OUTPUT, shaped)


@pytest.mark.parametrize("mod,inc", ALL, ids=[m.NAME for m, _ in ALL])
def test_empty_batch(mod, inc):
    first = next(iter(mod.FAMILIES))
    empty = {**inc, first: inc[first].broadcast_to((0, 2))}
    for to, fam in mod.FAMILIES.items():
        q = mod.belief(to, empty)
        assert isinstance(q, fam) and q.shape == (0, 2)
    assert mod.log_partition(empty).shape == (0, 2)


def test_gamma_rate_shape_parameter_is_validated():
    inc = ALL[2][1]
    for bad in (0.0, -1.0, np.nan, np.inf, "a"):
        with pytest.raises(ValueError, match="`shape`"):
            gamma_rate.belief("x", inc, shape=bad)


def test_module_metadata():
    assert set(FACTORS) == {"product", "gaussian", "gamma_rate", "exp"}
    assert product.INPUTS == ("x", "y") and product.OUTPUT == "z"
    assert gaussian.INPUTS == ("m", "tau") and gaussian.OUTPUT == "x"
    assert gamma_rate.INPUTS == ("r",) and gamma_rate.OUTPUT == "x" and gamma_rate.PARAMS == {"shape": 1.0}
    assert exp.INPUTS == ("x",) and exp.OUTPUT == "y"
    assert gaussian.FAMILIES == {"m": Gaussian, "tau": Gamma, "x": Gaussian}
    assert exp.FAMILIES == {"x": Gaussian, "y": Gamma}
