"""The per-message importance sampler (issue 14, part 1): any sampleable factor, a proposal per
message from the inputs' own incoming messages, adaptive particle counts, honest standard errors."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.factors import CompoundGamma, Logistic, SampledFactor
from kjit.families import Beta, Gamma, Gaussian
from kjit.oracles import ImportanceSamplingOracle, LowESSError, MessageImportanceSampler, OracleError, QuadratureOracle


def _logistic_batch(n, seed):
    rng = np.random.default_rng(seed)
    return {"x": Gaussian(rng.uniform(-5, 5, n), np.exp(rng.uniform(-4, 2, n))),
            "z": Beta(rng.uniform(0.5, 5, n), rng.uniform(0.5, 5, n))}


def _z_scores(q, qe, se, gaussian):
    err = q.to_coords() - qe.to_coords()
    if gaussian:
        err[:, 0] /= np.sqrt(qe.var())
    return err / se


@pytest.mark.parametrize("to", ["x", "z"])
def test_logistic_against_quadrature_within_the_reported_standard_errors(to):
    """Errors against the exact answer, in units of the sampler's own standard error, are ~N(0, 1):
    with 120 messages × 2 coordinates, ≥ 85 % within 2 SE (95 % expected; the binomial sd of the
    fraction is 1.4 %) and none beyond 5 SE."""
    inc = _logistic_batch(120, seed=1)
    s = MessageImportanceSampler(Logistic(), target_se=2e-2, random_state=0)
    q = s.belief(inc, to)
    qe = QuadratureOracle(Logistic()).belief(inc, to)
    z = _z_scores(q, qe, s.last_se_, to == "x")
    assert np.mean(np.abs(z) < 2) >= 0.85 and np.max(np.abs(z)) < 5
    # the answering round's size is set by a pilot's estimate of its standard errors, so rows meet the
    # target about, not always (measured: 86 % within it, 94 % within 1.5 ×); none misses it by more
    # than REPILOT_FACTOR unless at the cap (a Beta message with α < 1 weights heavily)
    from kjit.oracles import REPILOT_FACTOR

    worst = np.max(s.last_se_, axis=1)
    assert np.all((worst <= REPILOT_FACTOR * 2e-2) | (s.last_n_samples_ == s.max_samples))
    assert np.mean(worst <= 1.5 * 2e-2) > 0.8 and np.mean(worst <= 2e-2) > 0.6
    assert np.all(s.last_ess_ >= 50)


def test_compound_gamma_without_inputs_and_its_log_partition():
    rng = np.random.default_rng(2)
    inc = {"tau": Gamma(rng.uniform(0.5, 10, 60), rng.uniform(0.5, 10, 60))}
    s = MessageImportanceSampler(CompoundGamma(), target_se=2e-2, random_state=0)
    q = s.belief(inc, "tau")
    qo = QuadratureOracle(CompoundGamma())
    z = _z_scores(q, qo.belief(inc, "tau"), s.last_se_, False)
    assert np.mean(np.abs(z) < 2) >= 0.85 and np.max(np.abs(z)) < 5
    # log Z = log E[m(τ)] under the factor: relative error of the mean weight ~ 1/sqrt(ESS)
    lz, lz_exact = s.log_partition(inc), qo.log_partition(inc)
    assert np.all(np.abs(lz - lz_exact) < 5 / np.sqrt(s.last_ess_))


def test_narrow_input_messages_where_the_shared_proposal_fails():
    """A narrow incoming message on x (sd 1e-3): the paper's fixed N(0, 200) proposal puts almost
    no particle there (LowESSError); the per-message proposal is exact in x and only weights by
    the Beta message."""
    inc = {"x": Gaussian(np.array([2.0, -1.0]), np.array([1e-6, 1e-6])), "z": Beta(np.array([2.0, 1.0]), np.array([1.0, 2.0]))}
    with pytest.raises(LowESSError):
        ImportanceSamplingOracle(Logistic(), n_samples=100_000, random_state=0).belief(inc, "x")
    s = MessageImportanceSampler(Logistic(), random_state=0)
    q = s.belief(inc, "x")
    qe = QuadratureOracle(Logistic()).belief(inc, "x")
    assert np.all(s.last_ess_ > 0.99 * s.last_n_samples_)  # weights σ(x)^(α−1)... nearly constant
    assert np.all(np.abs(_z_scores(q, qe, s.last_se_, True)) < 5)


def _product():
    return SampledFactor("product_test", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                         sampler=lambda v, rng: v["x"] * v["y"])


def test_product_to_z_against_the_closed_form_under_a_broad_z_message():
    """With a z message of variance 1e8 the belief on z is the law of x·y to a relative 1e-7:
    mean m_x m_y, variance v_x v_y + m_x² v_y + m_y² v_x (an independent closed form)."""
    mx, vx, my, vy = np.array([1.0, 0.0, 3.0]), np.array([0.5, 1.0, 0.05]), np.array([2.0, 0.5, -1.0]), np.array([0.2, 2.0, 0.1])
    inc = {"x": Gaussian(mx, vx), "y": Gaussian(my, vy), "z": Gaussian(0.0, 1e8).broadcast_to((3,))}
    s = MessageImportanceSampler(_product(), target_se=1e-2, random_state=0)
    q = s.belief(inc, "z")
    mean, var = mx * my, vx * vy + mx**2 * vy + my**2 * vx
    assert np.all(np.abs(q.mean() - mean) / np.sqrt(var) < 5 * s.last_se_[:, 0])
    assert np.all(np.abs(np.log(q.var()) - np.log(var)) < 5 * s.last_se_[:, 1])


def test_adaptive_counts_and_low_ess_rows_are_named():
    f = _product()
    inc = {"x": Gaussian(np.array([1.0, 1.0, 0.0]), np.array([1.0, 1.0, 1.0])),
           "y": Gaussian(np.array([1.0, 1.0, 0.0]), np.array([1.0, 1.0, 1.0])),
           # row 1: a narrow z message (ESS ~ 1 % of the particles); row 2: impossible (z = 1e3 ± 1e-3)
           "z": Gaussian(np.array([0.0, 1.0, 1e3]), np.array([100.0, 1e-4, 1e-6]))}
    s = MessageImportanceSampler(f, target_se=5e-2, max_samples=256_000, random_state=0)
    with pytest.raises(LowESSError) as ei:
        s.belief(inc, "x")
    assert list(ei.value.rows) == [2]
    assert s.last_n_samples_[1] > s.last_n_samples_[0]  # the hard row needed more particles
    assert s.last_n_samples_[2] == s.max_samples
    stats, ess, se, n, _ = s.estimate({k: v[:2] for k, v in inc.items()}, "x")
    assert np.all(ess >= 50) and np.all(se <= 5e-2)


def test_target_ess_mode_and_validation():
    inc = _logistic_batch(10, seed=3)
    s = MessageImportanceSampler(Logistic(), target_ess=5000, random_state=0)
    s.belief(inc, "x")
    assert np.all((s.last_ess_ >= 5000) | (s.last_n_samples_ == s.max_samples))
    assert np.mean(s.last_ess_ >= 5000) >= 0.8
    with pytest.raises(ValueError):
        MessageImportanceSampler(Logistic(), target_se=0.0)
    with pytest.raises(ValueError):
        MessageImportanceSampler(Logistic(), n_initial=5)
    with pytest.raises(ValueError, match="improper"):
        MessageImportanceSampler(Logistic()).belief({"x": Gaussian.from_natural(np.array([0.0, 0.5])), "z": Beta(2.0, 1.0)}, "x")


def test_a_row_where_the_sampler_returns_nan_is_refused_not_answered_biased():
    """A user's sampler undefined on part of the input range (NaN for x < 0, say a log of a negative):
    dropping those particles answered a biased belief (KL up to 20 nats) with a healthy ESS (found in
    review); the rows whose particles hit NaN now fail by name (SamplerOutputError, an OracleError
    naming the rows — before, a LowESSError "effective sample size 0", which blamed the proposal), the
    others are answered as before — checked against the exact belief of z = x + N(0, 0.3²)."""
    from kjit.errors import SamplerOutputError
    from kjit.factors import SampledFactor
    from kjit.families import Gaussian
    from kjit.oracles import MessageImportanceSampler

    def sampler(v, rng):
        x = v["x"]
        return np.where(x < 0, np.nan, x + 0.3 * rng.standard_normal(x.shape))

    f = SampledFactor("nan_below_zero", inputs={"x": Gaussian}, output=("z", Gaussian), sampler=sampler)
    xm, xv = np.array([-1.5, 40.0, -0.5, 30.0]), np.ones(4)  # rows 1 and 3: no draw below 0 (40 and 30 sd)
    inc = {"x": Gaussian(xm, xv), "z": Gaussian(xm + 0.2, np.ones(4))}
    with pytest.raises(SamplerOutputError) as err:
        MessageImportanceSampler(f, random_state=0).belief(inc, "x")
    np.testing.assert_array_equal(err.value.rows, [0, 2])
    ok = {v: m[[1, 3]] for v, m in inc.items()}
    q = MessageImportanceSampler(f, random_state=0).belief(ok, "x")
    pv = 1 / (1 / xv[[1, 3]] + 1 / (1 + 0.09))
    pm = pv * (xm[[1, 3]] / xv[[1, 3]] + (xm[[1, 3]] + 0.2) / (1 + 0.09))
    assert np.all(Gaussian(pm, pv).kl(q) < 1e-3)


def test_outputs_that_round_onto_the_boundary_keep_their_weight():
    """A logistic z = σ(x) rounds to 1 for x > 36.7 and an exp y = e^x to 0 for x < −745, where the
    output message's log_pdf is −inf: those particles were dropped — N(34.8, 1.8) for the belief
    N(36, 4) at ESS 4e4 (found by an audit).  With z ~ Beta(2, 1) (a density of 2z) the belief on x
    is N(m, v) to within 1 − σ(x) < e^−25 over ±5 sd, and log Z = log 2; with y ~ Gamma(1, 1)
    (e^−y, flat to 1e-300 there) it is x's message.  The weights are now the output message at
    the factor's own statistics of the output (Family.log_pdf_stats)."""
    from kjit.factors import Exp

    mis = MessageImportanceSampler(Logistic(), random_state=0)
    inc = {"x": Gaussian([36.0, 38.0], [4.0, 4.0]), "z": Beta([2.0, 2.0], [1.0, 1.0])}
    q = mis.belief(inc, "x")
    assert np.all(mis.last_ess_ > 1e4)
    # KL ~ 1/(2 ESS) per coordinate for a sampled answer: 1e-3 is far above it and far below 0.6
    assert np.all(Gaussian([36.0, 38.0], [4.0, 4.0]).kl(q) < 1e-3)
    assert np.allclose(MessageImportanceSampler(Logistic(), random_state=1).log_partition(inc), np.log(2.0), atol=1e-12)
    q = MessageImportanceSampler(Exp(), random_state=0).belief({"x": Gaussian(-745.0, 4.0), "y": Gamma(1.0, 1.0)}, "x")
    assert float(Gaussian(-745.0, 4.0).kl(q)) < 1e-3


