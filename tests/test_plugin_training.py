"""A user's own factor, served (issue 16, server side): a factor with no exact rule, defined with
``SampledFactor`` in a tiny module named by ``KJIT_FACTORS``, is trained by ``POST /v1/operators``
(oracle ``auto`` → the per-message importance sampler), listed with its variables and families,
served, and still served after a restart — with no edit to kjit.

The factor is the repository's example plugin (``plugins/user_factors.py``, the directory
docker-compose.yml mounts): ``z = x·y + ε``, ε ~ N(0, s²), Gaussian messages.  The served oracle's beliefs are
checked against an independent large-sample estimate computed here (10^6 draws of x, y from
their messages, z from the factor, weighted by z's message; its own standard error is ~1e-3 of
the belief's sd, far inside the sampler's target_se = 1e-2).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from test_service_fixtures import wait_job

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"  # the example docker-compose.yml mounts
NOISE = 0.3  # plugins/user_factors.py's

RANGES = {"x": {"mean": {"low": -2, "high": 2}, "var": {"low": 0.1, "high": 2, "scale": "log"}},
          "y": {"mean": {"low": -2, "high": 2}, "var": {"low": 0.1, "high": 2, "scale": "log"}},
          "z": {"mean": {"low": -3, "high": 3}, "var": {"low": 0.5, "high": 5, "scale": "log"}}}


def _reference_belief_z(mx, vx, my, vy, mz, vz, n=1_000_000, seed=7):
    """Belief on z ∝ N(z; mz, vz) · p(z), p(z) = ∫ N(z; xy, s²) N(x; mx, vx) N(y; my, vy): mean and var."""
    rng = np.random.default_rng(seed)
    out_m, out_v = [], []
    for row in zip(mx, vx, my, vy, mz, vz):
        a, va, b, vb, c, vc = row
        x = a + np.sqrt(va) * rng.standard_normal(n)
        y = b + np.sqrt(vb) * rng.standard_normal(n)
        z = x * y + NOISE * rng.standard_normal(n)
        lw = -0.5 * (z - c) ** 2 / vc
        w = np.exp(lw - lw.max())
        w /= w.sum()
        m = np.sum(w * z)
        out_m.append(m)
        out_v.append(np.sum(w * (z - m) ** 2))
    return np.array(out_m), np.array(out_v)


def _body(mx, vx, my, vy, mz, vz):
    g = lambda m, v: {"family": "gaussian", "mean": list(map(float, m)), "var": list(map(float, v))}  # noqa: E731
    return {"to": "z", "incoming": {"x": g(mx, vx), "y": g(my, vy), "z": g(mz, vz)}}


def test_plugin_factor_without_exact_rule_is_trained_served_and_survives_restart(tmp_path):
    from service.testing import SubprocessServer

    assert float(re.search(r"^NOISE = (.*)$", (PLUGINS / "user_factors.py").read_text(), re.M).group(1)) == NOISE
    store = tmp_path / "store"
    env = {"KJIT_FACTORS": "user_factors",
           "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    rng = np.random.default_rng(11)
    k = 4
    probe = (rng.uniform(-1.5, 1.5, k), 10 ** rng.uniform(-0.7, 0.2, k), rng.uniform(-1.5, 1.5, k),
             10 ** rng.uniform(-0.7, 0.2, k), rng.uniform(-2, 2, k), 10 ** rng.uniform(0, 0.6, k))
    body = _body(*probe)
    ref_m, ref_v = _reference_belief_z(*probe)
    train = {"name": "noisy-product-z", "factor": "noisy_product", "to": "z", "n_inner": 100, "n_outer": 200,
             "threshold": -2.0, "source": {"kind": "oracle", "n": 500, "distribution": RANGES}}
    predicted = []
    srv = SubprocessServer(store, env=env).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert "noisy_product" in c.get("/v1/operators").json()["factors"]
            # bad requests: 4xx naming the field, nothing queued
            bad = [({**train, "factor": "no_such_factor"}, ["body", "factor"]),
                   ({**train, "to": "w"}, ["body", "to"]),
                   ({**train, "source": {**train["source"], "oracle": "quadrature"}}, ["body", "source", "oracle"]),
                   ({**train, "source": {**train["source"], "distribution": {**RANGES, "x": {
                       "mean": {"low": -1, "high": 1}, "sd": {"low": 0.1, "high": 1}}}}},
                    ["body", "source", "distribution", "x", "sd"]),
                   ({**train, "source": {**train["source"], "distribution": {**RANGES, "z": {
                       "mean": {"low": -3, "high": 3}, "var": {"low": -1, "high": 5}}}}},
                    ["body", "source", "distribution", "z"])]
            for req, loc in bad:
                r = c.post("/v1/operators", json=req)
                assert r.status_code == 422, (req, r.text)
                assert r.json()["detail"][0]["loc"][:len(loc)] == loc, r.text
            assert c.get("/v1/jobs").json()["jobs"] == []

            r = c.post("/v1/operators", json=train)
            assert r.status_code == 202, r.text
            job = wait_job(c, r.headers["Location"], timeout=1800)
            assert job["status"] == "succeeded", job
            assert job["request"]["source"]["oracle"] == "auto"
            listed = {o["name"]: o for o in c.get("/v1/operators").json()["operators"]}
            op = listed["noisy-product-z"]
            assert op["factor"] == "noisy_product" and op["to"] == "z" and op["inputs"] == ["x", "y"]
            assert op["families"] == {"x": "gaussian", "y": "gaussian", "z": "gaussian"}
            detail = c.get("/v1/operators/noisy-product-z").json()
            assert detail["oracle"] == {"kind": "message_sampler"}
            assert detail["source"]["source"]["oracle"] == "message_sampler"
            # the oracle is the per-message sampler: it agrees with the independent estimate
            r = c.post("/v1/operators/noisy-product-z/messages", params={"mode": "oracle"}, json=body)
            assert r.status_code == 200, r.text
            got = r.json()["beliefs"]
            sd = np.sqrt(ref_v)
            # target_se 1e-2 on (mean / sd, log var): 5 standard errors, plus the reference's own ~1e-3
            np.testing.assert_array_less(np.abs(np.array(got["mean"]) - ref_m) / sd, 0.06)
            np.testing.assert_array_less(np.abs(np.log(got["var"]) - np.log(ref_v)), 0.06)
            r = c.post("/v1/operators/noisy-product-z/messages", params={"mode": "predict"}, json=body)
            assert r.status_code == 200, r.text
            predicted.append(r.json())
            # the learned operator is in the right place (500 pairs, D_in = 100; 0.15 measured): mean error in sd units
            err = np.abs(np.array(r.json()["beliefs"]["mean"]) - ref_m) / sd
            assert err.mean() < 0.5, err
            # a wrong family for the plugin's variable is a 422 naming it
            wrong = _body(*probe)
            wrong["incoming"]["y"] = {"family": "gamma", "shape": [1.0] * k, "rate": [1.0] * k}
            r = c.post("/v1/operators/noisy-product-z/messages", params={"mode": "predict"}, json=wrong)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["y", "family"]
    finally:
        srv.stop()

    srv = SubprocessServer(store, env=env).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
            assert names == ["noisy-product-z"]
            r = c.post("/v1/operators/noisy-product-z/messages", params={"mode": "predict"}, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["beliefs"] == predicted[0]["beliefs"]  # the persisted operator, bit for bit
            assert r.json()["version"] == predicted[0]["version"]
            # the just-in-time path works after the restart (the sampler was rebuilt from the state):
            # a message far outside the training ranges is uncertain, goes to the sampler, and is not learned
            # (outside the data the operator learned: JITOperator.outside_rows)
            far = _body([6.0], [0.05], [5.0], [0.05], [30.0], [1.0])
            r = c.post("/v1/operators/noisy-product-z/messages", params={"mode": "jit"}, json=far)
            assert r.status_code == 200, r.text
            assert r.json()["consulted"] == [True] and r.json()["version"] == predicted[0]["version"]
            ref_m1, ref_v1 = _reference_belief_z([6.0], [0.05], [5.0], [0.05], [30.0], [1.0])
            assert abs(r.json()["beliefs"]["mean"][0] - ref_m1[0]) / np.sqrt(ref_v1[0]) < 0.06
    finally:
        srv.stop()


def test_jit_operator_with_message_sampler_round_trips_through_save_and_load(tmp_path):
    """The new oracle kind is part of the operator's state: configuration and generator state
    come back, so the reloaded operator's next oracle answer is the one the original would give."""
    from kjit.factors import SampledFactor, get_factor, register_factor
    from kjit.families import Gaussian
    from kjit.operators import JITOperator
    from kjit.oracles import MessageImportanceSampler
    from kjit.persistence import load_operator, save_operator

    f = SampledFactor("test_persist_noisy_product", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                      sampler=lambda v, rng: v["x"] * v["y"] + NOISE * rng.standard_normal(v["x"].shape))
    register_factor(f)
    assert get_factor("test_persist_noisy_product") is f
    oracle = MessageImportanceSampler(f, target_se=2e-2, n_initial=500, max_samples=4000, random_state=3)
    jit = JITOperator(None, oracle, threshold=-3.0, initial_batch=20, to="z",
                      operator_kwargs={"n_inner": 20, "n_outer": 30})
    rng = np.random.default_rng(0)
    inc = {v: Gaussian(rng.uniform(-1, 1, 25), rng.uniform(0.3, 2.0, 25)) for v in ("x", "y", "z")}
    jit.predict(inc, "z")  # the initial batch: 25 oracle answers, then a fit
    assert jit.operator is not None
    save_operator(jit, tmp_path / "jit.npz")
    loaded = load_operator(tmp_path / "jit.npz")
    o2 = loaded.oracle
    assert isinstance(o2, MessageImportanceSampler)
    assert (o2.target_se, o2.min_ess, o2.target_ess, o2.n_initial, o2.max_samples, o2.growth, o2.chunk_elements) == \
        (oracle.target_se, oracle.min_ess, oracle.target_ess, oracle.n_initial, oracle.max_samples, oracle.growth,
         oracle.chunk_elements)
    probe = {v: Gaussian(m.mean()[:3], m.var()[:3]) for v, m in inc.items()}
    a, b = oracle.belief(probe, "z"), o2.belief(probe, "z")
    np.testing.assert_array_equal(a.mean(), b.mean())
    np.testing.assert_array_equal(a.var(), b.var())
    np.testing.assert_array_equal(jit.operator.predict(probe)[0].mean(), loaded.operator.predict(probe)[0].mean())
    from kjit.factors import base

    base._REGISTRY.pop("test_persist_noisy_product", None)


