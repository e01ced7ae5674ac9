"""EP engine (client side): Gaussian sites on linear predictors, pluggable message operators.

* :class:`LinearEP` — the EP loop (parallel or sequential schedule, damping, skips, evidence);
* models: :class:`BayesianLogisticRegression`, :class:`ProbitClassifier`,
  :class:`CompoundGammaPrecision`;
* :class:`RecordingOperator` — records the (incoming, belief) pairs an EP run asks for;
* variants: power EP (``power=u``) and relaxed EP (``relax_c=c``) in the engine and models;
  operators :class:`ProbitNoiseOperator`, :class:`LogisticOperator` (power EP, relaxed EP) and
  :class:`LaplaceOperator` (Laplace propagation);
* :class:`GPClassifier` — GP classification with the noisy probit by EP / power EP / relaxed EP.
"""

from .engine import SKIP_REASONS, EPConvergenceWarning, EPResult, GaussianPosterior, IterationRecord, LinearEP
from .error_bars import ErrorBars, PosteriorErrorWarning, graph_error_bars, linear_error_bars
from .models import (
    BayesianLogisticRegression,
    CompoundGammaPrecision,
    PoissonRegression,
    ProbitClassifier,
    expected_sigmoid,
    logistic_gauss_hermite,
)
from .gp import GPClassifier, kernel_factor, linear_kernel, rbf_kernel
from .operators import (
    GaussianLogDensity,
    LaplaceOperator,
    LogisticLogDensity,
    LogisticOperator,
    ProbitNoiseOperator,
)
from .recording import Call, RecordingOperator

__all__ = [
    "ErrorBars",
    "PosteriorErrorWarning",
    "graph_error_bars",
    "linear_error_bars",
    "LinearEP",
    "EPConvergenceWarning",
    "EPResult",
    "IterationRecord",
    "GaussianPosterior",
    "SKIP_REASONS",
    "BayesianLogisticRegression",
    "ProbitClassifier",
    "CompoundGammaPrecision",
    "PoissonRegression",
    "expected_sigmoid",
    "logistic_gauss_hermite",
    "RecordingOperator",
    "Call",
    "ProbitNoiseOperator",
    "LogisticOperator",
    "LaplaceOperator",
    "LogisticLogDensity",
    "GaussianLogDensity",
    "GPClassifier",
    "rbf_kernel",
    "linear_kernel",
    "kernel_factor",
]