def test_rows_the_sampler_cannot_answer_are_named_and_the_others_answered():
    """Found by an audit: a Gamma(1e-3) input message draws exact zeros (47 %), where gamma_rate's
    sampler raised a bare ValueError for the whole batch; and a weighted particle whose statistic is
    −inf (gamma_rate of shape 0.01 draws x = 0 with probability 6e-4, log x = −inf) made the row's
    estimate NaN and the whole batch an OracleError without rows.  Now each is an OracleError naming
    exactly those rows, so EP can skip them and ask again for the others."""
    from kjit.errors import OracleError
    from kjit.factors import GammaRate

    mis = MessageImportanceSampler(GammaRate(), random_state=0)
    inc = {"r": Gamma([1e-3, 3.0], [1.0, 1.0]), "x": Gamma([2.0, 2.0], [1.0, 1.0])}
    with pytest.raises(OracleError, match="boundary of their support") as e:
        mis.belief(inc, "r")
    assert e.value.rows.tolist() == [0]
    q = MessageImportanceSampler(GammaRate(), random_state=0).belief({v: m[1:] for v, m in inc.items()}, "r")
    assert float(QuadratureOracle(GammaRate()).belief({v: m[1:] for v, m in inc.items()}, "r").kl(q)[0]) < 1e-3
    mis = MessageImportanceSampler(GammaRate(shape=0.01), random_state=0)
    inc = {"r": Gamma([1.0, 1.0], [1.0, 1.0]), "x": Gamma([1.0, 5.0], [1.0, 1.0])}
    with pytest.raises(OracleError, match="not a Gamma message's statistics") as e:
        mis.belief(inc, "x")
    assert e.value.rows.tolist() == [0]


