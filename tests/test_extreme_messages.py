"""Messages at the edge of the service's range (found by an adversarial review, session 18): a
reference or exact rule that lost its accuracy there must neither answer wrongly with confidence nor
teach a learned operator a pair that moves every prediction.

* Laplace's stationary point in a bracket ~1e100 wide (exp's y ~ Gamma(2, rate 1e100)): checked
  against the mode of the tilted density computed independently (a dense grid around it).
* bisection in such a bracket (quadrature.bisect): the root of a monotone function, closed form.
* an exact rule whose Gaussian belief is wider than the incoming message on a log-concave factor:
  refused by name (Brascamp–Lieb), instead of N(−5e58, 1e117)."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.errors import OracleError
from kjit.factors import get_factor
from kjit.families import Beta, Gamma, Gaussian
from kjit.oracles import QuadratureOracle


def test_exp_reference_finds_the_mode_in_a_bracket_1e100_wide():
    """x ~ N(0, 1), y = e^x with y's message Gamma(2, rate 1e100): the tilted density in x is
    N(x; 0, 1) e^{x} exp(−1e100 e^{x}) (shape 2: (a − 1) x), mode where −x + 1 − 1e100 e^x = 0,
    near −225; Laplace's mean must be that mode."""
    f = get_factor("exp")
    inc = {"x": Gaussian(np.array([0.0]), np.array([1.0])), "y": Gamma(np.array([2.0]), np.array([1e100]))}
    lap = f.laplace_belief(inc, "x")
    # the mode by an independent computation: the root of −x + 1 − e^{x + ln 1e100} by a dense grid
    # then Newton in extended steps (all terms are O(1) near the root)
    c = np.log(1e100)
    grid = np.linspace(-400.0, 0.0, 400001)
    g = -grid + 1.0 - np.exp(grid + c)
    x = grid[np.argmin(np.abs(g))]
    for _ in range(50):
        x -= (-x + 1.0 - np.exp(x + c)) / (-1.0 - np.exp(x + c))
    assert abs(float(lap.mean()[0]) - x) < 1e-9 * abs(x)
    # the reference of learned operators (quadrature on that Laplace approximation) and the exact
    # rule: the same belief (200 iterations left the mode, and the reference, at −1.2e40)
    ref, q = f.approximate_belief(inc, "x"), QuadratureOracle(f).belief(inc, "x")
    assert abs(float(q.mean()[0]) - x) < 0.05
    assert abs(float(ref.mean()[0]) - float(q.mean()[0])) < 1e-6 and abs(ref.var()[0] / q.var()[0] - 1) < 1e-4


def test_bisection_reaches_the_root_from_a_bracket_1e100_wide():
    from kjit.quadrature import bisect

    root = np.array([-224.84, 3.0, 1e-3])
    lo, hi = np.full(3, -1e100), np.full(3, 1e100)
    got = bisect(lambda t: t - root, lo, hi, 100)
    np.testing.assert_allclose(got, root, rtol=1e-11, atol=1e-11)
    # an ordinary bracket: exactly the 100 halvings of before
    lo, hi = np.array([-10.0]), np.array([10.0])
    a, b = lo.copy(), hi.copy()
    for _ in range(100):
        m = 0.5 * (a + b)
        same = np.sign(m - 1.3) == np.sign(a - 1.3)
        a, b = np.where(same, m, a), np.where(same, b, m)
    assert bisect(lambda t: t - 1.3, lo, hi, 100)[0] == 0.5 * (a + b)[0]


@pytest.mark.parametrize("mean, var, alpha, beta", [(0.0, 1.0, 1.0, 1e100), (0.0, 1.0, 1.0, 1e50),
                                                    (-1e15, 1.0, 2.0, 1.0), (1e50, 1.0, 2.0, 1.0)])
def test_a_log_concave_rule_never_answers_wider_than_the_incoming_message(mean, var, alpha, beta):
    """Logistic → x with labels α, β ≥ 1 is log-concave: the belief's variance is at most x's.  At
    these messages the panel rule loses its accuracy (doubles cannot resolve N(1e50, 1)); the oracle
    refuses the rows by name instead of answering N(1e50, 4e70)."""
    f = get_factor("logistic")
    inc = {"x": Gaussian(np.array([0.3, mean]), np.array([0.5, var])),
           "z": Beta(np.array([2.0, alpha]), np.array([1.0, beta]))}
    with pytest.raises(OracleError, match="wider than the incoming message") as err:
        QuadratureOracle(f).belief(inc, "x")
    np.testing.assert_array_equal(err.value.rows, [1])
    # the first row alone is answered, within the bound
    q = QuadratureOracle(f).belief({v: m[:1] for v, m in inc.items()}, "x")
    assert 0.0 < q.var()[0] <= 0.5
