"""LAPACK and BLAS calls that release the GIL: scipy's own routines, called through ctypes.

scipy's Python wrappers (``scipy.linalg.cho_factor``, ``cho_solve``, ``eigh``, ``inv`` and the raw
``scipy.linalg.lapack`` / ``blas`` functions) hold the GIL for the whole Fortran call — found by an
audit: a training job in a thread of the server froze every request, ``/health`` included, for up to
6.6 s at a time, in ``eigh`` and in ``cho_factor`` / ``dpotri`` of the posterior.  Measured at D = 1500
(a thread ticking every 1 ms while another runs the call): ``dpotrf``, ``dpotri``,
``dpotrs``, ``dtrtrs``, ``dgemm``, ``eigh`` blocked the ticking thread for 80–100 % of the call;
``numpy.linalg`` and ``@`` for 1–9 %.

numpy has no ``potri`` (the inverse from the Cholesky factor) nor a triangular solve, and its
``inv`` / ``solve`` are LU-based (4x slower than ``potri`` at D = 1500, and not the same numbers).
So the posterior calls the *same* LAPACK routines as before — scipy's, exported for Cython by
:mod:`scipy.linalg.cython_lapack` / :mod:`scipy.linalg.cython_blas` as function pointers — through
:mod:`ctypes`, which releases the GIL around a foreign call.  Same library, same routine, same
arguments (Fortran-ordered copies, as the f2py wrappers make them): the results are the old ones
bit for bit, and the speed is the same.

Every function here works in place on Fortran-contiguous float64 arrays the caller owns.
"""

from __future__ import annotations

import ctypes

import numpy as np
from scipy.linalg import cython_blas, cython_lapack

__all__ = ["dgemm", "dpotrf", "dpotri", "dpotrs", "dsyevr", "dtrtrs"]

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _routine(module, name: str, nargs: int):
    """scipy's Cython-exported ``name`` as a ctypes function (every Fortran argument is a pointer).
    A CFUNCTYPE call releases the GIL for its duration."""
    capsule = module.__pyx_capi__[name]
    signature = _get_name(capsule).decode()
    if signature.count("*") != nargs:  # pragma: no cover - a scipy that changed the routine's signature
        raise ImportError(f"scipy's {name} has signature {signature!r}, expected {nargs} pointer arguments")
    pointer = _get_pointer(capsule, _get_name(capsule))
    return ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * nargs))(pointer)


_dpotrf = _routine(cython_lapack, "dpotrf", 5)
_dpotri = _routine(cython_lapack, "dpotri", 5)
_dpotrs = _routine(cython_lapack, "dpotrs", 8)
_dtrtrs = _routine(cython_lapack, "dtrtrs", 10)
_dgemm = _routine(cython_blas, "dgemm", 13)
_dsyevr = _routine(cython_lapack, "dsyevr", 21)


class _Args:
    """Pointers to Fortran scalars; the ctypes objects live as long as this object."""

    def __init__(self) -> None:
        self._keep: list = []

    def ch(self, c: str) -> int:
        v = ctypes.c_char(c.encode())
        self._keep.append(v)
        return ctypes.addressof(v)

    def int(self, i: int) -> int:
        v = ctypes.c_int(int(i))
        self._keep.append(v)
        return ctypes.addressof(v)

    def dbl(self, x: float) -> int:
        v = ctypes.c_double(float(x))
        self._keep.append(v)
        return ctypes.addressof(v)

    def value(self, address: int) -> int:
        return ctypes.c_int.from_address(address).value


def _fortran(a: np.ndarray, name: str, ndim: int = 2) -> int:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float64 and a.ndim == ndim
            and a.flags.f_contiguous and a.flags.writeable):
        raise ValueError(f"{name} must be a writeable Fortran-contiguous float64 array of {ndim} dimensions")
    return a.ctypes.data


def _square(routine, a: np.ndarray, name: str, lower: bool) -> int:
    """``routine(uplo, n, a, lda, info)`` on the square ``a`` in place; LAPACK's ``info``."""
    p = _fortran(a, name)
    n = a.shape[0]
    if a.shape != (n, n):
        raise ValueError(f"{name} must be square")
    args = _Args()
    info = args.int(0)
    routine(args.ch("L" if lower else "U"), args.int(n), p, args.int(max(n, 1)), info)
    return args.value(info)


def dpotrf(a: np.ndarray, lower: bool = True) -> int:
    """Cholesky factor of ``a`` (n × n) in place, in the ``lower`` (else upper) triangle; the other
    triangle is left as it was (``scipy.linalg.cho_factor``).  Returns LAPACK's ``info``."""
    return _square(_dpotrf, a, "a", lower)


