"""benchmarks/factor_suite.py's opt-in flags (the figures themselves come from the benchmark)."""

from __future__ import annotations

import json

import numpy as np

from benchmark_modules import load_benchmark


def _suite():
    return load_benchmark("factor_suite.py")


#: a tiny run: one factor, --quick, few pairs
TINY = ["--quick", "--factors", "gamma_rate", "--n-train", "300", "--n-cal", "100", "--n-test", "200"]


def _lines(capsys) -> list:
    """The JSON lines the suite printed since the last read."""
    return [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]


def _rows(lines) -> tuple[list, dict]:
    """(the direction rows, the summary line) of the suite's lines; both present."""
    rows = [r for r in lines if "direction" in r]
    summary = lines[-1]
    assert rows and summary["summary"]
    return rows, summary


def test_ensemble_flag_adds_its_keys(capsys):
    """--ensemble K adds the ensemble's keys (suffixes _ens and _enssum) and summary counts, every
    existing key kept; a tiny run (one factor, --quick, few pairs)."""
    suite = _suite()
    argv = TINY
    suite.main(argv + ["--ensemble", "2"])
    lines = _lines(capsys)
    rows, summary = _rows(lines)
    for r in rows:
        for key in ("mean_log_kl", "flagged_fraction_needed", "worst1pct_flagged_at_q90", "flagged_fraction_at_q90",
                    "worst1pct_flagged_at_budget90", "flagged_fraction_at_budget90", "flagged_fraction_needed_kl"):
            assert key in r
            for tag in ("_ens", "_enssum"):
                if key not in ("mean_log_kl", "flagged_fraction_needed_kl"):
                    assert 0.0 <= r[key + tag] <= 1.0
        assert r["mean_log_kl_ens"] < 0 and r["ensemble_members"] == 2 and r["ensemble_hyperparameters"] == "shared"
        assert 0.0 <= r["flagged_fraction_needed_ensmean"] <= 1.0
    for key in ("n_met_at_q90_ens", "n_met_at_budget90_ens", "n_flagged_fraction_needed_le_006_ens",
                "n_met_at_q90_enssum", "n_met_at_budget90_enssum", "n_flagged_fraction_needed_le_006_enssum",
                "n_mean_log_kl_ens_lower"):
        assert 0 <= summary[key] <= len(rows)
    # without the flag: none of them, the rest as before
    suite.main(argv)
    plain = _lines(capsys)
    assert not any("ens" in k for r in plain for k in r)
    assert set(plain[-1]) == {k for k in summary if "ens" not in k}


def test_choose_uncertainty_flag_adds_its_keys(capsys):
    """--choose-uncertainty (with --ensemble) adds the chosen uncertainty's figures (suffix _choice),
    the choice and its scores, and the summary's counts; every other key and value as with
    --ensemble alone (timings aside); refused without --ensemble."""
    import pytest

    suite = _suite()
    argv = TINY + ["--ensemble", "2"]
    suite.main(argv + ["--choose-uncertainty"])
    lines = _lines(capsys)
    rows, summary = _rows(lines)
    for r in rows:
        assert r["uncertainty_choice"] in ("max", "kl", "enssum")
        assert r["error_model_choice"] in ("none", "additive", "ratio")
        assert len(r["uncertainty_choice_scores"]) == 9
        for key in ("worst1pct_flagged_at_q90", "flagged_fraction_at_q90", "worst1pct_flagged_at_budget90",
                    "flagged_fraction_at_budget90", "flagged_fraction_needed"):
            assert 0.0 <= r[key + "_choice"] <= 1.0
    assert sum(summary["uncertainties_choice"].values()) == len(rows)
    for key in ("n_met_at_q90_choice", "n_met_at_budget90_choice", "n_flagged_fraction_needed_le_006_choice"):
        assert 0 <= summary[key] <= len(rows)
    suite.main(argv)
    plain = _lines(capsys)
    timing = ("oracle_us_per_msg", "predict_us_per_msg", "ensemble_fit_seconds", "seconds")
    for a, b in zip(plain, lines):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing and "choice" not in k}
    with pytest.raises(SystemExit):
        suite.main(["--quick", "--choose-uncertainty"])


