"""Bayesian linear regression on random features (SPEC §5), batch and online.

Model
-----
Prior ``w ~ N(0, prior_var I)`` on ``D`` weights, observations ``y = w^T x + eps`` with
``eps ~ N(0, noise_var)``; ``k`` output columns are ``k`` independent regressions that share
the design, hence share the posterior covariance::

    P     = A / noise_var + I / prior_var          (posterior precision, D x D)
    Sigma = P^{-1}
    mu    = Sigma b / noise_var                    (posterior means, D x k)

with the sufficient statistics ``A = X^T X``, ``b = X^T y``, ``yy = sum_i y_i^2`` (per column)
and ``n``.  The column sums ``X^T 1`` (``x_sum_``) are kept beside them: with random features
``x_sum_ / n`` is the mean embedding of the training inputs, so ``x^T x_sum_ / n`` is the mean
kernel value of ``x`` to them (``x^T x_sum_``: the number of rows near ``x``, kernel-weighted) —
which the posterior variance of a finite feature model does not say (see
:meth:`KernelOperator.density`).  The predictive distribution at ``x`` is ``N(mu^T x, x^T Sigma x + noise_var)``.

Design
------
*The sufficient statistics are the source of truth.*  ``A_``, ``b_``, ``yy_`` and ``n_`` only
ever add, so two replicas merge exactly (:meth:`merge`), the hyperparameters can be changed
after the fact (:meth:`set_params`, :meth:`log_evidence_grid`) and the posterior can always be
recomputed from scratch.  :meth:`partial_fit` keeps its rows in a small buffer and adds them to
the stats ``_FOLD_ROWS`` (256) at a time with one BLAS product (reading ``A_`` etc. adds the
buffered rows to a copy, so they are always complete; only :meth:`partial_fit` folds).  Measured on random features with
``D = 100``, ``n = 10^4``: adding rows one at a time gave ``A`` a relative rounding error of
``2e-15`` against ``1.6e-16`` for one blocked ``X^T X``.  ``cond(P) ~ 4e6`` multiplied that
into a ``2e-10`` error in ``Sigma`` after a refactor.  With the buffer, online and batch stats
are equally accurate.  Folding a block also costs one pass over ``A`` instead of ``m`` passes.

*The posterior is kept explicitly.*  At request time a prediction needs the variance
``x^T Sigma x``.  With an explicit ``Sigma_`` this is one BLAS matrix product for a whole batch
(``rowsum((X @ Sigma) * X)``), and for one row a symmetric matrix-vector product that reads one
triangle of ``Sigma`` (``dsymv``: half the memory traffic a served one-message request waits
for); keeping only a Cholesky factor of ``P`` would instead cost a triangular solve per request.  ``Sigma_`` and ``coef_`` (= ``mu``) are therefore maintained:

- :meth:`fit` and every exact recomputation factorise ``P`` by Cholesky (``cho_factor``), solve
  for ``mu`` with ``cho_solve`` and form ``Sigma`` from the same factor with LAPACK ``potri``.
  There is no ``np.linalg.inv``, and ``potri`` is ~2.5x faster than ``cho_solve`` against ``I``.
  These calls, ``eigh`` in :meth:`log_evidence_grid` and a large Woodbury update go to scipy's
  LAPACK through :mod:`kjit._nogil`, which releases the GIL (the same routines and arrays, so the
  same numbers): a training job in a thread of the server no longer stops its other threads.
- :meth:`partial_fit` with ``m`` new rows applies the Woodbury identity in its Kalman-filter
  form, a rank-``m`` update in ``O(D^2 m)``::

      S = X_new Sigma X_new^T + noise_var I = L L^T        (m x m)
      W = L^{-1} X_new Sigma                               (m x D)
      mu    <- mu + W^T L^{-1} (Y_new - X_new mu)
      Sigma <- Sigma - W^T W
      log|P| <- log|P| + log|S| - m log(noise_var)          (matrix determinant lemma)

  ``Sigma - W^T W`` is applied in place with one BLAS ``gemm`` (``beta = 1``), so no ``D x D``
  temporary is allocated.  It is then symmetrised in place by ``(Sigma + Sigma^T) / 2`` in
  cache-sized tiles, which for ``D = 2000`` is ~5x faster than ``Sigma += Sigma.T``.
- Rounding errors of the Woodbury downdate accumulate, so every ``refactor_every`` added rows
  the posterior is recomputed exactly from the stats.  That costs ``O(D^3)``, i.e. amortised
  ``O(D^3 / refactor_every)`` per row, which for the default 1000 and ``D <= 2000`` is at most
  ``O(2 D^2)`` per row, the same order as the update itself.  Because the stats are exact, drift
  can never accumulate over more than ``refactor_every`` updates.  A batch with ``m >= D`` rows,
  or one that reaches the refactor threshold, goes straight to the exact recomputation, which is
  cheaper than a Woodbury update followed by a refactor.

  The recomputation is itself only accurate to about ``cond(P) * eps``.  Measured against a
  long-double reference on random features (``D = 100``, ``n = 10^4``, ``cond(P) ~ 5e6``),
  the relative error in ``coef`` was:

  - ``noise_var = 1e-4``: batch fit 2e-11, online with the refactor 3e-11, Woodbury alone 3e-13;
  - ``noise_var = 1e-8``: batch 3e-11, online 6e-11, Woodbury alone 8e-11, with a predictive
    mean error of 2e-10.

  So Woodbury alone can beat the Cholesky recomputation, because each step factorises only the
  well-conditioned ``S >= noise_var I``.  Its error does grow with more precise data, and the
  refactor bounds that growth.

The log evidence uses the quadratic form ``f(mu) = yy/s2 - 2 mu^T b/s2 + mu^T P mu``, which is
minimal (``= yy/s2 - mu^T P mu``) at the exact posterior mean: an error ``delta`` in a
Woodbury-updated ``coef_`` only enters at second order, ``delta^T P delta``.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import numpy as np
from scipy.linalg import blas, lapack

from . import _nogil
from .errors import check_number
from .state import StateReader

__all__ = ["BayesianLinearRegression", "NotFittedError", "MAX_CONDITION"]

_STATE_FORMAT = 2  # 2: the stats without the buffered rows, and the buffered rows (1: folded stats); the column
# sums ``x_sum`` are an optional key of format 2 (a reader that predates them ignores it)
# partial_fit buffers up to this many rows before adding them to the stats (see module docstring).
_FOLD_ROWS = 256
# Row chunk for predict: keeps the (chunk, D) temporary X @ Sigma at about 2**23 elements.
_PREDICT_CHUNK_ELEMENTS = 1 << 23
#: bound on the condition number of the posterior precision P, ``1 + prior_var λ_max(A) / noise_var``:
#: the hyperparameter search (kjit.operators) keeps its final Cholesky within it, and
#: :meth:`BayesianLinearRegression.log_evidence_grid` answers −inf beyond it
MAX_CONDITION = 1e13


class NotFittedError(ValueError, AttributeError):
    """Raised when a method needing a posterior is called before any data was seen."""


# --------------------------------------------------------------------------- validation


def _check_positive_scalar(name: str, value: Any) -> float:
    """Return ``value`` as a float; ValueError naming ``name`` unless finite and > 0 (:func:`kjit.errors.check_number`)."""
    return check_number(name, value, 0.0, low_open=True)


def _sym_quad(S: np.ndarray, x: np.ndarray) -> float:
    """``x^T S x`` for a symmetric float64 ``S`` (D, D) and one row ``x`` (D,), by BLAS ``dsymv`` on
    one triangle: half of ``S`` is read instead of all of it, and a one-row prediction waits on
    that read (measured at D = 500, one thread: 20 vs 30 µs with ``S`` in cache, 71–74 vs 113–121
    µs after other work has evicted it; ``S`` 8 MB at D = 1000).  The same value as the batch
    path's ``rowsum((X S) ∘ X)`` up to rounding (another order of the same sums)."""
    F = S if S.flags.f_contiguous else S.T  # (S is symmetric: its transpose is S, Fortran-ordered)
    if not F.flags.f_contiguous:
        F = np.asfortranarray(S)
    return float(x @ blas.dsymv(1.0, F, x, lower=1))


