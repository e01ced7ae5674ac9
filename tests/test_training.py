"""Tests for kjit.training (SPEC §3 "Training sets", issue 2 item 5).

make_training_set: from an incoming-message sampler and from recorded messages; the result is
independent of n_jobs and the joblib backend for a fixed seed; failed rows are dropped and counted.
TrainingSet: subset / split / concatenate; .npz save/load round trip is bit-exact, uses no pickle
(an object array — even a malicious one — is refused), and refuses another format version.

References are direct oracle calls on the same incoming messages (the QuadratureOracle is
deterministic and row-independent, so equality is up to ~1 ulp).
"""

from __future__ import annotations

import io
import json
import os

import joblib
import numpy as np
import pytest

from kjit.factors import CompoundGamma, Logistic, ProbitNoise, SampledFactor, register_factor
from kjit.errors import ConfigurationError
from kjit.families import Bernoulli, Beta, Gamma, Gaussian
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler, OracleError, QuadratureOracle
from kjit.training import FORMAT_VERSION, TrainingSet, make_training_set


def logistic_sampler(n, rng):
    """Incoming messages like those EP meets: cavity N(m, v), Beta label messages or general Betas."""
    m = rng.uniform(-8.0, 8.0, n)
    v = np.exp(rng.uniform(np.log(0.05), np.log(50.0), n))
    lab = rng.random(n) < 0.5
    a = np.where(lab, 2.0, 1.0)
    b = np.where(lab, 1.0, 2.0)
    general = rng.random(n) < 0.3
    a = np.where(general, rng.uniform(0.7, 5.0, n), a)
    b = np.where(general, rng.uniform(0.7, 5.0, n), b)
    return {"x": Gaussian(m, v), "z": Beta(a, b)}


def _ids(ts):
    """Rows are identified by their (unique, continuous) incoming x-mean."""
    return ts.incoming["x"].mean().tolist()


# =========================================================================== make_training_set
def test_from_sampler_matches_direct_oracle_calls():
    oracle = QuadratureOracle(Logistic())
    ts = make_training_set(Logistic(), "x", logistic_sampler, oracle, n=70, chunk_size=16, random_state=5)
    assert len(ts) == 70 and ts.factor == "logistic" and ts.to == "x"
    assert set(ts.incoming) == {"x", "z"}
    assert ts.meta["n_requested"] == 70 and ts.meta["n_failed"] == 0
    direct = oracle.belief(ts.incoming, "x")
    assert ts.beliefs.allclose(direct, rtol=1e-13)
    # the sampler is seeded from random_state: same seed, same messages; another seed, others
    again = make_training_set(Logistic(), "x", logistic_sampler, oracle, n=70, chunk_size=16, random_state=5)
    assert again.incoming["x"] == ts.incoming["x"] and again.incoming["z"] == ts.incoming["z"]
    assert again.beliefs == ts.beliefs
    other = make_training_set(Logistic(), "x", logistic_sampler, oracle, n=70, random_state=6)
    assert not np.array_equal(other.incoming["x"].mean(), ts.incoming["x"].mean())


def test_sampler_gets_n_and_a_generator():
    seen = {}

    def sampler(n, rng):
        seen["n"], seen["rng"] = n, rng
        return logistic_sampler(n, rng)

    make_training_set(Logistic(), "z", sampler, QuadratureOracle(Logistic()), n=9, random_state=1)
    assert seen["n"] == 9 and isinstance(seen["rng"], np.random.Generator)


def test_from_recorded_messages_and_by_factor_name():
    rng = np.random.default_rng(3)
    rec = logistic_sampler(30, rng)
    oracle = QuadratureOracle(Logistic())
    ts = make_training_set("logistic", "z", rec, oracle)
    assert len(ts) == 30
    assert ts.incoming["x"] == rec["x"] and ts.incoming["z"] == rec["z"]
    assert isinstance(ts.beliefs, Beta)
    assert ts.beliefs.allclose(oracle.belief(rec, "z"), rtol=1e-12)
    # n < number recorded: the first n
    head = make_training_set(Logistic(), "z", rec, oracle, n=12)
    assert len(head) == 12 and head.incoming["x"] == rec["x"][:12]
    assert head.beliefs.allclose(ts.beliefs[:12], rtol=1e-13)
    with pytest.raises(ValueError, match="exceeds"):
        make_training_set(Logistic(), "z", rec, oracle, n=31)