def test_novelty_figures_match_a_direct_computation():
    """novelty_figures' distances against scipy's pairwise distances on the operator's inner
    features (a test row copied from the training rows is at distance 0, a shifted one is not),
    the ranking figures are flagged_share_needed of those, and the choice's score for u alone is
    the library's pooled uncertainty's (kjit.learn.calibration._pooled: calibration rows, then the
    training rows left out by group)."""
    import numpy as np
    from scipy.spatial.distance import cdist

    from kjit.learn.calibration import _pooled
    from kjit.operators import flagged_share_needed

    suite = _suite()
    f, op, data, cal, groups, cal_groups, test, u, kl, worst = _novelty_case()
    got = suite.novelty_figures(op, data, groups, cal, cal_groups, test, u, kl, worst, 2)

    def phi(incoming):
        return op.features_.inner(op.feature_inputs(f.check_incoming(incoming, "x")[0]))

    d = cdist(phi(test), phi(data.incoming), "sqeuclidean").min(axis=1) / op.features_.gamma2_
    assert np.all(d[:20] <= 1e-9) and np.all(d[20:] > 1e-3)
    assert np.isclose(got["novelty_median"], np.median(d), rtol=1e-9, atol=1e-12)
    assert np.isclose(got["novelty_p99"], np.quantile(d, 0.99), rtol=1e-9, atol=1e-12)
    assert got["flagged_fraction_needed_novelty"] == flagged_share_needed(d, kl)
    u_pool, kl_pool = _pooled(op, cal, data, groups, labels=True)
    assert got["novelty_choice_scores"]["u"] == flagged_share_needed(u_pool, np.maximum(kl_pool, 1e-300))
    assert got["novelty_chosen"] == (got["novelty_choice_scores"]["union"] < got["novelty_choice_scores"]["u"])
    assert ("flagged_fraction_at_q90_novchoice" in got) == got["novelty_chosen"]

    # the density guard, recomputed row by row: the mean kernel value ψ(x)·ψ̄ to the training rows
    # (ψ̄ without a training row's own group), flagged below the pooled rows' lower conformal 1 %
    # quantile (the k-th smallest of n, k = floor((n + 1) 0.01))
    def psi(incoming):
        return op.features_.transform(op.feature_inputs(f.check_incoming(incoming, "x")[0]))

    P, C, T = psi(data.incoming), psi(cal.incoming), psi(test)
    pooled = [float(c @ P.mean(axis=0)) for c in C]
    pooled += [float(P[i] @ P[groups != groups[i]].mean(axis=0)) for i in range(len(P))]
    k = int(np.floor((len(pooled) + 1) * 0.01))
    assert k >= 1
    guard = T @ P.mean(axis=0) < np.sort(pooled)[k - 1]
    assert guard[20:].all() and not guard[:20].any()  # the shifted rows are the sparse ones
    g = suite._density_guard(op, data, groups, cal, test, u, kl, worst, {"t": np.inf, "s": -np.inf})
    assert g["guard_flagged_fraction"] == np.mean(guard)
    assert "max_kl_unflagged_at_t" not in g and g["max_kl_unflagged_at_t_guard"] == kl[~guard].max()
    assert g["flagged_fraction_at_t_guard"] == np.mean(guard)
    assert g["max_kl_unflagged_at_s_guard"] is None and g["flagged_fraction_at_s_guard"] == 1.0


def test_novelty_and_problems_scale_flags(capsys):
    """--novelty adds its keys (rows and summary) and changes no other; --problems-scale draws the
    same pair counts from S times the problems."""
    suite = _suite()
    argv = TINY
    suite.main(argv)
    plain = _lines(capsys)
    suite.main(argv + ["--novelty"])
    lines = _lines(capsys)
    timing = ("oracle_us_per_msg", "predict_us_per_msg", "seconds")
    assert len(plain) == len(lines)
    added = ("flagged_fraction_needed_novelty", "flagged_fraction_needed_union", "novelty_median", "novelty_p99",
             "novelty_chosen", "novelty_choice_scores", "n_novelty_chosen")
    for a, b in zip(plain, lines):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing and k not in added and "novchoice" not in k
             and "guard" not in k
             and not k.startswith("n_flagged_fraction_needed_le_006_novelty")
             and not k.startswith("n_flagged_fraction_needed_le_006_union")}
    rows = [r for r in lines if "direction" in r]
    assert rows and all(0.0 <= r[k] <= 1.0 for r in rows for k in added[:2])
    for at in ("q90", "budget90"):  # the worst confident error, in the default rows and summary
        assert all(r[f"max_kl_unflagged_at_{at}"] is None or r[f"max_kl_unflagged_at_{at}"] >= 0.0 for r in rows)
        assert lines[-1][f"max_kl_unflagged_at_{at}"] == max(r[f"max_kl_unflagged_at_{at}"] or 0.0 for r in rows)
    for r in rows:  # the chosen score's figures: the headline's where u alone was kept
        for k in ("flagged_fraction_needed", "flagged_fraction_at_q90", "worst1pct_flagged_at_budget90"):
            assert 0.0 <= r[k + "_novchoice"] <= 1.0
            assert r["novelty_chosen"] or r[k + "_novchoice"] == r[k]
    for k in ("n_flagged_fraction_needed_le_006_union", "n_met_at_q90_novchoice", "n_met_at_budget90_novchoice",
              "n_novelty_chosen"):
        assert 0 <= lines[-1][k] <= len(rows)
    suite.main(argv + ["--problems-scale", "2"])
    scaled = _lines(capsys)
    n = [sum(r["n_problems"].values()) for r in (plain[0], scaled[0])]
    assert n == [21, 42]


