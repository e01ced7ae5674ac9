"""Training of store operators: incoming-message distributions, oracle runs, fitting.

Default incoming-message distributions
--------------------------------------
Training pairs for the default operators (and for jobs that ask for ``"distribution":
"default"``) are drawn from each factor's own default distribution (``Factor.default_incoming``,
documented in the factor's module, e.g. :func:`kjit.factors.logistic.logistic_incoming`), meant
to cover what EP sends in practice.  For the built-ins they were chosen from the cavities EP
actually produces on the UCI problems of the KJIT paper (logistic regression on banknote, blood
transfusion, fertility, ionosphere: cavity means in [−21, 11], 95 % within [−11, 6]; cavity
variances in [0.03, 120], 90 % within [0.05, 27]) and then narrowed where a 2000-pair operator
with D_in = 300, D_out = 500 could not fit the whole range (held-out mean KL grew from 2e-2 to
4e-2 when the variance range was widened to 10^2.5; rows outside the range are what the
just-in-time threshold sends to the oracle).

A request may instead give an explicit distribution: for each variable of the factor and
each parameter of its family, ``{"low": a, "high": b, "scale": "linear" | "log"}`` (uniform
on [a, b], or log-uniform on [a, b] with 0 < a).

Threshold
---------
Unless a request gives one, the just-in-time threshold is calibrated with
:func:`kjit.operators.calibrate_threshold` on held-out oracle pairs (a quarter as many as the
training pairs, at least 200, drawn from the same distribution): the largest log predictive
variance at which the confident predictions still have a mean KL[q ‖ q̂] ≤ 1e-3 — and at least
5 % of the held-out pairs, and at least 20, are confident
(:func:`kjit.operators.calibration_support`; of the pairs the regression answers, those its reference
gate answers left out): a threshold admitting fewer saves little and its mean rests on a handful of
rows (a gaussian → m operator, 2 000 pairs at D 300/500, was calibrated on 7 of 500; EP through it
learned, answered its messages confidently and ended 0.46 sd off exact EP, found by a new-user audit).  If no
threshold meets that target, the factor's ``default_threshold`` is used (the paper's value:
−8.95 logistic, −6 compound gamma), else −8.5.  A threshold more than log 2 below the operator's
noise floor (:meth:`kjit.operators.JITOperator.threshold_floor`) makes every message consulted: the job's result
and the operator's detail then say so in ``threshold_note`` (:func:`below_floor_note`, which says
why the fallback is not raised to the floor).

A row whose own predictive variances imply an expected KL above ``KL_CAP`` (the target, 1e-3) is consulted
whatever the threshold (``JITOperator(kl_cap=)``): the threshold is calibrated on the mean over held-out rows, and
a handful of rows with a concentrated belief, whose error of one sd costs thousands of times a typical row's KL,
passed it (probit_noise → f: confident answers up to KL 0.88, 4.4 in mode=jit).

Where the factor's check of its reference holds further than ``REFERENCE_GATE`` (``Factor.reference_check_holds``:
product's, to 1e-2), an operator trained with a cap answers by the reference alone the rows whose checked error is
at most a tenth of the cap (``kjit.operators.capped_reference_gate``; a gated answer's variance is that estimate, so
the cap still sees it): the default product operators consulted 61 / 61 / 59 % of fresh default messages before,
24 / 24 / 18 % after (x / y / z), their confident answers' largest KL under 1e-4 (forty-sixth session,
``benchmarks/served_defaults.py``); the gaussian ones, with the factor's new reference, 100 % → about 1 %.  Operators trained before keep the gate (and the reference) they were trained with.

The job's result also gives ``held_out_consulted_share``: the share of the held-out pairs the operator's
just-in-time rule would send to the oracle (threshold, sign test, guards) — what to expect of messages like the
training ones — and, at ``CONSULTATION_NOTE_SHARE`` (half) or more, a ``consultation_note`` saying so.

Outside the data
----------------
Every trained operator also knows where its data ends, two ways (``JITOperator.outside_rows``): a
density guard (:func:`kjit.operators.density_guard`, share ``GUARD_SHARE``: the 1 % point of how much
training data lies near a message, over the held-out pairs and the training pairs each left out of its
own count) and an input margin (``INPUT_MARGIN``: a message coordinate — a Gaussian's mean or log
variance, a Beta's or Gamma's log parameters — more than half the training range's width beyond it; the
density does not see a message much wider than any learned, whose mean embedding is near the learned
ones').  A message outside lies where the operator's predictive variance means nothing (the random
features of a far message are a generic vector, and the posterior is tight in every direction), so the
just-in-time rule consults it whatever its variance (unless the factor's checked reference answers it outright, which
does not use the regression: ``kjit.learn.jit.REFERENCE_MARGIN``), and neither ``mode=jit`` nor an observation learns
it — learning such pairs moves the predictions everywhere while every variance stays small (measured,
fortieth session: 24 logistic-regression EP runs in turn through one served default logistic → x
operator, at prior variances 1e2–1e6, took its posteriors from 1e-9–0.005 sd off exact EP to 0.1–2.7 sd
off with no message flagged; with the density guard every run converged within 9.3e-4 sd, consulting
78 % of the messages, which lay outside the default training distribution.  Again with an operator trained
by this code, in-process, `/tmp` scratch: without either, 14 of the 24 runs stopped unconverged at 300
sweeps, 0.22 sd off at the median, 3.3 at worst; with both, all 24 converged, 1.2e-8 sd off at the median,
9.4e-4 at worst).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from kjit.factors import Factor, get_factor, registered_factors
from kjit.families import Family
from kjit.operators import (GUARD_SHARE, INPUT_MARGIN, KernelOperator, calibrate_threshold,  # noqa: F401
                            calibration_support, capped_reference_gate, guarded_jit)
from kjit.oracles import ClientOracle, make_oracle, resolve_oracle_kind
from kjit.training import (DEFAULT_DISTRIBUTIONS, HELD_OUT_STREAM, TrainingSet, default_incoming,  # noqa: F401
                           make_training_set)

from .schemas import PARAM_MAX, POSITIVE_MIN

__all__ = [
    "DEFAULT_DISTRIBUTIONS",
    "default_specs",
    "served_defaults",
    "TrainSpec",
    "sampler_from_ranges",
    "train_operator",
    "FALLBACK_THRESHOLD",
    "CONSULTATION_NOTE_SHARE",
    "GUARD_SHARE",
    "INPUT_MARGIN",
    "KL_CAP",
    "below_floor_note",
    "unguarded_note",
]

TARGET_KL = 1e-3
#: the expected KL above which a row is consulted whatever the threshold (``JITOperator(kl_cap=)``): the calibration's
#: target, per row — measured (forty-fifth session, every default direction trained here, 3 000 fresh default
#: messages and EP-recorded ones, against the exact rule): probit_noise → f's confident answers above KL 0.1
#: 11 → 0 (largest 0.88 → 0.017; mode=jit 8 → 0, largest 4.4 → 0.052) at 4.0 → 5.3 % consulted; product → z
#: largest 0.107 → 1.2e-7 at 5.2 → 60 % consulted (its variance is honest but wide: the job says so in its
#: consultation_note); every other direction unchanged (no row more consulted).  At 1e-2 probit kept 5 above 0.1
KL_CAP = TARGET_KL
FALLBACK_THRESHOLD = -8.5  # when calibration finds none and the factor declares no default_threshold
CONSULTATION_NOTE_SHARE = 0.5  # a job result says so (consultation_note) when mode=jit will consult this share
# Hyperparameter grids of the default operators: a subset of KernelOperator's defaults that
# keeps first-start training near a minute on two cores (the searches on the default
# distributions selected inner factor 0.25 and width factors 1/8 .. 2).
DEFAULT_INNER_FACTORS = (0.25, 1.0)
DEFAULT_WIDTH_FACTORS = (1 / 16, 1 / 8, 0.25, 0.5, 1.0, 2.0)




def sampler_from_ranges(factor: Factor, ranges: Mapping[str, Mapping[str, Mapping]]):
    """A sampler ``(n, rng) -> incoming`` from per-parameter ranges (see the module docstring).

    Raises ``ValueError`` whose message starts with the offending path (``var.param``).
    """
    for v in ranges:
        if v not in factor.variables:
            raise ValueError(f"{v}: not a variable of factor {factor.name!r} ({', '.join(factor.variables)})")
    for v in factor.variables:
        if v not in ranges:
            raise ValueError(f"{v}: missing (factor {factor.name!r} needs every variable)")
        fam = factor.families[v]
        given = ranges[v]
        for p in given:
            if p not in fam.param_names:
                raise ValueError(f"{v}.{p}: not a parameter of {fam.__name__} ({', '.join(fam.param_names)})")
        for p in fam.param_names:
            if p not in given:
                raise ValueError(f"{v}.{p}: missing")
            r = given[p]
            lo, hi, scale = float(r["low"]), float(r["high"]), r.get("scale", "linear")
            if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi):
                raise ValueError(f"{v}.{p}: need finite low <= high")
            if scale not in ("linear", "log"):
                raise ValueError(f"{v}.{p}: `scale` must be 'linear' or 'log'")
            if scale == "log" and lo <= 0:
                raise ValueError(f"{v}.{p}: a log scale needs low > 0")
            # the range a request's messages may carry (service.schemas): an operator trained beyond it
            # would learn messages the API refuses (found in review: var 1e-300 .. 1e-200 trained)
            kind = getattr(fam, "json_columns", {}).get(p)
            lo_ok = {"positive": POSITIVE_MIN, "probability": 0.0}.get(kind, -PARAM_MAX)
            hi_ok = 1.0 if kind == "probability" else PARAM_MAX
            if not (lo_ok <= lo and hi <= hi_ok):
                raise ValueError(f"{v}.{p}: the range must lie within [{lo_ok:g}, {hi_ok:g}], the values a "
                                 "request's messages may carry")
    # check the ranges give valid messages at their corners
    for v in factor.variables:
        fam = factor.families[v]
        corners = [[ranges[v][p][k] for p in fam.param_names] for k in ("low", "high")]
        for c in corners:
            try:
                fam(*c)
            except ValueError as exc:
                raise ValueError(f"{v}: the range gives invalid messages ({exc})") from None

    def sample(n: int, rng: np.random.Generator):
        out = {}
        for v in factor.variables:
            fam = factor.families[v]
            params = []
            for p in fam.param_names:
                r = ranges[v][p]
                lo, hi = float(r["low"]), float(r["high"])
                if r.get("scale", "linear") == "log":
                    params.append(np.exp(rng.uniform(np.log(lo), np.log(hi), n)))
                else:
                    params.append(rng.uniform(lo, hi, n))
            out[v] = fam(*params)
        return out

    return sample


@dataclass
class TrainSpec:
    """What to train: a direction of a registered factor, from an oracle run or a file."""

    factor: str
    to: str
    factor_params: dict = field(default_factory=dict)
    n_inner: int = 300
    n_outer: int = 500
    threshold: float | None = None
    kl_cap: float | None = KL_CAP               # JITOperator(kl_cap=): None, no cap
    initial_batch: int = 300
    random_state: int = 0
    # source: exactly one of these
    n: int | None = None                       # oracle run of n pairs
    distribution: str | Mapping = "default"    # "default" or per-parameter ranges
    training_set: str | None = None            # path of a TrainingSet .npz (already resolved)
    pairs: TrainingSet | None = None           # pairs sent with the request (oracle "client")
    oracle: str = "quadrature"                 # or "importance_sampling", "message_sampler", "auto"
    n_samples: int = 100_000                   # importance-sampling particles (message_sampler: the cap per message)
    target_se: float = 1e-2                    # message_sampler: standard error to reach per coordinate
    inner_factors: tuple = DEFAULT_INNER_FACTORS
    width_factors: tuple = DEFAULT_WIDTH_FACTORS
    n_jobs: int = 1

    def build_factor(self) -> Factor:
        return get_factor(self.factor, **dict(self.factor_params))

    def resolved_oracle(self, factor: Factor) -> str:
        """``"auto"``: the factor's exact rule for the recipient if it has one, else the per-message
        importance sampler (any sampleable factor)."""
        return self.oracle if self.oracle == "client" else resolve_oracle_kind(self.oracle, factor, self.to)

    def build_oracle(self, factor: Factor):
        if self.oracle == "client":
            return ClientOracle(factor)
        return make_oracle(self.oracle, factor, self.to, n_samples=self.n_samples, target_se=self.target_se,
                           random_state=self.random_state)

    def sampler(self, factor: Factor):
        if isinstance(self.distribution, str):
            if self.distribution != "default":
                raise ValueError(f"unknown distribution {self.distribution!r} (use 'default' or ranges)")
            return default_incoming(factor)
        return sampler_from_ranges(factor, self.distribution)

    def describe(self) -> dict:
        src = ({"kind": "file", "path": self.training_set} if self.training_set is not None else
               {"kind": "client", "n": len(self.pairs), "oracle": "client"} if self.pairs is not None else
               {"kind": "oracle", "n": self.n, "oracle": self.oracle,
                "distribution": self.distribution if isinstance(self.distribution, str) else dict(self.distribution)})
        return {"factor": self.factor, "factor_params": dict(self.factor_params), "to": self.to,
                "n_inner": self.n_inner, "n_outer": self.n_outer, "random_state": self.random_state,
                "threshold": self.threshold, "kl_cap": self.kl_cap, "source": src}


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _oracle_pairs(spec: TrainSpec, factor, oracle, incoming: Mapping[str, Family], progress: Progress | None,
                  stage: str, chunk: int = 256) -> TrainingSet:
    """make_training_set in slices, so progress can be reported pair by pair.  The held-out pairs' oracle draws
    from streams of their own (``kjit.training.HELD_OUT_STREAM``, which says why)."""
    n = len(next(iter(incoming.values())))
    block = chunk * max(1, spec.n_jobs if spec.n_jobs > 0 else 2)
    parts = []
    entropy = spec.random_state if stage != "held_out" else [spec.random_state, HELD_OUT_STREAM]
    seeds = np.random.SeedSequence(entropy).spawn(max(1, -(-n // block)))
    if progress:
        progress(stage, 0, n)
    for i, s in enumerate(range(0, n, block)):
        part = {v: m[s:s + block] for v, m in incoming.items()}
        parts.append(make_training_set(factor, spec.to, part, oracle, n_jobs=spec.n_jobs, chunk_size=chunk,
                                       random_state=seeds[i]))
        if progress:
            progress(stage, min(n, s + block), n)
    return TrainingSet.concatenate(parts) if len(parts) > 1 else parts[0]


def train_operator(spec: TrainSpec, progress: Progress | None = None):
    """Train a :class:`JITOperator` for ``spec``; returns ``(jit, training_set, info)``.

    ``progress(stage, done, total)`` is called with stages ``"oracle"`` (training pairs),
    ``"held_out"`` (calibration pairs) and ``"fit"`` (0/1, then 1/1).
    """
    t0 = time.perf_counter()
    factor = spec.build_factor()
    factor.check_to(spec.to)
    oracle = spec.build_oracle(factor)
    held_out = None
    if spec.training_set is not None or spec.pairs is not None:
        ts = TrainingSet.load(spec.training_set) if spec.pairs is None else spec.pairs
        if ts.factor != factor.name or ts.to != spec.to:
            raise ValueError(f"the training set is for {ts.factor}→{ts.to}, not {factor.name}→{spec.to}")
        factor.check_same((ts.factor, ts.factor_params), "the training set", "the operator")
        if len(ts) < 4:
            raise ValueError(f"the training set has {len(ts)} pairs; at least 4 are needed")
        if spec.threshold is None and len(ts) >= 40:
            ts, held_out = ts.split(len(ts) - max(len(ts) // 5, 10), random_state=spec.random_state)
        if progress:
            progress("oracle", len(ts), len(ts))
    else:
        if spec.n is None or spec.n < 4:
            raise ValueError("`n` (at least 4 training pairs) is required for an oracle run")
        sampler = spec.sampler(factor)
        rng = np.random.default_rng(spec.random_state)
        n_held = 0 if spec.threshold is not None else max(200, spec.n // 4)
        incoming = sampler(spec.n + n_held, rng)
        train_inc = {v: m[:spec.n] for v, m in incoming.items()}
        ts = _oracle_pairs(spec, factor, oracle, train_inc, progress, "oracle")
        if n_held:
            held_inc = {v: m[spec.n:] for v, m in incoming.items()}
            held_out = _oracle_pairs(spec, factor, oracle, held_inc, progress, "held_out")
    if progress:
        progress("fit", 0, 1)
    # (where the factor's check of its reference holds, the reference answers the rows it checks to within the cap:
    # capped_reference_gate)
    op = KernelOperator(factor, spec.to, n_inner=spec.n_inner, n_outer=spec.n_outer,
                        inner_factors=spec.inner_factors, width_factors=spec.width_factors,
                        reference_gate=capped_reference_gate(factor, spec.kl_cap),
                        random_state=spec.random_state).fit(ts)
    info = {"n_train": len(ts), "n_failed": int(ts.meta.get("n_failed", 0)) if ts.meta else 0}
    if ts.meta and ts.meta.get("failures"):  # why the oracle failed on the dropped pairs (count and first, per cause)
        info["failures"] = ts.meta["failures"]
    if spec.threshold is not None:
        threshold, how = float(spec.threshold), "given"
    else:
        threshold = -np.inf
        if held_out is not None:
            n_regression = int(np.count_nonzero(~op.gated_rows(held_out.incoming)))  # (what the threshold decides)
            threshold = calibrate_threshold(op, held_out, TARGET_KL, min_support=calibration_support(n_regression))
            info["n_held_out"] = len(held_out)
            if held_out.meta and held_out.meta.get("failures"):
                info["held_out_failures"] = held_out.meta["failures"]
            q_hat = op.belief(held_out.incoming)
            info["held_out_mean_kl"] = float(np.mean(held_out.beliefs.kl(q_hat)))
        how = f"calibrated: mean KL <= {TARGET_KL:g} on held-out pairs"
        if not np.isfinite(threshold):
            if factor.default_threshold is not None:
                threshold = float(factor.default_threshold)
                how = ("the factor's default (paper value; no threshold met the calibration target on enough "
                       "held-out pairs)")
            else:
                threshold = FALLBACK_THRESHOLD
                how = "generic fallback (no threshold met the calibration target on enough held-out pairs)"
    jit = guarded_jit(op, oracle, threshold, ts, held_out, initial_batch=spec.initial_batch, kl_cap=spec.kl_cap)
    if jit.density_guard is not None:  # (too few pairs for the share: no guard)
        info["density_guard"] = jit.density_guard
    floor = jit.threshold_floor()
    if np.isfinite(floor):
        info["threshold_floor"] = float(floor)
    note = below_floor_note(jit, how)
    if note is not None:
        info["threshold_note"] = note
    if held_out is not None:
        # what the user can expect: the share of messages like the training ones that mode=jit will send to the
        # oracle (the rule's: the threshold, the sign test, the guards) — a new-user audit's own factor had 95 %
        # and nothing said so
        share = float(np.mean(np.asarray(jit.screen(held_out.incoming)[2], bool)))
        info["held_out_consulted_share"] = share
        if share >= CONSULTATION_NOTE_SHARE:
            info["consultation_note"] = (
                f"mode=jit will ask the oracle for about {share:.0%} of messages like the training ones (the held-out "
                "pairs' share its just-in-time rule consults): EP through it runs near the oracle's pace. Train it on "
                "more pairs (source.n) or with larger features (n_inner, n_outer) for fewer consultations")
    info.update({"threshold": float(threshold), "threshold_source": how,
                 "train_seconds": time.perf_counter() - t0, "hyperparameters": _jsonable(op.hyperparameters())})
    if progress:
        progress("fit", 1, 1)
    return jit, ts, info


def unguarded_note(jit) -> str | None:
    """What a user should know about an operator without a density guard or an input margin (trained before
    the fortieth session, or published without service.training): None for one with either."""
    if getattr(jit, "density_guard", None) is not None or getattr(jit, "input_margin", None) is not None:
        return None
    return ("no density guard and no input margin (trained before they existed, or not by the service): "
            "messages outside its training data are answered by its regression, whose variance does not say "
            "so, and learned by mode=jit and observations, which can move every prediction; train it again "
            "(POST /v1/operators) to have both")


def below_floor_note(jit, how: str | None = None) -> str | None:
    """What a user should know when an operator's threshold lies below its noise floor
    (:meth:`kjit.operators.JITOperator.threshold_note`), with what to do; None otherwise.

    The fallback is not raised to the floor: calibration failing means that even the held-out
    pairs with the least predictive variance missed the KL target, so a threshold at the floor would
    serve as confident answers that calibration found inaccurate.  Consulting every message is slow
    but right; the user is told why and what to do."""
    note = jit.threshold_note()
    if note is None:
        return None
    why = f" ({how})" if how else ""
    return (f"{note}{why}: mode=jit asks the oracle for each message, and EP through this operator runs at the "
            "oracle's pace. To have confident answers, train it on more pairs (source.n) or with larger features "
            "(n_inner, n_outer) until calibration finds a threshold, or give a threshold at or above the floor if "
            "the held-out KL (held_out_mean_kl) is acceptable for your use")


def _jsonable(d):
    return json.loads(json.dumps(d, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def default_specs() -> dict[str, tuple[str, str]]:
    """Operators the server can train by default, ``"<factor>-<to>" → (factor, to)``: every
    direction with an exact rule of a registered factor (built with default parameters) that
    declares a default incoming distribution.  Read from the registry, so plugins count."""
    out = {}
    for name in registered_factors():
        try:
            f = get_factor(name)
        except (TypeError, ValueError):  # a factory that needs parameters
            continue
        if f.default_incoming is None:
            continue
        for to in f.exact_recipients:
            if to not in f.default_untrainable:
                out[f"{name}-{to}"] = (name, to)
    return out


def served_defaults() -> tuple[str, ...]:
    """The operators served by default: each registered factor's ``served`` recipients."""
    specs = default_specs()
    out = []
    for name in registered_factors():
        try:
            f = get_factor(name)
        except (TypeError, ValueError):
            continue
        out += [f"{name}-{to}" for to in f.served if f"{name}-{to}" in specs]
    return tuple(out)