def test_other_factors_and_directions():
    cg = CompoundGamma()
    rec = {"tau": Gamma(np.array([0.5, 2.0, 40.0]), np.array([1.0, 0.3, 7.0]))}
    ts = make_training_set(cg, "tau", rec, QuadratureOracle(cg))
    assert ts.factor == "compound_gamma" and ts.factor_params == {"s1": 1.0, "r1": 1.0, "s2": 1.0}
    assert isinstance(ts.beliefs, Gamma) and len(ts) == 3
    pn = ProbitNoise(0.1)

    rec = {"f": Gaussian([0.0, 1.0], [1.0, 2.0]), "y": Bernoulli([1.0, 0.0])}
    ts = make_training_set(pn, "f", rec, QuadratureOracle(pn))
    assert ts.factor_params == {"eps": 0.1} and isinstance(ts.beliefs, Gaussian)


def test_user_factor_through_importance_sampling():
    prod = SampledFactor("test_training_product", inputs={"x": Gaussian, "y": Gaussian},
                         output=("z", Gaussian), sampler=lambda v, rng: v["x"] * v["y"])
    register_factor(prod, replace=True)
    prop = {"x": Gaussian(0.0, 4.0), "y": Gaussian(0.0, 4.0)}
    oracle = ImportanceSamplingOracle(prod, n_samples=4000, proposal=prop)

    def sampler(n, rng):
        return {"x": Gaussian(rng.normal(0, 1, n), 0.5), "y": Gaussian(rng.normal(0, 1, n), 0.5),
                "z": Gaussian(0.0, 4.0)}

    ts = make_training_set("test_training_product", "z", sampler, oracle, n=20, chunk_size=8, random_state=2)
    assert len(ts) + ts.meta["n_failed"] == 20 and ts.factor == "test_training_product"
    assert isinstance(ts.beliefs, Gaussian) and np.all(ts.beliefs.var() > 0)


def test_bad_arguments():
    oracle = QuadratureOracle(Logistic())
    with pytest.raises(ValueError, match="`n`"):
        make_training_set(Logistic(), "x", logistic_sampler, oracle)
    with pytest.raises(ValueError, match="`to`='w'"):
        make_training_set(Logistic(), "w", logistic_sampler, oracle, n=3)
    with pytest.raises(ValueError, match="different factor"):
        make_training_set(Logistic(), "x", logistic_sampler, QuadratureOracle(CompoundGamma()), n=3)
    # found by an audit: an oracle for other parameters of the factor was taken, its beliefs stored under
    # the factor's parameters (shape-3 beliefs labelled shape 1)
    with pytest.raises(ConfigurationError, match=r"`s1` 5\.0 for `oracle`, 1\.0 for `factor`"):
        make_training_set(CompoundGamma(s1=1.0), "tau", None, QuadratureOracle(CompoundGamma(s1=5.0)), n=3)
    with pytest.raises(ValueError, match="chunk_size"):
        make_training_set(Logistic(), "x", logistic_sampler, oracle, n=3, chunk_size=0)
    with pytest.raises(ValueError, match="unknown factor 'nope'.*KJIT_FACTORS=module"):
        make_training_set("nope", "x", logistic_sampler, oracle, n=3)
    with pytest.raises(ValueError, match="1-D"):
        make_training_set(Logistic(), "x", {"x": Gaussian(np.zeros((2, 2)), 1.0), "z": Beta(2.0, 1.0)}, oracle)
    with pytest.raises(ValueError, match=r"incoming\['z'\]"):
        make_training_set(Logistic(), "x", {"x": Gaussian(np.zeros(3), 1.0), "z": Gaussian(0.0, 1.0)}, oracle)


# --------------------------------------------------------------------------- parallelism
def _is_set(n_jobs, random_state=123, chunk_size=8, backend=None, per_message=False):
    oracle = (MessageImportanceSampler(Logistic(), target_se=0.05, n_initial=500, random_state=0) if per_message
              else ImportanceSamplingOracle(Logistic(), n_samples=1000, random_state=0))
    kw = dict(n=40, n_jobs=n_jobs, chunk_size=chunk_size, random_state=random_state)
    if backend is None:
        return make_training_set(Logistic(), "x", logistic_sampler, oracle, **kw)
    with joblib.parallel_config(backend=backend):
        return make_training_set(Logistic(), "x", logistic_sampler, oracle, **kw)