def test_pareto_khat_recovers_known_tail_shapes():
    """Weights u^−ξ (u uniform) have a Pareto tail of shape ξ exactly; bounded weights a negative one.
    50 columns of 20 000: the estimate's sd is ~0.06–0.09 per column (measured), so the mean over
    50 is within ~0.015 — 0.05 is 3 sd."""
    from kjit.oracles import pareto_khat

    rng = np.random.default_rng(0)
    for xi in (0.3, 0.5, 0.9):
        assert abs(float(np.mean(pareto_khat(rng.random((20_000, 50)) ** -xi))) - xi) < 0.05
    assert np.all(pareto_khat(np.exp(-0.5 * rng.standard_normal((20_000, 4)) ** 2)) < 0)


def test_heavy_tailed_weights_are_refused_by_row():
    """compound gamma draws τ from (1 + τ)^−2 and weighs it by τ's message; Gamma(0.1, 1) has the
    density ∝ τ^−0.9 at 0, so the weights' tail has shape k = 0.9 (infinite variance).  Both samplers
    answered with a healthy ESS and standard errors, KL 0.3–0.43 to the exact belief (found by an
    audit).  Now the row is an OracleError naming it (Pareto k̂ > 0.7); Gamma(2, 1) beside it (a
    bounded density: k̂ below 0 for the per-message sampler, which checks every row since another audit, not
    computed by the shared-proposal one) is answered."""
    from kjit.errors import OracleError

    f = CompoundGamma()
    inc = {"tau": Gamma([2.0, 0.1], [1.0, 1.0])}
    for oracle in (MessageImportanceSampler(f, random_state=0), ImportanceSamplingOracle(f, n_samples=200_000,
                                                                                         random_state=0)):
        with pytest.raises(OracleError, match="heavy-tailed") as e:
            oracle.belief(inc, "tau")
        assert e.value.rows.tolist() == [1]
        if isinstance(oracle, MessageImportanceSampler):  # (every row's k̂)
            assert oracle.last_khat_[0] < 0.7 and oracle.last_khat_[1] > 0.7
        else:  # (the shared proposal's: only where a weight can be unbounded)
            assert np.isnan(oracle.last_khat_[0]) and oracle.last_khat_[1] > 0.7
        q = oracle.belief({"tau": inc["tau"][:1]}, "tau")
        assert float(QuadratureOracle(f).belief({"tau": inc["tau"][:1]}, "tau").kl(q)[0]) < 1e-3


