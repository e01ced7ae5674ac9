"""Options of the learned operators that were accepted and failed later, or were read otherwise than given (audit,
forty-fourth session): refused by name at construction now, or kept as given."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.operators import JITOperator, KernelOperator
from kjit.oracles import QuadratureOracle
from kjit.persistence import load_operator, save_operator
from kjit.training import logistic_incoming, make_training_set


@pytest.fixture(scope="module")
def pairs():
    return make_training_set(Logistic(), "x", logistic_incoming, QuadratureOracle(Logistic()), n=120, random_state=0)


def test_a_jit_s_operator_kwargs_in_numpy_values_save(tmp_path, pairs):
    """numpy values in operator_kwargs were accepted, the JIT learned, and saving it was a TypeError ("int64 is not
    JSON serializable") — its learned state lost.  They are kept as the Python values they are; a value JSON
    cannot hold is refused at construction."""
    kw = {"random_state": np.int64(0), "noise_vars": np.logspace(-8, -2, 4), "n_inner": np.int32(20), "n_outer": 30}
    jit = JITOperator(None, QuadratureOracle(Logistic()), to="x", initial_batch=60, operator_kwargs=kw)
    jit.belief({v: m[:60] for v, m in pairs.incoming.items()})
    save_operator(jit, tmp_path / "j.npz")
    back = load_operator(tmp_path / "j.npz")
    probe = {v: m[60:] for v, m in pairs.incoming.items()}
    assert back.operator.predict(probe)[0] == jit.operator.predict(probe)[0]
    assert back.operator_kwargs["random_state"] == 0
    assert back.operator_kwargs["noise_vars"] == list(np.logspace(-8, -2, 4))
    with pytest.raises(ValueError, match="`operator_kwargs` must be plain values"):
        JITOperator(None, QuadratureOracle(Logistic()), to="x", operator_kwargs={"noise_vars": object()})
    # a Generator seed, which a KernelOperator takes (and saves as None), is taken and saved as None (found in review)
    gen = JITOperator(None, QuadratureOracle(Logistic()), to="x", initial_batch=60,
                      operator_kwargs={"random_state": np.random.default_rng(0), "n_inner": 20, "n_outer": 30})
    gen.belief({v: m[:60] for v, m in pairs.incoming.items()})
    save_operator(gen, tmp_path / "g.npz")
    assert load_operator(tmp_path / "g.npz").operator_kwargs["random_state"] is None


@pytest.mark.parametrize("kw,match", [
    ({"density_guard": "0.1"}, "density_guard"), ({"initial_batch": 2.5}, "initial_batch"),
    ({"initial_batch": 1}, "initial_batch")])
def test_jit_options_are_named(kw, match):
    """density_guard "0.1" met numpy's TypeError; initial_batch 2.5 ran as 2."""
    with pytest.raises(ValueError, match=match):
        JITOperator(None, QuadratureOracle(Logistic()), to="x", **kw)


@pytest.mark.parametrize("kw,match", [({"treatment": "bogus"}, "treatment"), ({"dtype": int}, "dtype"),
                                      ({"dtype": np.float16}, "dtype")])
def test_kernel_operator_options_are_checked_at_construction(kw, match):
    """treatment and dtype were checked at fit (float16 after the whole hyperparameter search)."""
    with pytest.raises(ValueError, match=match):
        KernelOperator(Logistic(), "x", **kw)


def test_a_numpy_integer_seed_is_saved(tmp_path, pairs):
    """random_state np.int64(3) was accepted and saved as None: a reloaded operator's refit was not reproducible."""
    op = KernelOperator(Logistic(), "x", n_inner=20, n_outer=30, random_state=np.int64(3)).fit(pairs)
    save_operator(op, tmp_path / "o.npz")
    assert load_operator(tmp_path / "o.npz").random_state == 3
