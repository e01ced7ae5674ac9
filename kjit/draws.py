"""A learned operator drawn from its regression's posterior: what its errors could be, jointly.

A :class:`~kjit.operators.KernelOperator`'s regression (:mod:`kjit.blr`) has a Gaussian posterior
over its weights: per regressed coordinate ``N(coef_, Σ)`` in standardised units, ``Σ`` shared.  The
just-in-time rule reads its epistemic variance one message at a time, ``ψᵀΣψ``.  But the errors of
two answers are not independent: their covariance is ``ψ₁ᵀΣψ₂``, close to the product of their
standard deviations for two similar messages.  An EP posterior that multiplies many learned
messages (many factors sending to one variable, one operator for all of them) adds those errors up,
and no rule on one message sees the sum (measured by an audit: a user's exp factor with 60 Poisson
counts on one variable, every answer confident and as accurate as it said, the posterior mean 0.36
posterior sd off).

A draw ``W ~ N(coef_, Σ)`` is one operator the regression finds as plausible as its mean; answering
every message with it draws all their errors jointly.  :mod:`kjit.ep.error_bars` re-runs EP from a
fixed point with a few draws and reports how far the posterior moves.

What a draw leaves out: the regression's noise variance (the scatter of the targets it learned —
an oracle's Monte Carlo error — not of its answers), a learned error model's extra variance, the
reference's own error (``Factor.reference_error``, added where the reference is the factor's approximation)
and the range floor's prior variance (terms the rule adds to the variance of rows the regression does not
know: those rows are flagged by the rule, and the EP engines count them as uncertain answers).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .families import Family
from .protocols import Operator

__all__ = ["OperatorDraw", "Transient", "SEED_MAX", "draw_seeds"]

#: the largest seed of a draw (numpy's seeds are non-negative ints; a signed 64-bit bound keeps clients simple)
SEED_MAX = 2**63 - 1


def draw_seeds(n: int, random_state=None) -> list[int]:
    """The seeds of ``n`` draws from ``random_state`` — one rule for an operator in process
    (:meth:`KernelOperator.draws`) and a served one (:meth:`RemoteOperator.draws`), so that both give the same
    draws from the same ``random_state``."""
    from .errors import check_number
    from .features import check_random_state

    n = check_number("n", n, 1, integer=True)
    return [int(s) for s in np.random.default_rng(check_random_state(random_state)).integers(0, SEED_MAX, size=n)]


class Transient:
    """A cache slot (``value``) that a deep copy or a pickle does not carry: the copy starts empty (a square-root
    factor of D² numbers is rebuilt on demand, not copied along with an operator that is about to change)."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def __deepcopy__(self, memo):
        return Transient()

    def __reduce__(self):
        return (Transient, ())


class OperatorDraw(Operator):
    """One draw of a fitted :class:`~kjit.operators.KernelOperator`'s weights from its regression's
    posterior, answering ``belief(incoming, to)`` with them (build with
    :meth:`KernelOperator.draws`).  The weights are a copy: learning after the draw (a JIT's) does
    not change it.  ``weights``: (D_out, k), standardised units; None: the posterior mean — the operator's
    own answers (its ``belief``, in its own precision), as it is when asked."""

    certificate_source = "learned"

    def __init__(self, operator, weights: np.ndarray | None):
        self.operator = operator
        self.factor = operator.factor
        self.to = operator.to
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)

    def belief(self, incoming: Mapping[str, Family], to: str | None = None) -> Family:
        if self.weights is None:
            return self.operator.belief(incoming, to)
        return self.operator._belief_with_weights(incoming, to, self.weights)

    def _recipient(self, to):
        return self.to

    def __repr__(self):
        return f"OperatorDraw({self.factor.name}→{self.to})"
