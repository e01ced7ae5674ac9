"""Shared checks for factor modules that plug in an exact rule (not a test module itself).

``check_factor_module(name, cases, ...)``: the registered factor has the issue's variables,
families and parameters; ``QuadratureOracle(get_factor(name)).belief`` answers every direction
and equals the exact module's rule; it agrees with an independent importance-sampling estimate
that uses the factor's own sampler (proposal = the incoming input messages, so the weights are
the output message only); the default training distribution gives messages the oracle answers.

Tolerance of the Monte-Carlo comparison: 6 standard errors of the self-normalised estimate of
E[x] (SE = sqrt(Var_tilted[x] / ESS), the tilted variance from the moment-matched belief), with
fixed seeds.
"""

from __future__ import annotations

import numpy as np

from kjit.factors import get_factor
from kjit.families import Gaussian
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle


def check_signature(name, inputs, output, families, params):
    f = get_factor(name)
    assert f.name == name
    assert f.inputs == tuple(inputs) and f.output == output
    assert {v: fam for v, fam in f.families.items()} == families
    assert f.params() == params
    assert set(f.exact_recipients) == set(f.variables)
    return f


def check_against_module(name, module, incoming, **params):
    f = get_factor(name, **params)
    oracle = QuadratureOracle(f)
    exact_params = {k: v for k, v in f.params().items() if k != "projection"}
    for to in f.variables:
        q = oracle.belief(incoming, to)
        ref = module.belief(to, incoming, projection=f.params().get("projection", "kl"), **exact_params)
        assert type(q) is type(ref) and q.shape == ref.shape
        for a, b in zip(q.params, ref.params):
            np.testing.assert_array_equal(a, b)
    lz = oracle.log_partition(incoming)
    np.testing.assert_array_equal(lz, module.log_partition(incoming, **exact_params))


def check_against_sampling(name, incoming, n_samples=400_000, seed=0, **params):
    """``incoming``: scalar messages (one case)."""
    f = get_factor(name, **params)
    quad = QuadratureOracle(f)
    moments = QuadratureOracle(get_factor(name, **{**params, **({"projection": "moments"} if "projection" in f.params() else {})}))
    sampler = ImportanceSamplingOracle(f, n_samples=n_samples, proposal={v: incoming[v] for v in f.inputs},
                                       random_state=seed)
    for to in f.variables:
        q = quad.belief(incoming, to)
        tilted_var = float(moments.belief(incoming, to).var()) if not isinstance(q, Gaussian) else float(q.var())
        stats, ess = sampler.estimate(incoming, to)
        e_x = stats[0, 0]  # E[x] (Gaussian and Gamma recipients alike)
        se = np.sqrt(tilted_var / ess[0])
        assert ess[0] > 1000, (to, ess)
        assert abs(float(q.mean()) - e_x) < 6 * se, (to, float(q.mean()), e_x, se)


def check_default_distribution(name, n=200, seed=0, **params):
    f = get_factor(name, **params)
    assert f.default_incoming is not None
    inc = f.default_incoming(n, np.random.default_rng(seed))
    checked, shape = f.check_incoming(inc)
    assert shape == (n,)
    oracle = QuadratureOracle(f)
    for to in f.variables:
        q = oracle.belief(checked, to)
        assert q.shape == (n,) and np.all(q.is_proper)
