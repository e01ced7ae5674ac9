"""Tests for kjit.features: two-stage random features on tuples of messages (SPEC §4).

Random-feature tolerances.  For fixed messages r, s and one draw (omega_i, b_i),
X_i = 2 Re(e^{i b} A) Re(e^{i b} B) with A = prod_l chi_r, B = prod_l chi_s (|A|, |B| <= 1) has
E_b X_i = Re(A conj B), so E[phi(r).phi(s)] = E_omega Re(chi_r conj chi_s) = k(r, s) exactly, and
E_b X_i^2 = |A|^2 |B|^2 (1 + cos(2(arg A - arg B)) / 2) <= 3/2.  phi(r).phi(s) is the mean of D
independent X_i, so its standard deviation is <= sqrt(1.5 / D); the same holds for the outer
features (|chi| = 1 there).  Kernel checks therefore use max error <= 5 sqrt(1.5 / D) (a
5-sigma bound per entry; seeds are fixed, so the tests are deterministic).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from scipy import integrate, special
from scipy.spatial.distance import pdist

from kjit.factors import Logistic
from kjit.families import Bernoulli, Beta, Gamma, Gaussian
from kjit import features as F
from kjit.features import (
    NotFittedError,
    TwoStageFeatures,
    beta_characteristic_function,
    beta_chebyshev_moments,
    characteristic_function,
)


def _rf_tol(D: int) -> float:
    return 5.0 * np.sqrt(1.5 / D)


def _logistic_messages(n, seed=0):
    rng = np.random.default_rng(seed)
    g = Gaussian(rng.uniform(-5, 5, n), np.exp(rng.uniform(np.log(0.05), np.log(20), n)))
    b = Beta(np.exp(rng.uniform(np.log(0.5), np.log(200), n)), np.exp(rng.uniform(np.log(0.5), np.log(200), n)))
    return g, b


def _beta_cf_quad(a, b, w):
    """Reference E exp(i w x), x ~ Beta(a, b), by adaptive quadrature in t = logit(x).

    The density of t, sigma(t)^a sigma(-t)^b / B(a, b), is smooth (no endpoint singularities);
    it has mean psi(a) - psi(b), sd sqrt(psi'(a) + psi'(b)) and tails e^{a t}, e^{-b t}, so
    [mean - 10 sd - 34/a, mean + 10 sd + 34/b] holds all but ~e^-34 of the mass."""
    mu = special.digamma(a) - special.digamma(b)
    sd = np.sqrt(special.polygamma(1, a) + special.polygamma(1, b))
    lo, hi = mu - 10 * sd - 34 / a, mu + 10 * sd + 34 / b
    lb = special.betaln(a, b)

    def dens(t):
        return np.exp(-a * np.logaddexp(0, -t) - b * np.logaddexp(0, t) - lb)

    kw = dict(limit=2000, epsabs=1e-14, epsrel=1e-13, points=[mu - sd, mu, mu + sd])
    re = integrate.quad(lambda t: dens(t) * np.cos(w * special.expit(t)), lo, hi, **kw)[0]
    im = integrate.quad(lambda t: dens(t) * np.sin(w * special.expit(t)), lo, hi, **kw)[0]
    return re + 1j * im


# =========================================================================== characteristic functions


@pytest.mark.parametrize(
    "a, b", [(0.5, 0.5), (2.0, 1.0), (1.0, 2.0), (0.5, 1000.0), (1000.0, 1000.0), (50.0, 3.0), (3.0, 0.6), (0.05, 0.1)]
)
def test_beta_cf_matches_quadrature(a, b):
    w = np.array([0.0, 0.5, -3.0, 17.0, 40.0, 90.0])
    got = beta_characteristic_function([a], [b], w)[0]
    ref = np.array([_beta_cf_quad(a, b, wi) for wi in w])
    # the reference quadrature itself is good to ~1e-12; the Chebyshev rule to ~1e-14
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-11)


def test_beta_cf_closed_forms():
    w = np.linspace(-60, 60, 241)
    w = w[w != 0]
    # Beta(1, 1) = U(0, 1): (e^{iw} - 1) / (i w)
    np.testing.assert_allclose(
        beta_characteristic_function([1.0], [1.0], w)[0], (np.exp(1j * w) - 1) / (1j * w), rtol=0, atol=1e-13
    )
    # Beta(1, 2), density 2(1 - x): 2 (e^{iw} - 1 - i w) / (i w)^2
    np.testing.assert_allclose(
        beta_characteristic_function([1.0], [2.0], w)[0],
        2 * (np.exp(1j * w) - 1 - 1j * w) / (1j * w) ** 2,
        rtol=0,
        atol=1e-13,
    )
    # mean and variance from the derivatives at 0: chi'(0) = i E x, chi''(0) = -E x^2
    m = Beta(np.array([0.7, 30.0]), np.array([4.0, 2.0]))
    h = 1e-4
    chi = beta_characteristic_function(m.alpha, m.beta, [-h, 0.0, h])
    np.testing.assert_allclose(((chi[:, 2] - chi[:, 0]) / (2j * h)).real, m.mean(), rtol=1e-7)
    ex2 = -((chi[:, 2] - 2 * chi[:, 1] + chi[:, 0]) / h**2).real
    np.testing.assert_allclose(ex2, m.var() + m.mean() ** 2, rtol=1e-5)


def test_beta_moments_small_batch_path_is_identical(monkeypatch):
    a = np.array([0.5, 2.0, 1000.0, 3.0])
    b = np.array([0.7, 1.0, 999.0, 1e5])
    small = beta_chebyshev_moments(a, b, 64)
    from kjit import charfun

    monkeypatch.setattr(charfun, "_SMALL_BATCH", 0)
    assert np.array_equal(small, beta_chebyshev_moments(a, b, 64))
    assert np.all(np.abs(small) <= 1 + 1e-12)  # |T_j| <= 1


def test_characteristic_function_closed_forms():
    w = np.array([-2.0, 0.3, 5.0])
    p = np.array([0.0, 0.25, 1.0])
    np.testing.assert_allclose(
        characteristic_function(Bernoulli(p), w),
        p[:, None] * np.exp(1j * w) + (1 - p[:, None]) * np.exp(-1j * w),
        atol=1e-15,
    )
    a, r = np.array([0.5, 3.0, 200.0]), np.array([1.0, 0.2, 50.0])
    np.testing.assert_allclose(characteristic_function(Gamma(a, r), w), (1 - 1j * w / r[:, None]) ** (-a[:, None]), rtol=1e-12)
    with pytest.raises(ValueError, match="improper"):
        characteristic_function(Gaussian._unchecked([0.0], [-1.0]), w)


# =========================================================================== inner features


def test_inner_product_matches_gaussian_mean_embedding_kernel():
    rng = np.random.default_rng(11)
    n, D = 12, 20000
    s2 = np.array([2.0, 0.5])
    msgs = (
        Gaussian(rng.normal(0, 1.5, n), rng.uniform(0.05, 2.0, n)),
        Gaussian(rng.normal(0, 0.7, n), rng.uniform(0.01, 0.5, n)),
    )
    f = TwoStageFeatures((Gaussian, Gaussian), n_inner=D, n_outer=8, inner_widths=s2, random_state=3).fit(msgs)
    phi = f.inner(msgs)
    K_hat = phi @ phi.T
    K = np.ones((n, n))
    for l, m in enumerate(msgs):
        tot = s2[l] + m.var()[:, None] + m.var()[None, :]
        K *= np.sqrt(s2[l] / tot) * np.exp(-((m.mean()[:, None] - m.mean()[None, :]) ** 2) / (2 * tot))
    err = np.abs(K_hat - K)
    assert err.max() < _rf_tol(D), err.max()
    assert err.mean() < np.sqrt(1.5 / D)  # typical error is well inside one sd bound


def test_exact_treatment_is_product_of_characteristic_functions():
    rng = np.random.default_rng(5)
    n, D = 40, 64
    msgs = (
        Gaussian(rng.normal(0, 2, n), rng.uniform(0.1, 3, n)),
        Beta(rng.uniform(0.5, 50, n), rng.uniform(0.5, 50, n)),
        Gamma(rng.uniform(0.5, 20, n), rng.uniform(0.5, 5, n)),
        Bernoulli(rng.uniform(0, 1, n)),
    )
    f = TwoStageFeatures((Gaussian, Beta, Gamma, Bernoulli), n_inner=D, n_outer=16, treatment="exact", random_state=3)
    phi = f.fit(msgs).inner(msgs)
    Z = np.exp(1j * f.b_)[None, :]
    for l, m in enumerate(msgs):
        Z = Z * characteristic_function(m, f.omega_[l])
    np.testing.assert_allclose(phi, np.sqrt(2 / D) * Z.real, rtol=0, atol=1e-12)


def test_exact_and_gaussian_treatments_agree_on_gaussian_messages():
    g1, _ = _logistic_messages(200, seed=1)
    g2, _ = _logistic_messages(200, seed=2)
    kw = dict(n_inner=300, n_outer=50, random_state=7)
    fg = TwoStageFeatures((Gaussian, Gaussian), treatment="gaussian", **kw).fit((g1, g2))
    fe = TwoStageFeatures((Gaussian, Gaussian), treatment="exact", **kw).fit((g1, g2))
    np.testing.assert_allclose(fe.inner((g1, g2)), fg.inner((g1, g2)), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fe.transform((g1, g2)), fg.transform((g1, g2)), rtol=0, atol=1e-12)
    # mixed factor: the Gaussian component of the exact treatment is the closed form
    g, b = _logistic_messages(100, seed=3)
    fe = TwoStageFeatures((Gaussian, Beta), treatment="exact", inner_widths=(4.0, 0.05), **kw).fit((g, b))
    ref = np.sqrt(2 / 300) * (
        np.exp(1j * fe.b_) * characteristic_function(g, fe.omega_[0]) * beta_characteristic_function(b.alpha, b.beta, fe.omega_[1])
    ).real
    np.testing.assert_allclose(fe.inner((g, b)), ref, rtol=0, atol=1e-12)


def test_gaussian_treatment_is_moment_matching():
    g, b = _logistic_messages(100, seed=4)
    kw = dict(n_inner=200, n_outer=20, inner_widths=(4.0, 0.05), outer_width=1.0, random_state=9)
    f_beta = TwoStageFeatures((Gaussian, Beta), treatment="gaussian", **kw).fit((g, b))
    matched = Gaussian(b.mean(), b.var())
    f_gauss = TwoStageFeatures((Gaussian, Gaussian), treatment="exact", **kw).fit((g, matched))
    np.testing.assert_allclose(f_beta.inner((g, b)), f_gauss.inner((g, matched)), rtol=0, atol=1e-14)


def test_exact_features_match_monte_carlo():
    """Gamma and Beta characteristic-function features against 1e6-sample averages of
    sqrt(2/D) cos(omega^T x + b); tolerance 5 Monte-Carlo standard errors per feature."""
    D, N = 6, 10**6
    msgs = (
        Gamma(np.array([0.5, 3.0, 40.0]), np.array([1.0, 0.5, 20.0])),
        Beta(np.array([0.5, 2.0, 300.0]), np.array([0.5, 1.0, 700.0])),
    )
    f = TwoStageFeatures((Gamma, Beta), n_inner=D, n_outer=4, inner_widths=(1.0, 0.01), outer_width=1.0,
                         treatment="exact", random_state=21).fit(msgs)
    phi = f.inner(msgs)
    rng = np.random.default_rng(0)
    for k in range(3):
        x = np.stack([m[k].sample(N, random_state=rng) for m in msgs], axis=1)
        # cos in float32 (8x faster here): rounding ~1e-6, far below the MC error ~1e-3
        vals = np.cos((np.einsum("nc,cd->nd", x, f.omega_) + f.b_).astype(np.float32))
        mc = np.sqrt(2 / D) * vals.mean(axis=0, dtype=np.float64)
        se = np.sqrt(2 / D) * vals.std(axis=0, dtype=np.float64) / np.sqrt(N)
        assert np.all(np.abs(phi[k] - mc) <= 5 * se + 1e-12), (k, (phi[k] - mc) / se)
    # and the exact features really differ from the moment-matched ones for the wide Betas
    fg = TwoStageFeatures((Gamma, Beta), n_inner=D, n_outer=4, inner_widths=(1.0, 0.01), outer_width=1.0,
                          treatment="gaussian", random_state=21).fit(msgs)
    assert np.abs(fg.inner(msgs)[:2] - phi[:2]).max() > 0.05


# =========================================================================== outer features


def test_outer_features_approximate_gaussian_kernel_on_embeddings():
    g, b = _logistic_messages(12, seed=8)
    D_out, gamma2 = 20000, 0.3
    f = TwoStageFeatures((Gaussian, Beta), n_inner=50, n_outer=D_out, outer_width=gamma2, random_state=2).fit((g, b))
    phi = f.inner((g, b))
    psi = f.outer(phi)
    assert np.array_equal(psi, f.transform((g, b)))
    d2 = ((phi[:, None, :] - phi[None, :, :]) ** 2).sum(-1)
    K = np.exp(-d2 / (2 * gamma2))
    assert K.min() < 0.5  # the test is not trivial
    err = np.abs(psi @ psi.T - K)
    assert err.max() < _rf_tol(D_out), err.max()


# =========================================================================== widths


def test_median_heuristic_equals_direct_computation():
    g, b = _logistic_messages(300, seed=12)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=100, n_outer=10, outer_width_factor=2.5, random_state=0).fit((g, b))
    np.testing.assert_array_equal(f.sigma2_, [np.mean(g.var()), np.mean(b.var())])
    np.testing.assert_allclose(f.omega_, f.omega_std_ / np.sqrt(f.sigma2_)[:, None], rtol=1e-15)
    median = np.median(pdist(f.inner((g, b)), "sqeuclidean"))
    np.testing.assert_allclose(f.median_sq_dist_, median, rtol=1e-10)
    np.testing.assert_allclose(f.gamma2_, 2.5 * median, rtol=1e-10)
    np.testing.assert_allclose(f.nu_, f.nu_std_ / np.sqrt(f.gamma2_), rtol=1e-15)


def test_median_heuristic_subsamples_large_training_sets():
    g, b = _logistic_messages(2500, seed=13)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=50, n_outer=10, random_state=0).fit((g, b))
    full = np.median(pdist(f.inner((g, b)), "sqeuclidean"))
    # a 1000-message subsample: the median of ~5e5 pairs is within a few percent of the full one
    assert abs(f.median_sq_dist_ / full - 1) < 0.05
    assert f.median_sq_dist_ != full
    f2 = TwoStageFeatures((Gaussian, Beta), n_inner=50, n_outer=10, random_state=0).fit((g, b))
    assert f2.median_sq_dist_ == f.median_sq_dist_


def test_given_widths_are_used_and_point_mass_fallback():
    g, b = _logistic_messages(50, seed=14)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=20, n_outer=10, inner_widths=[3.0, 0.2], outer_width=0.7,
                         random_state=0).fit((g, b))
    np.testing.assert_array_equal(f.sigma2_, [3.0, 0.2])
    assert f.gamma2_ == 0.7
    assert f.median_sq_dist_ > 0  # still recorded, for with_outer_width_factor
    # observed labels (Bernoulli point masses) have zero variance: the width falls back to the
    # spread of the means
    y = Bernoulli(np.where(np.arange(50) % 3 == 0, 1.0, 0.0))
    f = TwoStageFeatures((Gaussian, Bernoulli), n_inner=20, n_outer=10, random_state=0).fit((g, y))
    assert f.sigma2_[1] == np.var(y.mean()) > 0
    assert np.all(np.isfinite(f.transform((g, y))))


def test_with_outer_width_factor_rescales_only_gamma():
    g, b = _logistic_messages(200, seed=15)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=80, n_outer=60, random_state=4).fit((g, b))
    psi = f.transform((g, b))
    h = f.with_outer_width_factor(3.0)
    assert h is not f and h.outer_width_factor == 3.0 and f.outer_width_factor == 1.0
    for name in ("omega_std_", "b_", "nu_std_", "c_", "sigma2_"):
        assert getattr(h, name) is getattr(f, name)
    assert h.median_sq_dist_ == f.median_sq_dist_
    np.testing.assert_allclose(h.gamma2_, 3.0 * f.gamma2_, rtol=1e-15)
    np.testing.assert_allclose(h.nu_, f.nu_ / np.sqrt(3.0), rtol=1e-14)
    assert np.array_equal(h.inner((g, b)), f.inner((g, b)))
    assert np.array_equal(f.transform((g, b)), psi)  # the original is untouched
    fresh = TwoStageFeatures((Gaussian, Beta), n_inner=80, n_outer=60, outer_width_factor=3.0, random_state=4).fit((g, b))
    assert np.array_equal(h.transform((g, b)), fresh.transform((g, b)))
    # also from a map fitted with an explicit outer width
    fo = TwoStageFeatures((Gaussian, Beta), n_inner=80, n_outer=60, outer_width=5.0, random_state=4).fit((g, b))
    assert fo.with_outer_width_factor(3.0).gamma2_ == h.gamma2_


# =========================================================================== reproducibility, persistence, dtype


def test_reproducible_by_random_state():
    g, b = _logistic_messages(100, seed=16)
    kw = dict(n_inner=40, n_outer=30, treatment="exact")
    a1 = TwoStageFeatures((Gaussian, Beta), random_state=123, **kw).fit((g, b)).transform((g, b))
    a2 = TwoStageFeatures((Gaussian, Beta), random_state=123, **kw).fit((g, b)).transform((g, b))
    a3 = TwoStageFeatures((Gaussian, Beta), random_state=124, **kw).fit((g, b)).transform((g, b))
    a4 = TwoStageFeatures((Gaussian, Beta), random_state=np.random.default_rng(123), **kw).fit((g, b)).transform((g, b))
    assert np.array_equal(a1, a2) and np.array_equal(a1, a4)
    assert not np.allclose(a1, a3)


def test_rows_are_independent_of_batch_and_chunking(monkeypatch):
    g, b = _logistic_messages(50, seed=17)
    for treatment in ("gaussian", "exact"):
        f = TwoStageFeatures((Gaussian, Beta), n_inner=60, n_outer=40, treatment=treatment, random_state=1).fit((g, b))
        full = f.transform((g, b))
        one = f.transform((g[7:8], b[7:8]))
        scalar = f.transform((g[7], b[7]))  # 0-d messages: one row
        np.testing.assert_allclose(one[0], full[7], rtol=0, atol=1e-14)
        np.testing.assert_allclose(scalar, one, rtol=0, atol=1e-14)
        monkeypatch.setattr(F, "_CHUNK_ELEMENTS", 7 * 60)  # 7-row chunks
        np.testing.assert_allclose(f.transform((g, b)), full, rtol=0, atol=1e-14)
        monkeypatch.undo()


@pytest.mark.parametrize("treatment", ["gaussian", "exact"])
def test_state_dict_round_trip_is_bit_identical(treatment):
    g, b = _logistic_messages(150, seed=18)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=70, n_outer=40, treatment=treatment, outer_width_factor=0.7,
                         random_state=5).fit((g, b))
    psi = f.transform((g, b))
    d = f.state_dict()
    assert d["families"] == ["gaussian", "beta"]
    g2 = TwoStageFeatures.from_state_dict(d)
    assert np.array_equal(g2.transform((g, b)), psi)
    # JSON (arrays as lists) and npz (no pickles) round trips
    js = json.loads(json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in d.items()}))
    assert np.array_equal(TwoStageFeatures.from_state_dict(js).transform((g, b)), psi)
    buf = io.BytesIO()
    np.savez(buf, **d)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        g3 = TwoStageFeatures.from_state_dict(z)
    assert np.array_equal(g3.transform((g, b)), psi)
    assert g3.get_params()["treatment"] == treatment and g3.outer_width_factor == 0.7
    # an unfitted map round-trips too
    u = TwoStageFeatures.from_state_dict(TwoStageFeatures((Gamma,), inner_widths=2.0, dtype=np.float32).state_dict())
    assert not u.is_fitted and u.families == (Gamma,) and u.dtype == np.float32
    np.testing.assert_array_equal(u.inner_widths, [2.0])


def test_state_dict_validation():
    g, b = _logistic_messages(20, seed=19)
    d = TwoStageFeatures((Gaussian, Beta), n_inner=10, n_outer=5, random_state=0).fit((g, b)).state_dict()
    with pytest.raises(ValueError, match="nu_std"):
        TwoStageFeatures.from_state_dict({**d, "nu_std": d["nu_std"][:, :3]})
    with pytest.raises(ValueError, match="missing key 'b'"):
        TwoStageFeatures.from_state_dict({k: v for k, v in d.items() if k != "b"})
    with pytest.raises(ValueError, match="format"):
        TwoStageFeatures.from_state_dict({**d, "format": 99})
    with pytest.raises(ValueError, match="unknown family"):
        TwoStageFeatures.from_state_dict({**d, "families": ["gaussian", "poisson"]})


@pytest.mark.parametrize("treatment", ["gaussian", "exact"])
def test_float32_close_to_float64(treatment):
    g, b = _logistic_messages(300, seed=20)
    kw = dict(n_inner=200, n_outer=300, treatment=treatment, random_state=6)
    f64 = TwoStageFeatures((Gaussian, Beta), **kw).fit((g, b))
    f32 = TwoStageFeatures((Gaussian, Beta), dtype=np.float32, **kw).fit((g, b))
    assert f32.gamma2_ == f64.gamma2_  # widths are fitted in float64
    phi32, psi32 = f32.inner((g, b)), f32.transform((g, b))
    assert phi32.dtype == np.float32 and psi32.dtype == np.float32
    # phases |omega^T m + b| reach ~ 100 here; float32 rounds them to ~1e-5 absolute, relative to
    # a feature scale of sqrt(2/D)
    phase = np.abs(np.stack([g.mean(), b.mean()], 1) @ f64.omega_).max() + 2 * np.pi
    tol = phase * 2.0**-23 * 4
    np.testing.assert_allclose(phi32, f64.inner((g, b)), rtol=0, atol=tol * np.sqrt(2 / 200))
    np.testing.assert_allclose(psi32, f64.transform((g, b)), rtol=0, atol=1e-4 * np.sqrt(2 / 300))


def test_for_factor_uses_variable_order():
    f = TwoStageFeatures.for_factor(Logistic(), n_inner=10, n_outer=10)
    assert f.families == (Gaussian, Beta)


# =========================================================================== validation


def test_validation_errors():
    g, b = _logistic_messages(10, seed=21)
    f = TwoStageFeatures((Gaussian, Beta), n_inner=10, n_outer=10, random_state=0)
    with pytest.raises(NotFittedError, match="fit"):
        f.transform((g, b))
    with pytest.raises(ValueError, match="fit"):
        f.inner((g, b))
    with pytest.raises(ValueError, match="messages.*2 message batch"):
        f.fit((g,))
    with pytest.raises(ValueError, match=r"messages\[1\]. must be a Beta"):
        f.fit((g, g))
    with pytest.raises(ValueError, match="mismatched batch lengths"):
        f.fit((g, b[:5]))
    with pytest.raises(ValueError, match="1-D"):
        f.fit((g.reshape(2, 5), b.reshape(2, 5)))
    with pytest.raises(ValueError, match="improper"):
        f.fit((Gaussian._unchecked(g.mean(), -g.var()), b))
    with pytest.raises(ValueError, match="at least 2 messages"):
        f.fit((g[:1], b[:1]))
    with pytest.raises(ValueError, match="messages"):
        f.fit({"x": g, "z": b})
    same = (Gaussian(np.zeros(5), np.ones(5)), Beta(np.ones(5), np.ones(5)))
    with pytest.raises(ValueError, match="zero outer width"):
        f.fit(same)
    assert not f.is_fitted  # a failed fit leaves no half-fitted state
    f.fit((g, b))
    with pytest.raises(ValueError, match="phi"):
        f.outer(np.zeros((3, 11)))
    with pytest.raises(ValueError, match="factor"):
        f.with_outer_width_factor(0.0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(inner_widths=[1.0, 0.0]), "inner_widths"),
        (dict(inner_widths=[1.0, -2.0]), "inner_widths"),
        (dict(inner_widths=[1.0, 2.0, 3.0]), "inner_widths"),
        (dict(outer_width=0.0), "outer_width"),
        (dict(outer_width=-1.0), "outer_width"),
        (dict(outer_width_factor=0.0), "outer_width_factor"),
        (dict(outer_width_factor=np.inf), "outer_width_factor"),
        (dict(treatment="quadrature"), "treatment"),
        (dict(n_inner=0), "n_inner"),
        (dict(n_outer=2.5), "n_outer"),
        (dict(dtype=np.int32), "dtype"),
        (dict(random_state="seed"), "random_state"),
        (dict(families=()), "families"),
        (dict(families=(Gaussian, int)), r"families\[1\]"),
    ],
)
def test_constructor_validation(kwargs, name):
    kw = dict(families=(Gaussian, Beta))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=name):
        TwoStageFeatures(**kw)