def test_the_adaptive_particle_count_does_not_bias_the_answer():
    """Answering with the round whose own standard errors first met the target selects rounds whose
    estimates lean one way: on gaussian → τ at target 0.03, +0.0094 in log shape, 8.7 standard errors
    of the mean over 600 seeds (found by an audit).  A pilot now sets the size of a fresh answering
    round.  300 seeds: the mean error is within 3 of its standard errors of 0 (the old rule gave ~6 at
    300; a fixed 8 000 particles 1.2 at 600 — the self-normalised estimate's own O(1/n) bias)."""
    from kjit.factors import get_factor

    f = get_factor("gaussian")
    inc = {"m": Gaussian(4.486494, 0.113532), "tau": Gamma(4.789022, 0.363762), "x": Gaussian(-2.231088, 3.575742)}
    exact = QuadratureOracle(f).belief(inc, "tau").to_coords()
    err = []
    for seed in range(300):
        st, *_ = MessageImportanceSampler(f, random_state=seed, target_se=0.03, n_initial=500).estimate(inc, "tau")
        err.append(Gamma.project(st).to_coords() - exact)
    err = np.array(err).reshape(300, -1)
    assert np.all(np.abs(err.mean(0)) < 3 * err.std(0, ddof=1) / np.sqrt(300))