def test_novelty_union_when_chosen(monkeypatch):
    """The union's branch (forced: its pooled score made the smaller): its test figures against a
    direct computation — each score's pooled empirical CDF, the larger of the two, the conformal
    90 % quantile of the pooled scores as the q90 threshold."""
    import numpy as np
    from scipy.spatial.distance import cdist

    from kjit.learn.calibration import _pooled

    suite = _suite()
    f, op, data, cal, groups, cal_groups, test, u, kl, worst = _novelty_case()
    real, calls = suite.flagged_share_needed, []

    def forced(a, b):  # the pooled scores: u's first (1.0), the union's second (0.0)
        calls.append(1)
        return {1: 1.0, 2: 0.0}.get(len(calls), real(a, b))

    monkeypatch.setattr(suite, "flagged_share_needed", forced)
    got = suite.novelty_figures(op, data, groups, cal, cal_groups, test, u, kl, worst, 2)
    assert got["novelty_chosen"]

    def phi(incoming):
        return op.features_.inner(op.feature_inputs(f.check_incoming(incoming, "x")[0]))

    P = phi(data.incoming)
    g2 = op.features_.gamma2_
    D = cdist(P, P, "sqeuclidean")
    D[groups[:, None] == groups[None, :]] = np.inf
    d_pool = np.r_[cdist(phi(cal.incoming), P, "sqeuclidean").min(axis=1), D.min(axis=1)] / g2
    d = cdist(phi(test), P, "sqeuclidean").min(axis=1) / g2
    u_pool, _ = _pooled(op, cal, data, groups, labels=True)

    def cdf(pool, v):
        return np.array([np.mean(pool <= t) for t in v])

    s_pool = np.maximum(cdf(u_pool, u_pool), cdf(d_pool, d_pool))
    s = np.maximum(cdf(u_pool, u), cdf(d_pool, d))
    thr = np.sort(s_pool)[int(np.ceil((s_pool.size + 1) * 0.9)) - 1]
    assert np.isclose(got["flagged_fraction_at_q90_novchoice"], np.mean(s > thr))
    assert np.isclose(got["worst1pct_flagged_at_q90_novchoice"], np.mean((s > thr)[worst]))
    assert got["flagged_fraction_needed_novchoice"] == real(s, kl)
    assert 0.0 <= got["flagged_fraction_at_budget90_novchoice"] <= 1.0


def _novelty_case():
    """A small logistic → x operator (12 training problems of 20 rows, 3 calibration problems),
    40 test rows — 20 copied from the training rows, 20 shifted far from them — and random u, KL."""
    import numpy as np

    from kjit.factors import Logistic
    from kjit.families import Beta, Gaussian
    from kjit.operators import KernelOperator
    from kjit.oracles import QuadratureOracle
    from kjit.training import logistic_incoming, make_training_set

    f = Logistic()
    oracle = QuadratureOracle(f)
    data = make_training_set(f, "x", logistic_incoming, oracle, n=240, random_state=0)
    cal = make_training_set(f, "x", logistic_incoming, oracle, n=60, random_state=1)
    groups, cal_groups = np.arange(240) // 20, np.arange(60) // 20
    op = KernelOperator(f, "x", n_inner=50, n_outer=80, random_state=0).fit(data)
    x, z = data.incoming["x"], data.incoming["z"]
    test = {"x": Gaussian(np.r_[x.mean()[:20], x.mean()[:20] + 40.0], np.r_[x.var()[:20], x.var()[:20]]),
            "z": Beta(np.r_[z.alpha[:20], z.alpha[:20]], np.r_[z.beta[:20], z.beta[:20]])}
    rng = np.random.default_rng(0)
    u, kl = rng.standard_normal(40), np.exp(rng.standard_normal(40))
    return f, op, data, cal, groups, cal_groups, test, u, kl, kl >= np.quantile(kl, 0.99)


