"""kjit.reductions: the shortcuts answer what numpy's reductions answer."""

from __future__ import annotations

import itertools

import numpy as np

from kjit.reductions import all_, all_finite, any_

SPECIALS = [0.0, -0.0, 1.0, -2.5, 1e-320, 1e308, np.inf, -np.inf, np.nan]


def _arrays():
    rng = np.random.default_rng(5)
    for size in range(0, 7):
        for shape in ((size,), (1, size), (size, 1)):
            for _ in range(20):
                yield rng.choice(SPECIALS, size=size).reshape(shape)
    for x in SPECIALS:
        yield np.array(x)  # 0-d
        yield np.float64(x)  # a numpy scalar
    yield np.arange(6.0).reshape(2, 3)
    yield np.array([[1.0, np.nan], [2.0, 3.0]])


def test_all_finite_is_numpys():
    n = 0
    for a in _arrays():
        assert all_finite(a) is bool(np.isfinite(a).all()), a
        n += 1
    assert n > 400
    assert all_finite(np.array([1, 2, 3])) and all_finite(np.array([True, False]))


def test_all_and_any_are_numpys():
    for a in _arrays():
        b = np.asarray(a) > 0  # boolean arrays of every size, 0-d included
        assert all_(b) is bool(b.all()) and any_(b) is bool(b.any()), b
    for bits in itertools.product([False, True], repeat=3):
        b = np.array(bits)
        assert all_(b) is bool(b.all()) and any_(b) is bool(b.any())
    for x in (np.bool_(True), np.bool_(False)):
        assert all_(x) is bool(x) and any_(x) is bool(x)
