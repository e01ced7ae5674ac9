"""One BLAS thread while an operator learns: replay is bit for bit only if it is.

An update's floating-point result depends on how BLAS splits its products among threads
(OpenBLAS's threaded kernels sum in another order): the same log replayed with 1 and with 2
threads gave operators whose predictions differ in the last bits (found by an audit) — a restart
with another ``OPENBLAS_NUM_THREADS``, or a replica on a machine with more cores, would no longer
be the state it acknowledged, bit for bit.  So every ``partial_fit`` of the store — a live update,
a replayed or another replica's record, a jit request that learns — runs under
:func:`one_blas_thread`.  The results then still depend on the BLAS library and the CPU's kernels
(replicas should run the same build on the same kind of CPU), no longer on the thread count.

The thread count is a process-wide setting of the BLAS library, not a thread's: the limit is
counted (the first update to enter sets it, the last to leave restores it), so updates of two
operators that overlap both run with one thread throughout; a prediction that runs meanwhile does
too (it only takes longer).  A 300-row update measured 1.5 ms (D 50/100) to 64 ms (D 500/1000)
with one thread — less than with two on the 2-core test machine, whose other core was busy —
and setting and restoring the limit costs ~13 µs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["one_blas_thread", "prepare", "set_threads"]

_lock = threading.Lock()
_depth = 0
_limiter = None
_controller = None


def _blas():
    """The process's BLAS libraries (threadpoolctl; found once: numpy's and scipy's OpenBLAS are
    loaded by then — :mod:`kjit` imports both)."""
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


def set_threads(n: int):
    """BLAS runs with ``n`` threads in this process until the returned callable restores what it was
    (None for ``n`` = 0: left as it is) — the service's ``KJIT_BLAS_THREADS``, for the app's lifetime
    (restored when it stops: a process that embeds the app keeps its own setting — found in review)."""
    if int(n) <= 0:
        return None
    with _lock:
        limiter = _limit(int(n))

    def restore() -> None:
        with _lock:
            _restore(limiter)

    return restore


def prepare() -> None:
    """Find the BLAS libraries now (the store calls it when it opens): the first update must not be the
    first to import threadpoolctl and read the process's libraries — found by an audit: with the file
    descriptors exhausted (idle connections) that import raised OSError, a 500 on every update."""
    from threadpoolctl import OpenBLASController  # noqa: F401 - imported here, not by an update

    _blas()


def _take_control() -> None:
    """Let this thread set OpenBLAS's pool: threadpoolctl (3.7 on) lets only the first thread that
    set it do so again and silently ignores the others (found in review: an update learned aside, on
    a request's thread, ran with two threads under the limit) — the limit here is counted under one
    lock, whichever thread enters first or leaves last."""
    from threadpoolctl import OpenBLASController

    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


def _limit(n: int):
    """BLAS limited to ``n`` threads (call under ``_lock``); the limiter restores what was."""
    _take_control()
    limiter = _blas().limit(limits=n, user_api="blas")
    _take_control()
    return limiter


def _restore(limiter) -> None:
    """What ``limiter`` found restored (call under ``_lock``); whoever sets BLAS next may (e.g. with
    threadpoolctl.threadpool_limits)."""
    _take_control()
    limiter.restore_original_limits()
    _take_control()


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS runs with one thread inside (every thread's calls: see the module's docstring)."""
    global _depth, _limiter
    with _lock:
        if _depth == 0:
            _limiter = _limit(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore(_limiter)
                _limiter = None
