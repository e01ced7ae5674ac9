"""EP engine (client side): Gaussian sites on linear predictors, pluggable message operators.

* :class:`LinearEP` — the EP loop (parallel or sequential schedule, damping, skips, evidence);
* models: :class:`BayesianLogisticRegression`, :class:`ProbitClassifier`,
  :class:`CompoundGammaPrecision`;
* :class:`RecordingOperator` — records the (incoming, belief) pairs an EP run asks for.
"""

from .engine import SKIP_REASONS, EPResult, GaussianPosterior, IterationRecord, LinearEP
from .models import (
    BayesianLogisticRegression,
    CompoundGammaPrecision,
    ProbitClassifier,
    expected_sigmoid,
    logistic_gauss_hermite,
)
from .recording import Call, RecordingOperator

__all__ = [
    "LinearEP",
    "EPResult",
    "IterationRecord",
    "GaussianPosterior",
    "SKIP_REASONS",
    "BayesianLogisticRegression",
    "ProbitClassifier",
    "CompoundGammaPrecision",
    "expected_sigmoid",
    "logistic_gauss_hermite",
    "RecordingOperator",
    "Call",
]