# ---------------------------------------------------------------- a user sampler's bad output, named
def _bad_output_factor(kind):
    """A user factor whose sampler returns, for x > 1, NaN / +inf / (Gamma output) negative values."""
    if kind == "neg":
        return SampledFactor("neg_for_gamma", inputs={"x": Gaussian}, output=("y", Gamma),
                             sampler=lambda v, rng: np.exp(v["x"]) * np.where(v["x"] > 1.0, -1.0, 1.0))
    bad = {"nan": np.nan, "inf": np.inf}[kind]
    return SampledFactor(f"{kind}_above_one", inputs={"x": Gaussian}, output=("z", Gaussian),
                         sampler=lambda v, rng: np.where(v["x"] > 1.0, bad, v["x"]))


@pytest.mark.parametrize("kind, cause, words", [
    ("nan", "sampler returned NaN", "NaN (where the factor is not defined)"),
    ("neg", "sampler returned values outside the support", "values outside the Gamma support [0, inf]"),
])
@pytest.mark.parametrize("to", ["x", "out"])
def test_a_sampler_returning_no_value_of_its_output_family_is_named_not_blamed_on_the_proposal(kind, cause, words, to):
    """Found by an audit: NaN draws, and negative draws for a Gamma output, were "LowESSError: … effective
    sample size 0 … use a better proposal or more samples" for every row that met one — even a row with
    ~4e-4 of its draws there.  Now a SamplerOutputError (an OracleError: EP skips the rows, a training
    set drops and counts them) naming the factor, the output, what was returned and exactly the rows whose
    draws met it; the other rows are answered."""
    from kjit.errors import SamplerOutputError

    f = _bad_output_factor(kind)
    out = f.output
    to = out if to == "out" else to
    # rows 0 and 2 reach x > 1 (row 0 with ~5e-3 of its mass: ~10 of 2 000 pilot draws), rows 1 and 3 never
    xm, xv = np.array([-1.0, -3.0, 2.0, -4.0]), np.array([0.6, 0.25, 0.5, 0.25])
    m_out = Gamma(np.full(4, 2.0), np.full(4, 1.0)) if kind == "neg" else Gaussian(xm, np.full(4, 4.0))
    inc = {"x": Gaussian(xm, xv), out: m_out}
    with pytest.raises(SamplerOutputError) as err:
        MessageImportanceSampler(f, random_state=0).belief(inc, to)
    e = err.value
    np.testing.assert_array_equal(e.rows, [0, 2])
    assert (e.factor, e.variable, e.cause) == (f.name, out, cause)
    msg = str(e)
    assert f"factor {f.name!r}" in msg and f"output {out!r}" in msg and words in msg and "rows [0, 2]" in msg
    assert "effective sample size" not in msg and "proposal or more samples" not in msg.replace("another proposal", "")
    if kind == "neg":
        assert "e.g. -" in msg  # (a value it returned)
    # the rows whose draws stay where the sampler is defined are answered
    ok = {v: m[[1, 3]] for v, m in inc.items()}
    q = MessageImportanceSampler(f, random_state=0).belief(ok, to)
    assert np.all(np.isfinite(q.to_coords()))


def test_an_infinite_draw_of_an_unbounded_output_weighs_its_limit_zero():
    """Found by an audit: a user's z = inf for x > 1 (Gaussian z) was "effective sample size 0 … use a
    better proposal or more samples" — the weight at inf, recomputed from the statistics, was inf − inf.
    ±inf is the end of an unbounded support (an overflow rounds onto it) and a proper message's density
    vanishes there: weight 0, the limit, exact — the answer is the tilted distribution of the factor as
    declared, here N(2, 1/3) truncated to x ≤ 1."""
    from scipy import stats

    f = _bad_output_factor("inf")
    inc = {"x": Gaussian([2.0], [0.5]), "z": Gaussian([2.0], [1.0])}
    q = MessageImportanceSampler(f, random_state=0).belief(inc, "x")
    t = stats.truncnorm(-np.inf, (1.0 - 2.0) / np.sqrt(1 / 3), loc=2.0, scale=np.sqrt(1 / 3))
    assert float(Gaussian([t.mean()], [t.var()]).kl(q)[0]) < 2e-3