def _solve(routine, flags: str, t: np.ndarray, b: np.ndarray, lower: bool) -> int:
    """``routine(uplo, *flags, n, k, t, ldt, b, ldb, info)`` solving in place in ``b`` (n × k)."""
    pt, pb = _fortran(t, "the factor"), _fortran(b, "b")
    n, k = b.shape
    if t.shape != (n, n):
        raise ValueError("the factor and b do not match")
    args = _Args()
    info = args.int(0)
    routine(args.ch("L" if lower else "U"), *(args.ch(f) for f in flags), args.int(n), args.int(k), pt,
            args.int(max(n, 1)), pb, args.int(max(n, 1)), info)
    return args.value(info)


def dpotrs(c: np.ndarray, b: np.ndarray, lower: bool = True) -> int:
    """Solve ``C C^T x = b`` (``lower``) in place in ``b`` (n × k), ``c`` from :func:`dpotrf`."""
    return _solve(_dpotrs, "", c, b, lower)


def dpotri(c: np.ndarray, lower: bool = True) -> int:
    """The inverse of ``C C^T`` in place in ``c``'s ``lower`` triangle (the other is left as it was)."""
    return _square(_dpotri, c, "c", lower)


def dtrtrs(t: np.ndarray, b: np.ndarray, lower: bool = True) -> int:
    """Solve ``T x = b`` in place in ``b`` (n × k) for the ``lower`` (else upper) triangular ``t``."""
    return _solve(_dtrtrs, "NN", t, b, lower)


def dgemm(alpha: float, a: np.ndarray, b: np.ndarray, beta: float, c: np.ndarray,
          trans_a: bool = False, trans_b: bool = False) -> None:
    """``c <- alpha op(a) op(b) + beta c`` in place (``scipy.linalg.blas.dgemm`` with ``overwrite_c``)."""
    pa, pb, pc = _fortran(a, "a"), _fortran(b, "b"), _fortran(c, "c")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if kb != k or c.shape != (m, n):
        raise ValueError(f"dgemm shapes do not match: {a.shape}, {b.shape}, {c.shape}")
    args = _Args()
    _dgemm(args.ch("T" if trans_a else "N"), args.ch("T" if trans_b else "N"), args.int(m), args.int(n),
           args.int(k), args.dbl(alpha), pa, args.int(max(a.shape[0], 1)), pb, args.int(max(b.shape[0], 1)),
           args.dbl(beta), pc, args.int(max(m, 1)))


def dsyevr(a: np.ndarray, lower: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """All eigenvalues (ascending) and eigenvectors of the symmetric ``a`` from its ``lower`` (else
    upper) triangle, by LAPACK ``syevr`` (MRRR) — ``scipy.linalg.eigh``'s default driver, with its
    workspace sizes: its numbers.  ``a`` is destroyed.  Returns ``(w, z, info)``, ``z`` Fortran-ordered.

    Not numpy's ``eigh``, which releases the GIL too but is ``syevd`` (divide and conquer): on a
    trained operator's ``A`` (D = 1000, cond(P) = 3e11) its log evidences were up to 36x further from
    a long-double reference (39 nats against 1.1 at the worst point of the grid, 4e-3 against 3e-4
    near the chosen one)."""
    from scipy.linalg import lapack

    p = _fortran(a, "a")
    n = a.shape[0]
    if a.shape != (n, n):
        raise ValueError("a must be square")
    work_size, iwork_size, info = lapack.dsyevr_lwork(n, lower=int(lower))  # as scipy's eigh asks
    if info != 0:  # pragma: no cover
        raise ValueError(f"dsyevr workspace query failed: info={info}")
    lwork, liwork = int(work_size), int(iwork_size)
    w = np.empty(n)
    z = np.empty((n, n), order="F")
    isuppz = np.empty(2 * max(n, 1), dtype=np.intc)
    work = np.empty(max(lwork, 1))
    iwork = np.empty(max(liwork, 1), dtype=np.intc)
    args = _Args()
    m, info = args.int(0), args.int(0)
    _dsyevr(args.ch("V"), args.ch("A"), args.ch("L" if lower else "U"), args.int(n), p, args.int(max(n, 1)),
            args.dbl(0.0), args.dbl(1.0), args.int(1), args.int(n), args.dbl(0.0), m, w.ctypes.data,
            z.ctypes.data, args.int(max(n, 1)), isuppz.ctypes.data, work.ctypes.data, args.int(lwork),
            iwork.ctypes.data, args.int(liwork), info)
    return w, z, args.value(info)
