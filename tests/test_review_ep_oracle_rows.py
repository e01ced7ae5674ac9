"""Review: LinearEP(on_uncertain="oracle") must map an oracle's failing rows back to the batch.

``_query`` asks the oracle for the uncertain rows only (a sub-batch).  An oracle error that
names its failing rows (LowESSError.rows) names positions in that sub-batch; ``_ask`` skips
those positions of the whole live batch, so it skipped the wrong sites (and, asking again,
went on failing until every site of the iteration was skipped).
"""

import numpy as np

from kjit.ep import LinearEP
from kjit.errors import LowESSError
from kjit.factors import Logistic
from kjit.families import Beta
from kjit.oracles import QuadratureOracle

BAD = 5.0  # the label message Beta(BAD, 1) marks the row the oracle cannot answer
UNCERTAIN = (3.0, BAD)  # label messages whose learned answer is above the threshold


class _Oracle:
    def __init__(self):
        self.q = QuadratureOracle(Logistic())

    def belief(self, incoming, to):
        bad = np.flatnonzero(np.asarray(incoming["z"].params[0]) == BAD)
        if bad.size:
            raise LowESSError(bad, np.zeros(bad.size), 50.0)
        return self.q.belief(incoming, to)


class _Operator:
    """Exact answers, with a log predictive variance of +10 on the 'uncertain' rows."""

    def __init__(self):
        self.q = QuadratureOracle(Logistic())

    def belief(self, incoming, to):
        return self.q.belief(incoming, to)

    def predict(self, incoming, to):
        unc = np.isin(np.asarray(incoming["z"].params[0]), UNCERTAIN)
        logvar = np.where(unc[:, None], 10.0, -10.0) * np.ones((unc.size, 2))
        return self.q.belief(incoming, to), logvar


def test_oracle_failure_skips_only_its_own_row():
    a = np.array([2.0, 3.0, 1.5, BAD])
    z = Beta(a, np.ones(4))
    A = np.eye(4)
    ep = LinearEP(_Operator(), site_var="x", prior_var=1.0, max_iter=1, on_uncertain="oracle",
                  uncertainty_threshold=0.0, oracle=_Oracle(), compute_evidence=False)
    res = ep.run(A, {"z": z})
    rec = res.history[0]
    assert rec.skipped["operator_error"] == 1  # only the row the oracle failed on
    assert rec.n_oracle == 1  # row 1 was answered by the oracle
    # rows 0, 1, 2 got their (positive-precision) sites; row 3 kept the prior
    assert np.all(res.site_precision[:3] > 0)
    assert res.site_precision[3] == 0.0


def test_rows_of_batch_names_the_batch_rows():
    """An error raised on a sub-batch names the batch's rows (used by the engine and the client)."""
    from kjit.errors import LowESSError, OracleError, rows_of_batch

    exc = rows_of_batch(LowESSError([0, 2], [1.0, 2.0], 50), np.array([3, 7, 9]))
    np.testing.assert_array_equal(exc.rows, [3, 9])
    assert rows_of_batch(OracleError("x", rows=[5]), np.array([1, 2])).rows is None  # cannot be mapped
    plain = ValueError("no rows")
    assert rows_of_batch(plain, np.array([1])) is plain and not hasattr(plain, "rows")
