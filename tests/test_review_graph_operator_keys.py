"""Review: GraphEP silently ignored `operators` keys that name no (factor, recipient) of the graph.

A typo ("tua" for "tau", or a fixed variable) ran the exact rule instead of the operator the
caller gave, with no sign of it; the standard is a clear error naming the key.
"""

import numpy as np
import pytest

from kjit.ep.graph import GraphEP
from kjit.ep.models import normal_mean_precision
from kjit.factors import get_factor
from kjit.oracles import QuadratureOracle


@pytest.mark.parametrize("key", [("gaussian", "tua"), ("gausian", "tau"), ("gaussian", "x")])
def test_unknown_operator_key_is_an_error(key):
    g = normal_mean_precision(np.array([0.3, -0.2, 1.1]))
    ep = GraphEP(g, operators={key: QuadratureOracle(get_factor("gaussian"))}, max_iter=2)
    with pytest.raises(ValueError, match="operators"):
        ep.run()


def test_known_operator_key_still_runs():
    g = normal_mean_precision(np.array([0.3, -0.2, 1.1]))
    res = GraphEP(g, operators={("gaussian", "tau"): QuadratureOracle(get_factor("gaussian"))}, max_iter=3).run()
    assert res.iterations >= 1


@pytest.mark.parametrize("op", [42, QuadratureOracle(get_factor("logistic"))])
def test_an_operator_of_another_factor_or_not_an_operator_is_a_configuration_error(op):
    """Found by an audit: it ran three iterations and ended "operator_failed", as a server that
    stopped answering would; a wrong object is the caller's mistake, raised at once."""
    from kjit.errors import ConfigurationError

    g = normal_mean_precision(np.array([0.3, -0.2, 1.1]))
    with pytest.raises(ConfigurationError, match="operators"):
        GraphEP(g, operators={("gaussian", "tau"): op}, max_iter=5).run()


def test_an_empty_batch_is_a_clear_error_everywhere():
    """Found by an audit: a raw numpy reshape error from deep in the quadrature (the JIT's initial
    phase, the oracle, a learned operator)."""
    from kjit.families import Beta, Gaussian
    from kjit.operators import JITOperator

    empty = {"x": Gaussian(np.zeros(0), np.ones(0)), "z": Beta(np.ones(0), np.ones(0))}
    oracle = QuadratureOracle(get_factor("logistic"))
    for call in (lambda: oracle.belief(empty, "x"),
                 lambda: JITOperator(None, oracle, to="x", initial_batch=4).predict(empty)):
        with pytest.raises(ValueError, match="holds no messages"):
            call()
