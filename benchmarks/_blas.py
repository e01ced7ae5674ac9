"""BLAS threads of a benchmark and its server, set before numpy or scipy load BLAS (they read the
environment then; a limit applied afterwards misses the libraries loaded later, e.g. scipy's BLAS
that a prediction's ``dsymv`` uses).  Not a benchmark itself; it imports nothing heavy."""

from __future__ import annotations

import os
import sys

BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pin_blas_from_argv(argv=None, default: int = 1) -> dict:
    """Read ``--blas-threads N`` from ``argv`` (default ``default``; 0: the libraries' own default) and
    set the BLAS environment of this process to it; returns that environment, for a child process
    (the server) to run alike.  Without it the figures depend on the caller's shell: an audit measured
    a batch-1 in-process prediction at 0.5 ms on one thread and 24 ms on this host's default two."""
    argv = sys.argv[1:] if argv is None else list(argv)
    n = default
    flag = "--blas-threads"
    for i, a in enumerate(argv):  # (and argparse's abbreviations of it: --blas 3, --blas=3)
        name, eq, value = a.partition("=")
        if len(name) > 3 and flag.startswith(name):
            if eq:
                n = int(value)
            elif i + 1 < len(argv):
                n = int(argv[i + 1])
    if n <= 0:
        return {}
    env = {k: str(n) for k in BLAS_ENV}
    os.environ.update(env)
    return env
