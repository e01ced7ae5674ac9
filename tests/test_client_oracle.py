"""Bring your own sampler (issue 16, client side): a served operator for a factor the server has no
code for — created from its variable names and families and the client's first batch of oracle
pairs — and ``RemoteOperator(url, name, oracle=...)`` running the just-in-time loop across the
wire: the server predicts, the client answers the rows above the server's threshold with its own
oracle, uses those answers and sends them back as observations.

The server is a subprocess started without the client's factor (no KJIT_FACTORS): it never
imports the client's code.  The client's factor is z = x·y + ε (ε ~ N(0, 0.3²)), its oracle the
per-message importance sampler; answers are checked against an independent 10^6-draw estimate.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from kjit.client import RemoteOperator
from kjit.factors import SampledFactor
from kjit.families import Gaussian
from kjit.oracles import MessageImportanceSampler

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")

NOISE = 0.3
VARIABLES = {"x": "gaussian", "y": "gaussian", "z": "gaussian"}
THRESHOLD = -1.5  # log predictive variance above which rows go to the client (here: 6 of 36 rows; noise floor ~ -2.4)


def _factor():
    return SampledFactor("my_noisy_product", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                         sampler=lambda v, rng: v["x"] * v["y"] + NOISE * rng.standard_normal(v["x"].shape))


def _incoming(rng, n):
    return {"x": Gaussian(rng.uniform(-2, 2, n), np.exp(rng.uniform(np.log(0.1), np.log(2), n))),
            "y": Gaussian(rng.uniform(-2, 2, n), np.exp(rng.uniform(np.log(0.1), np.log(2), n))),
            "z": Gaussian(rng.uniform(-3, 3, n), np.exp(rng.uniform(np.log(0.5), np.log(5), n)))}


def _far(rng, n):
    """Messages outside the training ranges, with z's message where x·y lands (a usable sample)."""
    mx, my = rng.uniform(3, 5, n) * rng.choice([-1, 1], n), rng.uniform(3, 5, n)
    return {"x": Gaussian(mx, np.full(n, 0.2)), "y": Gaussian(my, np.full(n, 0.2)),
            "z": Gaussian(mx * my, rng.uniform(4, 8, n))}


def _cols(m):
    return {"family": "gaussian", "mean": m.mean().tolist(), "var": m.var().tolist()}


