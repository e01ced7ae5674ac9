"""Tests for kjit.datasets: shipped UCI data, stratified splits, synthetic logistic problems."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from scipy.special import expit

import kjit
from kjit import datasets as D

# name -> (n, d, number of label-1 rows, number of label-0 rows)
EXPECTED = {
    "banknote": (1372, 4, 610, 762),
    "blood_transfusion": (748, 4, 178, 570),
    "fertility": (100, 9, 12, 88),  # 1 = 'O' (altered), 0 = 'N' (normal)
    "ionosphere": (351, 33, 225, 126),  # 1 = 'g', 0 = 'b'; constant column 2 dropped
    "heart": (270, 13, 120, 150),  # 1 = file code 2 (disease present)
    "pima": (768, 8, 268, 500),  # 1 = diabetic
    "haberman": (306, 3, 81, 225),  # 1 = file code 2 (died within 5 years)
    "spam": (4601, 57, 1813, 2788),  # 1 = spam
}

DATA_DIR = importlib.resources.files("kjit").joinpath("data")


def _raw_lines(name):
    return DATA_DIR.joinpath(D.DATA_FILES[name]).read_text(encoding="utf-8").splitlines()


def _raw_labels(name):
    """Last field of every data line, independently of the module's parser."""
    lines = _raw_lines(name)[1 if name == "blood_transfusion" else 0 :]
    return [re.split(r"[,\s]+", ln.strip())[-1] for ln in lines if ln.strip()]


def _raw_matrix(name):
    lines = _raw_lines(name)
    return np.array(
        [[float(f) for f in re.split(r"[,\s]+", ln.strip())[:-1]] for ln in lines if ln.strip()]
    )


# --------------------------------------------------------------------------- loading


def test_names():
    assert D.DATASETS == (
        "banknote",
        "blood_transfusion",
        "fertility",
        "ionosphere",
        "heart",
        "pima",
        "haberman",
        "spam",
    )
    assert set(D.DATA_FILES) == set(D.DATASETS) == set(D.POSITIVE_CLASS) == set(EXPECTED)


@pytest.mark.parametrize("name", D.DATASETS)
def test_load_shape_labels(name):
    n, d, n_pos, n_neg = EXPECTED[name]
    ds = D.load(name)
    assert isinstance(ds, D.Dataset)
    assert ds.name == name
    assert ds.X.shape == (n, d) and ds.X.dtype == np.float64
    assert ds.y.shape == (n,) and np.issubdtype(ds.y.dtype, np.integer)
    assert len(ds.feature_names) == d and len(set(ds.feature_names)) == d
    assert all(isinstance(f, str) for f in ds.feature_names)
    assert np.isfinite(ds.X).all()
    assert set(np.unique(ds.y)) == {0, 1}
    assert int((ds.y == 1).sum()) == n_pos and int((ds.y == 0).sum()) == n_neg
    assert (np.ptp(ds.X, axis=0) > 0).all()  # no constant columns left
    with pytest.raises(Exception):  # frozen dataclass
        ds.name = "other"


def test_load_returns_fresh_arrays():
    a, b = D.load("haberman"), D.load("haberman")
    a.X[0, 0] = -1e9
    a.y[0] = 1 - a.y[0]
    assert b.X[0, 0] != -1e9 and D.load("haberman").X[0, 0] != -1e9
    assert D.load("haberman").y[0] == b.y[0]


@pytest.mark.parametrize(
    "name, codes",
    [
        ("banknote", {"1": 1, "0": 0}),
        ("blood_transfusion", {"1": 1, "0": 0}),
        ("fertility", {"O": 1, "N": 0}),
        ("ionosphere", {"g": 1, "b": 0}),
        ("heart", {"2": 1, "1": 0}),
        ("pima", {"1": 1, "0": 0}),
        ("haberman", {"2": 1, "1": 0}),
        ("spam", {"1": 1, "0": 0}),
    ],
)
def test_label_coding_against_raw_file(name, codes):
    raw = _raw_labels(name)
    assert set(raw) == set(codes)
    np.testing.assert_array_equal(D.load(name).y, [codes[c] for c in raw])


