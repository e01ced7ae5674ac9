"""JITOperator(learn_above_kl=…): a consulted row is learned only where the operator's prediction for
it was wrong by more than the level (KL[oracle's answer ‖ prediction]); the answer is the oracle's
either way.

Setting as in test_jit.py: the logistic factor, message to x, a small operator fitted on 400 inside
messages, the exact (quadrature) oracle.  The realized KLs are computed here independently: the
operator's own predictions before the request against the oracle's beliefs.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.families import Beta, Gaussian
from kjit.operators import JITOperator, KernelOperator, PredictionOverflowError
from kjit.oracles import QuadratureOracle
from kjit.persistence import load_operator, save_operator
from kjit.training import make_training_set

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

KW = dict(n_inner=60, n_outer=150, inner_factors=(0.25, 1.0), width_factors=(0.25, 1.0, 2.0),
          prior_vars=(0.1, 1.0, 10.0, 100.0, 1e3, 1e4), noise_vars=tuple(10.0 ** np.arange(-8.0, -0.5, 1.0)),
          random_state=0, reference="incoming")
CONSULT_ALL = -50.0  # a threshold below every row's log variance: every row goes to the oracle


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with (threadpool_limits(limits=1) if threadpool_limits else contextlib.nullcontext()):
        yield


def messages(n, seed, lo=-3.0, hi=3.0):
    rng = np.random.default_rng(seed)
    mean = rng.uniform(lo, hi, n)
    var = np.exp(rng.uniform(np.log(0.1), np.log(3.0), n))
    label = rng.random(n) < 0.5
    return {"x": Gaussian(mean, var), "z": Beta(np.where(label, 2.0, 1.0), np.where(label, 1.0, 2.0))}


@pytest.fixture(scope="module")
def oracle():
    return QuadratureOracle(Logistic())


@pytest.fixture(scope="module")
def op(oracle):
    train = make_training_set(oracle.factor, "x", messages, oracle, n=400, random_state=0)
    return KernelOperator(oracle.factor, "x", **KW).fit(train)


@pytest.fixture(scope="module")
def batch(op, oracle):
    """40 messages, half inside the training messages' range and half beyond it (means 4–6; none so far out
    that its pair would be refused), with the realized KL of the fitted operator's prediction for each."""
    inc = {v: type(a).concatenate([a, b]) for (v, a), b in
           zip(messages(20, 1).items(), messages(20, 2, 4.0, 6.0).values())}
    q, _ = op.predict(inc)
    kl = oracle.belief(inc, "x").kl(q)
    return inc, np.asarray(kl, float)


def learned_rows(jit):
    groups = jit.last_learned_groups_
    return np.sort(np.concatenate(groups)) if groups else np.zeros(0, int)


def test_only_rows_predicted_worse_than_the_level_are_learned(op, oracle, batch):
    inc, kl = batch
    level = float(np.median(kl))
    assert np.sum(kl > level) >= 10 and np.sum(kl <= level) >= 10  # (both kinds in the batch)
    jit = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=level)
    q, _, consulted = jit.predict(inc)
    assert consulted.all()
    np.testing.assert_array_equal(learned_rows(jit), np.flatnonzero(kl > level))
    assert jit.counters()["updates"] == int(np.sum(kl > level))
    exact = oracle.belief(inc, "x")  # the answers are the oracle's, learned or not
    for a, b in zip(q.params, exact.params):
        np.testing.assert_array_equal(a, b)
    # without the gate every consulted row is learned
    plain = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all")
    plain.predict(inc)
    np.testing.assert_array_equal(learned_rows(plain), np.arange(len(kl)))