def _check_refactor_every(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"refactor_every must be an integer >= 1, got {value!r}")
    return int(value)


def _as_float_array(name: str, value: Any, dtype: np.dtype, ndims: tuple[int, ...]) -> np.ndarray:
    """Finite real array of ``dtype`` with ndim in ``ndims``, else ValueError naming ``name``."""
    try:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype}")
        arr = arr.astype(dtype, copy=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a real numeric array ({exc})") from None
    if arr.ndim not in ndims:
        want = " or ".join(str(d) for d in ndims)
        raise ValueError(f"{name} must be {want}-dimensional, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values (as {np.dtype(dtype).name})")
    return arr


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(np.float64 if dtype is None else dtype)
    except TypeError:
        raise ValueError(f"dtype must be None, float32 or float64, got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be None, float32 or float64, got {dtype!r}")
    return dt


# --------------------------------------------------------------------------- linear algebra

#: Woodbury updates with ``m D^2`` at least this go through :mod:`kjit._nogil` (GIL released)
_NOGIL_WORK = 1 << 22


def _posterior_from_stats(
    A: np.ndarray, b: np.ndarray, prior_var: float, noise_var: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """Exact posterior ``(Sigma, mu, log|P|)`` from the sufficient statistics, by Cholesky of P.

    LAPACK ``potrf`` / ``potrs`` / ``potri`` through :mod:`kjit._nogil`, which releases the GIL (a
    D = 2000 posterior is ~0.3 s of LAPACK: scipy's wrappers held every other thread of the server
    that long).  The arrays are the Fortran-ordered ones ``cho_factor`` / ``cho_solve`` / ``dpotri``
    made: the results are theirs, bit for bit."""
    D = A.shape[0]
    P = np.divide(A, noise_var, order="F", dtype=np.float64)
    P[_diag(D)] += 1.0 / prior_var
    info = _nogil.dpotrf(P, lower=True)
    if info > 0:  # only reachable with a catastrophically scaled A
        raise np.linalg.LinAlgError(
            f"posterior precision is not numerically positive definite ({info}-th leading minor of "
            "the array is not positive definite); the features are too large relative to noise_var"
        )
    if info < 0:  # pragma: no cover - a bad argument, i.e. a bug here
        raise ValueError(f"LAPACK dpotrf: illegal value in argument {-info}")
    log_det = 2.0 * float(np.sum(np.log(np.diagonal(P))))
    mu = np.divide(b, noise_var, order="F", dtype=np.float64)
    info = _nogil.dpotrs(P, mu.reshape(D, -1, order="F"), lower=True)
    if info != 0:  # pragma: no cover - potrs after a successful potrf cannot fail
        raise np.linalg.LinAlgError(f"LAPACK dpotrs failed with info={info}")
    info = _nogil.dpotri(P, lower=True)  # P's lower triangle becomes Sigma's
    if info != 0:  # pragma: no cover - potri after a successful potrf cannot fail
        raise np.linalg.LinAlgError(f"LAPACK dpotri failed with info={info}")
    Sigma = np.tril(P)
    Sigma += np.tril(P, -1).T
    return Sigma, np.ascontiguousarray(mu), log_det


def _diag(D: int) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(D)
    return i, i


def _sqrt_factor(Sigma: np.ndarray) -> np.ndarray:
    """R with R R^T = Sigma (Cholesky; eigen-decomposition with negative round-off clipped
    if Sigma is only semi-definite in floating point)."""
    R = np.array(Sigma, dtype=np.float64, order="F")
    if _nogil.dpotrf(R, lower=True) == 0:  # GIL released (``linalg.cholesky``'s numbers, its layout)
        for j in range(1, R.shape[0]):
            R[:j, j] = 0.0
        return R
    w, Q = np.linalg.eigh(Sigma)
    return Q * np.sqrt(np.clip(w, 0.0, None))


def _symmetrize_inplace(S: np.ndarray, block: int = 256) -> None:
    """Replace square ``S`` by ``(S + S^T) / 2`` in place, exactly symmetric.

    Tiled so that the transposed reads stay in cache: for D = 2000 this is ~5x faster than
    ``S += S.T`` (which also allocates a D x D temporary to resolve the overlap).
    """
    D = S.shape[0]
    for i in range(0, D, block):
        T = S[i : i + block, i : i + block]
        T += T.T.copy()
        T *= 0.5
        for j in range(i + block, D, block):
            U = S[i : i + block, j : j + block]
            V = S[j : j + block, i : i + block]
            U += V.T
            U *= 0.5
            V[...] = U.T


# --------------------------------------------------------------------------- model


class BayesianLinearRegression:
    """Bayesian linear regression with a shared isotropic Gaussian prior, k outputs.

    Parameters
    ----------
    prior_var : float, default 1.0
        Prior variance ``sigma_0^2`` of every weight.
    noise_var : float, default 1e-4
        Observation noise variance ``sigma_y^2``.
    refactor_every : int, default 1000
        Number of rows added by :meth:`partial_fit` after which the posterior is recomputed
        exactly from the sufficient statistics (bounds Woodbury rounding drift).

    Attributes
    ----------
    n_features_in_ : int
        ``D``.
    n_outputs_ : int
        ``k``.
    n_ : int
        Number of rows seen.
    A_ : ndarray (D, D)
        ``X^T X``.
    b_ : ndarray (D, k)
        ``X^T y``.
    yy_ : ndarray (k,)
        ``sum y^2`` per output.
    x_sum_ : ndarray (D,) or None
        ``X^T 1``, the column sums (None for a model restored from a state saved before they were
        kept: they cannot be recovered from the other stats).
    Sigma_ : ndarray (D, D)
        Posterior covariance of the weights (shared by all outputs).  Like the stats, it is
        updated in place by :meth:`partial_fit`; take a copy to keep a snapshot.
    coef_ : ndarray (D, k)
        Posterior mean of the weights.
    log_det_precision_ : float
        ``log|P|``.
    n_since_refactor_ : int
        Rows added by Woodbury updates since the last exact recomputation.
    """

    def __init__(self, prior_var: float = 1.0, noise_var: float = 1e-4, refactor_every: int = 1000):
        _check_positive_scalar("prior_var", prior_var)
        _check_positive_scalar("noise_var", noise_var)
        _check_refactor_every(refactor_every)
        self.prior_var = prior_var
        self.noise_var = noise_var
        self.refactor_every = refactor_every
        # (filled by predictions; present from the start so that none adds an attribute while another thread
        # deep-copies the regression — the service's update aside; found in review)
        self._hyper_seen = None

    # ----------------------------------------------------------------- sklearn-style params

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Hyperparameters as a dict (``deep`` is accepted for scikit-learn compatibility)."""
        return {
            "prior_var": self.prior_var,
            "noise_var": self.noise_var,
            "refactor_every": self.refactor_every,
        }

    def set_params(self, **params: Any) -> "BayesianLinearRegression":
        """Set hyperparameters; a fitted posterior is recomputed exactly from the stats.

        All values are validated before anything changes.
        """
        current = self.get_params()
        for key in params:
            if key not in current:
                raise ValueError(f"invalid parameter {key!r}; valid parameters: {sorted(current)}")
        new = {**current, **params}
        pv = _check_positive_scalar("prior_var", new["prior_var"])
        s2 = _check_positive_scalar("noise_var", new["noise_var"])
        _check_refactor_every(new["refactor_every"])
        posterior = None
        if self._is_fitted() and (pv, s2) != self._posterior_hyper:
            posterior = (*_posterior_from_stats(self.A_, self.b_, pv, s2), (pv, s2))
        self.prior_var = new["prior_var"]
        self.noise_var = new["noise_var"]
        self.refactor_every = new["refactor_every"]
        if posterior is not None:
            self._set_posterior(*posterior)
            self.n_since_refactor_ = 0
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # ----------------------------------------------------------------- internal helpers

    def _is_fitted(self) -> bool:
        return hasattr(self, "_A")

    # The stats are exact: the folded arrays plus the pending rows.  Reading them never folds:
    # the points where rows are folded — and so the rounding of the stats, and every posterior
    # recomputed from them — depend only on the sequence of partial_fit calls, not on who read
    # the stats or saved the state in between (a restored state continues bit for bit).
    def _complete_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._pending:
            return self._A, self._b, self._yy
        X, Y = self._stack_pending()
        return self._A + X.T @ X, self._b + X.T @ Y, self._yy + np.einsum("ij,ij->j", Y, Y)

    @property
    def x_sum_(self) -> np.ndarray | None:
        """``X^T 1`` over all rows seen, shape (D,) (None: restored from a state without it)."""
        if self._s is None:
            return None
        if not self._pending:
            return self._s.copy()  # (the folded array changes in place)
        return self._s + self._stack_pending()[0].sum(axis=0)

    @property
    def A_(self) -> np.ndarray:
        """``X^T X`` over all rows seen, shape (D, D) (a new array while rows are buffered)."""
        return self._complete_stats()[0]

    @property
    def b_(self) -> np.ndarray:
        """``X^T y`` over all rows seen, shape (D, k)."""
        return self._complete_stats()[1]

    @property
    def yy_(self) -> np.ndarray:
        """``sum y^2`` per output over all rows seen, shape (k,)."""
        return self._complete_stats()[2]

    def _fold_pending(self) -> None:
        """Add the buffered partial_fit rows to the stats with one matrix product."""
        if not self._is_fitted() or not self._pending:
            return
        X, Y = self._stack_pending()
        self._A += X.T @ X
        self._b += X.T @ Y
        self._yy += np.einsum("ij,ij->j", Y, Y)
        if self._s is not None:
            self._s += X.sum(axis=0)
        self._pending = []
        self._n_pending = 0

    def _stack_pending(self, X=None, Y=None) -> tuple[np.ndarray, np.ndarray]:
        """The pending rows, followed by ``X, Y`` if given, as two arrays."""
        rows = self._pending + ([(X, Y)] if X is not None else [])
        if len(rows) == 1:  # no copy of a large batch
            return rows[0]
        return np.vstack([r[0] for r in rows]), np.vstack([r[1] for r in rows])

    def _check_fitted(self) -> None:
        if not self._is_fitted():
            raise NotFittedError(
                f"this {type(self).__name__} has seen no data; call fit or partial_fit first"
            )

    def _hyper(self) -> tuple[float, float, int]:
        raw = (self.prior_var, self.noise_var, self.refactor_every)
        seen = self.__dict__.get("_hyper_seen")
        # the same three objects as last time (each prediction asks): validated already
        if seen is not None and all(a is b for a, b in zip(raw, seen[0])):
            return seen[1]
        out = (
            _check_positive_scalar("prior_var", raw[0]),
            _check_positive_scalar("noise_var", raw[1]),
            _check_refactor_every(raw[2]),
        )
        self._hyper_seen = (raw, out)
        return out

    def _check_Xy(
        self, X: Any, y: Any, against_state: bool = True
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """Validate training data; returns X (n, D), Y (n, k) float64 and whether y was 1-D.

        With ``against_state`` (and a fitted model), D and k must match the fitted state.
        """
        X = _as_float_array("X", X, np.float64, (2,))
        y = _as_float_array("y", y, np.float64, (1, 2))
        if y.shape[0] != X.shape[0]:
            raise ValueError(
                f"X and y have different numbers of rows: X has {X.shape[0]}, y has {y.shape[0]}"
            )
        if X.shape[1] == 0:
            raise ValueError("X must have at least one column (feature)")
        single = y.ndim == 1
        Y = y[:, None] if single else y
        if Y.shape[1] == 0:
            raise ValueError("y must have at least one column (output)")
        if against_state and self._is_fitted():
            if X.shape[1] != self.n_features_in_:
                raise ValueError(
                    f"X has {X.shape[1]} features, but the model was fitted with "
                    f"{self.n_features_in_}"
                )
            if Y.shape[1] != self.n_outputs_:
                raise ValueError(
                    f"y has {Y.shape[1]} outputs, but the model was fitted with {self.n_outputs_}"
                )
        return X, Y, single

    def _set_posterior(
        self, Sigma: np.ndarray, coef: np.ndarray, log_det: float, hyper: tuple[float, float]
    ) -> None:
        """Install a posterior computed with ``hyper = (prior_var, noise_var)``."""
        self.Sigma_ = Sigma
        self.coef_ = coef
        self.log_det_precision_ = float(log_det)
        self._posterior_hyper = hyper
        self._f32 = None

    def _sync_posterior(self) -> tuple[float, float, int]:
        """Validated hyperparameters, with the posterior brought in line with them.

        ``prior_var`` / ``noise_var`` assigned directly (not through :meth:`set_params`) after
        fitting would otherwise leave a posterior computed for the old values.
        """
        pv, s2, refactor_every = self._hyper()
        if self._is_fitted() and self._posterior_hyper != (pv, s2):
            self._set_posterior(*_posterior_from_stats(self.A_, self.b_, pv, s2), (pv, s2))
            self.n_since_refactor_ = 0
        return pv, s2, refactor_every

    def _format_mean(self, mean: np.ndarray) -> np.ndarray:
        return mean[:, 0] if self._single_output else mean

    # ----------------------------------------------------------------- fitting

    def fit(self, X: Any, y: Any) -> "BayesianLinearRegression":
        """Fit from scratch; the previous state is discarded (kept if the input is rejected).

        Parameters
        ----------
        X : array (n, D)
        y : array (n,) or (n, k)
        """
        pv, s2, _ = self._hyper()
        X, Y, single = self._check_Xy(X, y, against_state=False)
        A = X.T @ X
        b = X.T @ Y
        posterior = _posterior_from_stats(A, b, pv, s2)
        self._assign_stats(A, b, np.einsum("ij,ij->j", Y, Y), X.shape[0], single, X.sum(axis=0))
        self._set_posterior(*posterior, (pv, s2))
        self.n_since_refactor_ = 0
        return self

    def _assign_stats(self, A, b, yy, n, single, s) -> None:
        self.n_features_in_ = int(A.shape[0])
        self.n_outputs_ = int(b.shape[1])
        self._A = A
        self._b = b
        self._yy = yy
        self._s = s
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._n_pending = 0
        self.n_ = int(n)
        self._single_output = bool(single)

    def partial_fit(self, X: Any, y: Any) -> "BayesianLinearRegression":
        """Add rows online: exact stats update plus an ``O(D^2 m)`` Woodbury posterior update.

        Works from an empty model (the prior is the starting posterior).  Every
        ``refactor_every`` added rows, or for a batch of ``m >= D`` rows, the posterior is
        recomputed exactly from the stats instead.  If the input is rejected (ValueError)
        the model is left unchanged.
        """
        self._hyper()
        X, Y, single = self._check_Xy(X, y)
        pv, s2, refactor_every = self._sync_posterior()
        m, D = X.shape
        if not self._is_fitted():
            k = Y.shape[1]
            self._assign_stats(np.zeros((D, D)), np.zeros((D, k)), np.zeros(k), 0, single, np.zeros(D))
            self._set_posterior(pv * np.eye(D), np.zeros((D, k)), -D * np.log(pv), (pv, s2))
            self.n_since_refactor_ = 0
        if m == 0:
            return self

        if m >= D or self.n_since_refactor_ + m >= refactor_every:
            # Exact recomputation; new stats are built aside so a failure changes nothing.
            Xa, Ya = self._stack_pending(X, Y)
            A = self._A + Xa.T @ Xa
            b = self._b + Xa.T @ Ya
            self._set_posterior(*_posterior_from_stats(A, b, pv, s2), (pv, s2))
            self._A, self._b = A, b
            self._yy = self._yy + np.einsum("ij,ij->j", Ya, Ya)
            if self._s is not None:
                self._s = self._s + Xa.sum(axis=0)
            self._pending, self._n_pending = [], 0
            self.n_since_refactor_ = 0
        else:
            self._woodbury(X, Y, s2)
            # Copies: the caller may reuse its buffers.
            self._pending.append((X.copy(), Y.copy()))
            self._n_pending += m
            if self._n_pending >= _FOLD_ROWS:
                self._fold_pending()
            self.n_since_refactor_ += m
        self.n_ += m
        return self

    def _woodbury(self, X: np.ndarray, Y: np.ndarray, s2: float) -> None:
        """Kalman/Woodbury update of Sigma_, coef_, log_det_precision_ for new rows X, Y."""
        m = X.shape[0]
        XS = X @ self.Sigma_  # (m, D); Sigma symmetric so this is (Sigma X^T)^T
        S = X @ XS.T
        S = 0.5 * (S + S.T)
        S.flat[:: m + 1] += s2
        R = Y - X @ self.coef_  # (m, k) residuals
        D = XS.shape[1]
        # Raw LAPACK calls: for the typical m of 1..10, scipy.linalg's wrappers cost ~20x more
        # than the arithmetic itself.  A large update (O(m D^2) work from _NOGIL_WORK on) calls
        # the same routines with the same arrays through kjit._nogil, which releases the GIL (~3 µs
        # more per call): the numbers are the same either way.
        nogil = m * D * D >= _NOGIL_WORK
        if nogil:
            L = np.array(S, order="F")
            info = _nogil.dpotrf(L, lower=True)
        else:
            L, info = lapack.dpotrf(S, lower=1, clean=1)
        if info != 0:  # S >= s2 I, so this needs non-finite values from overflow
            raise np.linalg.LinAlgError(f"Woodbury update failed: dpotrf info={info}")
        if nogil:
            W, Z = np.array(XS, order="F"), np.array(R, order="F")
            _nogil.dtrtrs(L, W, lower=True)  # (m, D) = L^{-1} X Sigma
            _nogil.dtrtrs(L, Z, lower=True)  # (m, k)
        else:
            W, _ = lapack.dtrtrs(L, XS, lower=1)  # (m, D) = L^{-1} X Sigma
            Z, _ = lapack.dtrtrs(L, R, lower=1)  # (m, k)
        coef = self.coef_ + W.T @ Z
        log_det = self.log_det_precision_ + 2.0 * np.sum(np.log(np.diagonal(L))) - m * np.log(s2)
        # In place, Sigma -= W^T W with one BLAS gemm (no D x D temporary), then restore exact
        # symmetry.  Sigma is C-contiguous and symmetric, so its transpose is the F-ordered view
        # gemm can overwrite; the returned array is used in case a copy had to be made.
        if nogil:
            Sigma_t = self.Sigma_.T
            if not (Sigma_t.flags.f_contiguous and Sigma_t.flags.writeable):
                Sigma_t = np.array(Sigma_t, order="F")
            _nogil.dgemm(-1.0, W, W, 1.0, Sigma_t, trans_a=True)
        else:
            Sigma_t = blas.dgemm(-1.0, W, W, beta=1.0, c=self.Sigma_.T, trans_a=1, overwrite_c=1)
        _symmetrize_inplace(Sigma_t)
        self._set_posterior(Sigma_t.T, coef, log_det, self._posterior_hyper)

    def merge(self, other: "BayesianLinearRegression") -> "BayesianLinearRegression":
        """New model whose stats are the sum of both: equal to a fit on the union of the data.

        Both models must be fitted with the same ``D``, ``k``, ``prior_var`` and ``noise_var``.
        ``refactor_every`` only controls numerical housekeeping and is taken from ``self``.
        The merged posterior is computed exactly by Cholesky.
        """
        if not isinstance(other, BayesianLinearRegression):
            raise ValueError(
                f"other must be a BayesianLinearRegression, got {type(other).__name__}"
            )
        self._check_fitted()
        if not other._is_fitted():
            raise ValueError("other has seen no data; nothing to merge")
        if other.n_features_in_ != self.n_features_in_:
            raise ValueError(
                f"other has {other.n_features_in_} features, self has {self.n_features_in_}"
            )
        if other.n_outputs_ != self.n_outputs_:
            raise ValueError(f"other has {other.n_outputs_} outputs, self has {self.n_outputs_}")
        pv, s2, _ = self._hyper()
        for name, mine in (("prior_var", pv), ("noise_var", s2)):
            theirs = float(getattr(other, name))
            if theirs != mine:
                raise ValueError(f"other has {name}={theirs!r}, self has {name}={mine!r}")
        merged = type(self)(**self.get_params())
        A = self.A_ + other.A_
        b = self.b_ + other.b_
        s = None if self._s is None or other._s is None else self.x_sum_ + other.x_sum_
        merged._assign_stats(A, b, self.yy_ + other.yy_, self.n_ + other.n_, self._single_output, s)
        merged._set_posterior(*_posterior_from_stats(A, b, pv, s2), (pv, s2))
        merged.n_since_refactor_ = 0
        return merged

    # ----------------------------------------------------------------- prediction

    def predict(self, X: Any, return_var: bool = False, dtype: Any = None):
        """Predictive mean (and variance) at the rows of ``X``.

        Parameters
        ----------
        X : array (n, D)
        return_var : bool
            Also return the predictive variance ``x^T Sigma x + noise_var`` (shape (n,), shared
            by all outputs).
        dtype : None, np.float64 or np.float32
            Precision of the computation and the result.  float32 uses cached float32 copies
            of ``coef_`` and of a square-root factor R of ``Sigma_`` (R R^T = Sigma, from a
            float64 Cholesky; rebuilt lazily after every update) and computes the variance as
            ``‖x^T R‖²``, which stays accurate where ``x^T Sigma x`` in float32 would cancel.

        Returns
        -------
        mean : ndarray (n,) if the model was fitted with 1-D y, else (n, k)
        var : ndarray (n,), only if ``return_var``
        """
        dt = _check_dtype(dtype)
        self._check_fitted()
        X = _as_float_array("X", X, dt, (2,))
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features, but the model was fitted with {self.n_features_in_}"
            )
        _, s2, _ = self._sync_posterior()
        if dt == np.float32:
            if self._f32 is None:
                self._f32 = (_sqrt_factor(self.Sigma_).astype(np.float32), self.coef_.astype(np.float32))
            factor, coef = self._f32
        else:
            factor, coef = self.Sigma_, self.coef_
        mean = self._format_mean(X @ coef)
        if not return_var:
            return mean
        if X.shape[0] == 1 and dt == np.float64:
            # one row (a served one-message request): x^T Σ x from one triangle of Σ
            return mean, np.array([_sym_quad(factor, X[0]) + s2])
        var = np.empty(X.shape[0], dtype=dt)
        step = max(1, _PREDICT_CHUNK_ELEMENTS // max(1, self.n_features_in_))
        for start in range(0, X.shape[0], step):
            Xc = X[start : start + step]
            if dt == np.float32:
                # x^T Σ x = ‖x^T R‖² with Σ = R R^T: a sum of squares, never negative, and its
                # float32 error scales with the result, not with ‖Σ‖ (the Σ form cancels
                # catastrophically when the posterior variance is far below the prior's)
                XR = Xc @ factor
                var[start : start + step] = np.einsum("ij,ij->i", XR, XR)
            else:
                var[start : start + step] = np.einsum("ij,ij->i", Xc @ factor, Xc)
        var += dt.type(s2)
        return mean, var

    # ----------------------------------------------------------------- evidence

    def log_marginal_likelihood(self):
        """Log evidence ``log p(y | X, prior_var, noise_var)`` of all data seen, per output.

        Returns a float for a model fitted with 1-D y, else an array (k,).  Costs
        ``O(D^2 k)`` (uses the maintained ``log|P|`` and the stationary quadratic form, see the
        module docstring).
        """
        self._check_fitted()
        pv, s2, _ = self._sync_posterior()
        D, mu = self.n_features_in_, self.coef_
        Amu = self.A_ @ mu
        quad = (
            self.yy_ / s2
            - 2.0 * np.einsum("ij,ij->j", mu, self.b_) / s2
            + np.einsum("ij,ij->j", mu, Amu) / s2
            + np.einsum("ij,ij->j", mu, mu) / pv
        )
        lml = (
            -0.5 * self.n_ * np.log(2.0 * np.pi * s2)
            - 0.5 * D * np.log(pv)
            - 0.5 * self.log_det_precision_
            - 0.5 * quad
        )
        return float(lml[0]) if self._single_output else lml

    def log_evidence_grid(self, prior_vars: Any, noise_vars: Any,
                          max_condition: float | None = MAX_CONDITION) -> np.ndarray:
        """Log evidence on a hyperparameter grid from the stored stats, with one ``eigh(A)`` (``syevr``).

        With ``A = Q diag(lam) Q^T`` and ``c = Q^T b``:
        ``log|P| = sum_i log(lam_i/s2 + 1/pv)`` and
        ``mu^T P mu = sum_i c_i^2 / (s2^2 (lam_i/s2 + 1/pv))``.

        −inf where ``cond(P) <= 1 + pv lam_max / s2`` exceeds ``max_condition`` (default
        :data:`MAX_CONDITION`, as in the hyperparameter search; None: no bound — a caller that has
        fixed the pair and takes the risk): there the answer cannot be trusted.  The eigenvalues of ``A`` near 0
        are known only to about ``eps lam_max`` (the rounding of ``A = X^T X`` itself, then that of
        any factorisation of it in double precision), and as ``cond(P)`` nears ``1/eps`` that error
        reaches ``s2/pv``, the prior's share of ``P``, in every such direction: ``log|P|`` and
        ``mu^T P mu`` move by nats per direction (found in review: at cond(P) = 1e16 — a 30 × 12
        design with singular values 1 … 1e-12, pv = 1, s2 = 1e-16 — the grid was 183 nats off
        ``log N(y | 0, pv X X^T + s2 I)`` in 50 digits, with no sign of it).  Below the bound the
        error is about ``D eps cond(P)`` nats, plus ``eps yy / s2`` from the cancellation in the
        quadratic form.

        Returns
        -------
        ndarray (len(prior_vars), len(noise_vars), k)
        """
        self._check_fitted()
        pvs = _as_float_array("prior_vars", prior_vars, np.float64, (0, 1)).reshape(-1)
        nvs = _as_float_array("noise_vars", noise_vars, np.float64, (0, 1)).reshape(-1)
        for name, arr in (("prior_vars", pvs), ("noise_vars", nvs)):
            if arr.size == 0 or np.any(arr <= 0):
                raise ValueError(f"{name} must be a non-empty array of positive values")
        # scipy.linalg.eigh's syevr, through kjit._nogil: its numbers, with the GIL released (scipy's
        # wrapper held it for the whole call, 1 s at D = 2000, every other thread of the server waiting)
        lam, Q, info = _nogil.dsyevr(np.array(self.A_, dtype=np.float64, order="F"), lower=True)
        if info != 0:  # pragma: no cover - MRRR failing on a finite symmetric matrix
            raise np.linalg.LinAlgError(f"eigh(A) failed: LAPACK dsyevr info={info}")
        lam = np.maximum(lam, 0.0)  # A = X^T X is PSD; clip rounding-level negatives
        c2 = (Q.T @ self.b_) ** 2  # (D, k)
        D, n = self.n_features_in_, self.n_
        out = np.empty((pvs.size, nvs.size, self.n_outputs_))
        for i, pv in enumerate(pvs):
            prec = lam[None, :] / nvs[:, None] + 1.0 / pv  # (N, D) eigenvalues of P
            log_det = np.sum(np.log(prec), axis=1)  # (N,)
            mu_P_mu = ((1.0 / prec) @ c2) / nvs[:, None] ** 2  # (N, k)
            const = -0.5 * n * np.log(2.0 * np.pi * nvs) - 0.5 * D * np.log(pv) - 0.5 * log_det
            out[i] = const[:, None] - 0.5 * (self.yy_[None, :] / nvs[:, None] - mu_P_mu)
            if max_condition is not None:
                out[i, 1.0 + pv * lam[-1] / nvs > max_condition] = -np.inf
        return out

    # ----------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """Full state as plain numpy arrays and Python scalars (copies; ``np.savez``-friendly).

        The stats are saved as kept — the folded part and the buffered rows separately — so that
        a model rebuilt from the state folds, and rounds, exactly as this one will."""
        self._sync_posterior()
        d: dict[str, Any] = {"format": _STATE_FORMAT, "fitted": self._is_fitted()}
        d.update(self.get_params())
        if self._is_fitted():
            d.update(
                single_output=self._single_output,
                n=self.n_,
                n_since_refactor=self.n_since_refactor_,
                log_det_precision=self.log_det_precision_,
                A=self._A.copy(),
                b=self._b.copy(),
                yy=self._yy.copy(),
                Sigma=self.Sigma_.copy(),
                coef=self.coef_.copy(),
            )
            if self._s is not None:
                d["x_sum"] = self._s.copy()
            if self._pending:
                X, Y = self._stack_pending()
                d.update(pending_X=np.array(X, copy=True), pending_Y=np.array(Y, copy=True))
            else:
                d.update(pending_X=np.zeros((0, self.n_features_in_)), pending_Y=np.zeros((0, self.n_outputs_)))
        return d

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "BayesianLinearRegression":
        """Rebuild a model from :meth:`state_dict` output (also accepts an ``np.load`` npz)."""

        reader = StateReader(d)
        get, scalar = reader.get, reader.scalar

        fmt = scalar("format", int)
        if fmt not in (1, _STATE_FORMAT):
            raise ValueError(f"unsupported state dict format {get('format')!r}")
        model = cls(
            prior_var=scalar("prior_var", float),
            noise_var=scalar("noise_var", float),
            refactor_every=scalar("refactor_every", int),
        )
        if not scalar("fitted", bool):
            return model
        arrays = {}
        for key in ("A", "b", "yy", "Sigma", "coef"):
            arrays[key] = np.array(get(key), dtype=np.float64, order="C", copy=True)
        D, k = arrays["b"].shape if arrays["b"].ndim == 2 else (-1, -1)
        expected = {"b": (D, k), "A": (D, D), "yy": (k,), "Sigma": (D, D), "coef": (D, k)}
        for key, shape in expected.items():
            if D < 1 or arrays[key].shape != shape:
                raise ValueError(
                    f"state dict key {key!r} has shape {arrays[key].shape}, expected {shape}"
                )
        for key, a in arrays.items():  # (a damaged or altered file: refused here, not used as confident)
            if not np.all(np.isfinite(a)):
                raise ValueError(f"state dict key {key!r} holds numbers that are not finite")
        if np.any(np.diagonal(arrays["Sigma"]) <= 0) or np.any(np.diagonal(arrays["A"]) < 0):
            raise ValueError("state dict keys 'Sigma' / 'A' are not covariances (a diagonal entry is not positive)")
        s = None
        if "x_sum" in d:  # states saved before the column sums were kept have none
            s = np.array(get("x_sum"), dtype=np.float64, order="C", copy=True)
            if s.shape != (D,):
                raise ValueError(f"state dict key 'x_sum' has shape {s.shape}, expected {(D,)}")
        model._assign_stats(
            arrays["A"], arrays["b"], arrays["yy"], scalar("n", int), scalar("single_output", bool), s
        )
        if fmt >= 2:
            X = np.array(get("pending_X"), dtype=np.float64, order="C", copy=True)
            Y = np.array(get("pending_Y"), dtype=np.float64, order="C", copy=True)
            if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != D or Y.shape[1] != k or len(X) != len(Y):
                raise ValueError(f"state dict pending rows have shapes {X.shape}, {Y.shape}; expected (p, {D}), (p, {k})")
            if len(X):
                model._pending = [(X, Y)]
                model._n_pending = len(X)
        model._set_posterior(
            arrays["Sigma"],
            arrays["coef"],
            scalar("log_det_precision", float),
            (float(model.prior_var), float(model.noise_var)),
        )
        model.n_since_refactor_ = scalar("n_since_refactor", int)
        return model