@pytest.mark.parametrize("per_message", [False, True])
def test_n_jobs_and_backend_do_not_change_the_result(per_message):
    """Either sampler (the per-message one since an audit found it drew every chunk from one stream: n_jobs 1 and 2
    gave other pairs, and two chunks of the same messages in two workers the same particles)."""
    serial = _is_set(n_jobs=1, per_message=per_message)
    parallel = _is_set(n_jobs=2, per_message=per_message)  # loky processes
    threads = _is_set(n_jobs=2, backend="threading", per_message=per_message)
    for other in (parallel, threads):
        assert other.beliefs == serial.beliefs  # bit-identical
        assert other.incoming["x"] == serial.incoming["x"] and other.incoming["z"] == serial.incoming["z"]
        assert other.meta["n_failed"] == serial.meta["n_failed"]
    # and the seed matters: a different one gives different importance-sampling noise
    assert _is_set(n_jobs=1, random_state=124, per_message=per_message).beliefs != serial.beliefs
    # the oracle's own random_state does not leak in: each chunk gets its own child seed
    assert len(set(np.round(serial.beliefs.mean(), 12))) == len(serial)


def test_importance_sampling_set_is_close_to_quadrature():
    ts = _is_set(n_jobs=1)
    ref = QuadratureOracle(Logistic()).belief(ts.incoming, "x")
    # 1000 particles with the N(0, 200) proposal: ESS ≥ 50 by construction, so the error in the
    # mean is ≲ 5·sd/sqrt(50) ≈ 0.7 sd; we only check it is an estimate of the right thing
    z = np.abs(ts.beliefs.mean() - ref.mean()) / np.sqrt(ref.var())
    assert np.all(z < 1.0) and np.median(z) < 0.2


# --------------------------------------------------------------------------- failures
def _recorded_with_bad_rows():
    # rows 3 and 7 ask for x ≈ 40 ± 0.01: hopeless for N(0, 200) proposals with 2 000 particles
    m = np.linspace(-2.0, 2.0, 10)
    v = np.full(10, 2.0)
    m[[3, 7]] = 40.0
    v[[3, 7]] = 1e-4
    return {"x": Gaussian(m, v), "z": Beta(np.full(10, 2.0), np.full(10, 1.0))}


def test_drop_failures_counts_importance_sampling_failures():
    rec = _recorded_with_bad_rows()
    oracle = ImportanceSamplingOracle(Logistic(), n_samples=2000)
    ts = make_training_set(Logistic(), "x", rec, oracle, chunk_size=4, random_state=9)
    assert ts.meta["n_failed"] == 2 and ts.meta["n_requested"] == 10 and len(ts) == 8
    keep = [i for i in range(10) if i not in (3, 7)]
    assert ts.incoming["x"] == rec["x"][keep] and ts.incoming["z"] == rec["z"][keep]
    # beliefs stay aligned with their incoming rows
    ref = QuadratureOracle(Logistic()).belief(ts.incoming, "x")
    assert np.all(np.abs(ts.beliefs.mean() - ref.mean()) < np.sqrt(ref.var()))
    with pytest.raises(OracleError):
        make_training_set(Logistic(), "x", rec, oracle, chunk_size=4, random_state=9, drop_failures=False)


def test_drop_failures_with_quadrature_row_by_row():
    # row 2: N(0, 1e4)·Beta(1, 0.5) puts the mass at x ≈ 5000, where E[log z] ≈ −e^{−5000}
    # underflows: the z-belief is an OracleError for that row only
    m = np.array([0.0, 1.0, 0.0, -1.0, 2.0])
    v = np.array([1.0, 2.0, 1e4, 0.5, 3.0])
    a = np.array([2.0, 1.0, 1.0, 2.0, 1.5])
    b = np.array([1.0, 2.0, 0.5, 1.0, 2.5])
    rec = {"x": Gaussian(m, v), "z": Beta(a, b)}
    oracle = QuadratureOracle(Logistic())
    ts = make_training_set(Logistic(), "z", rec, oracle, chunk_size=3)
    assert ts.meta["n_failed"] == 1 and len(ts) == 4
    keep = [0, 1, 3, 4]
    assert ts.incoming["x"] == rec["x"][keep]
    single = Beta.concatenate([oracle.belief({"x": rec["x"][i:i + 1], "z": rec["z"][i:i + 1]}, "z") for i in keep])
    assert ts.beliefs.allclose(single, rtol=1e-12)
    with pytest.raises(OracleError):
        make_training_set(Logistic(), "z", rec, oracle, chunk_size=3, drop_failures=False)
    with pytest.raises(OracleError, match="every message"):
        make_training_set(Logistic(), "z", {"x": rec["x"][2:3], "z": rec["z"][2:3]}, oracle)