def test_an_overflow_to_inf_of_a_builtin_factor_is_still_weighted_not_refused():
    """±inf is the end of an unbounded support a value can round onto (e^x = inf for x > 709.8): where
    the factor's own statistics weigh it (exp's (e^x, x)), the row is answered as before — only an
    infinite draw whose weight cannot be told is refused."""
    from kjit.factors import get_factor

    f = get_factor("exp")
    inc = {"x": Gaussian([708.0], [4.0]), "y": Gamma([2.0], [1e-307])}
    exact = QuadratureOracle(f).belief(inc, "x")
    q = MessageImportanceSampler(f, random_state=0).belief(inc, "x")
    assert float(exact.kl(q)[0]) < 1e-3


def test_a_training_set_counts_its_dropped_pairs_by_cause_and_keeps_the_first_error():
    """Found by an audit: a training run whose sampler returned NaN on most messages "succeeded" with
    n_failed 45 of 50 and no cause; one where every message failed said only "the oracle failed on every
    message".  meta["failures"] = {cause: {count, first_message, first_error}}, joined across sets."""
    from kjit.training import TrainingSet, make_training_set

    f = _bad_output_factor("nan")
    xm = np.array([-1.0, -3.0, 2.0, -4.0, 3.0, -2.5])
    inc = {"x": Gaussian(xm, np.array([0.6, 0.25, 0.5, 0.25, 0.5, 0.2])), "z": Gaussian(xm, np.full(6, 4.0))}
    ts = make_training_set(f, "x", inc, MessageImportanceSampler(f, random_state=0), random_state=0, chunk_size=4)
    assert len(ts) == 3 and ts.meta["n_failed"] == 3
    rec = ts.meta["failures"]["sampler returned NaN"]
    assert rec["count"] == 3 and rec["first_message"] == 0 and "NaN" in rec["first_error"]
    both = TrainingSet.concatenate([ts, ts])
    rec2 = both.meta["failures"]["sampler returned NaN"]
    assert rec2["count"] == 6 and rec2["first_message"] == 0
    with pytest.raises(OracleError, match=r"failed on every message: 2 × sampler returned NaN; .*factor 'nan_above_one'"):
        make_training_set(f, "x", {v: m[[2, 4]] for v, m in inc.items()}, MessageImportanceSampler(f, random_state=0),
                          random_state=0)


def test_bounded_but_heavy_tailed_weights_get_more_particles_then_are_refused():
    """Audit (forty-fourth session): k̂ was computed only where the weight (the output's message) has an unbounded
    density, but bounded weights can be heavy-tailed in a sample too — exp → y at x N(1.966, 0.189), y Gamma(17.3,
    0.166) answered (log shape, log rate) (3.27, −0.29) for the exact (2.53, −1.22), 9 reported standard errors off,
    at ESS 58 (k̂ 1.55).  Now every row's k̂ is checked: a bounded row gets more particles, and where its weights are
    still heavy-tailed at the cap it is refused by row; a row beside it is answered within its standard errors."""
    from kjit.factors import get_factor

    f = get_factor("exp")
    inc = {"x": Gaussian([1.966, 0.5], [0.189, 0.3]), "y": Gamma([17.3, 3.0], [0.166, 2.0])}
    exact = QuadratureOracle(f).belief(inc, "y").to_coords()
    for seed in range(3):
        s = MessageImportanceSampler(f, target_se=0.05, random_state=seed)
        with pytest.raises(OracleError, match="heavy-tailed") as e:
            s.belief(inc, "y")
        assert e.value.rows.tolist() == [0] and s.last_n_samples_[0] == s.max_samples and s.last_khat_[0] > 0.7
        q = s.belief({v: m[1:] for v, m in inc.items()}, "y")
        assert np.all(np.abs(q.to_coords()[0] - exact[1]) < 5 * s.last_se_[0])


