"""Factor symmetries (Factor.symmetry) and the learned operator's canonical frame.

A declared symmetry must be a true one: the exact rule evaluated on the mapped messages gives the
mapped belief, so coordinates relative to the recipient's incoming message are unchanged.  This
is checked against each factor's exact rule (quadrature, independent of the symmetry code) at
random maps, not only at the canonical frame.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjit.factors import get_factor
from kjit.families import Beta, Gamma, Gaussian
from kjit.operators import KernelOperator
from kjit.training import TrainingSet

SYMMETRIC = [pytest.param(n, kw, id=n) for n, kw in
             (("gaussian", {}), ("exp", {}), ("gamma_rate", {}), ("probit_noise", {"eps": 0.05}))]


def test_affine_maps_moments():
    g = Gaussian(np.array([1.0, -2.0]), np.array([0.5, 3.0]))
    h = g.affine(np.array([2.0, 0.5]), np.array([1.0, -1.0]))
    np.testing.assert_allclose(h.mean(), [3.0, -2.0])
    np.testing.assert_allclose(h.var(), [2.0, 0.75])
    q = Gamma(np.array([2.0, 5.0]), np.array([1.0, 4.0]))
    r = q.affine(np.array([3.0, 0.1]))
    np.testing.assert_allclose(r.mean(), 3.0 * q.mean() * np.array([1, 0]) + 0.1 * q.mean() * np.array([0, 1]))
    np.testing.assert_allclose(r.var(), np.array([9.0, 0.01]) * q.var())
    with pytest.raises(ValueError, match="scaling only"):
        q.affine(2.0, 1.0)
    with pytest.raises(ValueError, match="not closed"):
        Beta(2.0, 3.0).affine(2.0)


@pytest.mark.parametrize("name, params", SYMMETRIC)
def test_symmetry_leaves_relative_beliefs_unchanged(name, params):
    f = get_factor(name, **params)
    rng = np.random.default_rng(3)
    inc = f.default_incoming(40, rng)
    mapped = f.canonical_messages(inc)
    for to in f.variables:
        q = f.exact_belief(inc, to)
        q_map = f.exact_belief(mapped, to)
        fam = f.families[to]
        if to not in f.symmetry(inc):  # a variable the map leaves alone: its belief is unchanged
            np.testing.assert_allclose(q_map.to_coords(), q.to_coords(), rtol=1e-8, atol=1e-10, err_msg=f"{name}->{to}")
            continue
        rel = fam.to_relative(q.to_coords(), inc[to].to_coords())
        rel_map = fam.to_relative(q_map.to_coords(), mapped[to].to_coords())
        # quadrature rules are accurate to ~1e-8 relative; the map itself is exact
        np.testing.assert_allclose(rel_map, rel, rtol=1e-5, atol=1e-6, err_msg=f"{name}->{to}")
        # and the mapped belief is the map of the belief (the same change of units)
        scale, shift = f.symmetry(inc)[to]
        np.testing.assert_allclose(q_map.mean(), q.affine(scale, shift).mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, params", SYMMETRIC)
def test_canonical_frame_is_fixed(name, params):
    """Mapping messages that are already canonical changes nothing."""
    f = get_factor(name, **params)
    inc = f.default_incoming(25, np.random.default_rng(4))
    once = f.canonical_messages(inc)
    twice = f.canonical_messages(once)
    for v in f.variables:
        np.testing.assert_allclose(twice[v].to_coords(), once[v].to_coords(), rtol=1e-12, atol=1e-12)


def test_factors_without_a_symmetry():
    assert get_factor("logistic").canonical_messages({}) is None
    assert get_factor("product").symmetry({}) is None  # measured worse: see the product module


@pytest.fixture(scope="module")
def gaussian_op():
    f = get_factor("gaussian")
    rng = np.random.default_rng(5)
    inc = f.default_incoming(300, rng)
    data = TrainingSet(f.name, "m", inc, f.exact_belief(inc, "m"), factor_params=f.params())
    return f, KernelOperator(f, "m", n_inner=40, n_outer=80, random_state=0).fit(data)


def test_operator_is_equivariant(gaussian_op):
    """Predictions on messages moved by the symmetry are the moved predictions: the features see
    the same canonical messages, and the reference (the factor's approximation) moves with the symmetry."""
    f, op = gaussian_op
    assert op.canonical_
    rng = np.random.default_rng(6)
    inc = f.default_incoming(30, rng)
    c, s = rng.uniform(-50, 50, 30), 10 ** rng.uniform(-2, 2, 30)
    moved = {"m": inc["m"].affine(s, c), "x": inc["x"].affine(s, c), "tau": inc["tau"].affine(1 / s**2)}
    q, lv = op.predict(inc)
    q2, lv2 = op.predict(moved)
    np.testing.assert_allclose(q2.mean(), q.affine(s, c).mean(), rtol=1e-8, atol=1e-8 * np.max(np.abs(c)))
    np.testing.assert_allclose(q2.var(), q.affine(s, c).var(), rtol=1e-8)
    # rows its reference gate answers (the factor's quadrature reference, checked) report the check's estimate of
    # the reference's error as their variance — ~1e-20 here, the quadrature's rounding, equivariant only to its own
    # rounding (measured: up to 5.5 nats apart in log variance): the same rows gated, below the gate in both frames
    from kjit.operators import REFERENCE_GATE
    g = op.gated_rows(inc)
    np.testing.assert_array_equal(op.gated_rows(moved), g)
    assert 0 < g.sum() < g.size  # (both kinds of rows)
    assert np.all(lv[g] <= np.log(REFERENCE_GATE)) and np.all(lv2[g] <= np.log(REFERENCE_GATE))
    np.testing.assert_allclose(lv2[~g], lv[~g], rtol=1e-8, atol=1e-10)


def test_canonical_and_width_rule_survive_state_dict(gaussian_op):
    f, op = gaussian_op
    back = KernelOperator.from_state_dict(op.state_dict())
    assert back.canonical_ and back.width_rule_ == op.width_rule_
    inc = f.default_incoming(10, np.random.default_rng(7))
    np.testing.assert_array_equal(back.predict_coords(inc)[0], op.predict_coords(inc)[0])


def test_state_saved_before_frames_predicts_without_them(gaussian_op):
    """A state without the keys (saved by an earlier kjit) was fitted on raw messages."""
    f, op = gaussian_op
    state = op.state_dict()
    del state["params"]["canonical"], state["params"]["width_rules"], state["fitted"]["canonical"]
    del state["fitted"]["width_rule"]
    old = KernelOperator.from_state_dict(state)
    assert not old.canonical_ and old.width_rule_ == "mean_variance"
    inc = f.default_incoming(10, np.random.default_rng(8))
    raw = tuple(inc[v] for v in f.variables)
    np.testing.assert_array_equal(old.features_.transform(old.feature_inputs(inc)), old.features_.transform(raw))


def test_canonical_off_and_absolute_targets_use_raw_messages():
    f = get_factor("gaussian")
    inc = f.default_incoming(60, np.random.default_rng(9))
    data = TrainingSet(f.name, "m", inc, f.exact_belief(inc, "m"), factor_params=f.params())
    assert not KernelOperator(f, "m", n_inner=20, n_outer=40, canonical=False, random_state=0).fit(data).canonical_
    assert not KernelOperator(f, "m", n_inner=20, n_outer=40, target="absolute", random_state=0).fit(data).canonical_
    with pytest.raises(ValueError, match="width_rules"):
        KernelOperator(f, "m", width_rules=("median",))


def test_overflowing_frame_names_only_its_row():
    """A row whose canonical frame overflows (gamma_rate: x's message mean underflows to a
    subnormal, so the frame's scale 1/mean is inf) is the only row the service reports as not
    computable; the other rows' features are finite (and so were that row's raw features)."""
    from service.validation import bad_feature_rows

    f = get_factor("gamma_rate")
    inc = f.default_incoming(200, np.random.default_rng(0))
    data = TrainingSet(f.name, "r", inc, f.exact_belief(inc, "r"), factor_params=f.params())
    op = KernelOperator(f, "r", n_inner=20, n_outer=40, random_state=0).fit(data)
    assert op.canonical_
    test = f.default_incoming(3, np.random.default_rng(1))
    shape, rate = np.array(test["x"].params[0]), np.array(test["x"].params[1])
    shape[1], rate[1] = 1e-5, 1e304  # a proper message with mean 1e-309
    test["x"] = Gamma(shape, rate)
    assert np.all(test["x"].is_proper)
    assert bad_feature_rows(op, test) == [1]
