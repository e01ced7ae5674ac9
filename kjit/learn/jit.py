"""The just-in-time operator (SPEC §6): :class:`JITOperator` predicts when confident, else asks
its oracle and learns the answer; and the registry of the learned operators' state kinds."""

from __future__ import annotations

import json
import time
from typing import Mapping

import numpy as np

from ..certificates import Certificates, above_threshold, certified, outgoing_proper, projection_convention
from ..errors import ConfigurationError, check_number, rows_of_batch
from ..factors import get_factor
from ..families import Family, family_name
from ..protocols import Operator
from ..training import TrainingSet
from .kernel_operator import (KernelOperator, PredictionOverflowError, TargetsNotFiniteError, _named_rows,
                              _state_json, respect_factor_bounds, sign_undetermined)
from .calibration import calibrate_threshold, density_guard
from .consultation import greedy_consultations

__all__ = ["GUARD_SHARE", "INITIAL_BATCH_CAP", "INPUT_MARGIN", "JITOperator", "OPERATOR_KINDS", "SURPRISE_Z",
           "UNCERTAINTY_RULES", "guarded_jit"]

#: the share of in-distribution messages a trained operator's density guard flags (:func:`guarded_jit`)
GUARD_SHARE = 0.01
#: widths of the learned inputs' range beyond which a trained operator's message is outside them (:func:`guarded_jit`)
INPUT_MARGIN = 0.5

#: the threshold of a variance rule when none is given (the paper's synthetic experiments')
DEFAULT_THRESHOLD = -8.5
#: a consulted row whose oracle answer lies more than this many predictive sd from the regression's prediction is
#: answered and not learned (``JITOperator(learn_surprise_z=...)``): under a Gaussian error a calibrated regression's
#: rows exceed it in one of two coordinates with probability ~1.3e-4
SURPRISE_Z = 4.0
#: ... where the regression's latent variance at the row is at most this share of its prior variance there (a row
#: beyond the learned ones is not judged: learning it is what a just-in-time operator is for)
SURPRISE_PRIOR_SHARE = 0.01
#: what a JIT operator's threshold can apply to (``JITOperator(uncertainty=...)``)
UNCERTAINTY_RULES = ("predictive", "epistemic", "learned_kl")
_FINITE_MAX = float(np.finfo(np.float64).max)  # a budget threshold above every score (kept finite: persisted)
#: a row its reference answers outright (the factor's check of the reference passed: reference weight 1) is not
#: consulted for lying outside the data (density guard, input margin) within this many training-range widths of
#: the inputs, where the factor declares how far its check holds (``Factor.reference_check_holds``): its answer is
#: the reference's, checked, not the regression's.  Found: the service's default gaussian operators consulted every
#: message of normal_mean_precision's EP (an observed x lies beyond the margin of the default distribution) though
#: the reference answered 91 % of them outright.  Measured (forty-sixth session): adversarial searches of the
#: factors' default ranges widened by 2 widths each side, worst KL among rows estimated at most 1e-6: gaussian m / x
#: 1.8e-6 / 6.5e-6, product y / z 1.9e-6 / 1.5e-5 (at most 1e-4: up to 2.9e-3 — hence REFERENCE_OUTSIDE_ERROR); a
#: review's search through served operators over the region they spare (the margin is in each operator's own input
#: coordinates — gaussian's canonical frame — and scales with its training range): gaussian ≤ 2.8e-10, product
#: x / y / z 7.4e-7 / 2.6e-6 / 1.1e-5.  Such rows are not learned.
REFERENCE_MARGIN = 2.0
#: ... and whose check's estimate is at most this (squared error in the reference's units), with the sign of its
#: outgoing precision settled by it
REFERENCE_OUTSIDE_ERROR = 1e-6
_MAX_ROUNDS = 3  # greedy rounds per request; then every row still uncertain is consulted