def _reference(inc, n=1_000_000, seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for mx, vx, my, vy, mz, vz in zip(inc["x"].mean(), inc["x"].var(), inc["y"].mean(), inc["y"].var(),
                                      inc["z"].mean(), inc["z"].var()):
        z = ((mx + np.sqrt(vx) * rng.standard_normal(n)) * (my + np.sqrt(vy) * rng.standard_normal(n))
             + NOISE * rng.standard_normal(n))
        lw = -0.5 * (z - mz) ** 2 / vz
        w = np.exp(lw - lw.max())
        w /= w.sum()
        m = np.sum(w * z)
        out.append((m, np.sum(w * (z - m) ** 2)))
    return np.array(out).T


def test_client_side_oracle_runs_the_jit_loop_across_the_wire(tmp_path):
    from service.testing import SubprocessServer

    factor = _factor()
    oracle = MessageImportanceSampler(factor, random_state=0)
    rng = np.random.default_rng(1)
    inc0 = _incoming(rng, 400)
    q0 = oracle.belief(inc0, "z")  # the client's first batch of oracle pairs
    # (no expected-KL cap: with it, every message of this 400-pair operator is consulted — the wire's answers
    # mixing the server's and the client's is what this test is about)
    create = {"name": "client-product-z", "factor": "my_noisy_product", "to": "z", "threshold": THRESHOLD,
              "kl_cap": None, "n_inner": 100, "n_outer": 200,
              "source": {"kind": "client", "variables": VARIABLES, "output": "z",
                         "incoming": {v: _cols(m) for v, m in inc0.items()}, "beliefs": _cols(q0)}}
    store = tmp_path / "store"
    srv = SubprocessServer(store).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert "my_noisy_product" not in c.get("/v1/operators").json()["factors"]
            # bad declarations and pairs: 422 naming the field, nothing queued
            src = create["source"]
            bad = [({**src, "variables": {**VARIABLES, "x": "normal"}}, ["body", "source", "variables", "x"]),
                   ({**src, "variables": {"x-1": "gaussian", "y": "gaussian", "z": "gaussian"}},
                    ["body", "source", "variables", "x-1"]),
                   ({**src, "output": "w"}, ["body", "source", "output"]),
                   ({**src, "beliefs": {"family": "gamma", "shape": [1.0] * 400, "rate": [1.0] * 400}},
                    ["body", "source", "beliefs", "family"]),
                   ({**src, "beliefs": {**src["beliefs"], "var": src["beliefs"]["var"][:-1]}},
                    ["body", "source", "beliefs", "var"]),
                   ({**src, "beliefs": {**src["beliefs"], "var": [-1.0] * 400}},
                    ["body", "source", "beliefs", "var"]),  # (not the union tag: a field of the body)
                   ({**src, "incoming": {**src["incoming"], "y": {"family": "beta", "alpha": [1.0] * 400,
                                                                 "beta": [1.0] * 400}}},
                    ["body", "source", "incoming", "y", "family"])]
            for s, loc in bad:
                r = c.post("/v1/operators", json={**create, "source": s})
                assert r.status_code == 422, (loc, r.text)
                assert r.json()["detail"][0]["loc"][:len(loc)] == loc, r.text
            r = c.post("/v1/operators", json={**create, "factor": "my-product"})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "factor"], r.text
            assert c.get("/v1/jobs").json()["jobs"] == []

            r = c.post("/v1/operators", json=create)
            assert r.status_code == 202, r.text
            loc = r.headers["location"]
            while (job := c.get(loc).json())["status"] not in ("succeeded", "failed"):
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
            assert job["request"]["source"]["n_pairs"] == 400 and "incoming" not in job["request"]["source"]
            detail = c.get("/v1/operators/client-product-z").json()
            assert detail["oracle"] == {"kind": "client"} and detail["families"] == VARIABLES
            assert detail["kl_cap"] is None
            assert detail["factor_params"]["label"] == "my_noisy_product"
            # the server has no oracle for it: jit and oracle modes say so
            body = {"to": "z", "incoming": {v: _cols(m[:2]) for v, m in inc0.items()}}
            for mode in ("jit", "oracle"):
                r = c.post("/v1/operators/client-product-z/messages", params={"mode": mode}, json=body)
                assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "mode"], r.text
                assert "RemoteOperator(url, name, oracle=your_oracle)" in r.json()["detail"][0]["msg"]  # (what to do)

        # the jit loop across the wire: 30 rows like the training ones and 6 far outside
        plain = RemoteOperator(srv.url, "client-product-z", mode="predict")
        remote = RemoteOperator(srv.url, "client-product-z", oracle=MessageImportanceSampler(factor, random_state=2))
        inc = {v: Gaussian.concatenate([a, b]) for (v, a), b in zip(_incoming(rng, 30).items(),
                                                                   _far(rng, 6).values())}
        q_pred, lv_pred, _ = plain.predict(inc)
        # the server marks the rows its just-in-time rule would consult: those above its threshold,
        # and those whose outgoing message's precision has an undetermined sign
        uncertain = plain.last_uncertain_
        above = np.any(lv_pred > THRESHOLD, axis=1)
        assert np.all(uncertain[above]) and 0 < above.sum() <= uncertain.sum() < len(uncertain), lv_pred
        v0, n0 = plain.info(refresh=True)["version"], plain.info()["n_train"]
        q, lv, consulted = remote.predict(inc)
        np.testing.assert_array_equal(consulted, uncertain)  # exactly the rows the server marked
        assert remote.consultations_ == uncertain.sum()
        np.testing.assert_array_equal(q.mean()[~uncertain], q_pred.mean()[~uncertain])  # the server's answers
        ref_m, ref_v = _reference({v: m[uncertain] for v, m in inc.items()})
        # the consulted rows are the client's sampler's answers (target_se 1e-2 in sd units; 6 se)
        np.testing.assert_array_less(np.abs(q.mean()[uncertain] - ref_m) / np.sqrt(ref_v), 0.06)
        info = plain.info(refresh=True)
        # learned, once — but for the rows outside the data the operator learned (the far ones among them),
        # which the server acknowledged without learning them
        assert remote.unlearned_ >= 6 and uncertain[30:].all()
        assert info["version"] == v0 + 1 and info["n_train"] == n0 + uncertain.sum() - remote.unlearned_ > n0
        # the learned rows are no longer uncertain: asking again consults less
        remote.predict(inc)
        assert remote.last_consulted_ < uncertain.sum()

        # an improper answer of the client's oracle is refused before anything is sent
        class Broken:
            factor = _factor()

            def belief(self, incoming, to):
                n = len(incoming["z"])
                return Gaussian.from_natural(np.column_stack([np.zeros(n), np.full(n, 0.5)]))

        broken = RemoteOperator(srv.url, "client-product-z", oracle=Broken())
        v1 = plain.info(refresh=True)["version"]
        far = _far(np.random.default_rng(9), 3)
        with pytest.raises(ValueError, match="improper"):
            broken.belief(far)
        assert plain.info(refresh=True)["version"] == v1
        # observations that do not fit the declared families: 422 naming the field, nothing learned
        r = httpx.post(srv.url + "/v1/operators/client-product-z/observations",
                       json={"incoming": {v: _cols(m) for v, m in far.items()},
                             "beliefs": {"family": "gamma", "shape": [1.0] * 3, "rate": [1.0] * 3}}, timeout=60)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", "beliefs", "family"], r.text
        assert plain.info(refresh=True)["version"] == v1
        final = plain.belief(inc)
        for op in (plain, remote, broken):
            op.close()
    finally:
        srv.stop()

    # after a restart (still without the client's code) the operator is the one learned
    srv = SubprocessServer(store).start()
    try:
        with RemoteOperator(srv.url, "client-product-z", mode="predict") as again:
            np.testing.assert_array_equal(again.belief(inc).mean(), final.mean())
            assert again.info()["oracle"] == {"kind": "client"}
    finally:
        srv.stop()
