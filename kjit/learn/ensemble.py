"""An ensemble-spread uncertainty for a fitted :class:`~kjit.learn.kernel_operator.KernelOperator`
(opt-in; issue 14 part 3): :class:`KernelEnsemble`."""

from __future__ import annotations

import copy
import numbers
from typing import Mapping

import numpy as np

from ..curvature import LearnedCurvature
from ..families import Family
from ..training import TrainingSet
from .kernel_operator import (ERROR_MODEL_CANDIDATES, ERROR_MODEL_FOLDS, ERROR_MODEL_MODES, KernelOperator,
                              UNCERTAINTY_CHOICES, flagged_share_needed)
from .calibration import _pooled, _pooled_budget_threshold

__all__ = ["ENSEMBLE_HYPERPARAMETERS", "KernelEnsemble"]

# ====================================================================== ensemble spread (opt-in)
ENSEMBLE_HYPERPARAMETERS = ("shared", "own")


class KernelEnsemble:
    """An ensemble-spread uncertainty for a fitted :class:`KernelOperator` (opt-in; issue 14 part 3).

    The BLR's predictive variance measures the distance of a row's random features to the
    training rows; it does not see the error the random-feature approximation itself makes (which
    features were drawn).  This fits ``members − 1`` further operators on the same pairs, differing
    only in the random features' seed, and reads the spread of the members' predictions —
    the operator itself is member 0 — as an uncertainty: per row and coordinate the across-member
    variance s²_k (ddof 1: an unbiased estimate of the variance of one member's prediction about
    the members' common expectation) of the *regressed* coordinates (relative to the operator's
    reference for relative targets: the units of the operator's own predictive variance).

    ``hyperparameters``: ``"shared"`` (default) — every member takes the operator's chosen width
    rule, inner and outer width factors, prior and noise variances (its fit searches that single
    point: only the features' draw differs); ``"own"`` — every member chooses its own by the log
    evidence, as the operator did (the spread then also includes the choice).  ``seeds``: the
    members' ``random_state`` (``members − 1`` ints); default from
    ``numpy.random.SeedSequence([operator.random_state, k])`` for k = 1…members − 1 (an int
    ``random_state``; otherwise fresh entropy).  ``add_variance``: the uncertainty is the spread
    alone, log s²_k (False, default), or added to the operator's own predictive variance as it
    stands (with its error model and reference error, if any), log(v_k + s²_k).

    The answers mimic the operator's so that :func:`budget_threshold` and
    :func:`calibrate_threshold` calibrate it unchanged (``scalar="max"`` only): :meth:`predict` and
    :meth:`held_out_predict` return the *operator's* belief (member 0's — the errors being ranked
    are the operator's) with the ensemble's log variances; :meth:`mean_belief` is the members'
    average in the regressed coordinates.  Not used by :class:`JITOperator` and not persisted.

    Measured on benchmarks/factor_suite.py (``--ensemble 4``, shared hyperparameters, seeds 0–9,
    140 directions; its docstring has the per-seed figures): directions meeting both goals at the
    pooled q90 threshold 53 (the operator's variance with its chosen error model) → 49 (the spread
    alone) / 60 (added), at budget90 91 → 74 / 86; flagged_share_needed ≤ 0.06 on 103 → 94 / 114.
    The members' mean lowers the mean log KL on 116 of 140.  Not the default.
    """

    def __init__(self, operator: KernelOperator, members: int = 4, hyperparameters: str = "shared",
                 seeds=None, add_variance: bool = False):
        operator._check_fitted()
        if int(members) < 2:
            raise ValueError("`members` must be ≥ 2 (the operator and at least one more)")
        if hyperparameters not in ENSEMBLE_HYPERPARAMETERS:
            raise ValueError(f"`hyperparameters` must be one of {ENSEMBLE_HYPERPARAMETERS}, got {hyperparameters!r}")
        self.operator = operator
        self.members = int(members)
        self.hyperparameters = hyperparameters
        if seeds is None:
            rs = operator.random_state
            entropy = int(rs) if isinstance(rs, numbers.Integral) and not isinstance(rs, bool) else None
            root = np.random.SeedSequence(entropy)
            seeds = [int(np.random.SeedSequence([root.entropy, k]).generate_state(1)[0])
                     for k in range(1, self.members)]
        seeds = [int(s) for s in seeds]
        if len(seeds) != self.members - 1:
            raise ValueError(f"`seeds` must give {self.members - 1} seeds (one per member after the operator)")
        self.seeds = seeds
        self.add_variance = bool(add_variance)
        self._held = None  # (data, groups, the other members' held-out coordinates): see held_out_predict

    # (the spread alone, add_variance=False, has no extrapolation floor: the operator's range floor
    # (KernelOperator.target_range_) applies to the operator's variance, which the spread replaces)
    def with_variance(self, add_variance: bool) -> "KernelEnsemble":
        """A view of this ensemble (the same fitted members) with ``add_variance`` set."""
        other = copy.copy(self)
        other.add_variance = bool(add_variance)
        return other

    def fit(self, data: TrainingSet | tuple, beliefs: Family | None = None) -> "KernelEnsemble":
        """Fit the other members on ``data`` — the pairs the operator was fitted on."""
        base = self.operator
        kw = dict(n_inner=base.n_inner, n_outer=base.n_outer, treatment=base.treatment,
                  inner_factors=base.inner_factors, width_factors=base.width_factors,
                  prior_vars=base.prior_vars, noise_vars=base.noise_vars, dtype=base.dtype, target=base.target,
                  canonical=base.canonical, width_rules=base.width_rules, reference=base.reference,
                  reference_gate=getattr(base, "reference_gate", "auto"))
        if self.hyperparameters == "shared":
            kw.update(inner_factors=[base.inner_factor_], width_factors=[base.width_factor_],
                      prior_vars=[base.prior_var_], noise_vars=[base.noise_var_],
                      width_rules=(getattr(base, "width_rule_", "mean_variance"),))
        self.members_ = [KernelOperator(base.factor, base.to, random_state=s, **kw).fit(data, beliefs)
                         for s in self.seeds]
        self._held = None
        return self

    def _regressed(self, coords, flat):
        """Belief coordinates (n, k) → the regressed coordinates (relative to the reference)."""
        op = self.operator
        if op.target != "relative":
            return coords
        with np.errstate(all="ignore"):
            return op._to_relative(coords, op._reference(flat))

    def _answer(self, q0, logvar0, others, flat):
        """(the operator's belief, the ensemble's log variances (n, k)) from the operator's answer
        and the other members' regressed coordinates ``others`` (K − 1, n, k)."""
        k = len(self.operator.y_mean_)
        c0 = self._regressed(q0.ravel().to_coords().reshape(-1, k), flat)
        s2 = np.var(np.concatenate([c0[None], others]), axis=0, ddof=1)
        if self.add_variance:
            s2 = s2 + np.exp(np.asarray(logvar0, np.float64).reshape(-1, k))
        return q0, np.log(np.maximum(s2, np.finfo(np.float64).tiny)).reshape(q0.shape + (k,))

    def _check_fitted(self):
        if not hasattr(self, "members_"):
            raise ValueError("this KernelEnsemble is not fitted yet: call fit() first")

    def _flat(self, incoming):
        """(the validated flat incoming messages, the batch shape)."""
        return self.operator.factor.flat_incoming(incoming, self.operator.to)

    def member_coords(self, incoming: Mapping[str, Family]) -> np.ndarray:
        """(K, n, k): every member's predicted regressed coordinates (member 0: the operator), of
        its belief (:meth:`KernelOperator.belief`: clipped to the factor's bound)."""
        self._check_fitted()
        return self._coords([self.operator] + self.members_, self._flat(incoming)[0])

    def _coords(self, models, flat):
        k = len(self.operator.y_mean_)
        return np.stack([self._regressed(m.belief(flat).to_coords().reshape(-1, k), flat) for m in models])

    def predict(self, incoming: Mapping[str, Family], to: str | None = None):
        """The operator's belief and the ensemble's log variances (batch, k)."""
        self._check_fitted()
        self.operator._check_to(to)
        q0, logvar0 = self.operator.predict(incoming)
        flat = self._flat(incoming)[0]
        others = self._coords(self.members_, flat)
        return self._answer(q0, logvar0, others, flat)

    def held_out_predict(self, data: TrainingSet | tuple, groups, beliefs: Family | None = None):
        """:meth:`KernelOperator.held_out_predict` of every member (each refitted without the row's
        group, exactly), read as :meth:`predict` reads the members' predictions.  The other
        members' answers are kept for the last (``data``, ``groups``) asked (the same objects):
        calibrations ask several times."""
        self._check_fitted()
        groups = np.asarray(groups)
        q0, logvar0 = self.operator.held_out_predict(data, groups, beliefs)
        incoming, _ = self.operator._unpack(data, beliefs)
        flat = self._flat(incoming)[0]
        k = len(self.operator.y_mean_)
        held = self._held
        if held is None or held[0] is not data or not np.array_equal(held[1], groups):
            others = np.stack([self._regressed(m.held_out_predict(data, groups, beliefs)[0].ravel()
                                               .to_coords().reshape(-1, k), flat) for m in self.members_])
            self._held = held = (data, groups.copy(), others)
        return self._answer(q0, logvar0, held[2], flat)

    def row_uncertainty(self, incoming, q: Family, logvar, scalar: str = "max", learned_curvature=None) -> np.ndarray:
        """The largest log variance over the coordinates, per row, weighted as the operator's (only
        ``scalar="max"``)."""
        if scalar != "max":
            raise ValueError("a KernelEnsemble's uncertainty is scalarised by 'max' only")
        return self.operator.row_uncertainty(incoming, q, logvar, "max", learned_curvature=learned_curvature)

    def held_out_learned_curvature(self, data, groups, beliefs: Family | None = None) -> LearnedCurvature:
        """The operator's (:meth:`KernelOperator.held_out_learned_curvature`)."""
        return self.operator.held_out_learned_curvature(data, groups, beliefs)

    def choose_uncertainty(self, data: TrainingSet, groups, held_out: TrainingSet,
                           held_out_groups=None, candidates=UNCERTAINTY_CHOICES, budget: float = 0.1,
                           confidence: float | None = None, problems: int | None = None, n_boot: int = 2000,
                           floor: float = 1e-3,
                           folds: int = ERROR_MODEL_FOLDS) -> "KernelEnsemble":
        """Choose the uncertainty a threshold compares, and the operator's error model with it, on
        pooled held-out rows only (opt-in; issue 14 part 3) — :meth:`KernelOperator.fit_error_model`'s
        ``mode="auto"`` widened to the ensemble spread, by a criterion aimed at the budget.

        Candidates: every uncertainty of ``candidates`` — ``"max"`` (the operator's largest log
        variance: the just-in-time rule), ``"kl"`` (its least expected KL,
        :meth:`KernelOperator.row_uncertainty`), ``"enssum"`` (the largest log of the operator's
        variance plus the members' spread: this ensemble with ``add_variance``) — with every error
        model (none, additive, ratio: :meth:`KernelOperator.fit_error_model` on ``data``, the pairs
        the operator learned, by ``groups``), so that the error model is chosen with the spread
        present.  Pooled rows: ``held_out`` (a TrainingSet none of the members learned: the
        operator's predictions) and ``data`` by leave-one-group-out (:meth:`held_out_predict`,
        the error term cross-fitted) — the rows :func:`budget_threshold` pools with ``fitted=``.

        The criterion, fixed before any test figure was seen: per candidate t = its
        :func:`budget_threshold` on the pooled rows (``budget``, ``confidence``, ``problems``,
        ``held_out_groups``, ``n_boot`` as there; the conformal quantile without ``confidence``);
        first the largest share of the pooled worst 1 % by KL (the operator's errors) with u > t
        — what the threshold is for —, then the smallest :func:`flagged_share_needed` (how well u
        ranks them), then the order of ``candidates`` and of ``ERROR_MODEL_CANDIDATES`` (the
        cheaper first: "max" with no error model is the operator as the JIT reads it).

        Afterwards the operator carries the chosen error model (none: removed), ``add_variance``
        is set if "enssum" won, and ``uncertainty_selection_`` records ``uncertainty``,
        ``error_model``, ``scalar`` ("kl" or "max"), ``scores`` (per ``"<uncertainty>:<model>"``,
        ``(worst share flagged, flagged_share_needed)``), ``thresholds`` and ``n_rows``;
        :meth:`chosen_uncertainty` gives what to calibrate and with which scalar.  The operator's
        beliefs never change, and :class:`JITOperator` still compares the largest log variance.

        Measured on benchmarks/factor_suite.py (``--ensemble 4 --choose-uncertainty``, seeds 0–9,
        140 directions; its docstring has the per-seed figures): directions meeting both goals at
        the pooled q90 threshold 63 (the operator's variance 53, its ``scalars=("max", "kl")``
        choice 58, the spread added 60), at budget90 93 (91 / 96 / 86); flagged_share_needed ≤ 0.06
        on 118 (103 / 112 / 114).  The first score ties at the top on 127 of 140: the choice is in
        effect by flagged_share_needed.  Not the default.
        """
        self._check_fitted()
        candidates = tuple(candidates)
        if not candidates or any(c not in UNCERTAINTY_CHOICES for c in candidates) or \
                len(set(candidates)) < len(candidates):
            raise ValueError(f"`candidates` must be distinct values of {UNCERTAINTY_CHOICES}, got {candidates!r}")
        if not isinstance(held_out, TrainingSet) or not isinstance(data, TrainingSet):
            raise ValueError("`data` and `held_out` must be TrainingSets (the KL needs the exact beliefs)")
        if not 0.0 < budget < 1.0:
            raise ValueError("`budget` must lie in (0, 1)")
        if confidence is not None and held_out_groups is None:
            raise ValueError("`confidence` needs `held_out_groups` (the held-out rows' problems)")
        op = self.operator
        # (a failure below leaves the operator's error model and its record as they were)
        saved = {k: op.__dict__[k] for k in ("error_model_", "error_model_selection_") if k in op.__dict__}
        models = {"none": None}
        order = [(c, name) for c in candidates for name in ERROR_MODEL_CANDIDATES]
        scores, thresholds, kl0 = {}, {}, None
        try:
            for m in ERROR_MODEL_MODES:
                op.fit_error_model(data, groups, mode=m, floor=floor, folds=folds)
                models[m] = op.error_model_
            op.remove_error_model()
            for name in ERROR_MODEL_CANDIDATES:
                if models[name] is not None:
                    op.error_model_ = models[name]
                for c in candidates:
                    model, scalar = self._candidate(c)
                    u, kl = _pooled(model, held_out, data, groups, labels=True, scalar=scalar)
                    kl = np.asarray(kl, np.float64)
                    if kl0 is None:
                        kl0 = kl
                    t = _pooled_budget_threshold(u, True, True, groups, held_out_groups, budget, confidence,
                                                 problems, n_boot, 0, False)
                    worst = kl0 >= np.quantile(kl0, 0.99)
                    key = f"{c}:{name}"
                    scores[key] = (float(np.mean(u[worst] > t)), flagged_share_needed(u, kl0))
                    thresholds[key] = float(t)
                op.remove_error_model()
        except BaseException:
            op.remove_error_model()
            op.__dict__.update(saved)
            raise
        op.remove_error_model()
        op.__dict__.pop("error_model_selection_", None)  # (fit_error_model's record: not this choice's)
        c, name = min(order, key=lambda cn: (-scores[f"{cn[0]}:{cn[1]}"][0], scores[f"{cn[0]}:{cn[1]}"][1],
                                              order.index(cn)))
        if models[name] is not None:
            op.error_model_ = models[name]
        self.add_variance = c == "enssum"
        self.uncertainty_selection_ = {"uncertainty": c, "error_model": name, "scalar": self._candidate(c)[1],
                                       "criterion": "worst1pct_flagged_at_budget, then flagged_share_needed",
                                       "scores": scores, "thresholds": thresholds, "n_rows": int(kl0.size)}
        return self

    def _candidate(self, uncertainty):
        """(what a threshold calibrates, its scalar) for an uncertainty of UNCERTAINTY_CHOICES."""
        if uncertainty == "enssum":
            return self.with_variance(True), "max"
        return self.operator, uncertainty

    def chosen_uncertainty(self):
        """``(model, scalar)`` after :meth:`choose_uncertainty`: the operator or this ensemble (with
        the spread added), and the scalar to pass to :func:`budget_threshold` /
        :func:`calibrate_threshold` and :meth:`row_uncertainty`."""
        sel = getattr(self, "uncertainty_selection_", None)
        if sel is None:
            raise ValueError("no uncertainty chosen yet: call choose_uncertainty() first")
        return self._candidate(sel["uncertainty"])

    def gated_rows(self, incoming: Mapping[str, Family]) -> np.ndarray:
        """The operator's (:meth:`KernelOperator.gated_rows`): every member gates the same rows to the same
        reference, so the ensemble answers them by it too."""
        return self.operator.gated_rows(incoming)

    def mean_belief(self, incoming: Mapping[str, Family]) -> Family:
        """The members' average prediction: the mean of their regressed coordinates, as a belief
        (clipped to the factor's bound as the operator's are)."""
        op = self.operator
        flat, shape = self._flat(incoming)
        rel = self.member_coords(flat).mean(axis=0)
        coords = op._from_relative(rel, op._base(flat)) if op.target == "relative" else rel
        return op._to_belief(coords, flat, shape)
