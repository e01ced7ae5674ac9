"""benchmarks/factor_suite.py's opt-in flags (the figures themselves come from the benchmark)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _suite():
    spec = importlib.util.spec_from_file_location(
        "factor_suite_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "factor_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ensemble_flag_adds_its_keys(capsys):
    """--ensemble K adds the ensemble's keys (suffixes _ens and _enssum) and summary counts, every
    existing key kept; a tiny run (one factor, --quick, few pairs)."""
    suite = _suite()
    argv = ["--quick", "--factors", "gamma_rate", "--n-train", "300", "--n-cal", "100", "--n-test", "200"]
    suite.main(argv + ["--ensemble", "2"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    rows = [r for r in lines if "direction" in r]
    summary = lines[-1]
    assert rows and summary["summary"]
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
    plain = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert not any("ens" in k for r in plain for k in r)
    assert set(plain[-1]) == {k for k in summary if "ens" not in k}


def test_choose_uncertainty_flag_adds_its_keys(capsys):
    """--choose-uncertainty (with --ensemble) adds the chosen uncertainty's figures (suffix _choice),
    the choice and its scores, and the summary's counts; every other key and value as with
    --ensemble alone (timings aside); refused without --ensemble."""
    import pytest

    suite = _suite()
    argv = ["--quick", "--factors", "gamma_rate", "--n-train", "300", "--n-cal", "100", "--n-test", "200",
            "--ensemble", "2"]
    suite.main(argv + ["--choose-uncertainty"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    rows = [r for r in lines if "direction" in r]
    summary = lines[-1]
    assert rows and summary["summary"]
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
    plain = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    timing = ("oracle_us_per_msg", "predict_us_per_msg", "ensemble_fit_seconds", "seconds")
    for a, b in zip(plain, lines):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing and "choice" not in k}
    with pytest.raises(SystemExit):
        suite.main(["--quick", "--choose-uncertainty"])