def test_kl_model_flag_adds_its_keys_and_changes_nothing_else(capsys):
    """--kl-model adds the learned log KL's figures (suffix _klmodel: thresholds, flagged shares,
    worst 1 % flagged, ranking) and the summary's counts; every other key and value as without it
    (timings aside) — the KL model reads the operator, it does not change it."""
    suite = _suite()
    argv = TINY
    suite.main(argv + ["--kl-model"])
    lines = _lines(capsys)
    rows, summary = _rows(lines)
    for r in rows:
        for at in ("q90", "budget90", "budget90_pred"):
            assert 0.0 <= r[f"flagged_fraction_at_{at}_klmodel"] <= 1.0
            assert 0.0 <= r[f"worst1pct_flagged_at_{at}_klmodel"] <= 1.0
            assert isinstance(r[f"threshold_{at}_klmodel"], float)
        assert 0.0 < r["flagged_fraction_needed_klmodel"] <= 1.0
        assert -1.0 <= r["rank_corr_logvar_kl_klmodel"] <= 1.0
        # the JIT's rule with the learned KL flags the threshold's rows and those of the sign test
        jit, thr = r["flagged_fraction_at_budget975p_klmodel_jit"], r["flagged_fraction_at_budget975p_klmodel"]
        assert jit >= thr and np.isclose((jit - thr) * r["n_test"], r["n_jit_differs_klmodel"])
        assert r["worst1pct_flagged_at_budget975p_klmodel_jit"] >= r["worst1pct_flagged_at_budget975p_klmodel"]
        # the threshold topped up by the budget, the test rows one request: the rank's top 10 % where the
        # threshold's rows fit in it (they are the top scores), else the threshold's rows alone
        fits = round(jit * r["n_test"]) <= np.floor(0.1 * r["n_test"])
        same = "rank10_klmodel_jit" if fits else "budget975p_klmodel_jit"
        for what in ("flagged_fraction", "worst1pct_flagged"):
            assert r[f"{what}_at_rank10_klmodel_topup_jit"] == r[f"{what}_at_{same}"]
    for key in ("n_met_at_q90_klmodel", "n_met_at_budget90_klmodel", "n_met_at_budget90_pred_klmodel",
                "n_met_at_budget975p_klmodel_jit", "n_met_at_rank10_klmodel_topup_jit",
                "n_flagged_fraction_needed_le_006_klmodel"):
        assert 0 <= summary[key] <= len(rows)
    suite.main(argv)
    plain = _lines(capsys)
    timing = ("oracle_us_per_msg", "predict_us_per_msg", "seconds", "kl_model_fit_seconds", "kl_model_us_per_msg")
    for a, b in zip(plain, lines):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing and "klmodel" not in k and not k.startswith("kl_model")}


def test_exact_kl_figures_rank_perfectly(capsys):
    """Every row reports the threshold rules with each row's exact KL as its uncertainty (suffix
    _exactkl; a ceiling) and the summary counts them.  A perfect ranking flags a top set of the KL, as
    the worst 1 % is: either every worst row is flagged, or every flagged row is among the worst 1 % —
    a score that is not the test rows' KL (the predicted variance, say) breaks this."""
    suite = _suite()
    suite.main(TINY)
    lines = _lines(capsys)
    rows, summary = _rows(lines)
    for r in rows:
        for at in ("q90", "budget90", "budget975p"):
            ff, w = r[f"flagged_fraction_at_{at}_exactkl"], r[f"worst1pct_flagged_at_{at}_exactkl"]
            assert 0.0 <= ff <= 1.0
            assert w == 1.0 or ff * r["n_test"] <= np.ceil(0.01 * r["n_test"]) + 1e-9, (at, ff, w)
    for at in ("q90", "budget90", "budget975p"):
        assert 0 <= summary[f"n_met_at_{at}_exactkl"] <= len(rows)