def test_rows_within_the_level_leave_the_operator_unchanged(op, oracle, batch):
    inc, kl = batch
    jit = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all",
                      learn_above_kl=float(kl.max()) * 2)
    before = jit.operator.predict(inc)
    jit.predict(inc)
    assert jit.counters()["updates"] == 0 and jit.last_learned_groups_ == []
    after = jit.operator.predict(inc)
    for a, b in zip(before[0].params + (before[1],), after[0].params + (after[1],)):
        np.testing.assert_array_equal(a, b)
    # inf: none (every prediction here is a belief)
    jit_inf = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=float("inf"))
    jit_inf.predict(inc)
    assert jit_inf.counters()["updates"] == 0 and jit_inf.counters()["consultations"] == len(kl)
    # a level of 0 learns every row whose prediction is not the answer exactly
    jit0 = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=0.0)
    jit0.predict(inc)
    np.testing.assert_array_equal(learned_rows(jit0), np.flatnonzero(kl > 0))


def test_a_prediction_that_is_no_belief_or_a_kl_that_is_no_number_is_learned(op, oracle, batch, monkeypatch):
    inc, kl = batch
    rows = {v: m[:5] for v, m in inc.items()}

    def gated():
        return JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all",
                           learn_above_kl=float(kl.max()) * 2)

    jit = gated()
    original, calls = jit.operator._to_belief, []

    def overflow_once(coords, flat, shape):  # the gate's comparison is the request's first call
        calls.append(len(coords))
        if len(calls) == 1:
            raise PredictionOverflowError("no belief", rows=np.arange(len(coords)))
        return original(coords, flat, shape)

    monkeypatch.setattr(jit.operator, "_to_belief", overflow_once)
    jit.predict(rows)
    np.testing.assert_array_equal(learned_rows(jit), np.arange(5))
    # one row that is no belief is learned alone; the others are judged each on its own (found in review:
    # the whole round was learned); with inf, none of them
    jit = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=float("inf"))
    original, calls = jit.operator._to_belief, []

    def overflow_row_2(coords, flat, shape):
        calls.append(len(coords))
        if len(calls) == 1:
            raise PredictionOverflowError("no belief", rows=np.array([2]))
        return original(coords, flat, shape)

    monkeypatch.setattr(jit.operator, "_to_belief", overflow_row_2)
    jit.predict(rows)
    np.testing.assert_array_equal(learned_rows(jit), [2])
    assert calls[:2] == [5, 4]  # (the others' beliefs formed without it)
    jit = gated()
    monkeypatch.setattr(Gaussian, "kl", lambda self, other: np.full(self.shape, np.nan))
    jit.predict(rows)
    np.testing.assert_array_equal(learned_rows(jit), np.arange(5))


def test_learn_above_kl_is_validated_and_saved(op, oracle, batch, tmp_path):
    for bad in (-1e-3, float("nan"), -float("inf"), "0.1", True, np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="learn_above_kl"):
            JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=bad)
    jit = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=1e-9)
    state = jit.state_dict()
    assert JITOperator.from_state_dict(state).learn_above_kl == 1e-9
    for inf_kind in (np.float32(np.inf), np.array(np.inf)):
        assert JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all",
                           learn_above_kl=inf_kind).learn_above_kl == float("inf")
    inf = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all", learn_above_kl=float("inf"))
    save_operator(inf, tmp_path / "jit.npz")  # (the file's JSON header carries the infinity)
    assert load_operator(tmp_path / "jit.npz").learn_above_kl == float("inf")
    del state["params"]["learn_above_kl"]  # a state saved before the option: every consulted row learned
    assert JITOperator.from_state_dict(state).learn_above_kl is None


def test_an_improper_answer_is_not_near_exact_and_the_others_are_judged_without_it(op, oracle, batch):
    """(``_near_exact`` directly: an oracle's improper answer would fail its request at the update anyway)"""
    inc, kl = batch
    jit = JITOperator(copy.deepcopy(op), oracle, threshold=CONSULT_ALL, selection="all",
                      learn_above_kl=float(kl.max()) * 2)
    rows = {v: m[:5] for v, m in inc.items()}
    coords, _ = jit.operator.predict_coords(rows)
    exact = oracle.belief(rows, "x")
    var = np.array(exact.var(), float)
    var[3] = -1.0  # (an improper answer: no KL)
    answer = Gaussian._unchecked(np.array(exact.mean(), float), var)
    np.testing.assert_array_equal(jit._near_exact(coords, rows, answer), [True, True, True, False, True])