def test_a_pilot_without_a_weighted_particle_is_given_more():
    """Audit (forty-fourth session): probit (ε 0) with f's message N(3.5, 1) and the label 0 weighs the particles
    with f < 0, P 2.3e-4: a pilot of 2 000 drew none (seeds 2, 3, 5), its estimate 0/0, and the row was refused as
    hopeless after 2 000 particles where the cap's 256 000 answer it (ESS ~60).  Now such a row gets more
    particles; answered, it is within 5 of its standard errors of the exact belief."""
    from kjit.families import Bernoulli
    from kjit.factors import get_factor

    f = get_factor("probit_noise")
    inc = {"f": Gaussian(3.5, 1.0), "y": Bernoulli(0.0)}
    exact = QuadratureOracle(f).belief(inc, "f").to_coords()[0]
    answered = 0
    for seed in (2, 3):
        s = MessageImportanceSampler(f, target_se=0.05, random_state=seed)
        try:
            q = s.belief(inc, "f")
        except LowESSError:
            assert s.last_n_samples_[0] == s.max_samples  # (not at the pilot's 2 000)
            continue
        answered += 1
        assert s.last_n_samples_[0] == s.max_samples
        assert np.all(np.abs(q.to_coords()[0] - exact) < 5 * s.last_se_[0])
    assert answered >= 1


def test_the_shared_proposal_refuses_a_message_wider_than_itself():
    """Audit (forty-fourth session): logistic → x with x's message N(0, 1000) against the paper's shared proposal
    N(0, 200): m/r is unbounded, the weights heavy-tailed (k̂ 0.8), and the oracle answered a variance of 263–310
    for the exact 365 at ESS 692–3 252.  k̂ is checked where an input's message against its proposal can be
    unbounded (``Family.unbounded_ratio``): refused by row; a message narrower than the proposal is answered."""
    inc = {"x": Gaussian([0.0, 0.0], [1000.0, 30.0]), "z": Beta([2.0, 2.0], [1.0, 1.0])}
    o = ImportanceSamplingOracle(Logistic(), n_samples=200_000, random_state=0)
    with pytest.raises(OracleError, match="heavy-tailed") as e:
        o.belief(inc, "x")
    assert e.value.rows.tolist() == [0] and o.last_khat_[0] > 0.7
    q = o.belief({v: m[1:] for v, m in inc.items()}, "x")
    assert float(QuadratureOracle(Logistic()).belief({v: m[1:] for v, m in inc.items()}, "x").kl(q)[0]) < 1e-3


@pytest.mark.parametrize("m,r,want", [
    (Gaussian([0.0, 0.0, 1.0, 0.0], [300.0, 100.0, 200.0, 200.0]), Gaussian(0.0, 200.0), [True, False, True, False]),
    (Beta([0.5, 2.0, 2.0, 1.0], [2.0, 0.5, 2.0, 1.0]), Beta(1.0, 1.0), [True, True, False, False]),
    (Gamma([0.5, 2.0, 2.0, 3.0, 1.0], [1.0, 0.5, 1.0, 0.1, 0.1]), Gamma(1.0, 0.1),
     [True, False, False, True, False])])
def test_unbounded_ratio_against_the_log_ratio_on_a_grid(m, r, want):
    """Where m / r grows without bound is where its log climbs towards the support's ends: checked against the log
    ratio evaluated ever closer to them (an independent reading of the closed forms)."""
    got = np.asarray(m.unbounded_ratio(r.broadcast_to(m.shape)), bool)
    assert got.tolist() == want
    if isinstance(m, Gaussian):
        ends = [np.array([-1e3, -1e5]), np.array([1e3, 1e5])]
    elif isinstance(m, Beta):
        ends = [np.array([1e-3, 1e-9]), np.array([1 - 1e-3, 1 - 1e-9])]
    else:
        ends = [np.array([1e-3, 1e-9]), np.array([1e3, 1e5])]
    for i, w in enumerate(want):
        mi, ri = m[i:i + 1], r
        def log_ratio(x):
            return np.asarray(mi.log_pdf(x) - ri.log_pdf(x), float).ravel()[0]

        climbs = any(log_ratio(x[1:]) > log_ratio(x[:1]) + 1.0 for x in ends)
        assert climbs == w, (i, mi, ri)