def test_ionosphere_constant_column_dropped():
    raw = _raw_matrix("ionosphere")
    assert raw.shape == (351, 34)
    assert (raw[:, 1] == 0).all()  # the 2nd attribute is constant zero
    ds = D.load("ionosphere")
    assert "a02" not in ds.feature_names and ds.feature_names[:2] == ("a01", "a03")
    np.testing.assert_array_equal(ds.X, np.delete(raw, 1, axis=1))


def test_spam_is_log1p_of_raw():
    raw = _raw_matrix("spam")
    assert raw.min() >= 0 and raw.max() > 1000  # skewed: capital-run lengths
    ds = D.load("spam")
    np.testing.assert_allclose(ds.X, np.log1p(raw))
    assert ds.feature_names[0] == "word_freq_make"
    assert ds.feature_names[-1] == "capital_run_length_total"


def test_pima_zeros_kept():
    ds = D.load("pima")
    zeros = dict(zip(ds.feature_names, (ds.X == 0).sum(axis=0)))
    assert zeros["glucose"] == 5
    assert zeros["blood_pressure"] == 35
    assert zeros["skin_thickness"] == 227
    assert zeros["insulin"] == 374
    assert zeros["bmi"] == 11
    np.testing.assert_array_equal(ds.X, _raw_matrix("pima"))


def test_other_features_unchanged():
    for name in ("banknote", "blood_transfusion", "fertility", "heart", "haberman"):
        lines = _raw_lines(name)
        if name == "blood_transfusion":
            assert lines[0].startswith("Recency (months)")
            lines = lines[1:]
        raw = np.array([[float(f) for f in re.split(r"[,\s]+", ln.strip())[:-1]] for ln in lines])
        np.testing.assert_array_equal(D.load(name).X, raw)


@pytest.mark.parametrize("bad", ["iris", "Banknote", "", "spam "])
def test_unknown_name(bad):
    with pytest.raises(ValueError) as exc:
        D.load(bad)
    msg = str(exc.value)
    assert repr(bad) in msg
    assert all(n in msg for n in D.DATASETS)
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        D.paper_split(bad)


# --------------------------------------------------------------------------- shipped files


def _sources_checksums():
    text = DATA_DIR.joinpath("SOURCES.md").read_text(encoding="utf-8")
    return text, dict(
        (m.group(2), m.group(1))
        for m in re.finditer(r"^([0-9a-f]{64})  (\S+)$", text, flags=re.MULTILINE)
    )


def test_checksums_match_sources_md():
    text, sums = _sources_checksums()
    assert "CC BY 4.0" in text and "UCI Machine Learning Repository" in text
    assert set(sums) == set(D.DATA_FILES.values())
    shipped = {p.name for p in DATA_DIR.iterdir() if p.is_file()} - {"SOURCES.md"}
    assert shipped == set(sums)
    for fname, digest in sums.items():
        assert hashlib.sha256(DATA_DIR.joinpath(fname).read_bytes()).hexdigest() == digest, fname


_OPEN_PROBE = r"""
import json, sys
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" else None)
from kjit import datasets as D
for name in D.DATASETS:
    D.load(name)
print(json.dumps(opened))
"""


def test_reads_only_package_data(tmp_path):
    """Every data file opened while loading lies inside kjit/data (never ../shared).

    Run in a fresh interpreter (an audit hook cannot be removed), from an unrelated directory.
    """
    pkg_data = (Path(kjit.__file__).parent / "data").resolve()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(kjit.__file__).parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    opened = [Path(p) for p in json.loads(out.strip().splitlines()[-1])]
    data_opens = [p for p in opened if p.suffix in {".data", ".dat", ".txt", ".md"}]
    assert {p.name for p in data_opens} >= set(D.DATA_FILES.values())
    for p in data_opens:
        assert p.resolve().is_relative_to(pkg_data), p
    shared = Path(kjit.__file__).resolve().parents[2] / "shared"  # the checkout's sibling
    assert not any(p.resolve().is_relative_to(shared) for p in opened)


# --------------------------------------------------------------------------- splits


def _rows_sorted(X):
    return X[np.lexsort(X.T[::-1])]


