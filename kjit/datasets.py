"""Binary classification data for Bayesian logistic regression with EP.

Two kinds of problem:

* **Real data**: eight small UCI data sets shipped with the package in ``kjit/data/``
  (see ``kjit/data/SOURCES.md`` for provenance, licence and SHA256 checksums).  They are always
  read from the installed package, never from anywhere else.  :func:`load` parses one into a
  :class:`Dataset`; :func:`train_test_split` makes a stratified, seeded, optionally standardised
  :class:`Split`; :func:`paper_split` uses the training sizes of the published experiments.
* **Synthetic data**: :func:`synthetic_logistic` draws the KJIT paper's logistic-regression
  problems, ``w ~ N(0, I_d)``, ``a_i ~ N(0, I_d)``, ``y_i ~ Bernoulli(sigmoid(w^T a_i))``.

Labels are always ``int64`` in ``{0, 1}``.  Which original class is coded 1 (the "positive"
class) is listed in :data:`POSITIVE_CLASS`:

=================  ====================  ==========================================  ==========
name               shape (n x d)         class coded 1 (original code)               n(1)/n(0)
=================  ====================  ==========================================  ==========
banknote           1372 x 4              file class ``1`` (file already 0/1)         610 / 762
blood_transfusion  748 x 4               donated blood in March 2007 (``1``)         178 / 570
fertility          100 x 9               altered diagnosis ``O`` (``N`` -> 0)        12 / 88
ionosphere         351 x 33              "good" radar return ``g`` (``b`` -> 0)      225 / 126
heart              270 x 13              heart disease present (``2``; ``1`` -> 0)   120 / 150
pima               768 x 8               tested positive for diabetes (``1``)        268 / 500
haberman           306 x 3               died within 5 years (``2``; ``1`` -> 0)     81 / 225
spam               4601 x 57             spam (``1``)                                1813 / 2788
=================  ====================  ==========================================  ==========

Preprocessing done by :func:`load` (nothing else is changed):

* constant columns are dropped -- only ionosphere has one, its 2nd attribute (index 1), all 0,
  so ionosphere has 33 features, named ``a01, a03, ..., a34`` after the original positions;
* spam: every feature is replaced by ``log(1 + x)`` (all are non-negative word/character
  frequencies and capital-run lengths, heavily right-skewed; the capital-run lengths reach 15841);
* pima: zeros that stand for missing values (glucose 5, blood pressure 35, skin thickness 227,
  insulin 374, BMI 11 rows) are **kept as zeros**, no rows are removed (all 768 are kept).  The
  532 rows with non-zero glucose, blood pressure, skin thickness and BMI match the size of
  Ripley's complete-case Pima set, which is what the relaxed-EP paper's "Pima" (319 + 213)
  appears to be.  Zeros in ``pregnancies`` are genuine;
* heart: categorical codes (chest pain type, resting ECG, slope, thal) are kept as numbers; so are
  fertility's (``season`` in {-1, -0.33, 0.33, 1}, ``high_fevers`` and ``smoking`` in {-1, 0, 1});
* blood_transfusion: ``monetary_cc_blood`` is exactly 250 x ``frequency_times`` (collinear
  but not constant, so kept: d = 4).

Duplicate rows are kept (counted by an audit): rows equal in features and label — transfusion 215,
spam 391, banknote 24, haberman 17, ionosphere 1 — and equal features with another label —
transfusion 31, haberman 6, spam 3, fertility 1.  So a test row can equal a training row although
the splits are disjoint by row: with seed 0's paper split, 160 of transfusion's 548 test rows (29 %)
have a training row of identical features (haberman 7.3 %, spam 4.3 %, banknote 1.1 %) — common
patterns, not memorised ones (a linear model of 5 weights).
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import operator
from dataclasses import dataclass

import numpy as np
from scipy.special import expit

__all__ = [
    "DATASETS",
    "DATA_FILES",
    "POSITIVE_CLASS",
    "PAPER_TRAIN_SIZES",
    "Dataset",
    "Split",
    "load",
    "train_test_split",
    "paper_split",
    "synthetic_logistic",
]

#: Names accepted by :func:`load`.
DATASETS: tuple[str, ...] = (
    "banknote",
    "blood_transfusion",
    "fertility",
    "ionosphere",
    "heart",
    "pima",
    "haberman",
    "spam",
)

#: File in ``kjit/data/`` holding each data set (raw UCI files, byte for byte).
DATA_FILES: dict[str, str] = {
    "banknote": "data_banknote_authentication.txt",
    "blood_transfusion": "transfusion.data",
    "fertility": "fertility_Diagnosis.txt",
    "ionosphere": "ionosphere.data",
    "heart": "heart.dat",
    "pima": "pima-indians-diabetes.data",
    "haberman": "haberman.data",
    "spam": "spambase.data",
}

#: Meaning of label 1 for each data set (label 0 is the other class).
POSITIVE_CLASS: dict[str, str] = {
    "banknote": "class 1 of the UCI file (the file is already coded 0/1)",
    "blood_transfusion": "donated blood in March 2007 (file 1)",
    "fertility": "altered seminal diagnosis 'O' (normal 'N' is 0); 12 of 100",
    "ionosphere": "good radar return 'g' (bad 'b' is 0)",
    "heart": "presence of heart disease (file 2; absence, file 1, is 0)",
    "pima": "tested positive for diabetes (file 1)",
    "haberman": "died within 5 years of the operation (file 2; survived 5+ years, file 1, is 0)",
    "spam": "spam (file 1)",
}

#: Number of training points in the published experiments; the rest of the data is the test set.
PAPER_TRAIN_SIZES: dict[str, int] = {
    # KJIT paper, logistic regression on four UCI data sets in sequence: "200 training points
    # each, fertility 50" (shared SPEC.md section 8).
    "banknote": 200,
    "blood_transfusion": 200,
    "fertility": 50,
    "ionosphere": 200,
    # Relaxed EP paper (Qi & Guo, "Message passing with relaxed moment matching", section 7.3):
    # "For the Heart dataset, ... We randomly split the dataset into 81 training and 189 test
    #  samples 20 times."  (81 + 189 = 270 = all of heart.dat)
    "heart": 81,
    # Same line: "For the Pima dataset, we randomly split it into 319 training and 213 test
    # samples" -- but 319 + 213 = 532, the number of complete cases (non-zero glucose, blood
    # pressure, skin thickness, BMI) in our file, i.e. Ripley's Pima subset, not our 768 rows.
    # Our file is the UCI Pima Indians Diabetes data, i.e. the paper's "Diabetes" set:
    # "Rättsch et al. [2001] split the UCI Diabetes dataset into two groups (468 training and
    # 300 test samples) for 100 times." (468 + 300 = 768).  We use that split.  (Applying the
    # Pima fraction 319/532 = 0.5996 to 768 rows would give 461; the two differ by 1%.)
    "pima": 468,
    # Same line: "We randomly split the dataset into 183 training and 123 test samples 100
    # times." (Haberman; 183 + 123 = 306)
    "haberman": 183,
    # Line 290: "We partitioned the dataset to have 276 training and 4325 test samples"
    # (Spam; 276 + 4325 = 4601).  The paper also flipped labels; we do not.
    "spam": 276,
}

_FEATURE_NAMES: dict[str, tuple[str, ...]] = {
    # Statistics of the wavelet-transformed banknote image.
    "banknote": ("variance", "skewness", "curtosis", "entropy"),
    # File header: Recency (months), Frequency (times), Monetary (c.c. blood), Time (months).
    "blood_transfusion": (
        "recency_months",
        "frequency_times",
        "monetary_cc_blood",
        "time_months",
    ),
    "fertility": (
        "season",
        "age",
        "childish_diseases",
        "accident_or_trauma",
        "surgical_intervention",
        "high_fevers",
        "alcohol_consumption",
        "smoking",
        "hours_sitting",
    ),
    "ionosphere": tuple(f"a{i:02d}" for i in range(1, 35)),
    "heart": (
        "age",
        "sex",
        "chest_pain_type",
        "resting_blood_pressure",
        "serum_cholesterol",
        "fasting_blood_sugar_gt_120",
        "resting_ecg",
        "max_heart_rate",
        "exercise_induced_angina",
        "oldpeak",
        "slope_peak_st",
        "n_major_vessels",
        "thal",
    ),
    "pima": (
        "pregnancies",
        "glucose",
        "blood_pressure",
        "skin_thickness",
        "insulin",
        "bmi",
        "diabetes_pedigree",
        "age",
    ),
    "haberman": ("age", "year_of_operation", "positive_axillary_nodes"),
    "spam": tuple(
        [
            "word_freq_" + w
            for w in (
                "make address all 3d our over remove internet order mail receive will people "
                "report addresses free business email you credit your font 000 money hp hpl "
                "george 650 lab labs telnet 857 data 415 85 technology 1999 parts pm direct cs "
                "meeting original project re edu table conference"
            ).split()
        ]
        + ["char_freq_" + c for c in (";", "(", "[", "!", "$", "#")]
        + [
            "capital_run_length_average",
            "capital_run_length_longest",
            "capital_run_length_total",
        ]
    ),
}

# name -> (separator (None = any whitespace), number of header lines, {raw label: 0/1})
_FORMAT: dict[str, tuple[str | None, int, dict[str, int]]] = {
    "banknote": (",", 0, {"0": 0, "1": 1}),
    "blood_transfusion": (",", 1, {"0": 0, "1": 1}),
    "fertility": (",", 0, {"N": 0, "O": 1}),
    "ionosphere": (",", 0, {"b": 0, "g": 1}),
    "heart": (None, 0, {"1": 0, "2": 1}),
    "pima": (",", 0, {"0": 0, "1": 1}),
    "haberman": (",", 0, {"1": 0, "2": 1}),
    "spam": (",", 0, {"0": 0, "1": 1}),
}


@dataclass(frozen=True, eq=False)
class Dataset:
    """A binary classification data set.

    Attributes
    ----------
    name:
        One of :data:`DATASETS`.
    X:
        ``(n, d)`` float64 feature matrix, after the preprocessing described in the module
        docstring (constant columns dropped; ``log1p`` for spam).
    y:
        ``(n,)`` int64 labels in ``{0, 1}``; see :data:`POSITIVE_CLASS` for what 1 means.
    feature_names:
        ``d`` column names, in the order of the columns of ``X``.

    Frozen (fields cannot be reassigned); ``eq=False`` because array fields make a generated
    ``__eq__``/``__hash__`` raise, so instances compare by identity.
    """

    name: str
    X: np.ndarray
    y: np.ndarray
    feature_names: tuple[str, ...]

    @property
    def n_samples(self) -> int:
        """Number of rows ``n``."""
        return int(self.X.shape[0])

    @property
    def n_features(self) -> int:
        """Number of features ``d``."""
        return int(self.X.shape[1])


@dataclass(frozen=True, eq=False)
class Split:
    """A train/test split, optionally standardised with training-set statistics.

    Attributes
    ----------
    X_train, y_train:
        Training features ``(n_train, d')`` and labels ``(n_train,)``.
    X_test, y_test:
        Test features ``(n - n_train, d')`` and labels.
    mean, scale:
        Length-``d`` per-feature mean and standard deviation (``ddof=0``) of the *training* part
        only; the features were transformed as ``(x - mean) / scale``.  A feature that is
        constant in the training part gets ``scale = 1``.  Without standardisation ``mean`` is
        all zeros and ``scale`` all ones, so the formula is the identity either way.
        ``d' = d + 1`` when a bias column was appended; ``mean``/``scale`` never include it.

    Frozen, compared by identity (``eq=False``), like :class:`Dataset`.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    mean: np.ndarray
    scale: np.ndarray


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(
            f"unknown data set {name!r}; valid names are: {', '.join(DATASETS)}"
        )
    return name


def _read_text(filename: str) -> str:
    """Text of a file shipped in ``kjit/data`` (read through importlib.resources)."""
    resource = importlib.resources.files("kjit").joinpath("data", filename)
    return resource.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _parse(name: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Parse a raw file into read-only ``(X, y, feature_names)`` before any column dropping."""
    sep, n_header, label_map = _FORMAT[name]
    # splitlines() handles both LF and CRLF endings and a missing final newline.
    lines = _read_text(DATA_FILES[name]).splitlines()
    header, body = lines[:n_header], lines[n_header:]
    rows: list[list[float]] = []
    labels: list[int] = []
    for lineno, line in enumerate(body, start=n_header + 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.strip().split(sep)]
        raw_label = fields[-1]
        if raw_label not in label_map:
            raise ValueError(
                f"{DATA_FILES[name]} line {lineno}: unexpected label {raw_label!r}"
            )
        rows.append([float(f) for f in fields[:-1]])
        labels.append(label_map[raw_label])
    X = np.asarray(rows, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    names = _FEATURE_NAMES[name]
    if header:
        # transfusion: 'Recency (months),Frequency (times),Monetary (c.c. blood),Time (months),
        # "whether he/she donated blood in March 2007"' (CRLF; data fields have trailing spaces).
        cols = [c.strip().strip('"') for c in header[0].split(",")]
        if len(cols) != len(names) + 1:
            raise ValueError(f"{DATA_FILES[name]}: unexpected header {header[0]!r}")
    if X.ndim != 2 or X.shape[1] != len(names):
        raise ValueError(f"{DATA_FILES[name]}: expected {len(names)} feature columns")
    X.flags.writeable = False
    y.flags.writeable = False
    return X, y, names


def load(name: str) -> Dataset:
    """Load one of the shipped UCI data sets.

    Parameters
    ----------
    name:
        One of :data:`DATASETS`.

    Returns
    -------
    Dataset
        Fresh (writeable) arrays: ``X`` float64 ``(n, d)``, ``y`` int64 in ``{0, 1}`` with the
        positive class given in :data:`POSITIVE_CLASS`.  Constant columns are dropped
        (ionosphere's 2nd attribute), spam features are ``log1p``-transformed, pima's
        missing-value zeros are kept as zeros (see the module docstring).

    Raises
    ------
    ValueError
        If ``name`` is not one of :data:`DATASETS`; the message names it and lists the valid ones.
    """
    _check_name(name)
    X, y, names = _parse(name)
    keep = np.ptp(X, axis=0) > 0
    X = X[:, keep]  # fancy indexing copies
    names = tuple(n for n, k in zip(names, keep) if k)
    if name == "spam":
        X = np.log1p(X)
    return Dataset(name=name, X=X, y=y.copy(), feature_names=names)


def _as_count(value, what: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            v = int(value)
        else:
            raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {v}")
    return v


def _stratified_counts(n_train: int, n_pos: int, n_neg: int) -> int:
    """Number of positives to put in a stratified training set of size ``n_train``.

    ``round(n_train * n_pos / n)``, clipped to what is available, and moved to keep at least
    one example of each class when ``n_train >= 2`` and both classes exist.  The result never
    differs from the exact proportional count by one or more.
    """
    n = n_pos + n_neg
    exact = n_train * n_pos / n
    k = int(math.floor(exact + 0.5))
    if n_train >= 2:
        if n_pos > 0 and k == 0:
            k = 1
        if n_neg > 0 and k == n_train:
            k = n_train - 1
    k = min(max(k, n_train - n_neg, 0), n_pos, n_train)
    return k


def train_test_split(
    ds: Dataset,
    n_train: int,
    random_state=None,
    standardize: bool = True,
    add_bias: bool = False,
) -> Split:
    """Stratified random train/test split of a :class:`Dataset`.

    Parameters
    ----------
    ds:
        The data set (e.g. from :func:`load`).
    n_train:
        Training-set size, ``1 <= n_train < n``; the remaining ``n - n_train`` rows form the
        test set.
    random_state:
        ``None``, an int seed or a :class:`numpy.random.Generator` (passed to
        :func:`numpy.random.default_rng`).  The same seed always gives the same split.
    standardize:
        If true, subtract the training mean and divide by the training standard deviation
        (``ddof=0``) in both parts; features constant in the training part are only centred.
    add_bias:
        If true, append a constant-1 column (after standardisation) to both parts.

    Returns
    -------
    Split
        Stratified: the number of class-1 examples in the training part is
        ``round(n_train * n_1 / n)`` (within one example of the data set's proportion; at least
        one of each class when ``n_train >= 2``).  Rows of each part are in random order, so
        classes are interleaved (which matters for sequential / online EP).

    Raises
    ------
    ValueError
        If ``n_train`` is not an integer with ``1 <= n_train < n``.
    """
    X = np.asarray(ds.X, dtype=np.float64)
    y = np.asarray(ds.y)
    n = X.shape[0]
    n_train = _as_count(n_train, "n_train", 1)
    if n_train >= n:
        raise ValueError(f"n_train must be < n = {n} (the data set size), got {n_train}")
    rng = np.random.default_rng(random_state)

    pos = np.flatnonzero(y == 1)
    neg = np.flatnonzero(y != 1)
    k = _stratified_counts(n_train, len(pos), len(neg))
    pos = rng.permutation(pos)
    neg = rng.permutation(neg)
    train_idx = rng.permutation(np.concatenate([pos[:k], neg[: n_train - k]]))
    test_idx = rng.permutation(np.concatenate([pos[k:], neg[n_train - k :]]))

    X_train, X_test = X[train_idx], X[test_idx]
    d = X.shape[1]
    if standardize:
        mean = X_train.mean(axis=0)
        scale = X_train.std(axis=0)
        scale = np.where(scale > 0, scale, 1.0)
        X_train = (X_train - mean) / scale
        X_test = (X_test - mean) / scale
    else:
        mean = np.zeros(d)
        scale = np.ones(d)
    if add_bias:
        X_train = np.hstack([X_train, np.ones((X_train.shape[0], 1))])
        X_test = np.hstack([X_test, np.ones((X_test.shape[0], 1))])
    return Split(
        X_train=X_train,
        y_train=y[train_idx].astype(np.int64),
        X_test=X_test,
        y_test=y[test_idx].astype(np.int64),
        mean=mean,
        scale=scale,
    )


def paper_split(name: str, random_state=0, **kw) -> Split:
    """Split a data set with the training size of the published experiment.

    ``train_test_split(load(name), PAPER_TRAIN_SIZES[name], random_state, **kw)``; the test set
    is the rest of the data, as in the papers.  Sizes: banknote, blood_transfusion, ionosphere
    200 and fertility 50 (KJIT paper); heart 81, pima 468, haberman 183, spam 276 (relaxed-EP
    paper, section 7.3; see the comments on :data:`PAPER_TRAIN_SIZES` for the quotes and why
    pima uses the paper's "Diabetes" split).

    Extra keyword arguments (``standardize``, ``add_bias``) go to :func:`train_test_split`.
    """
    _check_name(name)
    return train_test_split(load(name), PAPER_TRAIN_SIZES[name], random_state, **kw)


def synthetic_logistic(d: int = 20, n: int = 300, random_state=None, n_test: int = 0):
    """Draw a synthetic Bayesian logistic-regression problem (the KJIT paper's).

    ``w ~ N(0, I_d)``; rows ``a_i ~ N(0, I_d)``; ``y_i ~ Bernoulli(sigmoid(w^T a_i))``, with
    ``y_i`` in ``{0, 1}``.  Test points, if any, come from the same model with the same ``w``.

    Parameters
    ----------
    d, n:
        Dimension and number of training points (both >= 1).
    random_state:
        ``None``, an int seed or a :class:`numpy.random.Generator`.
    n_test:
        Number of test points (>= 0).  ``w``, ``X`` and ``y`` are drawn first, so they do not
        depend on ``n_test`` for a given seed.

    Returns
    -------
    ``(X, y, w)`` if ``n_test == 0``, else ``(X, y, X_test, y_test, w)``; ``X`` is ``(n, d)``
    float64, ``y`` ``(n,)`` int64, ``w`` ``(d,)`` float64.
    """
    d = _as_count(d, "d", 1)
    n = _as_count(n, "n", 1)
    n_test = _as_count(n_test, "n_test", 0)
    rng = np.random.default_rng(random_state)
    w = rng.standard_normal(d)

    def draw(m: int) -> tuple[np.ndarray, np.ndarray]:
        A = rng.standard_normal((m, d))
        y = (rng.random(m) < expit(A @ w)).astype(np.int64)
        return A, y

    X, y = draw(n)
    if n_test == 0:
        return X, y, w
    X_test, y_test = draw(n_test)
    return X, y, X_test, y_test, w