def test_held_out_pairs_are_answered_with_draws_of_their_own(monkeypatch):
    """The calibration pairs of a training run must not share the training pairs' sampler draws: with the
    shared-proposal sampler they did (both runs seeded from one SeedSequence), so their errors were the ones the
    operator had learned and the held-out KL judged it against its own noise (audit, forty-third session: a
    factor z = 1 − x with Beta messages, 100 particles — reported held-out mean KL 7.7e-6 against a true 1.2e-2,
    and a threshold "calibrated" on it).  Measured here against the closed form z ~ Beta(b + c − 1, a + d − 1):
    the reported figure is now 5.3e-3 (true 1.2e-2); asserted within 10× of the truth (it was 1 500× under)."""
    from kjit.factors import SampledFactor, base
    from kjit.families import Beta
    from service.training import TrainSpec, train_operator

    flip = SampledFactor("flip_heldout_test", inputs={"x": Beta}, output=("z", Beta), sampler=lambda v, r: 1.0 - v["x"])
    monkeypatch.setitem(base._REGISTRY, "flip_heldout_test", lambda **kw: flip)
    ranges = {"alpha": {"low": 1.0, "high": 3.0}, "beta": {"low": 1.0, "high": 3.0}}
    spec = TrainSpec(factor="flip_heldout_test", to="z", n=200, distribution={"x": ranges, "z": ranges},
                     oracle="importance_sampling", n_samples=100, n_inner=100, n_outer=200)
    jit, _, info = train_operator(spec)
    inc = spec.sampler(flip)(spec.n + max(200, spec.n // 4), np.random.default_rng(spec.random_state))
    held = {v: m[spec.n:] for v, m in inc.items()}
    a, b, c, d = held["x"].alpha, held["x"].beta, held["z"].alpha, held["z"].beta
    true_kl = float(np.mean(Beta(b + c - 1, a + d - 1).kl(jit.operator.belief(held))))
    assert info["n_held_out"] == len(a) and true_kl > 3e-3  # (the sampler's noise at 100 particles, learned)
    assert info["held_out_mean_kl"] > true_kl / 10, (info["held_out_mean_kl"], true_kl)


def test_observations_of_a_factor_with_a_rule_for_another_recipient_are_checked_by_its_sampler(monkeypatch):
    """The plausibility check of observations asks an oracle that shares no state with the served one: the
    factor's exact rule — but only where it has one for the operator's recipient.  A factor z = x + y with a rule
    for z alone, served to x by the per-message sampler, had every checked observation refused as "the oracle
    cannot check it" (audit, forty-third session).  Exact beliefs (closed form) are now checked by a copy of the
    sampler and accepted; a wrong one is still refused; a row the sampler cannot answer is refused alone."""
    from kjit.factors import Factor, base, rule
    from kjit.families import Gaussian
    from kjit.oracles import MessageImportanceSampler, QuadratureOracle
    from service.training import TrainSpec, train_operator
    from service.validation import implausible_rows, spot_oracle

    class PartialSum(Factor):
        name = "partial_sum_test"
        inputs, output = ("x", "y"), "z"
        families = {"x": Gaussian, "y": Gaussian, "z": Gaussian}

        def sample(self, inputs, size, rng):
            return inputs["x"] + inputs["y"]

        @rule("z")
        def _z(self, incoming, to, power=1.0):
            m0, v0 = incoming["x"].mean() + incoming["y"].mean(), incoming["x"].var() + incoming["y"].var()
            v = 1 / (1 / v0 + 1 / incoming["z"].var())
            return Gaussian(v * (m0 / v0 + incoming["z"].mean() / incoming["z"].var()), v)

    monkeypatch.setitem(base._REGISTRY, "partial_sum_test", PartialSum)
    ranges = {v: {"mean": {"low": -2, "high": 2}, "var": {"low": 0.1, "high": 2, "scale": "log"}} for v in "xyz"}
    jit, _, _ = train_operator(TrainSpec(factor="partial_sum_test", to="x", n=300, distribution=ranges,
                                         oracle="auto", threshold=-3.0, n_inner=50, n_outer=100))
    assert isinstance(jit.oracle, MessageImportanceSampler)
    assert isinstance(spot_oracle(jit), MessageImportanceSampler) and spot_oracle(jit) is not jit.oracle
    z_jit = copy.copy(jit)
    z_jit.to = "z"
    assert isinstance(spot_oracle(z_jit), QuadratureOracle)  # (the rule where there is one for the recipient)
    rng = np.random.default_rng(0)
    mx, my, mz = (rng.uniform(-2, 2, 12) for _ in range(3))
    vx, vy, vz = (np.exp(rng.uniform(np.log(0.1), np.log(2), 12)) for _ in range(3))
    v = 1 / (1 / vx + 1 / (vz + vy))
    inc = {"x": Gaussian(mx, vx), "y": Gaussian(my, vy), "z": Gaussian(mz, vz)}
    exact = Gaussian(v * (mx / vx + (mz - my) / (vz + vy)), v)
    # (max_z 0: every row checked; the sampler cannot answer row 3 at its cap of particles — its weights heavy-tailed
    # (k̂ > 0.7, checked on every row since the forty-fourth session's audit; before, its effective sample size stayed
    # under the minimum) — so that row alone cannot be checked, and is refused; before, one such row made all 12
    # uncheckable)
    refused = implausible_rows(jit, inc, exact, max_z=0.0, max_kl=0.05)
    assert [r for r, *_ in refused] == [3] and "the oracle cannot check it (OracleError)" in refused[0][1]
    wrong = Gaussian(exact.mean() + 5 * np.sqrt(v), v)
    assert [r for r, *_ in implausible_rows(jit, inc, wrong, max_z=0.0, max_kl=0.05)] == list(range(12))