@pytest.mark.parametrize("name", D.DATASETS)
def test_stratified_split(name):
    ds = D.load(name)
    n = len(ds.y)
    frac = ds.y.mean()
    for n_train in sorted({1, 2, 3, 10, 50, n // 2, n - 2, n - 1}):
        for seed in range(3):
            sp = D.train_test_split(ds, n_train, seed, standardize=False)
            assert sp.X_train.shape == (n_train, ds.X.shape[1])
            assert sp.X_test.shape == (n - n_train, ds.X.shape[1])
            k = int(sp.y_train.sum())
            # class proportions match to within one point (one example)
            assert abs(k - n_train * frac) < 1, (n_train, k)
            if n_train >= 2:
                assert set(sp.y_train) == {0, 1}
            # the test part is the complement
            assert sp.y_train.sum() + sp.y_test.sum() == ds.y.sum()
            if n_train in (10, n // 2):
                both = np.vstack([sp.X_train, sp.X_test])
                np.testing.assert_array_equal(_rows_sorted(both), _rows_sorted(ds.X))


def test_split_rows_match_labels():
    ds = D.load("banknote")
    lookup = {tuple(x): y for x, y in zip(ds.X, ds.y)}
    # duplicated rows, if any, carry the same label, so a row -> label map is well defined
    assert all(lookup[tuple(x)] == t for x, t in zip(ds.X, ds.y))
    sp = D.train_test_split(ds, 200, 5, standardize=False)
    for X, y in ((sp.X_train, sp.y_train), (sp.X_test, sp.y_test)):
        assert all(lookup[tuple(x)] == t for x, t in zip(X, y))


def test_split_interleaves_classes():
    sp = D.train_test_split(D.load("pima"), 468, 0)
    first_pos = np.flatnonzero(sp.y_train == 1)
    assert first_pos[0] < 20 and first_pos[-1] > 440  # not sorted by class


def test_split_deterministic_by_seed():
    ds = D.load("ionosphere")
    a = D.train_test_split(ds, 200, 123)
    b = D.train_test_split(ds, 200, 123)
    c = D.train_test_split(ds, 200, 124)
    g = D.train_test_split(ds, 200, np.random.default_rng(123))
    for field in ("X_train", "y_train", "X_test", "y_test", "mean", "scale"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_array_equal(getattr(a, field), getattr(g, field))
    assert not np.array_equal(a.X_train, c.X_train)
    assert not np.array_equal(a.mean, c.mean)
    # seed None: still valid, almost surely different
    assert D.train_test_split(ds, 200, None).X_train.shape == (200, 33)
    np.testing.assert_array_equal(D.paper_split("heart", 7).X_train, D.paper_split("heart", 7).X_train)
    assert not np.array_equal(D.paper_split("heart", 7).X_train, D.paper_split("heart", 8).X_train)
    np.testing.assert_array_equal(D.paper_split("heart").X_train, D.paper_split("heart", 0).X_train)


@pytest.mark.parametrize("name", D.DATASETS)
def test_standardised_training_features(name):
    ds = D.load(name)
    raw = D.paper_split(name, 3, standardize=False)
    sp = D.paper_split(name, 3)
    np.testing.assert_array_equal(raw.y_train, sp.y_train)
    np.testing.assert_array_equal(raw.mean, 0.0)
    np.testing.assert_array_equal(raw.scale, 1.0)
    np.testing.assert_allclose(sp.X_train.mean(axis=0), 0.0, atol=1e-10)
    sd = sp.X_train.std(axis=0)
    constant = raw.X_train.std(axis=0) == 0  # possible for binary features in small splits
    np.testing.assert_allclose(sd[~constant], 1.0, rtol=1e-10)
    np.testing.assert_array_equal(sd[constant], 0.0)
    # statistics come from the training part only, and are applied to the test part
    np.testing.assert_allclose(sp.mean, raw.X_train.mean(axis=0))
    np.testing.assert_allclose(sp.X_test * sp.scale + sp.mean, raw.X_test, rtol=1e-9, atol=1e-9)
    assert sp.mean.shape == sp.scale.shape == (ds.X.shape[1],)


def test_add_bias():
    ds = D.load("fertility")
    sp = D.train_test_split(ds, 50, 0, add_bias=True)
    assert sp.X_train.shape == (50, 10) and sp.X_test.shape == (50, 10)
    np.testing.assert_array_equal(sp.X_train[:, -1], 1.0)
    np.testing.assert_array_equal(sp.X_test[:, -1], 1.0)
    assert sp.mean.shape == (9,)
    plain = D.train_test_split(ds, 50, 0)
    np.testing.assert_array_equal(sp.X_train[:, :-1], plain.X_train)
    nostd = D.train_test_split(ds, 50, 0, standardize=False, add_bias=True)
    np.testing.assert_array_equal(nostd.X_train[:, -1], 1.0)


@pytest.mark.parametrize("bad", [0, -1, 306, 307, 10**6, 1.5, "10", None, True])
def test_n_train_validated(bad):
    ds = D.load("haberman")
    with pytest.raises(ValueError, match="n_train"):
        D.train_test_split(ds, bad, 0)


def test_n_train_extremes_ok():
    ds = D.load("haberman")
    assert D.train_test_split(ds, 1, 0).X_train.shape == (1, 3)
    assert D.train_test_split(ds, 305, 0).X_test.shape == (1, 3)
    assert D.train_test_split(ds, np.int64(100), 0).X_train.shape == (100, 3)


def test_paper_sizes():
    assert D.PAPER_TRAIN_SIZES == {
        "banknote": 200,
        "blood_transfusion": 200,
        "fertility": 50,
        "ionosphere": 200,
        "heart": 81,
        "pima": 468,
        "haberman": 183,
        "spam": 276,
    }
    # test sizes reported in the relaxed-EP paper, section 7.3
    paper_test = {"heart": 189, "pima": 300, "haberman": 123, "spam": 4325}
    for name in D.DATASETS:
        sp = D.paper_split(name)
        assert len(sp.y_train) == D.PAPER_TRAIN_SIZES[name]
        assert len(sp.y_train) + len(sp.y_test) == EXPECTED[name][0]
        if name in paper_test:
            assert len(sp.y_test) == paper_test[name]
    sp = D.paper_split("fertility", 1, add_bias=True, standardize=False)
    assert sp.X_train.shape == (50, 10) and int(sp.y_train.sum()) == 6


# --------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_and_determinism():
    X, y, w = D.synthetic_logistic(random_state=0)
    assert X.shape == (300, 20) and y.shape == (300,) and w.shape == (20,)
    assert X.dtype == np.float64 and np.issubdtype(y.dtype, np.integer)
    assert set(np.unique(y)) <= {0, 1}
    X2, y2, w2 = D.synthetic_logistic(random_state=0)
    np.testing.assert_array_equal(X, X2)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(w, w2)
    X3, _, w3 = D.synthetic_logistic(random_state=1)
    assert not np.array_equal(X, X3) and not np.array_equal(w, w3)
    out = D.synthetic_logistic(d=3, n=40, random_state=0, n_test=25)
    assert len(out) == 5
    Xa, ya, Xt, yt, wa = out
    assert Xa.shape == (40, 3) and ya.shape == (40,) and Xt.shape == (25, 3) and yt.shape == (25,)
    # training part and w do not depend on n_test
    Xb, yb, wb = D.synthetic_logistic(d=3, n=40, random_state=0)
    np.testing.assert_array_equal(Xa, Xb)
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(wa, wb)
    g = D.synthetic_logistic(d=3, n=40, random_state=np.random.default_rng(0))
    np.testing.assert_array_equal(g[0], Xb)
    for bad in ({"d": 0}, {"n": 0}, {"n_test": -1}, {"d": 2.5}):
        with pytest.raises(ValueError):
            D.synthetic_logistic(**bad)


def test_synthetic_inputs_standard_normal():
    X, _, _ = D.synthetic_logistic(d=4, n=50_000, random_state=11)
    # mean of 50k N(0,1) has sd 0.0045; covariance entries sd ~0.0045-0.0063
    np.testing.assert_allclose(X.mean(axis=0), 0.0, atol=0.03)
    np.testing.assert_allclose(np.cov(X.T), np.eye(4), atol=0.04)
    # w ~ N(0, I_d): ||w||^2 ~ chi2_d, mean d, sd sqrt(2d); averaged over 400 draws
    sq = [np.sum(D.synthetic_logistic(d=20, n=1, random_state=s)[2] ** 2) for s in range(400)]
    assert abs(np.mean(sq) - 20) < 4 * np.sqrt(40 / 400)


def test_synthetic_labels_follow_logistic_model_given_inputs():
    """Agreement of y with sign(w^T a), conditional on the drawn X and w.

    Given X and w, y_i ~ Bernoulli(sigmoid(x_i)), x_i = w^T a_i, independently, so
    y_i agrees with 1[x_i > 0] with probability p_i = sigmoid(|x_i|).  The number of agreements
    is Poisson-binomial with mean sum p_i and variance sum p_i (1 - p_i); with n = 20000 it is
    close to normal, so |z| < 4 fails a correct implementation with probability ~6e-5 (and the
    seed is fixed, so the test is deterministic).  Labels drawn deterministically
    (y = 1[x > 0]), with the wrong sign, or from sigmoid(2 x) would give |z| in the hundreds/
    tens (checked below), so the test has power against them.
    """
    X, y, w = D.synthetic_logistic(d=5, n=20_000, random_state=2024)
    x = X @ w
    agree = int(np.sum(y == (x > 0)))
    p = expit(np.abs(x))
    mean, sd = p.sum(), np.sqrt(np.sum(p * (1 - p)))
    assert abs(agree - mean) / sd < 4
    # power: what alternative label models would produce, in sd units
    assert (len(y) - mean) / sd > 50  # deterministic labels
    assert (mean - expit(2 * np.abs(x)).sum()) / sd < -20  # labels from sigmoid(2x)
    # and y is not simply independent of x
    assert np.corrcoef(y, x)[0, 1] > 0.5


def _expected_agreement(d, scale=1.0, m=100):
    """E[sigmoid(scale |w^T a|)] for w, a ~ N(0, I_d), by 2-D Gauss-Legendre quadrature.

    Given r = ||w|| ~ chi_d, w^T a ~ r z with z ~ N(0, 1), so the expectation is
    int chi_d(r) int_0^inf 2 phi(z) sigmoid(scale r z) dz dr.  The integrands are negligible
    beyond z = 10 and r = 4 sqrt(d) + 10; with 100 nodes per axis the result agrees with
    adaptive scipy.integrate.quad to ~1e-13 (0.879696391664 for d = 20).
    """
    t, wt = np.polynomial.legendre.leggauss(m)
    r_max, z_max = 4 * np.sqrt(d) + 10, 10.0
    r, wr = (t + 1) * r_max / 2, wt * r_max / 2
    z, wz = (t + 1) * z_max / 2, wt * z_max / 2
    inner = (2 * stats.norm.pdf(z) * wz * expit(scale * np.outer(r, z))).sum(axis=1)
    return float(np.sum(stats.chi.pdf(r, d) * wr * inner))


def test_synthetic_agreement_matches_exact_expectation():
    """Default problems (d=20, n=300): agreement rate vs. its exact expectation.

    The exact expectation E[sigmoid(|w^T a|)] is computed by quadrature (0.8797 for d=20).
    Over R = 400 independent problems the mean agreement rate has standard error
    sd(rates)/sqrt(R) (~0.0015); we allow 4 standard errors.  A wrong prior scale
    (w ~ N(0, 4 I), i.e. sigmoid(2x): 0.937) is ~40 standard errors away.
    """
    p20 = _expected_agreement(20)
    assert abs(p20 - 0.8796963916641445) < 1e-9
    assert abs(_expected_agreement(1) - 0.6321016664746751) < 1e-9  # d = 1 check
    rates = []
    for seed in range(400):
        X, y, w = D.synthetic_logistic(random_state=seed)
        rates.append(np.mean(y == (X @ w > 0)))
    rates = np.asarray(rates)
    se = rates.std(ddof=1) / np.sqrt(len(rates))
    assert abs(rates.mean() - p20) < 4 * se
    assert abs(_expected_agreement(20, scale=2.0) - p20) > 20 * se