def test_float_resolution_is_one_double_a_parameter():
    """float_resolution_kl: the KL to a belief's neighbours one double away, summed over parameters — for a
    Gaussian of variance 1e-10 at mean 10.7 the mean's ulp (1.78e-15) is KL ulp² / 2e-10 = 1.58e-20 (the variance's
    ~1e-32, what a mean of 0 leaves); at_float_resolution keeps an answer one ulp off in the mean and the
    variance, and not one two ulps off in the mean; a Gamma belief likewise, batched."""
    from kjit.families import Gamma, Gaussian

    suite = _suite()
    mean = np.array([10.7, -2.3, 0.0])
    q = Gaussian(mean, np.full(3, 1e-10))
    res = suite.float_resolution_kl(q)
    ulp = np.spacing(np.abs(mean))
    assert np.allclose(res[:2], ulp[:2] ** 2 / 2e-10, rtol=1e-6, atol=0) and 0 < res[2] < 1e-30, res
    off1 = Gaussian(mean + ulp, np.nextafter(np.full(3, 1e-10), 1.0))
    off2 = Gaussian(mean + 2 * ulp, np.full(3, 1e-10))
    assert np.all(suite.at_float_resolution(q.kl(off1), q))
    assert not np.any(suite.at_float_resolution(q.kl(off2), q)[:2])
    g = Gamma(np.array([3.0, 5e3]), np.array([2.0, 0.1]))
    assert np.all(suite.float_resolution_kl(g) > 0) and np.all(suite.float_resolution_kl(g) < 1e-26)
    moved = Gamma(np.nextafter(g.shape_param, np.inf), g.rate)
    assert np.all(suite.at_float_resolution(g.kl(moved), g))
    assert not np.any(suite.at_float_resolution(g.kl(Gamma(g.shape_param * (1 + 1e-9), g.rate)), g))


def test_pool_counts_a_worst_1pct_at_float_resolution_apart(tmp_path, capsys):
    """--pool with the _resolved readings: a test set whose worst 1 % lies wholly at float resolution (None) has
    nothing a double can show; it counts by its flagged share alone, apart (n_sets_worst_at_float_resolution_*),
    and the worst 1 % flagged is averaged over the other sets."""
    suite = _suite()
    paths = []
    for seed, (w, w_res, ff) in enumerate([(0.8, None, 0.1), (1.0, 1.0, 0.09), (0.9, 0.9, 0.08)]):
        row = {"factor": "gaussian", "direction": "x", "mean_log_kl": -90.0,
               "worst1pct_flagged_at_rank10_klmodel_jit": w, "flagged_fraction_at_rank10_klmodel_jit": ff,
               "worst1pct_flagged_at_rank10_klmodel_jit_resolved": w_res,
               "flagged_fraction_at_rank10_klmodel_jit_resolved": ff}
        path = tmp_path / f"run{seed}.jsonl"
        path.write_text(json.dumps(row) + "\n" + json.dumps({"summary": True}) + "\n")
        paths.append(str(path))
    suite.main(["--pool", *paths])
    out = _lines(capsys)
    (x,) = [r for r in out if "direction" in r]
    assert np.isclose(x["worst1pct_flagged_mean_rank10_klmodel_jit"], 2.7 / 3)
    assert not x["met_pooled_rank10_klmodel_jit"] and x["n_sets_met_rank10_klmodel_jit"] == 1
    assert np.isclose(x["worst1pct_flagged_mean_rank10_klmodel_jit_resolved"], 0.95)
    assert x["met_pooled_rank10_klmodel_jit_resolved"] and x["n_sets_met_rank10_klmodel_jit_resolved"] == 2
    assert x["n_sets_worst_at_float_resolution_rank10_klmodel_jit_resolved"] == 1
    assert "n_sets_worst_at_float_resolution_rank10_klmodel_jit" not in x
    # every set at resolution: met by the share alone, no mean
    for p in paths:
        row = json.loads(open(p).readline())
        row["worst1pct_flagged_at_rank10_klmodel_jit_resolved"] = None
        open(p, "w").write(json.dumps(row) + "\n")
    suite.main(["--pool", *paths])
    (x,) = [r for r in _lines(capsys) if "direction" in r]
    assert x["worst1pct_flagged_mean_rank10_klmodel_jit_resolved"] is None
    assert x["met_pooled_rank10_klmodel_jit_resolved"] and x["n_sets_met_rank10_klmodel_jit_resolved"] == 3
    # a NaN figure (a test KL that was NaN) is no resolution: not met, not counted apart
    for p in paths:
        row = json.loads(open(p).readline())
        row["worst1pct_flagged_at_rank10_klmodel_jit_resolved"] = float("nan")
        open(p, "w").write(json.dumps(row) + "\n")
    suite.main(["--pool", *paths])
    (x,) = [r for r in _lines(capsys) if "direction" in r]
    assert not x["met_pooled_rank10_klmodel_jit_resolved"] and x["n_sets_met_rank10_klmodel_jit_resolved"] == 0
    assert "n_sets_worst_at_float_resolution_rank10_klmodel_jit_resolved" not in x