def test_one_bad_row_does_not_kill_the_run():
    # row 1: N(-6.9701, 5351.7602)·Beta(1.7091, 0.6835) (see test_oracles.py, tiny-statistic case)
    rec = {"x": Gaussian([0.0, -6.9701, 1.0], [1.0, 5351.7602, 2.0]),
           "z": Beta([2.0, 1.7091, 1.0], [1.0, 0.6835, 2.0])}
    ts = make_training_set(Logistic(), "z", rec, QuadratureOracle(Logistic()))
    # either answered correctly or dropped and counted; never a crash
    assert len(ts) + ts.meta["n_failed"] == 3 and len(ts) >= 2


# =========================================================================== TrainingSet
@pytest.fixture(scope="module")
def small_set():
    return make_training_set(Logistic(), "x", logistic_sampler, QuadratureOracle(Logistic()), n=50,
                             random_state=11)


def test_subset_split_concatenate(small_set):
    ts = small_set
    ids = _ids(ts)
    assert len(set(ids)) == 50
    sub = ts.subset(np.array([4, 0, 9]))
    assert _ids(sub) == [ids[4], ids[0], ids[9]]
    assert sub.beliefs == Gaussian.concatenate([ts.beliefs[4:5], ts.beliefs[0:1], ts.beliefs[9:10]])
    assert len(ts.subset(slice(10, 20))) == 10

    a, b = ts.split(30, random_state=0)
    assert len(a) == 30 and len(b) == 20
    assert set(_ids(a)).isdisjoint(_ids(b)) and set(_ids(a)) | set(_ids(b)) == set(ids)
    # each row keeps its own belief
    pos = {x: i for i, x in enumerate(ids)}
    for part in (a, b):
        idx = [pos[x] for x in _ids(part)]
        assert part.beliefs == ts.beliefs[np.array(idx)]
        assert part.incoming["z"] == ts.incoming["z"][np.array(idx)]
    a2, _ = ts.split(30, random_state=0)
    assert _ids(a2) == _ids(a)
    a3, _ = ts.split(30, random_state=1)
    assert _ids(a3) != _ids(a)
    for bad in (0, 50, 51, -1):
        with pytest.raises(ValueError, match="n_first"):
            ts.split(bad)

    back = TrainingSet.concatenate([a, b])
    assert len(back) == 50 and sorted(_ids(back)) == sorted(ids)
    assert back.factor == ts.factor and back.to == ts.to and back.factor_params == ts.factor_params
    assert back.meta["n_sets"] == 2
    other_dir = make_training_set(Logistic(), "z", ts.incoming, QuadratureOracle(Logistic()), n=3)
    with pytest.raises(ValueError, match="different"):
        TrainingSet.concatenate([a, other_dir])
    # parameters compare by value: a tuple kept as a list by JSON is the same parameter; another value is not
    tup, lst = (TrainingSet(a.factor, a.to, a.incoming, a.beliefs, {"w": p}) for p in ((1, 2.5), [1.0, 2.5]))
    assert len(TrainingSet.concatenate([tup, lst])) == 2 * len(a)
    other = TrainingSet(a.factor, a.to, a.incoming, a.beliefs, {"w": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"`w` \[1\.0, 2\.0\] for set 1, \(1, 2\.5\) for set 0"):
        TrainingSet.concatenate([tup, other])


def test_constructor_checks_lengths(small_set):
    with pytest.raises(ValueError, match=r"incoming\['x'\].*shape"):
        TrainingSet("logistic", "x", {"x": small_set.incoming["x"][:3], "z": small_set.incoming["z"][:4]},
                    small_set.beliefs[:4])


# --------------------------------------------------------------------------- npz I/O
def _assert_same(a, b):
    assert (a.factor, a.to, a.factor_params, a.meta) == (b.factor, b.to, b.factor_params, b.meta)
    assert set(a.incoming) == set(b.incoming)
    for v in a.incoming:
        assert type(a.incoming[v]) is type(b.incoming[v]) and a.incoming[v] == b.incoming[v]
    assert type(a.beliefs) is type(b.beliefs) and a.beliefs == b.beliefs  # bit-exact


def test_save_load_round_trip(small_set, tmp_path):
    path = tmp_path / "set.npz"
    small_set.save(path)
    _assert_same(small_set, TrainingSet.load(path))
    # other families, a user meta dict, and a str path
    cg = CompoundGamma(s1=2.0, r1=0.5, s2=3.0)
    ts = make_training_set(cg, "tau", {"tau": Gamma([0.5, 3.0], [1.0, 0.25])}, QuadratureOracle(cg))
    ts.meta["note"] = "round trip ✓"
    ts.save(str(tmp_path / "cg.npz"))
    back = TrainingSet.load(str(tmp_path / "cg.npz"))
    _assert_same(ts, back)
    assert back.factor_params == {"s1": 2.0, "r1": 0.5, "s2": 3.0}


def test_saved_file_is_plain_npz(small_set, tmp_path):
    path = tmp_path / "set.npz"
    small_set.save(path)
    with np.load(path, allow_pickle=False) as z:  # readable without pickle
        for k in z.files:
            assert z[k].dtype != object
        header = json.loads(str(z["header"]))
    assert header["format_version"] == FORMAT_VERSION and header["factor"] == "logistic"


class _Boom:
    """An object whose unpickling would run os.mkdir(sentinel)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _rewrite(path, out, **changes):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    np.savez(out, **arrays)  # np.savez pickles object arrays


def test_load_refuses_pickled_object_arrays(small_set, tmp_path):
    path = tmp_path / "set.npz"
    small_set.save(path)
    sentinel = tmp_path / "pwned"
    evil = np.empty(1, dtype=object)
    evil[0] = _Boom(str(sentinel))
    bad = tmp_path / "evil.npz"
    _rewrite(path, bad, **{"belief.mean": evil})
    with pytest.raises(ValueError, match="allow_pickle"):
        TrainingSet.load(bad)
    assert not sentinel.exists()
    # a pickled header is refused too
    hdr = np.empty((), dtype=object)
    with np.load(path, allow_pickle=False) as z:
        hdr[()] = str(z["header"])
    bad2 = tmp_path / "evil2.npz"
    _rewrite(path, bad2, header=hdr)
    with pytest.raises(ValueError):
        TrainingSet.load(bad2)


def test_load_refuses_other_format_version(small_set, tmp_path):
    path = tmp_path / "set.npz"
    small_set.save(path)
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(str(z["header"]))
    for version in (FORMAT_VERSION + 1, 0, "1", None):
        header["format_version"] = version
        bad = tmp_path / f"v{version}.npz"
        _rewrite(path, bad, header=np.array(json.dumps(header)))
        with pytest.raises(ValueError, match=r"format version .* not supported"):
            TrainingSet.load(bad)


def test_load_refuses_foreign_npz(tmp_path):
    p = tmp_path / "plain.npz"
    np.savez(p, a=np.arange(3.0))
    with pytest.raises(ValueError, match="no header"):
        TrainingSet.load(p)
    p2 = tmp_path / "other.npz"
    np.savez(p2, header=np.array(json.dumps({"format": "something-else", "format_version": 1})))
    with pytest.raises(ValueError, match="not a kjit training set"):
        TrainingSet.load(p2)


def test_load_from_file_object(small_set, tmp_path):
    buf = io.BytesIO()
    small_set.save(tmp_path / "s.npz")
    buf.write((tmp_path / "s.npz").read_bytes())
    buf.seek(0)
    _assert_same(small_set, TrainingSet.load(buf))


def test_progress_bar_does_not_change_the_result(capsys):
    oracle = QuadratureOracle(Logistic())
    a = make_training_set(Logistic(), "x", logistic_sampler, oracle, n=20, chunk_size=5, random_state=4)
    b = make_training_set(Logistic(), "x", logistic_sampler, oracle, n=20, chunk_size=5, random_state=4,
                          progress=True)
    assert a.beliefs == b.beliefs
    assert "oracle logistic" in capsys.readouterr().err
