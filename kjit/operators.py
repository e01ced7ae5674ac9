"""Learned message operators (SPEC §4–6) — their public import path.

Each concept has one home in :mod:`kjit.learn`: the kernel operator and its uncertainty
(:mod:`kjit.learn.kernel_operator`), the thresholds calibrated for it (:mod:`kjit.learn.calibration`),
the opt-in ensemble spread (:mod:`kjit.learn.ensemble`), the greedy choice of the rows to consult
(:mod:`kjit.learn.consultation`), the opt-in learned model of a prediction's KL
(:mod:`kjit.learn.kl_model`) and the just-in-time operator (:mod:`kjit.learn.jit`).  This module
re-exports their public names, the path users import them by
(``from kjit.operators import KernelOperator, JITOperator``).  To replace a function that the code calls
(a test's monkeypatch), patch the module that calls it, not this one.
"""

from .learn.kernel_operator import (CAPPED_GATE_MARGIN, ApproximationOverflowError, DEFAULT_NOISE_VARS,
                                    DEFAULT_PRIOR_VARS,
                                    ERROR_MODEL_CANDIDATES, ERROR_MODEL_FOLDS, ERROR_MODEL_MODES,
                                    ERROR_MODEL_NOISE_VARS, ERROR_MODEL_PRIOR_VARS, KernelOperator,
                                    LEARN_RANGE_FACTOR, MIN_TARGET_SCALE, PredictionOverflowError, REFERENCE_GATE,
                                    REFERENCES,
                                    SEARCH_SIZE, SIGN_Z, TARGET_RANGE_MARGIN, TargetsNotFiniteError,
                                    TargetsOutOfRangeError, UNCERTAINTY_CHOICES, UNCERTAINTY_SCALARS, WIDTH_RULES,
                                    fit_log_variance, flagged_share_needed, flagged_share_to_catch, group_index,
                                    predict_log_variance, respect_factor_bounds, sign_undetermined,
                                    capped_reference_gate)
from .learn.calibration import (CALIBRATION_MIN_ROWS, CALIBRATION_SUPPORT, UNATTAINABLE, BudgetUnattainableWarning,
                                budget_threshold, calibrate_threshold, calibration_support, density_guard,
                                kl_model_threshold, tolerance_threshold)
from .learn.kl_model import KLModel
from .learn.ensemble import ENSEMBLE_HYPERPARAMETERS, KernelEnsemble
from .learn.consultation import greedy_consultations
from .learn.jit import GUARD_SHARE, INITIAL_BATCH_CAP, INPUT_MARGIN, JITOperator, OPERATOR_KINDS, guarded_jit

__all__ = ["CAPPED_GATE_MARGIN", "capped_reference_gate",
           "ApproximationOverflowError", "DEFAULT_NOISE_VARS", "DEFAULT_PRIOR_VARS", "ERROR_MODEL_CANDIDATES",
           "ERROR_MODEL_FOLDS", "ERROR_MODEL_MODES", "ERROR_MODEL_NOISE_VARS", "ERROR_MODEL_PRIOR_VARS",
           "KernelOperator", "LEARN_RANGE_FACTOR", "MIN_TARGET_SCALE", "PredictionOverflowError", "REFERENCE_GATE",
           "REFERENCES", "SEARCH_SIZE", "SIGN_Z", "TARGET_RANGE_MARGIN", "TargetsNotFiniteError",
           "TargetsOutOfRangeError",
           "UNCERTAINTY_CHOICES", "UNCERTAINTY_SCALARS", "WIDTH_RULES", "fit_log_variance", "flagged_share_needed",
           "flagged_share_to_catch", "group_index", "predict_log_variance", "respect_factor_bounds", "sign_undetermined",
           "budget_threshold", "CALIBRATION_MIN_ROWS", "CALIBRATION_SUPPORT", "calibration_support",
           "calibrate_threshold", "density_guard", "kl_model_threshold", "KLModel", "tolerance_threshold",
           "BudgetUnattainableWarning", "UNATTAINABLE",
           "ENSEMBLE_HYPERPARAMETERS", "KernelEnsemble", "greedy_consultations", "INITIAL_BATCH_CAP", "JITOperator",
           "OPERATOR_KINDS", "GUARD_SHARE", "INPUT_MARGIN", "guarded_jit"]
