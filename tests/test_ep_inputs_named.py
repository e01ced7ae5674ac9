"""Inputs of the EP models and engines that were accepted silently or met Python's or numpy's own errors (audit,
forty-fourth session): each is now refused naming what is wrong, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.ep import GPClassifier, LinearEP, LogisticOperator, ProbitClassifier, expected_sigmoid
from kjit.ep.models import CompoundGammaPrecision
from kjit.ep.operators import ProbitNoiseOperator
from kjit.families import Beta
from kjit.factors import CompoundGamma
from kjit.oracles import QuadratureOracle


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return X, (X[:, 0] > 0).astype(int)


@pytest.mark.parametrize("n_folds", [1, 0])
def test_gp_tune_by_cross_validation_needs_two_folds(n_folds):
    """One fold tests on all the data and was skipped (zero: no fold): every grid point scored an error of 0 and the
    first won — length scale 1e-3, whose 5-fold error is 0.475 against 0.075 for 1.0."""
    X, y = _data()
    with pytest.raises(ValueError, match="n_folds"):
        GPClassifier().tune(X, y, [1e-3, 1.0], criterion="cv", n_folds=n_folds)
    assert GPClassifier().tune(X, y, [1e-3, 1.0], criterion="cv", n_folds=5).length_scale == 1.0


def test_gp_batch_and_empty_grids_are_named():
    X, y = _data()
    gp = GPClassifier().fit(X, y)
    for batch in (0, -1):
        with pytest.raises(ValueError, match="batch"):
            gp.predict_latent(X, batch=batch)
    with pytest.raises(ValueError, match="length_scales"):
        GPClassifier().tune(X, y, [])
    with pytest.raises(ValueError, match="eps_grid"):
        GPClassifier().tune(X, y, [1.0], eps_grid=[])


@pytest.mark.parametrize("x", [[1 + 5j, 2.0], ["1", "2"]])
def test_compound_gamma_observations_must_be_real_numbers(x):
    """Complex observations lost their imaginary part (numpy's ComplexWarning only), text was read as numbers."""
    model = CompoundGammaPrecision(QuadratureOracle(CompoundGamma()))
    with pytest.raises(ValueError, match="must be real numbers"):
        model.fit(x)
    with pytest.raises(ValueError, match=r"`xs\[0\]` must be real numbers"):
        model.fit_many([x])


@pytest.mark.parametrize("mean,var", [(0.0, -1.0), (0.0, np.nan), (np.nan, 1.0), (np.inf, 1.0)])
def test_expected_sigmoid_refuses_what_has_no_value(mean, var):
    with pytest.raises(ValueError, match="expected_sigmoid"):
        expected_sigmoid(mean, var)
    assert float(expected_sigmoid(0.0, 0.0)) == 0.5


def test_a_stop_rule_answering_an_array_is_named():
    X = np.random.default_rng(0).normal(size=(10, 2))
    with pytest.raises(TypeError, match="`stop_rule` must return True or False, got ndarray"):
        LinearEP(LogisticOperator(), stop_rule=lambda rec, m, c: np.abs(m) < 1).run(X, {"z": Beta(2.0, 1.0)})
    ok = LinearEP(LogisticOperator(), stop_rule=lambda rec, m, c: bool(rec.max_change < 1e-6))
    r = ok.run(X, {"z": Beta(2.0, 1.0)})
    assert r.converged
    # (a scalar that is not a bool still reads as one: None never stops the run — found in review)
    r = LinearEP(LogisticOperator(), max_iter=5, stop_rule=lambda rec, m, c: None).run(X, {"z": Beta(2.0, 1.0)})
    assert not r.converged and r.iterations == 5


def test_a_probit_fit_that_refuses_its_labels_keeps_its_eps_with_its_posterior():
    """``eps_`` was set before EP ran: with the operator swapped for another ε and the labels refused, it held the
    new ε while the posterior was the earlier fit's, and predict_proba mixed the two."""
    X, y = _data()
    model = ProbitClassifier(ProbitNoiseOperator(0.1)).fit(X, y)
    p = model.predict_proba(X[:3])
    model.operator = ProbitNoiseOperator(0.3)
    with pytest.raises(ValueError):
        model.fit(X, np.full(len(y), 7))
    assert model.eps_ == 0.1
    np.testing.assert_array_equal(model.predict_proba(X[:3]), p)
