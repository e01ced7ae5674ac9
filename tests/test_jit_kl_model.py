"""benchmarks/jit_kl_model.py: EP through JIT operators of both rules (the figures come from the benchmark)."""

from __future__ import annotations

import json

import numpy as np

from benchmark_modules import load_benchmark


def _bench():
    return load_benchmark("jit_kl_model.py")


def test_ep_runs_through_both_rules_and_the_flags_are_the_consultations(capsys):
    """A tiny run (gamma_rate, few pairs, 30 sweeps, with the density guard): one line per rule and a
    summary per rule; with selection "all" the rows the rule flags on screening (threshold, sign test
    and guard) are exactly the rows the JIT consults; the shares are shares, and the posterior is
    compared only where both EP runs converged."""
    _bench().main(["--quick", "--factors", "gamma_rate", "--n-train", "300", "--n-cal", "100", "--n-test", "200",
                   "--max-iter", "30", "--density-guard"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    rows = [r for r in lines if not r.get("summary")]
    summaries = [r for r in lines if r.get("summary")]
    assert [r["rule"] for r in rows] == ["predictive", "learned_kl"]
    assert [s["rule"] for s in summaries] == ["predictive", "learned_kl"]
    for r in rows:
        assert r["directions"] == ["r", "x"]
        assert r["requests"] > 0 and r["ep_errors"] == 0
        assert r["n_screen_mismatch"] == 0
        assert 0.0 < r["consultation_rate"] < 1.0
        assert 0.0 <= r["worst1pct_flagged"] <= 1.0
        assert r["n_converged_both"] <= r["n_converged_exact"] <= r["test_problems"]
        assert (r["n_posterior_values"] > 0) == (r["n_converged_both"] > 0)
        assert r["n_without_exact"] == 0
        assert set(r["threshold"]) == set(r["density_guard"]) == set(r["by_direction"]) == {"r", "x"}
        by = r["by_direction"].values()
        assert sum(d["requests"] for d in by) == r["requests"]
        assert np.isclose(sum(d["consultation_rate"] * d["requests"] for d in by), r["consultation_rate"] * r["requests"])
        assert all(d["n_screen_mismatch"] == 0 for d in by)
    for s, r in zip(summaries, rows):
        assert s["n_met"] == int(r["worst1pct_flagged"] >= 0.95 and r["consultation_rate"] <= 0.1)
