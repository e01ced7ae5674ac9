"""Relaxed EP: the paper's readings (issue 18), each selectable with ``relax_reading``.

* the appendix's eq. 22 as written (``ProbitNoiseOperator.appendix_relaxed_q``) against an
  independent quadrature: it is ``KL(p_b ‖ proj p_b)`` plus a closed-form remainder (so it is
  *not* the relaxed KL it is said to be), and its F_{i,b} is the second moment of ``proj p_b``;
* every reading with c → ∞ is EP bit for bit, and with a small c it does relax (the test of
  c → ∞ is not vacuous);
* ``appendix_site`` keeps r in the site: its new belief is ``proj[t r q^{\\i}]`` itself;
* ``scaled_message`` relaxes by a power of the old message, so nothing relaxes in the first sweep;
* bad options are refused with the field named.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, special
from threadpoolctl import threadpool_limits

from kjit.ep import GPClassifier, LinearEP, LogisticOperator, ProbitClassifier, ProbitNoiseOperator
from kjit.ep.engine import RELAX_READINGS
from kjit.families import Bernoulli, Gaussian

FIVE_X = np.array([[-1.0, 0.6], [-1.4, -0.4], [1.2, 0.6], [1.0, -0.7], [2.6, 0.3]])
FIVE_Y = np.array([1, 1, 0, 0, 1])
EPS = 0.2


@pytest.fixture(autouse=True)
def _single_threaded_blas():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _quad_relaxed_tilted(hc, lc, m, b, eps):
    """Moments of p_b(g) ∝ (ε + (1−2ε)Θ(g)) N(g; h̃c, λ̃) (label-absorbed g = y f) and
    KL(p_b ‖ N(mean, var)) by adaptive quadrature split at the jump g = 0."""
    lt = 1.0 / (1.0 / lc + b)
    htc = lt * (hc / lc + b * m)
    sd = np.sqrt(lt)
    t = lambda g: eps + (1 - 2 * eps) * (g > 0)  # noqa: E731
    dens = lambda g: t(g) * np.exp(-0.5 * (g - htc) ** 2 / lt) / np.sqrt(2 * np.pi * lt)  # noqa: E731
    lo, hi = htc - 14 * sd, htc + 14 * sd
    pieces = [(lo, min(0.0, hi)), (max(0.0, lo), hi)]

    def integral(fn):
        return sum(integrate.quad(fn, a, c, epsabs=1e-15, epsrel=1e-12, limit=200)[0] for a, c in pieces if c > a)

    Z = integral(dens)
    mean = integral(lambda g: g * dens(g)) / Z
    var = integral(lambda g: (g - mean) ** 2 * dens(g)) / Z
    kl = integral(lambda g: dens(g) * (np.log(t(g)) - np.log(Z) - 0.5 * (g - htc) ** 2 / lt
                                        - 0.5 * np.log(lt) + 0.5 * (g - mean) ** 2 / var + 0.5 * np.log(var))) / Z
    return htc, lt, mean, var, kl


@pytest.mark.parametrize("seed", range(4))
def test_appendix_eq22_against_quadrature(seed):
    """Eq. 22 as written = KL(p_b ‖ proj p_b) − ½ α h̃^{\\i} − ½ b ṽ − ½ b (m − h̃)² bλ/(1 + bλ),
    every quantity on the right by quadrature (α = (h̃ − h̃^{\\i})/λ̃ from the tilted mean).
    Derivation: F_{i,b} = ṽ + h̃² (the second moment of proj p_b) makes the term
    (F − h̃ m_{i,b})/(2 v_{i,b}) vanish, the two logs give −½ log(λ̃/ṽ), and what is left is the
    closed form above instead of −KL(proj p_b ‖ r q^{\\i}).  Tolerance 1e-8: quadrature at
    rtol 1e-12 on O(1) integrands, differenced once."""
    rng = np.random.default_rng(seed)
    op = ProbitNoiseOperator(EPS)
    for _ in range(3):
        y = float(rng.integers(0, 2))
        s = 1.0 if y == 1 else -1.0
        hc, lc = 1.5 * rng.standard_normal(), float(np.exp(rng.standard_normal()))
        m, sp = rng.standard_normal(), 0.5 * rng.standard_normal()   # site mean and precision (g coords)
        a_ii = 1.0 / (1.0 / lc + sp)                                   # posterior marginal with the site
        if not a_ii > 0:
            continue
        bs = np.array([0.0, 0.05, 0.4, 3.0])
        inc = {"f": Gaussian(np.full(4, s * hc), np.full(4, lc)), "y": Bernoulli(np.full(4, y))}
        q22 = op.appendix_relaxed_q(inc, bs, s * m, sp, a_ii)
        for b, q in zip(bs, q22):
            htc, lt, mean, var, kl = _quad_relaxed_tilted(hc, lc, m, b, EPS)
            alpha = (mean - htc) / lt
            rest = -0.5 * alpha * htc - 0.5 * b * var - 0.5 * b * (m - mean) ** 2 * b * lc / (1 + b * lc)
            assert q == pytest.approx(kl + rest, abs=1e-8)
        # at b = 0 the remainder −½ α h^{\i} is not 0 (unless the cavity mean is 0)
        assert abs(q22[0] - _quad_relaxed_tilted(hc, lc, m, 0.0, EPS)[4]) > 1e-6


def test_appendix_eq22_is_decreasing_in_b_where_the_relaxed_kl_is_not():
    """Why eq. 22 relaxes at c where the relaxed KL does not: the −½ b ṽ term gives it a slope
    of about −½ ṽ at b = 0 (finite differences), while KL(p_b ‖ proj p_b) is flat-ish there."""
    op = ProbitNoiseOperator(EPS)
    hc, lc, m, sp = 0.8, 1.0, 0.5, 0.3
    a_ii = 1.0 / (1.0 / lc + sp)
    inc = {"f": Gaussian(np.full(2, hc), np.full(2, lc)), "y": Bernoulli(np.ones(2))}
    db = 1e-6
    q0, q1 = op.appendix_relaxed_q(inc, np.array([0.0, db]), m, sp, a_ii)
    slope = (q1 - q0) / db
    _, _, _, var0, kl0 = _quad_relaxed_tilted(hc, lc, m, 0.0, EPS)
    kl1 = _quad_relaxed_tilted(hc, lc, m, db, EPS)[4]
    assert slope < -0.4 * var0
    assert abs((kl1 - kl0) / db) < 0.2 * abs(slope)


def test_appendix_q_needs_hard_labels_and_eps():
    op = ProbitNoiseOperator(EPS)
    with pytest.raises(ValueError, match="hard labels"):
        op.appendix_relaxed_q({"f": Gaussian(0.0, 1.0), "y": Bernoulli(0.3)}, 0.1, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="eps > 0"):
        ProbitNoiseOperator(0.0).appendix_relaxed_q({"f": Gaussian(0.0, 1.0), "y": Bernoulli(1.0)}, 0.1, 0.0, 0.0, 1.0)


def _fit(schedule="sequential", max_iter=300, X=FIVE_X, tol=1e-10, **kw):
    return ProbitClassifier(ProbitNoiseOperator(EPS), tol=tol, max_iter=max_iter, schedule=schedule,
                            **kw).fit(X, FIVE_Y)


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
@pytest.mark.parametrize("reading", RELAX_READINGS)
def test_every_reading_with_large_c_is_ep_and_small_c_relaxes(reading, schedule):
    """c → ∞: the l1 penalty forces r = 1 at every update, so REP is EP bit for bit (for a finite
    c = 1e12 the smallest grid relaxation costs ≥ 1e8 nats).  c = 1e-3 does relax, and moves
    the answer."""
    damp = {"damping": 0.3} if schedule == "parallel" else {}
    ep = _fit(schedule, **damp)
    big = _fit(schedule, relax_c=1e12, relax_reading=reading, **damp)
    np.testing.assert_array_equal(big.result_.site_shift, ep.result_.site_shift)
    np.testing.assert_array_equal(big.result_.site_precision, ep.result_.site_precision)
    assert big.n_iter_ == ep.n_iter_
    assert all(r.n_relaxed == 0 for r in big.result_.history)
    small = _fit(schedule, max_iter=20, relax_c=1e-3, relax_reading=reading, **damp)
    assert sum(r.n_relaxed for r in small.result_.history) > 0
    assert np.max(np.abs(small.coef_ - ep.coef_)) > 1e-3


def test_gp_classifier_passes_the_reading():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((30, 2))
    y = (X[:, 0] * X[:, 1] > 0).astype(int)
    common = dict(eps=0.1, length_scale=1.0, max_iter=6)
    ep = GPClassifier(**common).fit(X, y)
    for reading in RELAX_READINGS:
        big = GPClassifier(method="rep", relax_c=1e12, relax_reading=reading, **common).fit(X, y)
        np.testing.assert_array_equal(big.alpha_, ep.alpha_)
        assert big.get_params()["relax_reading"] == reading
    small = GPClassifier(method="rep", relax_c=1e-3, relax_reading="appendix_q", **{**common, "max_iter": 3}).fit(X, y)
    assert sum(r.n_relaxed for r in small.result_.history) > 0


@pytest.mark.parametrize("reading", ["projection_kl", "appendix_q"])
def test_units_of_c_in_the_b_readings(reading):
    """Scaling the inputs by k scales the latent by k and leaves the noisy-probit posterior over w
    unchanged; b is a precision of the latent, so REP(c) on X is REP(c k²) on k X (the line
    search's grid is in b · v_¬, which is scale-free).  Exactly 25 sweeps each (tol = 0);
    tolerance: round-off through 125 sequential rank-one updates."""
    k = 3.0
    a = _fit(max_iter=25, tol=0.0, relax_c=0.05, relax_reading=reading)
    assert sum(r.n_relaxed for r in a.result_.history) > 0
    b = _fit(max_iter=25, tol=0.0, relax_c=0.05 * k * k, relax_reading=reading, X=k * FIVE_X)
    np.testing.assert_allclose(b.coef_, a.coef_, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(b.posterior_.cov, a.posterior_.cov, rtol=1e-7, atol=1e-9)
    c_same = _fit(max_iter=25, tol=0.0, relax_c=0.05, relax_reading=reading, X=k * FIVE_X)
    assert np.max(np.abs(c_same.coef_ - a.coef_)) > 1e-3  # the same c on the rescaled latent is another REP


def test_appendix_site_keeps_r_in_the_site():
    """One site (x = w, w ~ N(0, 1)), one update from a given old site: reading ``appendix_q``
    (r removed, §4.1) and ``appendix_site`` (r kept, eqs. 22–23 as printed) choose the same b
    (same objective, same inputs); the belief of ``appendix_site`` is proj[t r q^{\\i}] — checked
    against quadrature of the relaxed tilted — and its precision exceeds §4.1's by exactly b."""
    A = np.ones((1, 1))
    obs = {"y": Bernoulli(np.array([0.0]))}  # a label that disagrees with the old site's pull
    init = (np.array([1.2]), np.array([0.8]))  # old site: mean 1.5, precision 0.8
    c = 0.05
    runs = {}
    for reading in ("appendix_q", "appendix_site"):
        eng = LinearEP(ProbitNoiseOperator(EPS), site_var="f", relax_c=c, relax_reading=reading,
                       max_iter=1, schedule="sequential", allow_negative_sites=True)
        runs[reading] = eng.run(A, obs, init_sites=init)
        assert runs[reading].history[0].n_relaxed == 1
    p_site = 1.0 / runs["appendix_site"].cov[0, 0]
    p_q = 1.0 / runs["appendix_q"].cov[0, 0]
    b = p_site - p_q
    assert b > 0
    # old posterior N(1.2/1.8, 1/1.8); cavity = prior N(0, 1); relaxation centred at the site mean 1.5
    _, _, mean, var, _ = _quad_relaxed_tilted(-0.0, 1.0, -1.5, b, EPS)  # label 0: g = −f
    np.testing.assert_allclose(runs["appendix_site"].cov[0, 0], var, rtol=1e-9)
    np.testing.assert_allclose(runs["appendix_site"].mean[0], -mean, rtol=1e-9, atol=1e-12)
    # §4.1: the belief is proj[t r q^{\i}] / r — its mean is the same precision-weighted remainder
    np.testing.assert_allclose(runs["appendix_q"].mean[0] * p_q, -mean / var - b * 1.5, rtol=1e-9)


def test_scaled_message_cannot_relax_an_untouched_site():
    """r = t̃_old^η: in the first sweep every site is 1 (v_i = ∞), so nothing is relaxed however
    small c is; relaxation starts in the second sweep."""
    m = _fit(max_iter=4, relax_c=1e-4, relax_reading="scaled_message")
    assert m.result_.history[0].n_relaxed == 0
    assert any(r.n_relaxed > 0 for r in m.result_.history[1:])


def test_bad_reading_options_are_refused():
    with pytest.raises(ValueError, match="relax_reading"):
        _fit(relax_c=1.0, relax_reading="eq22")
    with pytest.raises(ValueError, match="appendix_relaxed_q"):
        LinearEP(LogisticOperator(), relax_c=1.0, relax_reading="appendix_q").run(
            np.ones((2, 1)), {"y": Bernoulli(np.array([1.0, 0.0]))})
    with pytest.raises(ValueError, match="power = 1"):
        _fit(relax_c=1.0, relax_reading="appendix_site", power=0.8)


@pytest.mark.slow
def test_benchmark_summary_has_rep_readings():
    """benchmarks/rep.py keeps its summary keys and adds rep_readings (five points + one small
    synthetic problem; the real figures come from the benchmark itself)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "rep.py"), "--quick", "--sections", "five_point", "synthetic",
         "--noise", "0.2", "--n-test", "200", "--max-iter", "5", "--is-samples", "200000",
         "--readings", "projection_kl", "appendix_q", "--reading-c", "0.3"],
        capture_output=True, text=True, check=True, cwd=root, timeout=1800)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ep_test_error", "pep_test_error", "rep_test_error", "ep_divergences", "pep_divergences",
                "rep_divergences", "five_point"):
        assert key in summary
    rr = summary["rep_readings"]
    assert rr["best_reading"] in ("projection_kl", "appendix_q")
    for rd in ("projection_kl", "appendix_q"):
        for key in ("test_error", "divergences", "five_point_mean_mse", "five_point_cov_mse"):
            assert np.isfinite(rr[rd][key])


def test_combine_uses_each_runs_reading_grid(tmp_path, capsys):
    """--combine takes each reading's c values from the runs' config rows (their --reading-grid), not
    only --reading-c: a run with ``--reading-c 0.3 --reading-grid appendix_q=3`` is summarised at c = 3."""
    import json

    from benchmark_modules import load_benchmark

    rep = load_benchmark("rep.py")

    def res(err, div):
        return {"test_error": err, "diverged": div, "converged": not div, "iterations": 7, "relaxed_updates": 2}

    cfg = {"section": "config", "sections": ["synthetic"], "noise": [0.1], "readings": ["projection_kl", "appendix_q"],
           "reading_c": [0.3], "reading_grid_": {"appendix_q": [3.0]}}
    rows = [{"section": "synthetic", "noise": 0.1, "repeat": r, "ep": res(0.1, False), "ep_damped": res(0.1, False),
             "pep": res(0.1, False), "rep": res(0.1, False), "rep_projection_kl_c0.3": res(0.2, r == 0),
             "rep_appendix_q_c3": res(0.05 + 0.01 * r, False)} for r in range(2)]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [cfg, *rows]) + "\n")
    rep.main(["--combine", str(path)])
    rr = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rep_readings"]
    assert rr["appendix_q"]["c"] == 3.0 and rr["appendix_q"]["test_error"] == pytest.approx(0.055)
    assert rr["projection_kl"]["c"] == 0.3 and rr["projection_kl"]["divergences"] == 1
    assert rr["best_reading"] == "appendix_q"