def test_log_partition_refuses_the_rows_belief_refuses():
    """Audit (forty-fourth session): log_partition answered every row — exp at x N(0, 0.01), y Gamma(400, 4) gave
    −1 323.8 at ESS 1.04 for the exact −772.7, where belief() refuses the row.  Now an OracleError naming it; a row
    the sampler can answer is within a few of its standard errors (≈ 1/√ESS) of the exact log partition."""
    from kjit.factors import get_factor

    f = get_factor("exp")
    inc = {"x": Gaussian([0.0, 0.0], [0.01, 0.01]), "y": Gamma([2.0, 400.0], [1.0, 4.0])}
    s = MessageImportanceSampler(f, random_state=0, max_samples=4000, n_initial=1000)
    with pytest.raises(OracleError) as e:
        s.log_partition(inc)
    assert e.value.rows.tolist() == [1]
    one = {v: m[:1] for v, m in inc.items()}
    lz = s.log_partition(one)
    assert abs(lz[0] - QuadratureOracle(f).log_partition(one)[0]) < 5 / np.sqrt(s.last_ess_[0])


def test_no_message_to_an_observed_label_as_belief_over_incoming():
    """Audit (forty-fourth session): probit (ε 0.1) with f N(1, 1) and the label observed 0 — the exact rule's
    message to y is Bernoulli(0.773); the samplers' belief / incoming gave Bernoulli(1.0) (the weight floor's 3e-151
    over 0) and Bernoulli(NaN).  The quotient has no value at a point mass: an OracleError naming those rows."""
    from kjit.factors import get_factor
    from kjit.families import Bernoulli

    f = get_factor("probit_noise", eps=0.1)
    inc = {"f": Gaussian([1.0, 1.0], [1.0, 1.0]), "y": Bernoulli([0.0, 0.4])}
    exact = QuadratureOracle(f).message({v: m[:1] for v, m in inc.items()}, "y").p[0]
    assert exact == pytest.approx(0.773076, abs=1e-6)
    for oracle in (ImportanceSamplingOracle(f, n_samples=100_000, random_state=0),
                   MessageImportanceSampler(f, random_state=0)):
        with pytest.raises(OracleError, match="point mass") as e:
            oracle.message(inc, "y")
        assert e.value.rows.tolist() == [0]
        # (one observed label sent with a batch stands for every row; an empty batch is named as before — review)
        with pytest.raises(OracleError, match="point mass") as e:
            oracle.message({"f": inc["f"], "y": Bernoulli(0.0)}, "y")
        assert e.value.rows.tolist() == [0, 1]
        with pytest.raises(ValueError, match="holds no messages"):
            oracle.message({"f": Gaussian(np.zeros(0), np.ones(0)), "y": Bernoulli(np.zeros(0))}, "y")
        got = oracle.message({v: m[1:] for v, m in inc.items()}, "y").p[0]
        want = QuadratureOracle(f).message({v: m[1:] for v, m in inc.items()}, "y").p[0]
        assert abs(got - want) < 0.02


def test_heavy_bounded_weights_under_a_target_ess_run_to_the_cap_and_stop():
    """Found in review: with ``target_ess`` a row whose bounded weights stayed heavy-tailed kept its particle count
    round after round while its ESS met the target (exp, x N(0, 10), y Gamma(2, 1e-6): 600–1 600 rounds, 19–51
    million particles; at x variance 16 no answer in 150 s).  It grows to the cap like any heavy row, then is
    answered or refused there."""
    from kjit.factors import get_factor

    f = get_factor("exp")
    for v in (10.0, 16.0):
        inc = {"x": Gaussian(0.0, v), "y": Gamma(2.0, 1e-6)}
        s = MessageImportanceSampler(f, target_ess=50.0, random_state=0)
        rounds = []
        orig = s._round

        def counted(flat, rows, n, to, orig=orig):
            rounds.append(n)
            return orig(flat, rows, n, to)

        s._round = counted
        try:
            s.belief(inc, "y")
        except OracleError:
            pass
        assert len(rounds) <= 10 and sum(rounds) <= 2 * s.max_samples + 10 * s.n_initial