def _plain(v):
    """A numpy scalar or array (in lists and tuples too) as the Python value JSON holds (``operator_kwargs``)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _saved_kwargs(kw: Mapping) -> dict:
    """``operator_kwargs`` as a saved JIT holds them: a Generator ``random_state`` (which a KernelOperator takes, and
    saves as None) as None."""
    rs = kw.get("random_state")
    return {**kw, "random_state": None} if isinstance(rs, np.random.Generator) else dict(kw)
INITIAL_BATCH_CAP = 4  # the initial fit waits for varied messages up to this many initial batches


class JITOperator(Operator):
    """Just-in-time operator (SPEC §6): predict when confident, else ask the oracle and learn.

    Parameters
    ----------
    operator : a fitted :class:`KernelOperator`, or None to start from nothing.
    oracle : the fallback (QuadratureOracle or ImportanceSamplingOracle) for the same factor.
    threshold : log predictive variance above which (in any output coordinate) a row is
        uncertain (with ``uncertainty="learned_kl"``: the predicted log KL above which it is — then
        required); [paper] −8.5 synthetic (the default), −8.95 UCI, −6 compound gamma.  Use
        :func:`calibrate_threshold` to derive it from a target KL on held-out pairs.  Each
        coordinate's variance is weighted first by how many times the predicted belief's KL curvature
        in it exceeds the learned one — beyond the fifth largest among the beliefs learned, or between
        learned concentrations (:meth:`KernelOperator.decision_log_weights`, :mod:`kjit.curvature`): 1 where
        learned (the paper's rule), more for a belief more concentrated than those learned, whose error
        costs more — a Gamma's log parameters' error moves its mean by √shape·δ sd.  ``predict``, its
        certificates and :meth:`screen` / :meth:`screen_certified` report the weighted log variance
        (the one the threshold applies to).
    initial_batch : with no operator, the first ``initial_batch`` messages go to the oracle;
        then the operator (widths, hyperparameters) is fitted once on them and takes over —
        provided the batch varies: at least ``initial_batch // 4`` of its rows must differ from
        its first row in every coordinate of every incoming message, else more messages are
        consulted until they do (at most ``INITIAL_BATCH_CAP`` × ``initial_batch`` in all).
        EP's first sweep sends messages that share a coordinate (before any site is updated
        every cavity mean is the prior's, 0); a width search on those has nothing to set the
        kernel's width along it by and can pick a degenerate kernel whose finite random-feature
        model is confident everywhere once it has seen more pairs than features — measured on
        jit_synthetic.py (initial batch = EP's first sweep of 300 messages): confident
        predictions with mean KL ≈ 78 on later problems and test-error gaps up to 0.07.  A
        request that completes the initial batch is split: the rows after it are answered by
        the freshly fitted operator.
    target_kl : if given, the threshold is derived from a target accuracy when the operator is
        first fitted from the initial batch: a quarter of the batch is held out of the fit, the
        threshold is set by :func:`calibrate_threshold` so that held-out predictions under it
        have mean KL[q ‖ q̂] ≤ target_kl (``threshold`` is kept if no value meets it), and the
        held-out pairs are then learned online.
    to : recipient variable (taken from ``operator`` when given).
    operator_kwargs : constructor arguments for the KernelOperator built after the initial batch.
    uncertainty : what the threshold is applied to.  "predictive" (default): the BLR's predictive
        variance ψᵀΣψ + σ_y² (the paper's rule).  "epistemic": ψᵀΣψ alone, the part that learning
        reduces — for a noisy oracle (importance sampling) the evidence sets σ_y² near the oracle's
        own error, and a threshold below that floor would consult every row forever (measured on
        the Poisson–Gamma JIT experiment of benchmarks/ep_models.py); a row then counts as known
        once the operator has seen enough like it, and its answer is as good as the oracle's.
        ``predict`` returns the log variance the rule used.  "learned_kl" (opt-in; issue 14 part 3):
        the operator's KL model (:meth:`KernelOperator.fit_kl_model`; required) — the row's predicted
        log KL (:meth:`KernelOperator.learned_log_kl`), thresholded at ``threshold`` in the KL's units
        (:func:`~kjit.learn.calibration.kl_model_threshold` gives one).  The KL model is fitted once and
        kept as the operator learns; it reads the operator's current prediction and variances, so a
        learned row's score moves with them (tests/test_kl_model.py: 17 of 200 rows consulted, then 1,
        then none), but a region the trees score high whatever is learned would be consulted each time
        (answered by the oracle, at its pace; no gate on the epistemic variance: with more pairs than
        features it is below the noise σ_y² on most fresh rows — 81 % in that test, where such a gate
        dropped 17 of the 54 rows the rule flags).  ``predict``,
        the certificates and :meth:`screen_certified` then report the predicted log KL in every
        coordinate's column (``log_var``: the quantity the threshold applies to; ``log_var_is_variance``
        is False, so the EP engine reads no spread from it); :meth:`screen` still the weighted log
        predictive variance.  Needs ``selection="all"`` (the greedy look-ahead
        is on variances).  Not served: the service's audit, threshold floor and clients read a threshold
        as a log variance, and its store refuses such an operator.
    selection : which uncertain rows of a request go to the oracle.  "greedy" (default): a few,
        picked by :func:`greedy_consultations` (most uncertain first) so that after learning
        them every row of the request is under the
        threshold — computable before the oracle is called, since the BLR posterior covariance
        does not depend on the answers; the remaining rows are answered by the updated operator
        and checked (up to 3 rounds, then every row still uncertain is consulted).  "all":
        every row that is uncertain before the request (the rule without look-ahead).
        Measured on jit_uci.py (seed 0): consultations after the first data set 218 → 91,
        JIT seconds on the last three sets 2.55 → 1.65, the same test errors.
    budget : a consultation budget instead of an absolute level (opt-in; issue 14 part 3): a row is
        uncertain only if its score — the largest coordinate of what the threshold applies to — is also
        among the top ``budget`` of the last ``budget_window`` scores, this request's included (the whole
        request where it is longer): the rule's threshold is then, request by request, the larger of
        ``threshold`` (a floor; None: none) and the budget's edge — the k-th largest of the m scores ranked,
        k = ⌊budget · m⌋ (``threshold`` reports it after a request; ``threshold_floor_`` keeps the floor).
        The rows consulted whatever the threshold (the outgoing precision's sign, the density guard, a NaN
        score, ``budget_level``) count as the top scores.  A fixed threshold calibrated on other problems flags a new set of problems' rows
        by how far those problems lie from the calibration's (benchmarks/factor_suite.py: even each row's
        exact KL as the score, a threshold at budget975p met both goals of issue 14 part 3 on 135 and 126 of
        140 test sets); ranked, a request at least ``budget_window`` long has at most ``budget`` of its rows
        consulted (the rows consulted anyway rank first: those alone where they exceed it; rows tied at the
        edge are taken in order, this request's before earlier ones), and its worst rows are caught as well
        as the score ranks them.  Over a stream of shorter requests each is ranked against the recent scores
        when it comes, which alone does not bound the share consulted (benchmarks/jit_kl_model.py
        ``--budget``, without the credit: 7.8–11.2 % at 0.1 in EP); the credit (``budget_credit``) does, but
        for the rows consulted anyway.  The price: a window of rows that are all near exact still has its
        top ``budget`` consulted (``threshold`` as a floor stops that).  :meth:`screen` ranks as
        :meth:`predict` would, without keeping the scores or moving ``threshold`` (``screened_threshold_``:
        the one it ranked by).  Needs ``selection="all"`` and no ``target_kl`` (its calibration is of a
        fixed threshold); not served (the service's audit reads a fixed threshold).  None (default): the
        fixed threshold alone.
    budget_window : how many recent scores the budget ranks a request's rows among (default 1000).
    budget_credit : with a budget, bound the share consulted over the operator's life (opt-in): of the m
        rows ranked so far, this request's included, at most ⌊budget · m⌋ are consulted — a request's ranked
        rows take the places its and earlier requests left unspent, highest score first (ties in row order);
        the rows consulted anyway (sign test, density guard, ``budget_level``, a NaN score) take theirs
        first, all of them, and may overdraw the credit, which later requests then repay.  Quiet requests
        save places for a burst of new messages (a new problem's first sweeps), up to the window's rank.  A
        request ranked alone (the first, or one longer than the window) is unchanged by it, unless an
        overdraft is still being repaid.  A row the credit refuses is answered learned, and ``threshold`` is
        raised to its score, so the certificates rate what the rule did (no row answered learned lies above
        it).  The ledger (``budget_rows_``, ``budget_consulted_``) starts when the operator is fitted and is
        saved with it.  Measured in EP (benchmarks/jit_kl_model.py, seeds 0–4, the learned KL at 0.1): it
        holds every direction's share ≤ 10 % (the rank alone: over 10 % on 16 of 35 (factor, seed) pairs)
        but catches less — both goals of issue 14 part 3 on 9 of 35 pairs against the rank alone's 11,
        learned answers above KL e^-10 5 007 against 1 360, the largest 26 against 0.065: a burst the credit
        cannot pay for goes unlearned, so the operator stays wrong for longer.  For a hard cap on the
        oracle's cost, not for accuracy.  False (default): the rank alone.
    budget_level : with a budget, a score above which a row is consulted whatever its rank or the credit, as
        the sign test's rows are (they rank first and spend the credit): a fixed threshold the budget tops
        up.  Measured in EP (benchmarks/jit_kl_model.py ``learned_kl_topup``: the learned KL's budget975p
        threshold as the level, ``budget_credit=True``, budget 0.1) against that threshold alone: both goals
        of issue 14 part 3 on 18 → 19 of 35 (factor, seed) pairs at seeds 0–4 and 14 → 16 at fresh seeds
        5–9, per direction 28 → 30 and 22 → 33 of 50; learned answers above KL e^-10 2 752 → 1 228 and 9 578
        → 7 813; but shares over 10 % on 2 → 8 and 1 → 4 pairs (the level's rows overdraw a credit the rank
        has spent; up to 12.4 %).  None (default): none.
    learn_above_kl : learn a consulted row only where the operator's prediction for it was wrong by more
        than this: KL[oracle's answer ‖ prediction] > ``learn_above_kl`` (opt-in).  The answer is the
        oracle's either way; a row the operator already predicted within it is not learned — learning it
        changes nothing EP needs, yet moves every nearby prediction a little (each update fits its row
        and shifts the rest).  With ``uncertainty="learned_kl"`` this keeps the rule honest: the KL model
        was fitted on the errors of the operator as it was, and an operator that learns near-exact rows
        makes new errors at rounding level that the model cannot rank — measured in EP
        (benchmarks/jit_kl_model.py ``learned_kl_gated``, at e^-10, against the same threshold learning every
        consulted row): both goals of issue 14 part 3 on 18 → 21 of 35 (factor, seed) pairs at seeds 0–4
        and 14 → 23 at fresh seeds 5–9, per direction 28 → 37 and 22 → 36 of 50, for 15 % and 45 % more
        rows consulted; with ``float("inf")`` (``learned_kl_static``: no row learned) 29 and 30 of 35, per
        direction 40 and 44 of 50, for 20 % and 54 % more rows consulted, and fewer learned answers above KL
        e^-10 (1 226 and 3 881 against 2 752 and 9 578) — on product and gaussian the rows the gate still
        learns lower their own later scores the same way.  A row not learned keeps its score (with a
        variance rule, its variance), so it is consulted again when it returns; ``selection="greedy"``
        consults more rows, its look-ahead assuming they are learned, and its later rounds compare with the
        operator as the earlier rounds left it.  An oracle's answer is compared as it comes: a sampling
        oracle's noise counts as error.  The initial batch of a JIT started without an operator is learned
        whole.  ``float("inf")``: the operator stays as fitted but for a consulted row whose prediction was
        no belief (or whose KL is not a number), which is learned.  None (default): every consulted row is
        learned (unless it lies far outside the learned range, or outside the data: :meth:`outside_rows`).
    learn_surprise_z : do not learn a consulted row whose oracle answer lies more than this many of the
        regression's predictive standard deviations from its prediction, in any regressed coordinate (the
        regression's own standardised space, as the operator stood before learning the row), where the learned
        rows claim the region — its latent variance at most :data:`SURPRISE_PRIOR_SHARE` of the prior's (a row
        beyond the data is learned as before: that is what a just-in-time operator is for).  The answer is the
        oracle's, and the row, not learned, stays uncertain.  Such a row says the regression's variance does not
        describe its error there — its features cannot represent the target at the noise level the evidence
        chose — and learning it shrinks the variance around it without a fit that holds between the rows learned
        (found by an audit, forty-second session: a JIT started from nothing on ``probit_noise`` → f, 1 000
        default pairs then 8 × 500 default messages, learned 68 consulted exact answers and its confident answers
        on 3 000 fresh default messages went from mean KL 1.9e-4 (largest 0.058) to 1.19 (largest 417, 218 rows
        above 0.1), its own standardised errors from median 0.21 to 0.56 sd (p99 4.1 → 15.9) — exactly as a refit
        with the same hyperparameters; a refit by evidence on the same pairs was calibrated again (0.18, 3.5).
        With the gate (4 sd, a hundredth of the prior) it learned 30 rows and held back 160: confident mean KL
        0.011, largest 12, 25 rows above 0.1 — judged everywhere, not only where the rows claim the region, 2
        learned, mean 2.6e-4, largest 0.12, but a JIT then stops learning far rows whose targets lie beyond
        its prior.  Elsewhere, same runs: logistic x none held back; compound_gamma τ 19 (mean KL 8.4e-10 →
        7.8e-10), exp x 27 (2.4e-11 → 9.5e-12), gamma_rate r 4 (7.4e-15 → 3.5e-15), product z 4 (3.5e-5 →
        3.4e-5), product x 20 (1.7e-5 → 1.3e-5; largest 0.012 → 0.0057); ``benchmarks/jit_uci.py``'s
        consultations and test errors unchanged.)  Opt-in: a precise operator (300 logistic x pairs, a threshold
        near −16) answered by :class:`~kjit.oracles.MessageImportanceSampler` held back 37 of 40 consulted rows
        (the sampler's Monte Carlo error exceeds the regression's sd), so a JIT that learns to consult less would
        consult on; and with the exact oracle it stops a JIT learning a region its traffic drifts to (forty-third
        session: a logistic → x operator of 400 pairs at means in ±3 sent 5 × 40 messages at means 4–6: once its
        first rows there are learned the region counts as claimed, and 103 of the 200 were held back — far mean
        KL 1.8e-4 against 1.8e-6 learning every row, inside 8.0e-7 against 1.7e-6) — measure before making it a
        default.  Counted in ``consultations_surprising``.  None (default): every
        consulted row is learned; :data:`SURPRISE_Z` is the value measured.
    density_guard : also consult a row whose :meth:`KernelOperator.density` (mean kernel value to
        the learned rows) is below this value, whatever its variance — a row far from every
        training row can have a small predictive variance and an arbitrary prediction (see
        :meth:`KernelOperator.density`).  The guard is held as a count: the value times the pairs
        learned when it was set (``guard_rows_``), compared with the row's density times the pairs
        learned now — so learning rows elsewhere does not, in expectation, make a row sparser (the
        random features' kernel estimate between far rows scatters about 0, negative as often as
        positive: many far rows learned can lower a row's count, and guard it — see
        :meth:`KernelOperator.density`).  Such a row is answered by the oracle (unless the factor's checked
        reference answers it outright: see ``input_margin``) and not learned (:meth:`outside_rows`):
        learning rows outside the data moves the predictions everywhere while every
        variance stays small (fortieth session, one served default logistic → x operator shared by 24
        logistic-regression EP runs at prior variances 1e2–1e6: learning them took its posteriors from
        within 0.005 sd of exact EP to 0.1–2.7 sd off, no message flagged; the guard kept every run within
        9.3e-4 sd).  None (default): no guard.  :func:`density_guard` derives one from a share of
        in-distribution messages; the service's training sets one (``service.training.GUARD_SHARE``).
    guard_share : with no operator, set ``density_guard`` when the operator is fitted from the
        initial batch: :func:`density_guard` with this share of the batch's rows, each left out
        with its request's rows (a request of EP is a sweep, whose rows are distinct messages; the
        batch's rows are learned too) — a share of the batch's messages, not of later traffic.
        None (default): keep ``density_guard``.
    input_margin : also consult, and do not learn, a row whose incoming messages have a coordinate
        (``Family.to_coords``: a Gaussian's mean and log variance, a Beta's or a Gamma's log parameters)
        beyond the range of the pairs the operator was fitted on by more than this many times its width
        (:meth:`KernelOperator.inputs_outside`; learning online does not widen that range).  The density guard
        does not see such rows: a Gaussian message 100× wider than any learned has a mean embedding near
        the learned ones' (measured, fortieth session, a logistic → x operator of 300 pairs at cavity
        variances 0.1–3: 150 messages at variances 300–3e4 none below a 1 % density guard; learning them
        took the in-distribution mean KL from 1.8e-6 to 4.4e-3, its largest 1.7e-4 → 0.43, every log
        variance still below −10; at variances 6–30, learning them did no harm).  None (default): no
        margin; the service's training sets ``service.training.INPUT_MARGIN``.  Neither this nor the density
        guard consults a row the factor's checked reference answers outright (within :data:`REFERENCE_MARGIN`
        widths, its estimate at most :data:`REFERENCE_OUTSIDE_ERROR`, where the factor declares
        ``reference_check_holds``): its answer is not the regression's.  Such rows are not learned either.
    kl_cap : also consult a row whose own predictive variances (with a sampling oracle their epistemic part: the
        regression's noise taken out, which its answers do not settle) imply an expected KL above this — the least
        over every correlation of the coordinates' errors, at the predicted belief
        (:meth:`~kjit.families.Family.least_expected_kl`, the row's second-order KL in its own curvature):
        a row whose uncertainty, in the KL's units, exceeds what its answers may cost cannot be confident,
        whatever the threshold calibrated on the mean of other rows admits.  The threshold compares log
        variances weighted by a row's curvature only relative to the learned rows'; a belief as concentrated
        as the most concentrated learned ones, whose error of one sd costs thousands of times more KL than a
        typical row's, passes it.  Found by an audit (forty-fifth session; the service's default operators,
        3 000 fresh default messages each against the exact rule): probit_noise → f answered 11 rows above
        KL 0.1 confidently in mode=predict (largest 0.88) and 3 above 1 in mode=jit (largest 4.4) — a label
        contradicting a narrow message, the belief ~60× narrower; product → z answered up to 0.107 where its
        own variance implied ~0.03.  Such a row is consulted and learned (it lies inside the data).  None
        (default): no cap; the service's training sets ``service.training.KL_CAP``.

    Counters (``counters()``): calls, requests (messages), consultations (messages sent to the
    oracle), of them ``consultations_outside`` (messages outside the data, :meth:`outside_rows`: answered,
    not learned — a share near the consultation rate says the traffic lies beyond what the operator was
    trained on) and ``consultations_surprising`` (answers beyond ``learn_surprise_z`` of the prediction: not
    learned — a large share says the regression's variance misjudges its error: fit it again on more pairs),
    seconds in prediction, in the oracle, in updates and in the initial fit.
    """

    def __init__(self, operator: KernelOperator | None, oracle, threshold: float | None = None,
                 initial_batch: int = 300, to: str | None = None, operator_kwargs: Mapping | None = None,
                 target_kl: float | None = None, selection: str = "greedy", uncertainty: str = "predictive",
                 density_guard: float | None = None, guard_share: float | None = None,
                 budget: float | None = None, budget_window: int = 1000, budget_credit: bool = False,
                 budget_level: float | None = None, learn_above_kl: float | None = None,
                 input_margin: float | None = None, learn_surprise_z: float | None = None,
                 kl_cap: float | None = None):
        if uncertainty not in UNCERTAINTY_RULES:
            raise ValueError(f"`uncertainty` must be one of {UNCERTAINTY_RULES}, got {uncertainty!r}")
        self.uncertainty = uncertainty
        if selection not in ("greedy", "all"):
            raise ValueError(f"`selection` must be 'greedy' or 'all', got {selection!r}")
        self.selection = selection
        if uncertainty == "learned_kl":
            if getattr(operator, "kl_model_", None) is None:
                raise ValueError("`uncertainty`='learned_kl' needs an operator with a KL model "
                                 "(KernelOperator.fit_kl_model)")
            if selection != "all":
                raise ValueError("`uncertainty`='learned_kl' needs `selection`='all' (the greedy look-ahead "
                                 "is on the predictive variance)")
        if operator is None and to is None:
            raise ValueError("`to` is required when starting without an operator")
        if operator is not None and to is not None and to != operator.to:
            raise ValueError(f"`to`={to!r} contradicts the operator's recipient {operator.to!r}")
        if not callable(getattr(oracle, "belief", None)) or getattr(oracle, "factor", None) is None:
            raise ValueError(f"`oracle` must be an oracle of the factor (with belief(incoming, to) and a factor), got "
                             f"{type(oracle).__name__}")
        self.factor = oracle.factor
        self.to = self.factor.check_to(operator.to if operator is not None else to)
        if operator is not None:
            if operator.to != self.to:
                raise ValueError("`operator` and `oracle` are for different factors or directions")
            self.factor.check_same(operator.factor, "`operator`", "`oracle`")
        if budget is not None:
            check_number("budget", budget, 0.0, 1.0, low_open=True, high_open=True)
            check_number("budget_window", budget_window, 1, integer=True)
            if selection != "all":
                raise ValueError("`budget` needs `selection`='all' (the greedy look-ahead aims at a fixed threshold)")
            if target_kl is not None:
                raise ValueError("`budget` and `target_kl` exclude each other (target_kl calibrates a fixed threshold)")
            if threshold is None:
                threshold = -_FINITE_MAX  # (no floor: the budget alone)
        self.budget = None if budget is None else float(budget)
        self.budget_window = int(budget_window)
        if not isinstance(budget_credit, (bool, np.bool_)):
            raise ValueError(f"`budget_credit` must be True or False, got {budget_credit!r}")
        if budget_credit and budget is None:
            raise ValueError("`budget_credit` needs a `budget` (it bounds the budget's share)")
        self.budget_credit = bool(budget_credit)
        if budget_level is not None:
            if budget is None:
                raise ValueError("`budget_level` needs a `budget` (it is the level the budget tops up)")
            check_number("budget_level", budget_level)
        self.budget_level = None if budget_level is None else float(budget_level)
        if isinstance(learn_above_kl, np.ndarray) and learn_above_kl.ndim == 0:
            learn_above_kl = learn_above_kl.item()
        if learn_above_kl is not None and not (isinstance(learn_above_kl, (float, np.floating))
                                               and learn_above_kl == np.inf):
            try:
                check_number("learn_above_kl", learn_above_kl, 0.0)
            except ValueError as exc:
                raise ValueError(f"{exc} (or inf: learn no row)") from None
        self.learn_above_kl = None if learn_above_kl is None else float(learn_above_kl)
        self.learn_surprise_z = None if learn_surprise_z is None else check_number(
            "learn_surprise_z", learn_surprise_z, 0.0, low_open=True)
        self.budget_scores_ = np.zeros(0)  # the last budget_window scores (with a budget)
        # the credit's ledger: rows the budget has ranked and rows it has consulted (ints: exact)
        self.budget_rows_, self.budget_consulted_ = 0, 0
        self.screened_threshold_ = None  # the threshold the last screen ranked by (with a budget)
        if threshold is None:  # the paper's synthetic value, in log-variance units
            if uncertainty == "learned_kl":
                raise ValueError("`threshold` is required with `uncertainty`='learned_kl' (a log KL: "
                                 "kjit.operators.kl_model_threshold gives one)")
            threshold = DEFAULT_THRESHOLD
        threshold = check_number("threshold", threshold)  # (a string was numpy's TypeError: found by an audit)
        initial_batch = check_number("initial_batch", initial_batch, 2, integer=True)  # (2.5 ran as 2: audit)
        if target_kl is not None and not (np.isfinite(target_kl) and target_kl > 0):
            raise ValueError("`target_kl` must be a positive number")
        self.target_kl = None if target_kl is None else float(target_kl)
        if density_guard is not None and not (  # (a string met numpy's TypeError: audit; −inf is no guard)
                isinstance(density_guard, (int, float, np.integer, np.floating)) and not isinstance(density_guard, bool)
                and not np.isnan(density_guard)):
            raise ValueError(f"`density_guard` must be a number or None, got {density_guard!r}")
        self.density_guard = None if density_guard is None else float(density_guard)
        if self.density_guard is not None and operator is not None and operator.blr_.x_sum_ is None:
            raise ValueError("`density_guard` needs an operator whose regression keeps its column sums "
                             "(this one was restored from a state saved before they were kept)")
        self.guard_rows_ = operator.n_train_ if operator is not None else None
        if input_margin is not None and not (np.isfinite(input_margin) and input_margin >= 0):
            raise ValueError("`input_margin` must be a number >= 0 or None")
        self.input_margin = None if input_margin is None else float(input_margin)
        self.kl_cap = None if kl_cap is None else check_number("kl_cap", kl_cap, 0.0, low_open=True)
        if guard_share is not None and not 0.0 < guard_share < 1.0:
            raise ValueError("`guard_share` must lie in (0, 1)")
        self.guard_share = None if guard_share is None else float(guard_share)
        self.operator = operator
        self.oracle = oracle
        self.threshold = float(threshold)
        self.threshold_floor_ = self.threshold
        self.initial_batch = int(initial_batch)
        self.operator_kwargs = {k: _plain(v) for k, v in dict(operator_kwargs or {}).items()}
        if "dtype" in self.operator_kwargs:  # keep the kwargs JSON-serialisable for state_dict
            self.operator_kwargs["dtype"] = np.dtype(self.operator_kwargs["dtype"]).name
        try:  # (found by an audit: numpy values learned normally, then the JIT could not be saved)
            json.dumps(_saved_kwargs(self.operator_kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`operator_kwargs` must be plain values a saved operator can hold (numbers, text, "
                             f"lists; {exc})") from None
        self.family = self.factor.families[self.to]
        self._pending: list[tuple[dict, Family]] = []
        self._n_pending = 0
        self._undo = None
        self._keep_undo = False
        self._oracle_certs: list = []  # (rows of the request, certificates) of this request's oracle answers
        self.last_learned_groups_: list = []  # rows each partial_fit of the last request learned
        self._counts = {"calls": 0, "requests": 0, "consultations": 0, "updates": 0, "consultations_outside": 0,
                        "consultations_surprising": 0,
                        "seconds_predict": 0.0, "seconds_oracle": 0.0, "seconds_update": 0.0,
                        "seconds_initial_fit": 0.0}

    @property
    def log_var_is_variance(self) -> bool:
        """Whether :meth:`predict`'s log variance is one (:func:`kjit.protocols.log_var_is_variance`):
        not with ``uncertainty="learned_kl"``, whose column holds the predicted log KL — the EP engine
        then compares it with the threshold but takes no spread from it."""
        return self.uncertainty != "learned_kl"

    def __repr__(self):
        return f"JITOperator({self.factor.name}→{self.to}, threshold={self.threshold}, fitted={self.operator is not None})"

    def raw_counters(self) -> dict:
        """The stored counters (no derived values): what :meth:`set_counters` accepts."""
        return dict(self._counts)

    def set_counters(self, counts: Mapping) -> None:
        """Restore counters (e.g. replayed from a log); unknown keys are a ValueError."""
        unknown = set(counts) - set(self._counts)
        if unknown:
            raise ValueError(f"unknown counter(s) {sorted(unknown)}")
        for k, v in counts.items():
            self._counts[k] = type(self._counts[k])(v)

    def counters(self) -> dict:
        c = dict(self._counts)
        c["consultation_rate"] = c["consultations"] / c["requests"] if c["requests"] else 0.0
        c["n_train"] = self.operator.n_train_ if self.operator is not None else self._n_pending
        return c

    def _oracle_beliefs(self, incoming, positions):
        """The oracle's beliefs for a sub-batch; ``positions``: its rows' places in the request,
        so that a LowESSError names the failing rows of the *request* (the EP engine skips
        exactly those and asks again for the rest)."""
        from ..oracles import LowESSError

        t = time.perf_counter()
        try:
            q, cert = certified(self.oracle, incoming, self.to, unknown_source="oracle")
        except LowESSError as exc:
            raise LowESSError(np.asarray(positions)[exc.rows], exc.ess, exc.min_ess) from exc
        except Exception as exc:  # any other error naming rows (the exact rule's OracleError): the request's
            if getattr(exc, "rows", None) is not None:
                raise rows_of_batch(exc, positions)
            raise
        finally:
            self._counts["seconds_oracle"] += time.perf_counter() - t
        # a sampled (or round-off) answer on the wrong side of the factor's bound is moved onto
        # it: strictly closer to the truth, and what is learned is what is returned
        flat = {v: m.ravel() for v, m in incoming.items()}
        self._oracle_certs.append((np.asarray(positions), cert))
        return respect_factor_bounds(self.factor, self.to, flat, q.ravel())[0].reshape(q.shape)

    def _certify(self, q, logvar, consulted, flat):
        """The certificates of an answer: learned rows with their log predictive variance and the
        threshold, consulted rows with their oracle's certificates (ESS, standard errors)."""
        n = len(consulted)
        lv = np.reshape(logvar, (n, -1))
        source = np.full(n, "learned", dtype=object)
        ess, se = np.full(n, np.nan), np.full(lv.shape, np.nan)
        for pos, c in self._oracle_certs:
            source[pos], ess[pos], se[pos] = c.source, c.ess, c.mc_se
        qf = q.ravel()
        cert = Certificates(source, self.family.coord_names, log_var=lv, threshold=self.threshold, ess=ess,
                            mc_se=se, projection=projection_convention(self.factor),
                            proper=outgoing_proper(qf, flat[self.to]),
                            version=self.operator.n_train_ if self.operator is not None else self._n_pending)
        cert.of = q
        return cert

    def _check_to(self, to):
        if to is not None and to != self.to:
            raise ConfigurationError(f"this operator sends messages to {self.to!r}, not `to`={to!r}")

    def predict(self, incoming: Mapping[str, Family], to: str | None = None, revertible: bool = False):
        """Belief, log predictive variance (n, k) and the mask of rows the oracle answered.

        During the initial phase (no operator yet) every row is consulted and the log
        variance is NaN (a request that completes the initial batch: its first rows); after
        that it is the operator's value that decided the row — before the consultation for
        consulted rows, after learning this request's consulted rows for the others that were
        uncertain before (``selection="greedy"``).  A request is atomic: if an oracle call
        raises, the exception propagates and the operator, its initial batch and the counters
        are left as they were.

        ``revertible=True`` keeps, in ``revert_last_``, a callable that undoes what this request learned and
        counted — the service's replicas call it when another replica's update took the place
        in the shared log this request's update was to have (and then ask again).
        """
        return self._predict_certified(incoming, to, revertible)[0]

    def certified(self, incoming: Mapping[str, Family], to: str | None = None, revertible: bool = False):
        """``(belief, Certificates)``: :meth:`predict`'s answer with its certificates (consulted rows:
        the oracle's source, ESS and standard errors; the others: learned, with their log
        predictive variance and the threshold).  Also kept in ``last_certificates_``."""
        (q, _, _), cert = self._predict_certified(incoming, to, revertible)
        return q, cert

    def _predict_certified(self, incoming, to, revertible):
        saved = dict(self._counts)
        saved_budget = (self.threshold, self.budget_scores_, self.budget_rows_,
                        self.budget_consulted_)  # (replaced, never changed in place)
        self._undo = None  # set before anything is learned that a later oracle call could void
        self._keep_undo = bool(revertible)
        self._oracle_certs = []
        try:
            out = self._predict(incoming, to)
            cert = self._certify(out[0], out[1], np.asarray(out[2]).reshape(-1), {self.to: self._request_to})
            self.last_certificates_ = cert
            out = (out, cert)
            if revertible:
                undo = self._undo

                def revert():
                    if undo is not None:
                        undo()
                    self._counts.clear()
                    self._counts.update(saved)
                    (self.threshold, self.budget_scores_, self.budget_rows_,
                     self.budget_consulted_) = saved_budget

                self.revert_last_ = revert
            return out
        except BaseException:
            self._counts.clear()
            self._counts.update(saved)
            self.threshold, self.budget_scores_, self.budget_rows_, self.budget_consulted_ = saved_budget
            if self._undo is not None:
                self._undo()
            raise
        finally:
            self._undo = None
            self._keep_undo = False
            self._oracle_certs = []

    def screen(self, incoming: Mapping[str, Family], to: str | None = None):
        """The fitted operator's answer and the rows :meth:`predict` would send to the oracle, without
        consulting or learning: ``(belief, log predictive variance (…, k) weighted as the rule weighs
        it (see ``threshold``), uncertain mask)``.  The mask is this operator's rule — the threshold on
        the variance its ``uncertainty`` names, an outgoing message whose precision's sign is undetermined,
        or a message outside the data (:meth:`outside_rows`: below the density guard, beyond the input
        margin) that the factor's checked reference does not answer outright (:data:`REFERENCE_MARGIN`) — so a
        client whose oracle runs elsewhere (a served operator's ``mode=predict``) consults
        exactly the rows ``predict`` with ``selection="all"`` would."""
        q, var, _, uncertain, _, logw = self._screen(incoming, to)
        return q, np.log(var) + logw.reshape(var.shape), uncertain

    def screen_certified(self, incoming: Mapping[str, Family], to: str | None = None, version: int | None = None):
        """:meth:`screen` with the answer's certificates instead of the bare log variance:
        ``(belief, Certificates (learned, with the threshold), uncertain mask)``; the certificates'
        ``log_var`` is the one the threshold applies to (see ``uncertainty``), as in :meth:`certified`.
        ``version``: the certificates' version (default: the pairs the operator has learned)."""
        q, _, decision, uncertain, flat, _ = self._screen(incoming, to)
        # rated on the variance the threshold applies to, as predict's certificates are (the
        # epistemic part with uncertainty="epistemic": the predictive one never falls below the
        # noise floor, though the rule stops consulting there); the rows the rule would consult
        # for another reason (the outgoing precision's sign, the density guard) are flagged: never
        # confident (found by an audit: guarded rows, KL up to 0.05, were certified confident)
        thr = self.threshold if self.budget is None else self.screened_threshold_  # (the one it ranked by)
        flagged = np.asarray(uncertain, bool).reshape(-1) & ~above_threshold(decision, thr)
        cert = self.operator._certify(q, decision, flat, threshold=thr, version=version, flagged=flagged)
        return q, cert, uncertain

    def _screen(self, incoming, to):
        """``(belief, predictive variance, log of the variance the threshold applies to, weighted (n, k),
        uncertain mask, flat incoming messages, the log weights (n, k))``."""
        self._check_to(to)
        if self.operator is None:
            raise ValueError("no operator yet: the initial batch goes to the oracle")
        op = self.operator
        (coords, var, psi, logw, base, gate), flat, shape = op._predict_coords(
            incoming, return_var=True, return_features=True, return_weights=True, return_base=True, return_gate=True)
        q = op._to_belief(coords, flat, shape)
        k = coords.shape[-1]
        c2, v2 = coords.reshape(-1, k), var.reshape(-1, k)
        decision = self._decision(flat, c2, v2, logw)
        uncertain = self._uncertain(flat, c2, decision, psi, var=v2, budget="rank", base=base, gate=gate)
        return q, var, decision, uncertain.reshape(shape), flat, logw

    def _restore_initial(self, pending, n_pending, threshold, guard, guard_rows):
        self.operator = None
        self._pending, self._n_pending, self.threshold = pending, n_pending, threshold
        self.density_guard, self.guard_rows_ = guard, guard_rows

    def _predict(self, incoming, to):
        self._check_to(to)
        self.last_learned_groups_ = []
        flat, shape = self.factor.flat_incoming(incoming, self.to)
        self._request_to = flat[self.to]
        n = next(iter(flat.values())).size
        self._counts["calls"] += 1
        self._counts["requests"] += n
        if self.operator is None:
            # initial phase: the oracle answers until the initial batch is complete; if the
            # request is longer, the operator is fitted and answers the remaining rows
            k = len(self.family.coord_names)
            start = self._initial_rows(flat)
            head = flat if start == n else {v: m[:start] for v, m in flat.items()}
            q = self._oracle_beliefs(head, np.arange(start))
            self._counts["consultations"] += start
            state = (list(self._pending), self._n_pending, self.threshold, self.density_guard, self.guard_rows_)
            self._undo = lambda: self._restore_initial(*state)
            n_before = self._n_pending
            try:
                self._learn_initial(head, q)
            except Exception as exc:
                # the initial fit's rows are the pending pairs': earlier requests' first, then this one's
                # head — named as this request's, or not at all where an earlier request's row is named
                # (found in review: row 25 of the fit for the request's row 5)
                r = getattr(exc, "rows", None)
                if r is not None:
                    try:
                        r = np.asarray(r, dtype=int).ravel()
                        exc.rows = r - n_before if r.size and r.min() >= n_before else None
                    except (TypeError, ValueError, AttributeError):
                        pass
                raise
            if start == n:
                return q.reshape(shape), np.full(shape + (k,), np.nan), np.ones(shape, dtype=bool)
            q_t, lv_t, c_t = self._answer({v: m[start:] for v, m in flat.items()}, offset=start)
            q = self.family.concatenate([q, q_t])
            lv = np.concatenate([np.full((start, k), np.nan), lv_t])
            consulted = np.concatenate([np.ones(start, dtype=bool), c_t])
            return q.reshape(shape), lv.reshape(shape + (k,)), consulted.reshape(shape)
        q, lv, consulted = self._answer(flat)
        return q.reshape(shape), lv.reshape(shape + lv.shape[-1:]), consulted.reshape(shape)

    def _answer(self, flat, offset=0):
        """The fitted operator's answer for flat incoming messages (see :meth:`predict`)."""
        n = next(iter(flat.values())).size
        t = time.perf_counter()
        coords, var, psi, logw, base, gate = _named_rows(offset + np.arange(n), self._coords_and_base, flat)
        var = np.array(var)  # (its rows are brought up to date as the operator learns)
        logvar = self._decision(flat, coords, var, logw)
        self._counts["seconds_predict"] += time.perf_counter() - t
        uncertain = self._uncertain(flat, coords, logvar, psi, var=var, budget="commit", base=base, gate=gate)
        consulted = np.zeros(n, dtype=bool)
        answers = []  # (row indices, oracle beliefs, the rows of them learned)
        rounds = 0
        while uncertain.any():
            rows = np.flatnonzero(uncertain)
            if self.selection == "greedy" and rounds < _MAX_ROUNDS:
                op = self.operator
                # per row, the latent-variance limit equivalent to the threshold on the largest
                # weighted coordinate; 0.99: a margin for the float32 prediction path
                with np.errstate(all="ignore"):
                    limit = 0.99 * np.exp(self.threshold) / np.max(np.exp(logw[rows]) * op.y_scale_ ** 2, axis=-1)
                limit = np.where(np.isnan(limit), -np.inf, limit)  # (no weights: consulted)
                if self.uncertainty == "predictive":
                    limit -= op.noise_var_
                t = time.perf_counter()
                pick = greedy_consultations(psi[rows], op.blr_.Sigma_, op.noise_var_, limit)
                # learned in row order, like "all"
                idx = np.sort(rows[pick]) if pick.size else rows
                sub = {v: m[rows] for v, m in flat.items()}
                checked = self._checked_outright(gate[rows], var[rows], sub, coords[rows])
                outside = self._outside(sub, psi[rows], checked)
                if outside is not None and outside.any():  # whatever their variance
                    idx = np.union1d(idx, rows[outside])
                # (a row above kl_cap that the picks leave out is checked again once they are learned, as the
                # others are: learning one of two identical rows brings the other under the cap too)
                self._counts["seconds_predict"] += time.perf_counter() - t
            else:
                idx = rows
            sub = {v: m[idx] for v, m in flat.items()}
            q_or = self._oracle_beliefs(sub, offset + idx)
            self._counts["consultations"] += idx.size
            consulted[idx] = True
            # a pair far outside the learned range is answered by the oracle but not learned: it
            # would move every prediction (LEARN_RANGE_FACTOR); nor is one whose messages lie outside
            # the data (the density guard, the input margin: learning them poisons the operator)
            learn = ~self.operator.out_of_range_rows(sub, q_or)
            outside = self._outside(sub, psi[idx])
            if outside is not None:
                learn &= ~outside
                self._counts["consultations_outside"] += int(outside.sum())
            if self.learn_above_kl is not None:
                learn &= ~self._near_exact(coords[idx], sub, q_or)
            if self.learn_surprise_z is not None and learn.any():
                surprising = learn & self._surprising(psi[idx], sub, q_or)
                self._counts["consultations_surprising"] += int(surprising.sum())
                learn &= ~surprising
            answers.append((idx, q_or, idx[learn]))
            if not learn.all():
                sub, q_or = {v: m[learn] for v, m in sub.items()}, q_or[learn]
            t = time.perf_counter()
            if self._undo is None and (self.selection == "greedy" or self._keep_undo):
                # a later round's oracle call may fail: keep what to restore (atomic request)
                self._undo = self.operator.online_undo()
            try:
                if learn.any():
                    self.operator.partial_fit(sub, q_or)
            except TargetsNotFiniteError as exc:  # rows of the learned sub-batch: name the request's
                rows = (offset + idx[learn])[exc.rows]
                raise TargetsNotFiniteError(f"the oracle's beliefs for rows {rows[:10].tolist()}"
                                            f"{'…' if rows.size > 10 else ''} cannot be learned: their regression "
                                            "targets are not finite (too far from their reference)", rows=rows) from None
            self._counts["seconds_update"] += time.perf_counter() - t
            self._counts["updates"] += int(learn.sum())
            rest = np.flatnonzero(uncertain & ~consulted)
            uncertain[:] = False
            if rest.size:
                # rows left uncertain before this round: answered by the updated operator, if
                # it is now confident about them (checked, not assumed)
                t = time.perf_counter()
                flat_rest = {v: m[rest] for v, m in flat.items()}
                c2, v2, p2, w2, b2, g2 = _named_rows(offset + rest, self._coords_and_base, flat_rest)
                self._counts["seconds_predict"] += time.perf_counter() - t
                coords[rest], logvar[rest], psi[rest], logw[rest] = c2, self._decision(flat_rest, c2, v2, w2), p2, w2
                var[rest] = v2
                gate[rest] = g2
                uncertain[rest] = self._uncertain(flat_rest, c2, logvar[rest], p2, var=v2, base=b2, gate=g2)
            rounds += 1
        # the rows learned by each partial_fit, in order: replaying the pairs group by group
        # reproduces the operator bit for bit (the service's update log does)
        self.last_learned_groups_ = [offset + learned for _, _, learned in answers if learned.size]
        # (the consulted rows' learned coordinates are replaced below: they need not be a belief — found
        # by an audit, a row whose prediction overflowed failed the request though the oracle answered it)
        q_hat = _named_rows(offset + np.arange(n), self.operator._to_belief, np.where(consulted[:, None], 0.0, coords),
                            flat, (n,))
        if answers:
            # return the oracle's own message for consulted rows (not a coordinate round trip)
            params = [np.array(p) for p in q_hat.params]
            for idx, q_or, _ in answers:
                for p_all, p_or in zip(params, q_or.params):
                    p_all[idx] = p_or
            q_hat = self.family(*params)
        return q_hat, logvar, consulted

    def threshold_floor(self) -> float:
        """The lowest useful threshold: below it every answer is uncertain and the oracle answers
        everything.  With ``uncertainty="predictive"`` the decision variance of coordinate k is
        w_k sd_k²(ψᵀΣψ + σ_y²) ≥ sd_k² σ_y² however much is learned (w_k ≥ 1 the row's weight, see
        ``threshold``: 1 where learned); the floor is where the learnable part ψᵀΣψ may still be
        as large as the noise σ_y² in the largest coordinate of a row whose weights are 1:
        max_k log(2 sd_k² σ_y²).  A belief more concentrated than any learned has a higher floor of its
        own, until one like it is learned.  ``"epistemic"`` and ``"learned_kl"``: −inf."""
        if self.operator is None or self.uncertainty != "predictive":
            return -np.inf
        op = self.operator
        return float(np.max(np.log(2.0 * op.coordinate_noise_var)))

    def threshold_note(self) -> str | None:
        """None, or — when the threshold lies below :meth:`threshold_floor` − log 2, the least log
        variance an answer has — a sentence saying so: no answer is confident there, so every message
        is consulted (the oracle answers all of them, and
        EP through the operator runs at the oracle's pace).  Found by an audit: a served operator of a
        user's factor whose calibration failed took the generic fallback −8.5, 5–9 nats below floors of
        −3.5 … +0.6, and consulted every row with nothing saying why."""
        floor = self.threshold_floor()
        # an answer's decision log variance is at least max_k log(sd_k² σ_y²) = floor − log 2 (weights ≥ 1,
        # ψᵀΣψ ≥ 0): below that nothing is confident; between it and the floor a calibrated threshold may
        # lie (the default logistic-x of the tests: −15.89 against a floor of −15.42), and rows are
        # confident there
        least = floor - np.log(2.0)
        if not (np.isfinite(floor) and self.threshold < least):
            return None
        if getattr(self.operator, "reference_gate_", None) is not None:  # (its gated answers are the reference's)
            return (f"the threshold {self.threshold:.4g} is below this operator's noise floor {floor:.4g}, and below "
                    f"{least:.4g}, the least log predictive variance any answer of its regression has however much is "
                    "learned: no regression answer is confident, so every message the factor's checked reference "
                    "does not answer (the reference gate) will be consulted")
        return (f"the threshold {self.threshold:.4g} is below this operator's noise floor {floor:.4g}, and below "
                f"{least:.4g}, the least log predictive variance any answer has however much is learned: no answer "
                "is confident, so every message will be consulted")

    def _decision_logvar(self, var):
        """log of the variance a variance rule's threshold is applied to, unweighted (see ``uncertainty``)."""
        if self.uncertainty == "predictive":
            return np.log(var)
        return self.operator.epistemic_log_variance(np.log(var))

    def _decision(self, flat, coords, var, logw):
        """(n, k) what the threshold is applied to (see ``uncertainty``) for predicted coordinates
        ``coords`` with variances ``var`` and log weights ``logw`` (n, k) for the flat messages ``flat``:
        the variance rules' log variance weighted, or the predicted log KL in every column."""
        if self.uncertainty == "learned_kl":
            s = self.operator.learned_log_kl(flat, coords, np.log(var))
            return np.repeat(s[:, None], np.shape(coords)[-1], axis=1)
        return self._decision_logvar(var) + logw

    def outside_rows(self, incoming: Mapping[str, Family], density: bool = True) -> np.ndarray:
        """Per message (flat), whether it lies outside the data the operator learned — below the density
        guard (``density_guard``) or beyond the input margin (``input_margin``): what the operator
        consults whatever its variance (but for rows its checked reference answers outright: see
        ``input_margin``), and does not learn; all False without either.  ``density=False``:
        beyond the input margin only — a fixed range, unlike the density, which learning moves."""
        flat, _ = self.factor.check_incoming(incoming, self.to)
        flat = {v: m.ravel() for v, m in flat.items()}
        n = next(iter(flat.values())).size
        if self.operator is None or ((not density or self.density_guard is None) and self.input_margin is None):
            return np.zeros(n, dtype=bool)
        out = (np.asarray(self.operator._inputs_outside_flat(flat, self.input_margin), bool).reshape(-1)
               if self.input_margin is not None else np.zeros(n, dtype=bool))
        if density and self.density_guard is not None:
            # the density of the rows within the margin only: a row beyond it is outside whatever its density,
            # and its features may not even be finite (found by a hostile-input audit: an observation batch with
            # one far exp → x row was refused whole, then failed on those features)
            idx = np.flatnonzero(~out)
            if idx.size:
                sub = flat if idx.size == n else {v: m[idx] for v, m in flat.items()}
                psi = self.operator.features_.transform(self.operator.feature_inputs(sub))
                out = out.copy()
                out[idx] |= np.asarray(self._guarded(psi), bool).reshape(-1)
        return out

    def unlearnable_rows(self, incoming: Mapping[str, Family], beliefs: Family) -> np.ndarray:
        """Per pair (flat), whether it is answered but not learned: its targets far outside the learned range
        (:meth:`KernelOperator.out_of_range_rows`) or its messages outside the data (:meth:`outside_rows`) —
        what the service's observations and audit leave out of what they learn, as :meth:`predict` does."""
        return np.asarray(self.operator.out_of_range_rows(incoming, beliefs), bool) | self.outside_rows(incoming)

    def _checked_outright(self, gate, var, flat, coords):
        """(n,) the rows whose answer is the reference's outright (reference weight ``gate`` 1) with an estimated
        error (their variances ``var`` (n, k), the check's estimate) at most :data:`REFERENCE_OUTSIDE_ERROR` and an
        outgoing precision whose sign that estimate settles (:func:`sign_undetermined` at the predicted
        ``coords`` of the flat messages ``flat``: found in review, product → z rows beyond the data answered an
        improper message where the oracle's was proper), where the factor declares how far its check holds;
        None where none can be."""
        if gate is None or var is None or not getattr(self.factor, "reference_check_holds", None):
            return None
        if getattr(self.operator, "input_range_", None) is None:  # (no margin to bound the rows spared)
            return None
        v = np.asarray(var, float)
        with np.errstate(invalid="ignore"):
            ok = (np.asarray(gate, float) >= 1.0) & np.all(v <= REFERENCE_OUTSIDE_ERROR, axis=-1)
        if ok.any():
            ok &= ~np.asarray(sign_undetermined(self.factor, self.to, flat, np.asarray(coords, float), v), bool)
        return ok

    def _outside(self, flat, psi, checked=None):
        """Rows of the flat (checked) messages ``flat`` (features ``psi``, or None: no density guard)
        outside the data: below the density guard or beyond the input margin; None without either.
        ``checked`` (n,): rows the reference answers outright within its check (:meth:`_checked_outright`) — not
        outside within :data:`REFERENCE_MARGIN`."""
        out = self._guarded(psi)
        if self.input_margin is not None:
            beyond = self.operator._inputs_outside_flat(flat, self.input_margin)
            out = beyond if out is None else out | beyond
        if out is not None and checked is not None and out.any():
            spared = out & np.asarray(checked, bool)
            if spared.any():
                far = np.asarray(self.operator._inputs_outside_flat({v: m[spared] for v, m in flat.items()},
                                                                    REFERENCE_MARGIN), bool)
                out = out.copy()
                out[np.flatnonzero(spared)[~far]] = False
        return out

    def _guarded(self, psi):
        """Rows (features ``psi``) below the density guard; None without a guard (the constructor
        refuses a guard on a regression without column sums)."""
        if self.density_guard is None or psi is None:
            return None
        op = self.operator
        # as counts of nearby rows (see density_guard): d n_now < guard n_then
        return op._density(psi) * op.n_train_ < self.density_guard * self.guard_rows_

    def _coords_and_base(self, flat):
        """``predict_coords(flat, return_var=True, return_features=True, return_weights=True)``, the reference
        coordinates of the targets (for :meth:`_capped`, which would compute them again) and the reference's weight
        in each row's answer (for :meth:`_outside`)."""
        return self.operator._predict_coords(flat, True, True, return_weights=True, return_base=True,
                                             return_gate=True)[0]

    def _uncertain(self, flat, coords, decision, psi=None, var=None, budget=None, base=None, gate=None):
        """Rows to consult: ``decision`` (n, k) — :meth:`_decision`'s, what the threshold applies to —
        exceeds the threshold in some coordinate, or the outgoing message's
        precision has an undetermined sign (:func:`sign_undetermined`: what EP consumes is the
        message, not the belief) while the prediction's epistemic variance is above the oracle's noise
        (an oracle answer would settle it), or the row lies outside the data: its density is below
        the guard (features ``psi``; none given: no guard) or its inputs beyond the input margin.
        ``var``: the predictive variances (n, k); none given (the tests' shortcut), ``decision`` must be
        a variance rule's unweighted log variance, which gives them.
        ``base``: the targets' reference coordinates (n, k), if at hand (:meth:`_capped` reads them).
        ``budget`` (with a ``budget``): "rank" ranks these rows' scores among the recent ones
        (:meth:`_rank`) and keeps the threshold it used in ``screened_threshold_`` (a screen), "commit"
        sets ``threshold`` to it and keeps the scores as recent (a request); None: ``threshold`` as it
        stands (the request's, for its rows re-checked after learning)."""
        # the sign test uses the epistemic part of the variance: consulting cannot resolve the
        # noise floor, and a message indistinguishable from 0 at that level is EP's to treat as 0
        # (KernelOperator.sign_unsettled, which the KL model's calibration counts too)
        op = self.operator
        noise = op.coordinate_noise_var  # σ_y² in each coordinate's units
        if var is not None:
            epistemic = np.maximum(np.asarray(var, float) - noise, 0.0)
        elif self.uncertainty == "learned_kl":
            raise ValueError("`var` is needed with uncertainty='learned_kl'")
        else:
            epistemic = np.exp(decision)
            if self.uncertainty == "predictive":
                epistemic = np.maximum(epistemic - noise, 0.0)
        always = op.sign_unsettled(flat, coords, epistemic)
        outside = self._outside(flat, psi, self._checked_outright(gate, var, flat, coords))
        if outside is not None:
            always = always | outside
        if var is not None:
            always = always | self._capped(flat, coords, var, base)
        if self.budget is not None and budget is not None:
            # a NaN score is no prediction: consulted whatever the rank or the credit (found in review: the
            # credit could refuse one), as are the rows above the level
            with np.errstate(invalid="ignore"):
                always = always | np.isnan(np.asarray(decision, float)).reshape(len(always), -1).any(axis=-1)
            if self.budget_level is not None:
                always = always | above_threshold(decision, self.budget_level)
            commit = budget == "commit"
            threshold, ties, scores = self._rank(decision, always, commit=commit)
            ranked = above_threshold(decision, threshold) | always | ties
            if self.budget_credit:
                ranked, refused = self._spend(ranked, always, scores, commit)
                # the threshold reported is the one the rows answered learned lie under (found in review:
                # at the rank's edge, a refused row's certificate said uncertain and EP's on_uncertain acted)
                threshold = max(threshold, min(refused, _FINITE_MAX))
            if commit:
                self.threshold = threshold
            else:
                self.screened_threshold_ = threshold
            return ranked
        return above_threshold(decision, self.threshold) | always

    def _capped(self, flat, coords, var, base=None) -> np.ndarray:
        """(n,) the rows whose predictive variances ``var`` (n, k), at the predicted coordinates ``coords`` of the
        flat messages ``flat`` (``base``: their targets' reference coordinates, if at hand), imply an expected KL
        above ``kl_cap`` (none without a cap; a variance that is not a number is above it).  The variances an
        oracle answer can settle: all of them where the oracle is an exact rule (``certificate_source`` "rule":
        the regression's noise is then its misfit, which the exact answer removes); their epistemic part, above
        the regression's noise, where it samples (an operator learned from a sampler's answers has the sampler's
        noise in its floor, which consulting the sampler again does not lower — as the sign test reads it)."""
        n = len(coords)
        if self.kl_cap is None or n == 0:
            return np.zeros(n, dtype=bool)
        op = self.operator
        if op.target != "relative":
            base = None
        elif base is None:
            base = op._reference(flat)
        v = np.asarray(var, np.float64)
        with np.errstate(all="ignore"):
            if getattr(self.oracle, "certificate_source", "oracle") != "rule":
                v = np.where(np.isnan(v), np.nan, np.maximum(v - op.coordinate_noise_var, 0.0))  # (NaN: above)
            e = self.family.least_expected_kl(np.asarray(coords, np.float64), v, base)
        return ~(e <= self.kl_cap)

    def _surprising(self, psi, flat, q_or) -> np.ndarray:
        """(n,) the consulted rows whose oracle answer ``q_or`` lies more than :attr:`learn_surprise_z` predictive
        standard deviations from the regression's prediction at features ``psi`` in some regressed coordinate, in
        the regression's standardised space, as the operator stands (before learning them).  A row whose targets
        are not finite is not judged here (partial_fit names it)."""
        op = self.operator
        n = len(psi)
        try:
            Y = op._targets(q_or.ravel(), n, flat)
        except ValueError:
            return np.zeros(n, bool)
        psi = np.asarray(psi, np.float64)
        with np.errstate(all="ignore"):
            zp, v = op.blr_.predict(psi, return_var=True)
            z = np.abs((Y - op.y_mean_) / op.y_scale_ - np.asarray(zp).reshape(n, -1)) / np.sqrt(v).reshape(n, 1)
            # judged only where the learned rows claim the region: the latent variance a hundredth of the prior's
            # or less — a row beyond the data (its variance the prior's) is what a JIT learns
            known = (v - op.noise_var_) <= SURPRISE_PRIOR_SHARE * op.prior_var_ * np.einsum("ij,ij->i", psi, psi)
        return known & np.any(z > self.learn_surprise_z, axis=-1)

    def _near_exact(self, coords, flat, q_or) -> np.ndarray:
        """(n,) the consulted rows whose prediction (``coords``, as the operator stood when the oracle was asked)
        lies within ``learn_above_kl`` of the oracle's answer ``q_or``: KL[answer ‖ prediction] ≤ it.  A row
        whose prediction is no belief, or whose KL is not a number (an improper answer), is not near exact;
        the others are judged each on its own (found in review: one such row had every row of its round learned)."""
        n = len(coords)
        near = np.zeros(n, bool)
        rows = np.arange(n)
        with np.errstate(all="ignore"):
            try:
                try:
                    q = self.operator._to_belief(coords, flat, (n,))
                except PredictionOverflowError as exc:  # (the rows that are no belief: named)
                    rows = np.setdiff1d(rows, np.asarray(exc.rows, int).reshape(-1))
                    if not rows.size:
                        return near
                    q = self.operator._to_belief(coords[rows], {v: m[rows] for v, m in flat.items()}, (rows.size,))
            except ValueError:  # (no belief, its rows unnamed: none judged near exact)
                return near
            # (an improper answer has no KL: the others are compared without it)
            ok = np.broadcast_to(np.asarray(q_or.is_proper, bool).reshape(-1), (n,))[rows]
            rows, q = rows[ok], q[np.flatnonzero(ok)]
            if rows.size:
                near[rows] = np.asarray(q_or[rows].kl(q), np.float64).reshape(-1) <= self.learn_above_kl
        return near

    def _places(self, m: int) -> int:
        """⌊budget · m⌋, read as the decimal product the user meant (0.29 · 100 is 28.999… in floating
        point: 29, not 28)."""
        return int(np.floor(self.budget * m * (1.0 + 1e-12)))

    def _spend(self, ranked, always, scores, commit=False):
        """``(rows of ranked the credit pays for, the largest score it refused or -inf)``: with m rows
        ranked so far (this request's included) and c consulted, ⌊budget · m⌋ − c places; the rows
        consulted anyway (``always``) take theirs first (all of them, even beyond it: the credit goes
        into debt), then the others by score, highest first, ties in row order.  ``commit``: the
        ledger keeps the request."""
        rows = self.budget_rows_ + ranked.size
        spare = self._places(rows) - self.budget_consulted_ - int(np.count_nonzero(always))
        extra = np.flatnonzero(ranked & ~always)
        out = np.array(always, bool)
        refused = -np.inf
        if extra.size:
            # by score, highest first; a stable sort keeps tied rows in row order
            order = extra[np.argsort(-scores[extra], kind="stable")]
            n_keep = max(spare, 0)
            out[order[:n_keep]] = True
            if n_keep < order.size:
                refused = float(scores[order[n_keep]])
        if commit:
            self.budget_rows_, self.budget_consulted_ = rows, self.budget_consulted_ + int(np.count_nonzero(out))
        return out, refused

    def _rank(self, decision, always, commit=False):
        """``(threshold, ties, scores)`` of the budget for a request whose rows have ``decision`` (n, k)
        and are consulted anyway where ``always`` (a NaN score among them): scores (a row's largest
        coordinate; consulted anyway: +inf) ranked among the last ``budget_window`` (the request's own
        first).  With t the k-th
        largest of the m ranked (k = ⌊budget · m⌋), the rows above t take a of the k places and the
        request's rows tied at t the rest, in row order (``ties``; earlier rows tied at t are passed
        over: a resent message's copies would otherwise fill the places and leave every one of them
        out); the threshold is the larger of the floor and t (kept finite).  ``commit``: the request's
        scores join the recent ones."""
        with np.errstate(invalid="ignore"):
            s = np.max(np.asarray(decision, np.float64).reshape(len(always), -1), axis=-1)
        s = np.where(always, np.inf, s)  # (a NaN score is among the rows consulted anyway: _uncertain)
        ref = np.concatenate([self.budget_scores_, s])[-max(self.budget_window, s.size):]
        k = self._places(ref.size)
        ties = np.zeros(s.size, bool)
        if k == 0:
            t = float(ref.max())
        else:
            t = float(np.partition(ref, ref.size - k)[ref.size - k])  # the k-th largest (k < ref.size: budget < 1)
            if t < np.inf and t > self.threshold_floor_:
                free = k - int(np.count_nonzero(ref > t))
                ties[np.flatnonzero(s == t)[:free]] = True
        if commit:
            self.budget_scores_ = ref[-self.budget_window:]
        return max(self.threshold_floor_, min(t, _FINITE_MAX)), ties, s

    def _differs(self, flat, ref):
        """(n, c) booleans: does each row differ from the reference row in each coordinate of
        each incoming message (``ref``: {variable: coords of one row})."""
        cols = [flat[v].to_coords().reshape(flat[v].size, -1) != ref[v] for v in sorted(flat)]
        return np.concatenate(cols, axis=1)

    def _reference(self, flat):
        first = self._pending[0][0] if self._pending else flat
        return {v: first[v][:1].to_coords().reshape(1, -1) for v in first}

    def _varied_counts(self, ref):
        """Per coordinate: pending rows that differ from the reference row."""
        if not self._pending:
            return 0
        return sum(self._differs(p[0], ref).sum(axis=0) for p in self._pending)

    def _initial_rows(self, flat) -> int:
        """How many leading rows of ``flat`` (a request with no operator yet) complete the
        initial batch: ``initial_batch`` pairs, of which at least ``initial_batch // 4`` differ
        from the first one in every coordinate of the incoming messages, or the cap.  Decided
        from the incoming messages alone; all rows when the request does not complete it."""
        n = next(iter(flat.values())).size
        ref = self._reference(flat)
        counts = self._varied_counts(ref) + np.cumsum(self._differs(flat, ref), axis=0)  # (n, c)
        total = self._n_pending + np.arange(1, n + 1)
        ok = (total >= self.initial_batch) & (counts.min(axis=1) >= self.initial_batch // 4)
        ok |= total >= INITIAL_BATCH_CAP * self.initial_batch
        return int(np.argmax(ok)) + 1 if ok.any() else n

    def _ready_to_fit(self) -> bool:
        if self._n_pending < self.initial_batch:
            return False
        if self._n_pending >= INITIAL_BATCH_CAP * self.initial_batch:
            return True
        counts = self._varied_counts(self._reference(None))
        return int(np.min(counts)) >= self.initial_batch // 4

    def _learn_initial(self, flat, q):
        self._pending.append((flat, q))
        self._n_pending += len(q)
        if not self._ready_to_fit():
            return
        t = time.perf_counter()
        incoming = {v: type(flat[v]).concatenate([p[0][v] for p in self._pending]) for v in flat}
        beliefs = self.family.concatenate([p[1] for p in self._pending])
        if self.target_kl is None:
            self.operator = KernelOperator(self.factor, self.to, **self.operator_kwargs).fit(incoming, beliefs)
        else:
            # calibrate the threshold on a quarter of the initial batch held out from the fit,
            # then learn those pairs too (online: the hyperparameters stay those of the fit)
            data = TrainingSet(self.factor.name, self.to, incoming, beliefs, self.factor.params())
            n_held = max(1, len(data) // 4)
            fit_part, held = data.split(len(data) - n_held, random_state=0)
            self.operator = KernelOperator(self.factor, self.to, **self.operator_kwargs).fit(fit_part)
            # on the variance the rule thresholds (found by an audit: an epistemic rule was calibrated on
            # the predictive variance, which is larger by the noise)
            t_cal = calibrate_threshold(self.operator, held, self.target_kl,
                                        scalar="max_epistemic" if self.uncertainty == "epistemic" else "max")
            if np.isfinite(t_cal):
                self.threshold = t_cal
            # held-out rows far outside the fitted range are answered already but not learned
            # (LEARN_RANGE_FACTOR); the fitted rows are inside it by construction
            far = self.operator.out_of_range_rows(held)
            if far.any() and self.guard_share is not None:  # the same, over every row, for the guard
                unlearned = self.operator.out_of_range_rows(incoming, beliefs)  # (before learning widens it)
            if not far.all():
                self.operator.partial_fit(held.subset(np.flatnonzero(~far)) if far.any() else held)
        if self.guard_share is not None:
            # each learned row of the batch without its request's rows (a request of EP is a sweep: its
            # rows are distinct messages, while later sweeps resend near-duplicates of them)
            sizes = [len(p[1]) for p in self._pending]
            groups = np.repeat(np.arange(len(sizes)), sizes) if len(sizes) > 1 else np.arange(sum(sizes))
            if self.target_kl is not None and far.any():  # the rows learned, only (found in review)
                keep = np.flatnonzero(~unlearned)
                incoming, groups = {v: m[keep] for v, m in incoming.items()}, groups[keep]
                if len(sizes) == 1:
                    groups = np.arange(keep.size)
            self.density_guard = density_guard(self.operator, share=self.guard_share, fitted=incoming, groups=groups)
        self.guard_rows_ = self.operator.n_train_
        self._pending = []
        self._n_pending = 0
        self._counts["seconds_initial_fit"] += time.perf_counter() - t

    def belief(self, incoming: Mapping[str, Family], to: str | None = None) -> Family:
        return self.predict(incoming, to)[0]

    def _recipient(self, to):
        self._check_to(to)
        return self.to

    def draws(self, n: int, random_state=None, mean: bool = False) -> list:
        """:meth:`KernelOperator.draws` of the operator as it is now (its seeded draws are copies: what it learns
        later does not change them); a ValueError before the operator is fitted (the initial batch's answers are
        the oracle's)."""
        if self.operator is None:
            raise ValueError("no operator yet: the initial batch goes to the oracle, and there is nothing to draw")
        return self.operator.draws(n, random_state, mean=mean)

    # ------------------------------------------------------------------ state
    def oracle_state(self) -> dict | None:
        """The oracle's mutable state — its random generator (and a sampler's reused particle
        draw) — as JSON-able values, or None for an oracle without one (quadrature, a client's).
        :meth:`set_oracle_state` restores it: what a service's update record carries so that
        replaying the record continues the oracle's stream exactly (state_dict holds it too)."""
        from ..oracles import ImportanceSamplingOracle, MessageImportanceSampler

        o = self.oracle
        if isinstance(o, MessageImportanceSampler):
            return {"rng_state": json.dumps(o._rng.bit_generator.state)}
        if isinstance(o, ImportanceSamplingOracle):
            return {"rng_state": json.dumps(o._rng.bit_generator.state), "pool": json.dumps(o.pool_state())}
        return None

    def set_oracle_state(self, state: Mapping) -> None:
        """Restore :meth:`oracle_state`'s answer (on the same kind of oracle)."""
        from ..oracles import ImportanceSamplingOracle, MessageImportanceSampler

        o = self.oracle
        if not isinstance(o, (ImportanceSamplingOracle, MessageImportanceSampler)):
            raise ValueError(f"a {type(o).__name__} has no generator state to restore")
        o._rng.bit_generator.state = json.loads(state["rng_state"])
        if isinstance(o, ImportanceSamplingOracle) and "pool" in state:
            o._pool = None
            o.set_pool_state(json.loads(state["pool"]))

    def state_dict(self) -> dict:
        """Everything needed to continue exactly where this operator stopped: the learned
        operator (or the pending initial batch), counters, threshold, and the oracle's
        configuration including its random generator state."""
        from ..oracles import ClientOracle, ImportanceSamplingOracle, MessageImportanceSampler, QuadratureOracle

        if isinstance(self.oracle, ClientOracle):
            oracle = {"kind": "client"}
        elif isinstance(self.oracle, MessageImportanceSampler):
            o = self.oracle
            oracle = {"kind": "message_sampler", "target_se": o.target_se, "min_ess": o.min_ess,
                      "target_ess": json.dumps(o.target_ess), "n_initial": o.n_initial,
                      "max_samples": o.max_samples, "growth": o.growth, "chunk_elements": o.chunk_elements,
                      **self.oracle_state()}
        elif isinstance(self.oracle, ImportanceSamplingOracle):  # noqa: SIM114
            o = self.oracle
            oracle = {"kind": "importance_sampling", "n_samples": o.n_samples, "min_ess": o.min_ess,
                      "chunk": o.chunk, "reuse": o.reuse, **self.oracle_state(),
                      "proposal": json.dumps({v: [family_name(m), m.to_dict()] for v, m in o.proposal.items()})}
        elif isinstance(self.oracle, QuadratureOracle):
            oracle = {"kind": "quadrature"}
        else:
            raise ValueError(f"cannot save a JITOperator whose oracle is {type(self.oracle).__name__}")
        state = {
            "params": {"factor": self.factor.name, "factor_params": json.dumps(self.factor.params()),
                       "to": self.to, "threshold": self.threshold, "initial_batch": self.initial_batch,
                       "target_kl": self.target_kl, "selection": self.selection, "uncertainty": self.uncertainty,
                       "density_guard": self.density_guard, "guard_share": self.guard_share,
                       "guard_rows": self.guard_rows_, "learn_above_kl": self.learn_above_kl,
                       "input_margin": self.input_margin, "learn_surprise_z": self.learn_surprise_z,
                       "kl_cap": self.kl_cap, "operator_kwargs": json.dumps(_saved_kwargs(self.operator_kwargs))},
            **({"budget": {"budget": self.budget, "window": self.budget_window, "floor": self.threshold_floor_,
                           "scores": np.array(self.budget_scores_), "credit": self.budget_credit,
                           "level": self.budget_level,
                           "rows": self.budget_rows_, "consulted": self.budget_consulted_}}
               if self.budget is not None else {}),
            "counters": dict(self._counts),
            "oracle": oracle,
        }
        if self.operator is not None:
            state["operator"] = self.operator.state_dict()
        if self._pending:
            inc = {v: type(m).concatenate([p[0][v] for p in self._pending]) for v, m in self._pending[0][0].items()}
            bel = self.family.concatenate([p[1] for p in self._pending])
            state["pending"] = {
                "incoming": {v: {n: p for n, p in zip(m.param_names, m.params)} for v, m in inc.items()},
                "beliefs": {n: p for n, p in zip(bel.param_names, bel.params)},
                # the requests they came in: the density guard groups the initial batch by them (found
                # by an audit: after a reload the guard, and the rows it routed, differed)
                "sizes": np.array([len(p[1]) for p in self._pending], dtype=np.int64),
            }
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping) -> "JITOperator":
        from ..families import family_by_name
        from ..oracles import ClientOracle, ImportanceSamplingOracle, MessageImportanceSampler, QuadratureOracle

        try:
            p = state["params"]
            factor = get_factor(p["factor"], **_state_json(p, "factor_params", "params/", dict))
            o = state["oracle"]
            if o["kind"] == "quadrature":
                oracle = QuadratureOracle(factor)
            elif o["kind"] == "importance_sampling":
                proposal = {v: family_by_name(name).from_dict(params) for v, (name, params) in json.loads(o["proposal"]).items()}
                oracle = ImportanceSamplingOracle(factor, n_samples=int(o["n_samples"]), proposal=proposal,
                                                  min_ess=float(o["min_ess"]), chunk=int(o["chunk"]),
                                                  reuse=int(o.get("reuse", 1)))
            elif o["kind"] == "client":
                oracle = ClientOracle(factor)
            elif o["kind"] == "message_sampler":
                oracle = MessageImportanceSampler(
                    factor, target_se=float(o["target_se"]), min_ess=float(o["min_ess"]),
                    target_ess=json.loads(o["target_ess"]), n_initial=int(o["n_initial"]),
                    max_samples=int(o["max_samples"]), growth=int(o["growth"]),
                    chunk_elements=int(o["chunk_elements"]))
            else:
                raise ValueError(f"unknown oracle kind {o['kind']!r}")
            operator = KernelOperator.from_state_dict(state["operator"]) if "operator" in state else None
            jit = cls(operator, oracle, threshold=float(p["threshold"]), initial_batch=int(p["initial_batch"]),
                      to=p["to"], operator_kwargs=_state_json(p, "operator_kwargs", "params/", dict),
                      target_kl=p.get("target_kl"),
                      selection=p.get("selection", "all"), uncertainty=p.get("uncertainty", "predictive"),
                      density_guard=p.get("density_guard"), guard_share=p.get("guard_share"),
                      learn_above_kl=p.get("learn_above_kl"), input_margin=p.get("input_margin"),
                      learn_surprise_z=p.get("learn_surprise_z"), kl_cap=p.get("kl_cap"),
                      **({"budget": float(state["budget"]["budget"]), "budget_window": int(state["budget"]["window"]),
                          "budget_credit": bool(state["budget"].get("credit", False)),
                          "budget_level": state["budget"].get("level")}
                         if "budget" in state else {}))
            if "budget" in state:
                b = state["budget"]
                jit.threshold_floor_ = float(b["floor"])
                scores = np.asarray(b["scores"], np.float64).reshape(-1)
                if scores.size > jit.budget_window or np.isnan(scores).any():
                    raise ValueError("JIT operator state's budget scores are malformed (NaN, or more than its window)")
                jit.budget_scores_ = scores
                rows, consulted = int(b.get("rows", 0)), int(b.get("consulted", 0))
                if not 0 <= consulted <= rows:
                    raise ValueError("JIT operator state's budget ledger is malformed (consulted rows outside 0…rows)")
                jit.budget_rows_, jit.budget_consulted_ = rows, consulted
            if o["kind"] in ("importance_sampling", "message_sampler"):
                # the generator (and, mid-way through a reused particle draw, the same particles again)
                jit.set_oracle_state(o)
            if p.get("guard_rows") is not None:
                jit.guard_rows_ = int(p["guard_rows"])
            for k, v in state["counters"].items():
                jit._counts[k] = type(jit._counts.get(k, 0.0))(v)
            if "pending" in state:
                pend = state["pending"]
                inc = {v: factor.families[v].from_dict(d) for v, d in pend["incoming"].items()}
                bel = jit.family.from_dict(pend["beliefs"])
                if set(inc) != set(factor.variables) or any(m.shape != bel.shape or m.ndim != 1 for m in inc.values()):
                    raise ValueError(f"JIT operator state's pending pairs are inconsistent: incoming "
                                     f"{ {v: m.shape for v, m in inc.items()} }, beliefs {bel.shape}")
                sizes = np.asarray(pend.get("sizes", [len(bel)]), dtype=np.int64).reshape(-1)
                if sizes.sum() != len(bel) or (sizes.size and sizes.min() < 1):
                    raise ValueError(f"JIT operator state's pending request sizes {sizes.tolist()} do not add up to "
                                     f"its {len(bel)} pending pairs")
                ends = np.cumsum(sizes)
                jit._pending = [({v: m[e - n:e] for v, m in inc.items()}, bel[e - n:e]) for n, e in zip(sizes, ends)]
                jit._n_pending = len(bel)
        except KeyError as exc:
            raise ValueError(f"JIT operator state is missing {exc}") from None
        except (TypeError, AttributeError) as exc:  # (a value of the wrong kind)
            raise ValueError(f"JIT operator state is malformed: {exc}") from None
        return jit


OPERATOR_KINDS = {"KernelOperator": KernelOperator, "JITOperator": JITOperator}


def guarded_jit(operator: KernelOperator, oracle, threshold: float, fitted: TrainingSet,
                held_out: TrainingSet | None = None, **kwargs) -> JITOperator:
    """A trained operator as the service and ``kjit train --jit`` serve it: a :class:`JITOperator` at
    ``threshold`` that also knows where its data ends — a density guard flagging ``GUARD_SHARE`` of
    in-distribution messages (:func:`density_guard` over the ``held_out`` pairs and the ``fitted`` ones each left
    out of its own count; none when too few pairs give that share) and the input margin ``INPUT_MARGIN`` — so a
    message outside it is consulted whatever its variance (unless the factor's checked reference answers it
    outright: :data:`REFERENCE_MARGIN`), and not learned (:meth:`JITOperator.outside_rows`;
    why, with measurements: :mod:`service.training`).  ``kwargs``: more of the JITOperator's settings."""
    guard = density_guard(operator, held_out=held_out, fitted=fitted, groups=np.arange(len(fitted)),
                          share=GUARD_SHARE)
    return JITOperator(operator, oracle, threshold=threshold, density_guard=guard if np.isfinite(guard) else None,
                       input_margin=INPUT_MARGIN, **kwargs)
