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
