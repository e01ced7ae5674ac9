"""Whole-array reductions with a shortcut for arrays of a few elements.

A served one-message request runs ~20 checks such as ``ok.all()`` or ``np.isfinite(c).all()`` on
arrays of one or two elements, where numpy's reductions cost ~1 µs each (the Python wrapper of
``ndarray.all`` and the ufunc machinery) and ``bool()`` of a one-element array or ``math.isfinite``
of a few numbers a tenth of that.  The answers are numpy's; arguments are numpy arrays (or numpy
scalars)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["all_", "any_", "all_finite"]

#: up to this many elements, ``all_finite`` tests the numbers in Python
_FEW = 4


def all_(a) -> bool:
    """``bool(a.all())``."""
    return bool(a) if a.size == 1 else bool(a.all())


def any_(a) -> bool:
    """``bool(a.any())``."""
    return bool(a) if a.size == 1 else bool(a.any())


def all_finite(a) -> bool:
    """``bool(np.isfinite(a).all())`` for a real array."""
    if a.size <= _FEW:
        return all(map(math.isfinite, a.ravel().tolist()))
    return bool(np.isfinite(a).all())
