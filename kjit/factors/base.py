"""Factors, their exact rules, and the registry that finds them.

A factor is declared once, in its own module, with everything specific to it beside it (the
layout of ReactiveMP's ``@node`` + ``@rule`` files and Infer.NET's one ``*Op`` class per factor):

* the factor: ``name``, ``inputs`` → ``output``, the message ``families`` of its variables and a
  sampler (SPEC §2: "any factor that can be sampled" — all the learned path needs);
* its exact rules, one per recipient (methods tagged with :func:`rule`, with ``power`` where the
  powered factor stays tractable), an optional ``log_partition`` (:func:`partition`) and
  optional direct messages (:func:`message_rule`) — :class:`kjit.oracles.QuadratureOracle` looks
  them up here; there is no central switch;
* its defaults for serving: ``default_incoming(n, rng)`` (the incoming-message distribution
  training draws from when none is given), ``default_threshold`` (the JIT threshold used when
  calibration finds none) and ``served`` (the recipients the service trains by default).

Exact rules receive *flat* batches: ``incoming`` maps every variable to a validated message
batch of shape ``(B,)``; a belief rule returns a message of shape ``(B,)``, a partition rule an
array ``(B,)``.  A vectorised exact module with ``belief(to, incoming, **params)`` and
``log_partition(incoming, **params)`` plugs in with :func:`exact_rules`.

Registry
--------
:func:`register_factor` / :func:`get_factor` / :func:`registered_factors`.  The built-in factor
modules register themselves when :mod:`kjit.factors` imports them (every module of the package
is imported, so a new built-in is one new file).  Third-party factors are found

* through the entry-point group ``kjit.factors`` of installed packages (loaded on first use of
  the registry: an entry point may name a Factor subclass, a factory, an instance, or a module
  that registers its factors on import), and
* through modules named explicitly: :func:`import_factor_modules` (``kjit serve --factors
  MODULE[,MODULE]`` / ``KJIT_FACTORS``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import numbers
import threading
import types
from typing import Any, Callable, ClassVar, Iterable, Mapping

import numpy as np

from ..errors import ConfigurationError, OracleError, check_number, quoted
from ..families import FAMILIES, Family, Gamma, Gaussian
from ..reductions import all_

__all__ = [
    "Factor",
    "tilted_laplace",
    "laplace_mode",
    "capped_log_var",
    "MAX_LOG_PARAM",
    "SampledFactor",
    "rule",
    "partition",
    "message_rule",
    "exact_rules",
    "register_factor",
    "get_factor",
    "registered_factors",
    "import_factor_modules",
    "load_entry_points",
    "ENTRY_POINT_GROUP",
    "UnknownFactorError",
    "FactorBuildError",
    "FactorCodeError",
    "FactorParamError",
    "number_param",
    "param_mismatch",
]

log = logging.getLogger("kjit.factors")

ENTRY_POINT_GROUP = "kjit.factors"


class UnknownFactorError(ValueError):
    """No factor of this name is registered (a ``ValueError``; ``.name`` is the name asked for)."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


class FactorCodeError(ValueError):
    """A factor's own code raised: named, as a ``ValueError`` (a 422 in the service), instead of a bare
    exception from inside it (found by an audit: a sampler's RuntimeError or KeyError was a 500, even
    in ``mode=predict`` for an approximation's).  A user's sampler (:class:`SampledFactor`) is named
    whatever it raises but an :class:`~kjit.errors.OracleError` — a MemoryError included (a later
    audit: HTTP 500; an allocation too large for these inputs fails again on a retry, so it is the
    request's 422, not a 503), and a ValueError / ArithmeticError, which reached the client as the
    sampler's bare words; other factor code is named for what :data:`PASSED_THROUGH` lets by.
    ``rows``: the messages whose draws raise it, when known (the per-message sampler finds them)."""

    rows = None

    def __init__(self, name: str, message: str, rows=None):
        self.name = name
        super().__init__(message)
        if rows is not None:
            self.rows = np.asarray(rows, dtype=int).ravel()

    def with_rows(self, rows) -> "FactorCodeError":
        """This error for the messages ``rows`` of the batch, named in its text."""
        rows = np.asarray(rows, dtype=int).ravel()
        return FactorCodeError(self.name, f"{self.args[0]} (on the draws of rows {rows[:10].tolist()}"
                                          f"{'…' if rows.size > 10 else ''})", rows)


#: what a factor's own code may raise as it is (the callers name and map these); a user's sampler's
#: are all named (:meth:`SampledFactor.sample`)
PASSED_THROUGH = (ValueError, ArithmeticError, OracleError, MemoryError)


def factor_code_error(factor, what: str, exc: BaseException) -> FactorCodeError:
    """The :class:`FactorCodeError` for ``exc``, raised by ``factor``'s ``what`` (call sites catch
    everything but :data:`PASSED_THROUGH` and raise this ``from exc``)."""
    name = getattr(factor, "name", "?")
    return FactorCodeError(name, f"factor {name!r}: its {what} raised {type(exc).__name__}: {exc}")


class FactorBuildError(ValueError):
    """A registered factor's factory failed (an exception other than a ValueError / TypeError about
    its parameters) or returned something that is not a Factor: a broken plugin, named, instead of a
    bare exception from inside it (found in review: a 500 on POST /v1/operators, and ``kjit serve``
    would not start)."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


class FactorParamError(ValueError):
    """A factor parameter of the wrong kind or out of its range (a ``ValueError``; ``.param`` names
    it): the service reports it at ``factor_params.<param>``, as pydantic reports a parameter that
    is neither a number nor text."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def number_param(owner: str, param: str, value) -> float:
    """A numeric factor parameter as a float, or :class:`FactorParamError` naming it.

    The service's ``factor_params`` take text as well as numbers (a ``projection``), so a number
    sent as text (``"2"``) reaches the factor's constructor; its range check then failed with
    numpy's own TypeError ("ufunc 'isfinite' not supported for the input types"), which named
    neither the parameter nor what it should be (found in review).  Booleans are not numbers
    here, as in the service's JSON; a 0-d real array is its number."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
        value = value.item()  # (found in review: np.array(0.1) was taken before)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise FactorParamError(param, f"{owner}: `{param}` must be a number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:  # an int beyond a double: the caller's range check names it
        return math.inf if value > 0 else -math.inf


# ============================================================================ rules
def rule(*recipients: str, power: bool = False):
    """Tag a method ``(self, incoming, to, power) -> Family`` as the exact belief rule for
    ``recipients``; ``power=True`` if it computes the tilted distribution of ``f**power``."""
    if not recipients:
        raise ValueError("rule() needs at least one recipient variable")

    def deco(fn):
        fn._kjit_rule = ("belief", tuple(recipients), bool(power))
        return fn

    return deco


def partition(power: bool = False):
    """Tag a method ``(self, incoming, power) -> ndarray`` as the exact log partition
    ``log ∫ f^power Π_W m_W`` (normalised messages)."""

    def deco(fn):
        fn._kjit_rule = ("partition", (None,), bool(power))
        return fn

    return deco


def message_rule(*recipients: str):
    """Tag a method ``(self, incoming, to) -> Family`` that computes the outgoing message to
    ``recipients`` directly (when ``belief / incoming[to]`` is ill-posed, e.g. an observed
    label)."""

    def deco(fn):
        fn._kjit_rule = ("message", tuple(recipients), False)
        return fn

    return deco


def exact_rules(module, recipients: Iterable[str], power: bool = False):
    """Belief and partition rules from a vectorised exact module.

    ``module.belief(to, incoming, [projection=...,] [power=u,] **params) -> Family`` and
    optionally ``module.log_partition(incoming, [power=u,] **params) -> ndarray``, with
    ``params`` the factor's :meth:`Factor.params` — except ``projection`` (a belief-only option,
    e.g. a Gamma belief by KL or by moments), which only the belief rule receives.  In the
    factor's class body::

        _belief, _log_partition = exact_rules(kjit.exact.product, ("x", "y", "z"))
    """
    recipients = tuple(recipients)

    def belief(self, incoming, to, power_=1.0):
        kw = self.params()
        if power:
            kw["power"] = power_
        return module.belief(to, incoming, **kw)

    belief._kjit_rule = ("belief", recipients, bool(power))
    if not hasattr(module, "log_partition"):
        return belief, None

    def log_partition(self, incoming, power_=1.0):
        kw = self.params()
        kw.pop("projection", None)
        if power:
            kw["power"] = power_
        return module.log_partition(incoming, **kw)

    log_partition._kjit_rule = ("partition", (None,), bool(power))
    return belief, log_partition


# ============================================================================ Factor
class Factor:
    """A directed factor: ``inputs`` (possibly none) → one ``output`` variable.

    Subclasses set ``name``, ``inputs``, ``output``, ``families`` and implement
    :meth:`sample`; they may add exact rules (:func:`rule`), a default incoming distribution
    (:meth:`default_incoming`), a default JIT threshold and default served recipients.
    """

    name: str = "factor"
    inputs: tuple[str, ...] = ()
    output: str = ""
    families: Mapping[str, type[Family]] = {}
    #: JIT threshold (log predictive variance) used when calibration finds none; None: the
    #: trainer's generic fallback.
    default_threshold: ClassVar[float | None] = None
    #: recipients whose operators the service trains and serves by default (``<name>-<to>``).
    served: ClassVar[tuple[str, ...]] = ()
    #: ``default_incoming(n, rng) -> dict`` of message batches, or None when the factor has no
    #: documented default distribution (training then needs ranges or recorded messages).
    default_incoming: ClassVar[Callable | None] = None
    #: recipients no operator can be trained for from :meth:`default_incoming`, each with the reason (the service
    #: does not offer them by default and refuses them with that distribution: found by an audit, probit_noise-y
    #: was accepted, 202, and its job always failed)
    default_untrainable: ClassVar[Mapping[str, str]] = {}
    #: why power EP is not available for this factor (shown when it is asked for)
    no_power_reason: ClassVar[str | None] = None

    # rule tables, filled per class by __init_subclass__ from the tagged methods
    _belief_rules: ClassVar[dict[str, tuple[str, bool]]] = {}
    _message_rules: ClassVar[dict[str, str]] = {}
    _partition_rule: ClassVar[tuple[str, bool] | None] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        beliefs = dict(cls._belief_rules)
        messages = dict(cls._message_rules)
        part = cls._partition_rule
        for attr, value in vars(cls).items():
            tag = getattr(value, "_kjit_rule", None)
            if tag is None:
                continue
            kind, recipients, power = tag
            if kind == "belief":
                for r in recipients:
                    beliefs[r] = (attr, power)
            elif kind == "message":
                for r in recipients:
                    messages[r] = attr
            else:
                part = (attr, power)
        cls._belief_rules, cls._message_rules, cls._partition_rule = beliefs, messages, part

    @property
    def variables(self) -> tuple[str, ...]:
        """All variables, inputs first then the output: the order of feature maps."""
        return tuple(self.inputs) + (self.output,)

    def declaration_error(self) -> str | None:
        """What is wrong with this factor's declared ``inputs`` / ``output`` / ``families``, or None: each input
        and the output a distinct non-empty name, each with a message family (a :class:`Family` subclass).  Checked
        where a registered factor is built (:func:`get_factor`; found by an audit: a plugin whose output had no
        family was a KeyError — a 500 from the service — at its first training, a family given as "gaussian" an
        AttributeError, an output listed among the inputs answered without complaint)."""
        inputs, output, fams = self.inputs, self.output, self.families
        if isinstance(inputs, str) or not all(isinstance(v, str) and v for v in inputs):
            return f"`inputs` must be a sequence of variable names, got {repr(inputs)[:100]}"
        if not isinstance(output, str) or not output:
            return f"`output` must be the output variable's name, got {repr(output)[:100]}"
        if len(set(inputs)) != len(tuple(inputs)) or output in inputs:
            return f"its variables must be distinct: inputs {tuple(inputs)!r}, output {output!r}"
        if not isinstance(fams, Mapping):
            return f"`families` must map each variable to a message family, got {type(fams).__name__}"
        for v in self.variables:
            fam = fams.get(v)
            if not (isinstance(fam, type) and issubclass(fam, Family)):
                what = "no family" if fam is None else f"{repr(fam)[:100]}, not a Family subclass (kjit.families)"
                return f"variable {v!r} has {what}"
        return None

    def sample(self, inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
        """Draw the output given arrays of inputs (each of shape ``(size,)``)."""
        raise NotImplementedError

    def suff_stats(self, var: str, draws: Mapping[str, np.ndarray]) -> np.ndarray:
        """Sufficient statistics of ``var`` at the drawn values, shape ``(size, n_stats)``."""
        return self.families[var].suff_stats(draws[var])

    def params(self) -> dict:
        """Constructor parameters (JSON-ready), so a factor can be rebuilt by name."""
        return {}

    def same_as(self, other) -> bool:
        """Whether ``other`` is this factor — an operator for one answers for the other: the same
        class, name and :meth:`params` (see :meth:`mismatch`)."""
        return self.mismatch(other) is None

    def mismatch(self, other, theirs: str = "the other", mine: str = "this one") -> str | None:
        """None if ``other`` is this factor, else a sentence saying what differs — the parameter and
        both values.  The one home of "the same factor": the same class, name and :meth:`params`
        (parameters compare by value, so ones round-tripped through JSON or an npz compare equal).

        ``other``: a Factor, or the ``(name, params)`` that a training set or a saved operator
        records of one (then only the name and parameters can be compared).  ``theirs`` and
        ``mine`` name the two sides in the sentence ("the training set", "the operator").
        Found by an audit: only names were compared, and an operator for gamma_rate(shape=1) fitted
        pairs labelled shape 3 (231 of 493 rows it then accepted at threshold -6 were > 0.1 nats off)."""
        if other is self:
            return None
        if isinstance(other, Factor) and getattr(other, "declared", False) and not getattr(self, "declared", False):
            return other.mismatch(self, mine, theirs)  # (a declaration decides what it stands for)
        if isinstance(other, Factor):
            if type(other) is not type(self):
                return (f"{theirs} and {mine} are for different factors: {other!r} ({type(other).__name__}) "
                        f"for {theirs}, {self!r} ({type(self).__name__}) for {mine}")
            name, params = other.name, other.params()
        else:
            name, params = other
        if name != self.name:
            return f"{theirs} and {mine} are for different factors: {name!r} for {theirs}, {self.name!r} for {mine}"
        why = param_mismatch(params, self.params(), theirs, mine)
        return None if why is None else f"{theirs} and {mine} are for different factors: {self.name!r} with {why}"

    def check_same(self, other, theirs: str = "the other", mine: str = "this one") -> None:
        """:class:`~kjit.errors.ConfigurationError` (a ValueError) with :meth:`mismatch`'s sentence
        unless ``other`` is this factor."""
        why = self.mismatch(other, theirs, mine)
        if why is not None:
            raise ConfigurationError(why)

    def log_concave(self, to: str, incoming: Mapping[str, Family]) -> np.ndarray | None:
        """Rows (of the flat batch ``incoming``) where the factor, with the other variables'
        incoming messages integrated out, is log-concave in ``to`` — or None where unknown.

        For a Gaussian recipient this is a guarantee on the answer (Brascamp–Lieb: a Gaussian
        times a log-concave function has variance at most the Gaussian's), so the projected
        belief is never wider than ``incoming[to]`` and the outgoing message never has a
        negative precision.  Operators use it to keep learned or sampled answers on the right
        side of that bound (see :func:`kjit.operators.respect_factor_bounds`).
        """
        return None

    def approximate_belief(self, incoming: Mapping[str, Family], to: str) -> Family | None:
        """A cheap closed-form approximation of the belief on ``to`` (flat batches), or None (the
        default: none is known).

        A learned operator regresses the belief relative to a reference message
        (``Family.to_relative``); by default the reference is the recipient's incoming message, and
        where the belief lies far from it (a recipient whose message is much wider than what the
        factor implies, e.g. the product's z) the regression must learn that whole move.  A
        factor that knows an approximation (moment matching, a linearisation) returns it here, and
        the operator learns only the approximation's error.  It must be proper and finite for
        proper incoming messages (rows that overflow are refused by name), and transform with
        :meth:`symmetry` if the factor declares one (relative targets must stay unchanged by it).
        A factor that changes its approximation raises :attr:`approximation_revision` and keeps the
        earlier ones in :attr:`earlier_approximations`: operators fitted relative to them stay valid.
        """
        return None

    #: the revision of :meth:`approximate_belief`; a learned operator records the one it was fitted
    #: relative to (its targets are relative to that approximation)
    approximation_revision: ClassVar[int] = 1
    #: earlier revisions still available, ``{revision: name of the method computing it}`` (same
    #: signature as :meth:`approximate_belief`)
    earlier_approximations: ClassVar[dict[int, str]] = {}

    def checked_answer(self, q, incoming: Mapping[str, Family], to: str, what: str) -> Family:
        """``q``, the belief on ``to`` that the factor's ``what`` (its approximation, an exact rule) gave for the
        flat batch ``incoming``, if it is one: a message of ``to``'s family with one row per message, else a
        :class:`FactorCodeError` naming what it returned (found by an audit of a user's factor, served: an
        array was an HTTP 500, a Gamma for a Gaussian recipient was read as a Gaussian — learned, silently)."""
        fam = self.families[to]
        if not isinstance(q, fam):
            raise FactorCodeError(self.name, f"factor {self.name!r}: its {what} returned {type(q).__name__}, not a "
                                             f"{fam.__name__} belief on {to!r}")
        shape = np.broadcast_shapes(*(m.shape for m in incoming.values()))  # (a message may broadcast)
        if q.shape != shape:
            raise FactorCodeError(self.name, f"factor {self.name!r}: its {what} returned a belief of shape {q.shape} "
                                             f"for messages of shape {shape}")
        return q

    def reference_belief(self, incoming: Mapping[str, Family], to: str, revision: int | None = None) -> Family | None:
        """:meth:`approximate_belief` as it was at ``revision`` (None: the current one), from
        :attr:`earlier_approximations`; asking for a revision the factor no longer has is an error
        naming both."""
        method = None if revision is None else self.earlier_approximations.get(int(revision))
        if method is None and revision is not None and int(revision) != self.approximation_revision:
            raise ValueError(f"factor {self.name!r} has approximation revision {self.approximation_revision}; an "
                             f"operator fitted relative to revision {revision} cannot be evaluated with it")
        try:
            q = getattr(self, method)(incoming, to) if method is not None else self.approximate_belief(incoming, to)
        except PASSED_THROUGH:
            raise
        except Exception as exc:  # a user factor's own bug, named (FactorCodeError)
            raise factor_code_error(self, "approximation", exc) from exc
        return None if q is None else self.checked_answer(q, incoming, to, "approximation")

    def reference_error(self, incoming: Mapping[str, Family], to: str, revision: int | None = None,
                        reference=None) -> np.ndarray | None:
        """A per-row estimate of the squared error of :meth:`reference_belief` (at ``revision``, None:
        the current one), shape (n, k): in the recipient family's coordinates *relative to the
        reference* (``Family.to_relative``), the units a learned operator regresses in, so it adds
        to the operator's predictive variance per coordinate.  None (the default): no estimate.

        A learned correction is smooth in the messages; where the reference fails abruptly (a
        quadrature whose nodes miss a mode) the correction cannot follow, and the regression's
        variance, which measures distance to the training inputs, does not see it.  A factor whose
        reference can fail that way estimates the failure here, e.g. by a second, finer rule.
        Deterministic and vectorised over the flat batch ``incoming``; rows with no finite
        estimate are +inf.  ``reference``: the coordinates (n, k) of ``reference_belief(incoming,
        to, revision)`` when the caller has them already (a learned operator does), so they are not
        computed again."""
        return None

    #: the largest estimated squared error at which :meth:`reference_error` has been measured to bound the
    #: reference's actual error (its rows' KL to the exact rule about the estimate's size); None (the default):
    #: not measured — operators gate on the reference only below ``REFERENCE_GATE`` (1e-12), where any check
    #: that sees the failure at all is reliable.  A served operator's gate may reach it
    #: (:func:`kjit.learn.kernel_operator.capped_reference_gate`)
    reference_check_holds: ClassVar[float | None] = None

    def symmetry(self, incoming: Mapping[str, Family]) -> dict[str, tuple] | None:
        """A per-row change of units under which the factor is invariant, or None (the default).

        Returns ``{variable: (scale, shift)}`` (arrays over the flat batch ``incoming``): the map
        ``x_v -> scale_v·x_v + shift_v`` of every variable changes the factor's density by a
        constant only (e.g. N(x; m, 1/τ) under x, m -> (· − c)/s, τ -> s²τ).  The maps depend on
        the incoming messages (the "frame" of the row), so applying them to those messages puts
        every row in one canonical frame, where a learned operator sees only what the frame does
        not fix.  Beliefs transform with the same map, so coordinates *relative* to the
        recipient's incoming message (``Family.to_relative``) are unchanged: see
        :meth:`canonical_messages`.
        """
        return None

    def canonical_messages(self, incoming: Mapping[str, Family]) -> dict[str, Family] | None:
        """The incoming messages (flat batches, all variables) mapped by :meth:`symmetry`, or None
        when the factor declares no symmetry."""
        sym = self.symmetry(incoming)
        if sym is None:
            return None
        with np.errstate(all="ignore"):  # an overflowing frame gives improper messages: service.validation names their rows
            return {v: incoming[v].affine(*sym[v]) if v in sym else incoming[v] for v in self.variables}

    def log_density(self, *args, **kw):  # pragma: no cover - optional
        raise NotImplementedError(f"factor {self.name!r} has no log density")

    def laplace_log_density(self):
        """The object Laplace propagation needs (``site_var``, ``derivatives(x, observed)``), or
        ``ValueError`` saying why this factor has none (the default: none is known)."""
        raise ValueError(
            f"no log density is known for factor {self.name!r}: pass an object with "
            "site_var and derivatives(x, observed) -> (log f, d/dx, d²/dx²)"
        )

    # -------------------------------------------------------------- exact rules
    @property
    def exact_recipients(self) -> tuple[str, ...]:
        """Recipients with an exact rule, in variable order."""
        return tuple(v for v in self.variables if v in self._belief_rules)

    def has_exact(self, to: str) -> bool:
        return to in self._belief_rules

    def supports_power(self, to: str | None = None) -> bool:
        """Whether the exact rule for ``to`` (None: the partition rule) handles ``power`` ≠ 1."""
        if to is None:
            return self._partition_rule is not None and self._partition_rule[1]
        r = self._belief_rules.get(to)
        return r is not None and r[1]

    def _power(self, power, to, what):
        u = float(power)
        if u == 1.0:
            return u
        if not (np.isfinite(u) and u > 0):
            raise ValueError(f"`power` must be a finite number > 0, got {power!r}")
        supported = self.supports_power(to) if what == "belief" else self.supports_power(None)
        if not supported:
            target = f"to {to!r}" if what == "belief" else "for the log partition"
            why = self.no_power_reason or "its exact rule does not compute the tilted distribution of f^power"
            raise ValueError(f"power EP is not supported for factor {self.name!r} {target}: {why}")
        return u

    def exact_belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        """The exact projected belief on ``to`` for flat validated batches (see the module doc)."""
        r = self._belief_rules.get(to)
        if r is None:
            raise ValueError(f"factor {self.name!r} has no exact rule for recipient {to!r} "
                             f"(it has: {', '.join(self.exact_recipients) or 'none'})")
        u = self._power(power, to, "belief")
        try:
            q = getattr(self, r[0])(incoming, to, u)
        except PASSED_THROUGH:
            raise
        except Exception as exc:  # a user factor's own bug, named (FactorCodeError)
            raise factor_code_error(self, f"exact rule for {to!r}", exc) from exc
        q = self.checked_answer(q, incoming, to, f"exact rule for {to!r}")
        ok = q.proper_and_finite()
        if not ok.all():  # (the oracles' by-row signal: the service answers 422 naming them)
            rows = np.flatnonzero(~ok.ravel())  # (ok has the batch's shape: checked_answer)
            raise OracleError(f"factor {self.name!r}: its exact rule for {to!r} answered no proper distribution with "
                              f"finite parameters for rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''}",
                              rows=rows)
        if isinstance(q, Gaussian) and isinstance(incoming.get(to), Gaussian):
            lc = self.log_concave(to, incoming)
            if lc is not None:
                # Brascamp–Lieb (see log_concave): a belief twice as wide is a rule that lost its
                # accuracy — messages beyond what doubles can resolve (N(1e50, 1), Beta(1, 1e100) on
                # logistic's z: found in review, answered as N(1e50, 4e70) and N(−5e58, 1e117)).  Less
                # is round-off (a second review: 1e-3 relative at |mean|/sd ~ 1e8), which the operators
                # move onto the bound (respect_factor_bounds) as before
                with np.errstate(invalid="ignore"):
                    bad = np.asarray(lc, bool) & ~(np.asarray(q.var(), float) <= 2.0 * np.asarray(incoming[to].var(), float))
                if bad.any():
                    rows = np.flatnonzero(np.broadcast_to(bad, q.shape).ravel())
                    raise OracleError(f"factor {self.name!r}: the exact rule's belief on {to!r} is wider than the incoming "
                                      f"message (twice or more) for rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''}, "
                                      "which a log-concave factor cannot give: the messages are beyond the rule's "
                                      "numerical reach", rows=rows)
        return q

    def exact_message(self, incoming: Mapping[str, Family], to: str) -> Family:
        """The exact outgoing message to ``to``: a direct rule if the factor has one, else
        ``belief / incoming[to]``."""
        name = self._message_rules.get(to)
        if name is not None:
            return getattr(self, name)(incoming, to)
        return self.exact_belief(incoming, to) / incoming[to]

    def exact_log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        if self._partition_rule is None:
            raise ValueError(f"factor {self.name!r} has no exact log-partition rule")
        u = self._power(power, None, "partition")
        return getattr(self, self._partition_rule[0])(incoming, u)

    # -------------------------------------------------------------- validation helpers
    def check_to(self, to: str) -> str:
        if to not in self.variables:
            raise ValueError(
                f"unknown recipient variable `to`={to!r} for factor {self.name!r}; "
                f"its variables are {', '.join(self.variables)}"
            )
        return to

    def check_incoming(self, incoming: Mapping[str, Family], to: str | None = None):
        """Validate a dict of incoming messages; return it with a common batch shape.

        Every variable of the factor needs a message of its family; batch shapes must be
        equal (a scalar message broadcasts), and hold at least one message.  Raises ``ValueError``
        naming the problem.
        """
        if to is not None:
            self.check_to(to)
        if type(incoming) is not dict and not isinstance(incoming, Mapping):  # (dict: no ABC check)
            raise ValueError("`incoming` must be a mapping from variable name to message")
        variables, families = self.variables, self.families
        unknown = [k for k in incoming if k not in variables]
        if unknown:
            raise ValueError(
                f"unknown variable(s) {', '.join(map(repr, unknown))} in `incoming` for factor "
                f"{self.name!r}; its variables are {', '.join(variables)}"
            )
        missing = [v for v in variables if v not in incoming]
        if missing:
            raise ValueError(
                f"`incoming` lacks message(s) for {', '.join(map(repr, missing))} (factor {self.name!r})"
            )
        shapes = {}
        for v in variables:
            m, fam = incoming[v], families[v]
            if not isinstance(m, fam):
                raise ValueError(f"`incoming[{v!r}]` must be a {fam.__name__} message, got {type(m).__name__}")
            if not all_(np.asarray(m.is_proper)):
                raise ValueError(f"`incoming[{v!r}]` contains improper messages")
            shapes[v] = m.shape
        nonscalar = {s for s in shapes.values() if s != ()}
        if len(nonscalar) > 1:
            desc = ", ".join(f"{v}{s}" for v, s in shapes.items())
            raise ValueError(f"mismatched batch shapes in `incoming`: {desc}")
        shape = nonscalar.pop() if nonscalar else ()
        if 0 in shape:  # (found by an audit: a raw numpy reshape error deep in the quadrature)
            raise ValueError(f"`incoming` holds no messages (batch shape {shape})")
        return {v: incoming[v] if shapes[v] == shape else incoming[v].broadcast_to(shape) for v in variables}, shape

    def flat_incoming(self, incoming: Mapping[str, Family], to: str | None = None):
        """:meth:`check_incoming`, each batch then flattened: ``({variable: 1-D batch}, batch shape)``."""
        inc, shape = self.check_incoming(incoming, to)
        return {v: m.ravel() for v, m in inc.items()}, shape

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class SampledFactor(Factor):
    """A user factor from a sampler: ``sampler(inputs: dict[str, ndarray], rng) -> output``.

    Example — a product factor z = x·y::

        prod = SampledFactor("my_product", inputs={"x": Gaussian, "y": Gaussian},
                             output=("z", Gaussian),
                             sampler=lambda v, rng: v["x"] * v["y"])
        register_factor(prod)

    ``approximate(incoming, to)``, optional: a cheap closed-form approximation of the belief on
    ``to`` (or None for a recipient it does not cover); learned operators then regress only its
    error (:meth:`Factor.approximate_belief`).
    """

    def __init__(
        self,
        name: str,
        inputs: Mapping[str, type[Family]],
        output: tuple[str, type[Family]],
        sampler: Callable[[Mapping[str, np.ndarray], np.random.Generator], np.ndarray],
        approximate: Callable[[Mapping[str, Family], str], Family | None] | None = None,
    ):
        if not name or not isinstance(name, str):
            raise ValueError("`name` must be a non-empty string")
        if not callable(sampler):
            raise ValueError("`sampler` must be a callable (inputs, rng) -> output draws")
        if approximate is not None and not callable(approximate):
            raise ValueError("`approximate` must be None or a callable (incoming, to) -> Family or None")
        if not isinstance(inputs, Mapping) or not inputs:
            # (the sampler is told the sample size only through its inputs' draws)
            raise ValueError("`inputs` must map at least one input variable to its Family")
        # ("zz" was unpacked as a variable z of family "z")
        if not (isinstance(output, (tuple, list)) and len(output) == 2):
            raise ValueError(f"`output` must be a (name, Family) pair such as ('z', Gaussian), got {output!r}")
        out_name, out_family = output
        for v, fam in list(inputs.items()) + [(out_name, out_family)]:
            # identifiers, as a declared factor's: variable names are JSON keys and parts of error
            # locations (found by an audit: a name 1 was a 500 at POST /v1/operators)
            if not isinstance(v, str) or not v.isidentifier():
                raise ValueError(f"variable name {v!r} of factor {name!r} must be an identifier string")
            if not (isinstance(fam, type) and issubclass(fam, Family)) or fam not in FAMILIES.values():
                raise ValueError(f"family of variable {v!r} must be one of kjit's families "
                                 f"({', '.join(c.__name__ for c in FAMILIES.values())}), got {fam!r}")
        if out_name in inputs:
            raise ValueError(f"output variable {out_name!r} is also an input")
        self.name = name
        self.inputs = tuple(inputs)
        self.output = out_name
        self.families = {**dict(inputs), out_name: out_family}
        self._sampler = sampler
        self._approximate = approximate

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        """The factor itself: it is the same factor only as the same object (:meth:`mismatch`), and a
        copied operator still answers for it (a factor is not changed after it is built)."""
        return self

    #: the registry's factory that built this factor (:func:`get_factor`), if one did
    _origin = None

    def mismatch(self, other, theirs: str = "the other", mine: str = "this one") -> str | None:
        """As :meth:`Factor.mismatch`, but another SampledFactor is this one only if the same registered
        factory built both (each :func:`get_factor` of a factory is a new object: a saved operator and its
        oracle are rebuilt so — found in review), else never: two sampled factors of one name may sample
        different things (a recorded ``(name, params)`` is compared as usual)."""
        if isinstance(other, Factor) and getattr(other, "declared", False):
            return other.mismatch(self, mine, theirs)  # (a declaration decides what it stands for)
        if isinstance(other, Factor) and other is not self and (
                self._origin is None or getattr(other, "_origin", None) is not self._origin):
            return (f"{theirs} is for another sampled factor named {other.name!r} ({mine}'s is {self.name!r}): "
                    f"sampled factors are the same only as the same object, or built by the same registered factory")
        return super().mismatch(other, theirs, mine)

    def approximate_belief(self, incoming, to):
        """The ``approximate`` callable's answer (see :meth:`Factor.approximate_belief`), or None.  Whatever the
        callable raises but an :class:`~kjit.errors.OracleError` is named (:class:`FactorCodeError`), as the
        sampler's is (found by an audit: a MemoryError of a user's approximation was an HTTP 500 in
        ``mode=predict``)."""
        to = self.check_to(to)
        if self._approximate is None:
            return None
        try:
            return self._approximate(incoming, to)
        except OracleError:
            raise
        except Exception as exc:  # the user's approximation's own error, whatever it is, named
            raise factor_code_error(self, "approximation", exc) from exc

    def sample(self, inputs, size, rng):
        try:
            raw = np.asarray(self._sampler({k: inputs[k] for k in self.inputs}, rng))
        except OracleError:  # (an oracle's own signal, with its rows)
            raise
        except Exception as exc:  # the user's sampler's own error, whatever it is, named (FactorCodeError)
            raise factor_code_error(self, "sampler", exc) from exc
        return raw  # (its dtype and shape are checked where every factor's draws are: kjit.oracles.sample_output)


# ============================================================================ registry
_REGISTRY: dict[str, Callable[..., Factor]] = {}
_LOCK = threading.RLock()
_ENTRY_POINTS_LOADED = False
_PLUGIN_ERRORS: dict[str, str] = {}  # entry point or module → why it could not be loaded


def register_factor(factor: Factor | Callable[..., Factor], name: str | None = None, replace: bool = False) -> None:
    """Register a factor instance (or a factory of them, e.g. a Factor subclass) under ``name``.

    Registering the very same object again under its name is a no-op (a module imported twice,
    or a plugin that registers itself and is also named by its entry point).
    """
    if isinstance(factor, Factor):
        inst = factor
        factory = lambda **kw: inst  # noqa: E731 - a fixed instance
        factory._kjit_instance = inst
        name = name or inst.name
        if name != inst.name:  # operators save a factor by its own name and rebuild it from the registry
            raise ValueError(f"a factor instance named {inst.name!r} cannot be registered as {name!r}: operators "
                             f"save a factor by its own name and rebuild it from the registry under that name "
                             f"(give the instance the name {name!r})")
    elif callable(factor):
        factory = factor
        name = name or getattr(factor, "name", None)
    else:
        raise ValueError("`factor` must be a Factor or a callable returning one")
    if not name or not isinstance(name, str):
        raise ValueError("`name` is required to register this factor")
    with _LOCK:
        old = _REGISTRY.get(name)
        if old is not None and not replace:
            if old is factory or getattr(old, "_kjit_instance", None) is factor:
                return
            raise ValueError(f"a factor named {name!r} is already registered (pass replace=True)")
        _REGISTRY[name] = factory


def load_entry_points(force: bool = False) -> list[str]:
    """Load the ``kjit.factors`` entry points of installed packages (once; ``force`` again).

    Each entry point may name a Factor subclass or factory (registered under its ``name``
    attribute, else the entry point's name), a Factor instance, or a module whose import
    registers its factors.  A plugin that fails to load is logged and remembered (the error of
    :func:`get_factor` for a missing name reports it), never fatal.  Returns the entry points
    loaded by this call.
    """
    global _ENTRY_POINTS_LOADED
    with _LOCK:
        if _ENTRY_POINTS_LOADED and not force:
            return []
        _ENTRY_POINTS_LOADED = True
        from importlib.metadata import entry_points

        loaded = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if not isinstance(obj, types.ModuleType):
                    nm = getattr(obj, "name", None) if not isinstance(obj, Factor) else obj.name
                    if not isinstance(nm, str) or not nm or (isinstance(obj, type) and nm == Factor.name):
                        nm = ep.name
                    register_factor(obj, name=nm)
                loaded.append(ep.name)
                _PLUGIN_ERRORS.pop(f"entry point {ep.name}", None)
            except Exception as exc:  # a broken plugin must not take kjit down
                _PLUGIN_ERRORS[f"entry point {ep.name}"] = f"{type(exc).__name__}: {exc}"
                log.warning("kjit.factors entry point %r (%s) failed to load: %s", ep.name, ep.value, exc)
        return loaded


def import_factor_modules(modules: str | Iterable[str]) -> list[str]:
    """Import the modules that define (and register) factors: ``"pkg.mod,other.mod"`` or a list.

    Raises ``ValueError`` naming a module that cannot be imported (a server asked to serve a
    factor it cannot find should not start).  Returns the module names imported.
    """
    if isinstance(modules, str):
        modules = [m.strip() for m in modules.split(",")]
    names = [m for m in modules if m]
    for m in names:
        try:
            importlib.import_module(m)
        except Exception as exc:
            raise ValueError(f"factor module {m!r} could not be imported: {type(exc).__name__}: {exc}") from None
        except SystemExit as exc:  # (found by an audit: the server ended silently with its code)
            raise ValueError(f"factor module {m!r} could not be imported: it called sys.exit({exc.code!r}) "
                             f"while being imported") from None
    return names


def get_factor(name: str, **params) -> Factor:
    """Build the registered factor ``name`` with constructor ``params``."""
    factory = _REGISTRY.get(name)
    if factory is None:
        load_entry_points()
        factory = _REGISTRY.get(name)
    if factory is None:
        msg = (f"unknown factor {quoted(name)}; registered: {', '.join(sorted(_REGISTRY))} (a factor of your own "
               "module: load it with KJIT_FACTORS=module / `kjit serve --factors module`, or a `kjit.factors` "
               "entry point)")
        if _PLUGIN_ERRORS:
            msg += "; plugins that failed to load: " + "; ".join(f"{k} ({v})" for k, v in _PLUGIN_ERRORS.items())
        raise UnknownFactorError(name, msg)
    def broken(why: str) -> FactorBuildError:  # remembered with the plugins' errors, and logged
        _PLUGIN_ERRORS[f"factory {name}"] = why = f"factor {name!r}: {why}"
        log.warning("%s", why)
        return FactorBuildError(name, why)

    if params and getattr(factory, "_kjit_instance", None) is not None:
        raise ValueError(f"factor {name!r} is a registered instance: it takes no parameters "
                         f"(got {', '.join(sorted(params))})")
    try:
        factor = factory(**params)
    except (ValueError, TypeError):
        raise  # the parameters: the caller names them
    except Exception as exc:  # a plugin's own bug
        raise broken(f"its factory failed ({type(exc).__name__}: {exc})") from exc
    if not isinstance(factor, Factor):
        raise broken(f"its factory returned {type(factor).__name__}, not a Factor")
    if (why := factor.declaration_error()) is not None:
        raise broken(why)
    # an operator saves its factor as (name, params()) and rebuilds it by get_factor: a factor that
    # calls itself otherwise, or does not report a parameter it was built with, would come back as
    # another factor — an operator trained on one and answering (and learning from) another's
    # oracle (found by an audit: a class without params() served with its default parameters)
    if factor.name != name:
        raise broken(f"its factory built a factor named {factor.name!r}; operators save a factor by its "
                     f"name and rebuild it from the registry, so it must be named {name!r}")
    if params:
        try:
            reported = factor.params()
        except Exception as exc:  # noqa: BLE001 - a plugin's own bug
            raise broken(f"its params() failed ({type(exc).__name__}: {exc})") from exc
        lost = [k for k in params if k not in reported]
        changed = [k for k, val in params.items() if k in reported and not _same_param(reported[k], val)]
        if changed and not lost:
            # a factory may normalise a parameter (a tuple kept as a list, a name in lower case): what
            # matters is that its params() rebuild the same factor (found in review)
            try:
                again = factory(**reported)
                lost = [] if again.same_as(factor) else changed
            except Exception:  # noqa: BLE001 - params() that do not rebuild it are the error below
                lost = changed
        if lost:
            raise ValueError(f"factor {name!r} does not report its parameter(s) {', '.join(map(repr, lost))} in "
                             f"params() (it gives {reported!r}): operators save a factor as its name and "
                             f"params() and rebuild it from them, so the factor must report every parameter "
                             f"it is built with (override Factor.params)")
    if isinstance(factor, SampledFactor) and getattr(factory, "_kjit_instance", None) is None:
        factor._origin = factory  # (SampledFactor.mismatch: built by this registration)
    return factor


def param_mismatch(theirs_params: Mapping, mine_params: Mapping, theirs: str = "the other",
                   mine: str = "this one") -> str | None:
    """None if two :meth:`Factor.params` dicts are the same parameters (see :meth:`Factor.mismatch`), else
    each differing parameter with both values ("`shape` 3.0 for the training set, 1.0 for the operator")."""
    keys = list(mine_params) + [k for k in theirs_params if k not in mine_params]
    parts = []
    for k in keys:
        if k not in theirs_params:
            parts.append(f"`{k}` {mine_params[k]!r} for {mine}, none recorded for {theirs}")
        elif k not in mine_params:
            parts.append(f"`{k}` {theirs_params[k]!r} for {theirs}, no such parameter for {mine}")
        elif not _same_param(theirs_params[k], mine_params[k]):
            parts.append(f"`{k}` {theirs_params[k]!r} for {theirs}, {mine_params[k]!r} for {mine}")
    return "; ".join(parts) if parts else None


def _same_param(a, b) -> bool:
    """Parameter values compare by value: an int and the float of it, a tuple and the list JSON keeps of
    it, dicts entry by entry, two NaNs (JSON and npz write one back as one) — each the same."""
    try:
        if isinstance(a, Mapping) or isinstance(b, Mapping):
            return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                    and all(_same_param(a[k], b[k]) for k in a))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and not any(
                isinstance(v, np.ndarray) for v in (*a, *b)):
            return len(a) == len(b) and all(_same_param(x, y) for x, y in zip(a, b))
        if isinstance(a, numbers.Real) and isinstance(b, numbers.Real) and not isinstance(a, bool) \
                and not isinstance(b, bool) and math.isnan(a) and math.isnan(b):
            return True
        same = a == b
        if isinstance(same, np.ndarray):
            return bool(np.all(same)) and np.shape(a) == np.shape(b)
        if bool(same):
            return True
        if isinstance(a, (list, tuple, np.ndarray)) or isinstance(b, (list, tuple, np.ndarray)):
            x, y = np.asarray(a), np.asarray(b)  # (a tuple kept as a list: the same numbers)
            return x.shape == y.shape and bool(np.all((x == y) | ((x != x) & (y != y))))
        return False
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return False


def registered_factors() -> tuple[str, ...]:
    load_entry_points()
    return tuple(sorted(_REGISTRY))


def _exported(module) -> dict[str, Any]:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in names}


# ============================================================================ helpers for rule code
def check_power(power) -> float:
    """``power`` as a float, or ``ValueError`` unless it is a finite real number > 0 (not text: ``"0.5"`` passed
    ``float()`` here while the engines refused it — :func:`kjit.errors.check_number`, the one check)."""
    return check_number("power", power, 0.0, low_open=True)


def broadcast_messages(incoming: Mapping[str, Family], names) -> tuple[tuple[int, ...], list[Family]]:
    """The messages ``incoming[n]`` for ``names`` broadcast to one batch shape: ``(shape, list)``."""
    missing = [n for n in names if n not in incoming]
    if missing:
        raise ValueError(f"incoming messages missing for {missing}")
    shape = np.broadcast_shapes(*(incoming[n].shape for n in names))
    return shape, [incoming[n].broadcast_to(shape) if incoming[n].shape != shape else incoming[n] for n in names]


PROJECTIONS = ("kl", "moments")


def check_projection(projection) -> str:
    """A Gamma (non-Gaussian) belief's projection: ``"kl"`` (match E[x], E[log x]; the default) or
    ``"moments"`` (match mean and variance, Infer.NET's convention for some factors)."""
    if projection not in PROJECTIONS:
        raise FactorParamError("projection", f"`projection` must be one of {', '.join(map(repr, PROJECTIONS))}, "
                                             f"got {projection!r}")
    return projection


# e^700 ≈ 1e304: the largest exponential an approximation of a belief (a learned operator's reference,
# which need only be proper) lets a parameter or a mean reach
MAX_LOG_PARAM = 700.0


def capped_log_var(mean_log, var_log):
    """A log-normal reference's log-variance, capped where its mean e^{μ + σ²/2} would pass
    e^MAX_LOG_PARAM (:meth:`Gamma.from_log_normal` could not represent it)."""
    return np.minimum(var_log, np.maximum(2.0 * (MAX_LOG_PARAM - np.asarray(mean_log, dtype=float)), 0.0))


#: iterations of :func:`laplace_mode`: each halves the bracket at least, and ~1100 halvings take any
#: finite bracket to the spacing of doubles — a row stops at its own convergence (usually in a few
#: Newton steps), so the cap only matters for a bracket as wide as 1e100 (a Gamma message of rate
#: 1e100 on exp's y), where 200 left the stationary point at ~1e40 (found in review: the learned
#: operator's reference, hence its prediction, was −1.2e40 for a belief at −224.8)
LAPLACE_MAX_ITER = 1100


def laplace_mode(dlog: Callable, lo, hi, start=None, max_iter: int = LAPLACE_MAX_ITER, tol: float = 1e-12):
    """Mode t* of a univariate log density g (vectorised over rows) and −g''(t*).

    ``dlog(t, rows) -> (g'(t), g''(t))`` for the rows ``rows`` (an index array into the batch, or
    ``slice(None)`` while every row is evaluated; ``t`` holds their points; for a batch of one row
    the iteration passes ``rows`` = 0 and ``t`` a scalar: elementwise code serves both); ``[lo, hi]``
    must bracket a root of g' (g'(lo) ≥ 0 ≥ g'(hi)).
    Newton's method, kept inside the bracket (a step that leaves it, or a point of non-negative
    curvature, bisects instead), which shrinks on every iterate: where g is concave this is its
    mode; elsewhere a stationary point.  ``start``: the first iterate (default the bracket's
    midpoint).  Each row stops at its first step below ``tol`` (relative) and is not evaluated
    again, so its answer does not depend on the other rows of the batch and a batch costs what its
    rows' own iterations cost.  Returns ``(t*, −g''(t*))``.
    """
    lo, hi = np.array(lo, dtype=float), np.array(hi, dtype=float)
    if lo.size == 1 and hi.size == 1:  # one row (a served batch-1 request): the same steps on scalars
        one = _one_row_start(lo.item(), hi.item(), start)
        if one is not None:
            with np.errstate(all="ignore"):  # (as the array path: dlog may overflow on a far start)
                return _laplace_mode_one(dlog, *one, max_iter, tol)
    every = slice(None)
    with np.errstate(all="ignore"):
        t = np.clip(0.5 * (lo + hi) if start is None else np.asarray(start, dtype=float), lo, hi)
        t = np.array(t if t.shape == lo.shape else np.broadcast_to(t, lo.shape), dtype=float).ravel()
        lo, hi = lo.ravel().copy(), hi.ravel().copy()
        dx_old = np.abs(hi - lo)  # the step before last, per row (rtsafe's safeguard)
        if t.size == 1:  # one row with a non-finite bound or start
            return _laplace_mode_one(dlog, t[0], lo[0], hi[0], dx_old[0], max_iter, tol)
        idx = every  # the rows still iterating: all of them (no gathers) until the first stops
        for _ in range(max_iter):
            ti, li, hi_, d_old = t[idx], lo[idx], hi[idx], dx_old[idx]
            g1, g2 = dlog(ti, idx)
            right = g1 > 0  # the root is to the right of t
            li, hi_ = np.where(right, ti, li), np.where(right, hi_, ti)
            step = -g1 / g2
            # Newton where it stays in the bracket, the curvature is negative and the step at most
            # half the one before last (else it may cycle); bisection otherwise
            newton = ti + step
            use = (newton >= li) & (newton <= hi_) & (g2 < 0) & (np.abs(step) <= 0.5 * d_old)
            new = np.where(use, newton, 0.5 * (li + hi_))
            new = np.where(g1 == 0, ti, new)
            dx = np.abs(new - ti)
            going = dx > tol * np.maximum(1.0, np.abs(ti))
            t[idx], lo[idx], hi[idx], dx_old[idx] = new, li, hi_, np.where(use, np.abs(step), 0.5 * np.abs(hi_ - li))
            if going.all():
                continue
            idx = (np.arange(t.size) if idx is every else idx)[going]
            if idx.size == 0:
                break
        return t, -dlog(t, every)[1]  # (flat, as the rows)


def _one_row_start(lo: float, hi: float, start):
    """``(t, lo, hi, |hi − lo|)`` for :func:`laplace_mode`'s one-row iteration, or None — then the
    array path — unless the bracket and the start are finite and the start lies strictly inside
    the bracket, where ``np.clip`` leaves it as it is (at a bound numpy's clip returns the bound,
    whose zero may have the other sign: −0.0 vs 0.0)."""
    if start is None:
        t = 0.5 * (lo + hi)
    else:
        s = start if isinstance(start, np.ndarray) else np.asarray(start, dtype=float)
        if s.size != 1:
            return None
        t = float(s.item())
    if not (math.isfinite(t) and math.isfinite(lo) and math.isfinite(hi) and lo < t < hi):
        return None
    return t, lo, hi, abs(hi - lo)


def _laplace_mode_one(dlog, ti, li, hi_, d_old, max_iter, tol):
    """:func:`laplace_mode`'s iteration for a batch of one row, step for step on scalars —
    ``dlog`` too (``rows`` = 0): the same IEEE operations as on arrays, so the same doubles, at a
    fraction of one-element arrays' cost.  ``ti``: the row's start."""
    for _ in range(max_iter):
        g1, g2 = dlog(ti, 0)
        if g1 > 0:  # the root is to the right of t
            li = ti
        else:
            hi_ = ti
        step = -g1 / g2
        newton = ti + step
        use = (newton >= li) and (newton <= hi_) and (g2 < 0) and (abs(step) <= 0.5 * d_old)
        new = ti if g1 == 0 else (newton if use else 0.5 * (li + hi_))
        a = abs(ti)
        scale = a if (a > 1.0 or a != a) else 1.0  # np.maximum(1.0, |t|), NaN included
        going = abs(new - ti) > tol * scale
        d_old = abs(step) if use else 0.5 * abs(hi_ - li)
        ti = new
        if not going:
            break
    return np.array([ti], dtype=float), np.array([-dlog(ti, 0)[1]], dtype=float)


#: Gauss–Hermite nodes of the factors' quadrature references (product, gamma_rate, exp)
GH_NODES = 16
#: nodes of the finer rule that estimates such a reference's error (``Factor.reference_error``); on product's
#: references 20, 24 and 32 ranked the actual errors alike (rank correlation 0.99)
REFERENCE_CHECK_NODES = 24


def gamma_stat_rounding(q) -> np.ndarray:
    """(n, 2): the squared error, in a Gamma belief's log shape and log rate, that :func:`gamma_from_log_nodes`'
    rounding leaves in it and any two of its rules share — so no check of one by the other sees it.  Its
    statistic log E[v] − E[log v] (≈ 1/(2·shape) for a large shape) is formed after E[log v], whose rounding
    ε·max(1, |E log v|) it carries; the log shape moves by that over the statistic (for a large shape, one for
    one).  Found in review: exp → y at x ~ N(0.1, 1e-16), two rules' shape 1.37e16 against the exact 1.00e16,
    their difference ~0."""
    from scipy.special import digamma
    a = np.asarray(q.shape_param, np.float64).ravel()
    b = np.asarray(q.rate, np.float64).ravel()
    with np.errstate(all="ignore"):
        big = a > 1e3
        stat = np.where(big, 0.5 / a + 1.0 / (12.0 * a * a), np.log(a) - digamma(np.where(big, 1.0, a)))
        elog = np.where(big, np.log(a) - 0.5 / a, digamma(np.where(big, 1.0, a))) - np.log(b)
        r = np.finfo(np.float64).eps * np.maximum(1.0, np.abs(elog)) / stat
        r2 = np.where(np.isfinite(r), r * r, np.inf)
    return np.stack([r2, r2], axis=-1)


def reference_coords(q, fam) -> np.ndarray:
    """(n, k): the coordinates (``Family.to_coords``) of the flattened belief ``q`` of family ``fam``, NaN on rows
    that are not proper and finite."""
    flat = q.ravel()
    out = np.full((flat.size, len(fam.coord_names)), np.nan)
    ok = np.asarray(flat.proper_and_finite(), bool)
    if ok.any():
        out[ok] = flat[ok].to_coords() if not ok.all() else flat.to_coords()
    return out


def reference_change(factor, incoming, to: str, fine, reference=None) -> np.ndarray:
    """The body of a :meth:`Factor.reference_error` by a finer rule: the squared change, per row (n, k), in
    the recipient family's coordinates relative to the reference (``Family.to_relative``), of the reference
    (its coordinates ``reference``, or :meth:`Factor.approximate_belief` now) under ``fine`` — the finer
    rule's belief, with NaN parameters where its statistics are not finite (never a fallback: a row where
    both rules fell back to the same answer would read as checked).  +inf where either is not finite."""
    fam = factor.families[to]
    with np.errstate(all="ignore"):
        base = (reference_coords(factor.approximate_belief(incoming, to), fam) if reference is None
                else np.asarray(reference, float))
        err = fam.to_relative(reference_coords(fine, fam), base) ** 2
    return np.where(np.isfinite(err), err, np.inf)


def nan_like(q):
    """A belief of ``q``'s family and shape with NaN parameters (a finer rule's "no answer" for
    :func:`reference_change`)."""
    return type(q)._unchecked(*(np.full(np.shape(p), np.nan) for p in q.params))


@functools.lru_cache(maxsize=8)
def gauss_hermite(n: int = GH_NODES) -> tuple[np.ndarray, np.ndarray]:
    """Nodes ξ and weights ω of n-point Gauss–Hermite quadrature: ∫ e^{−ξ²} f(ξ) dξ ≈ Σ ω f(ξ).
    For adaptive quadrature of a density on a Gaussian N(c, s²): nodes c + √2 s ξ, log weights
    log ω + ξ² + log density (normalised over the nodes)."""
    xi, omega = np.polynomial.hermite.hermgauss(int(n))
    xi.flags.writeable = omega.flags.writeable = False
    return xi, omega


@functools.lru_cache(maxsize=8)
def gauss_hermite_log_base(n: int = GH_NODES) -> np.ndarray:
    """log ω + ξ² of :func:`gauss_hermite`'s rule (read-only): the part of adaptive quadrature's log
    weights that does not depend on the density — what every factor's reference starts from."""
    xi, omega = gauss_hermite(n)
    out = np.log(omega) + xi * xi
    out.flags.writeable = False
    return out


def multi_centre_gauss_hermite(log_density, centres, scales, n: int = GH_NODES):
    """``(t (B, J·n), log weights (B, J·n))``: Gauss–Hermite quadrature of a 1-D density ``log_density`` (a
    function of nodes t (B, m)) over J Gaussians at once — ``centres`` and ``scales`` (B, J), e.g. one per mode
    — combined by the balance heuristic: the partition of unity q_j / Σ_k q_k (q_j = N(c_j, s_j²)) gives each
    Gaussian its share of the density, integrated by n-point adaptive quadrature on it, so a node's weight is
    ω_i · w(t) / Σ_k q_k(t).  Exact for a w that is a polynomial times that mixture (degree < 2n per centre), so
    a bimodal density with a centre on each mode is integrated as one-centre adaptive quadrature integrates a
    unimodal one.  A centre given twice costs nodes only; a wide centre far from the mass makes w / Σ q_k less
    polynomial there and costs accuracy (a unimodal density with a second centre 8 sds off at 6× the scale: its
    variance 24 % off).  With J = 1 it is :func:`gauss_hermite_log_base`'s rule (up to a per-row constant)."""
    xi, omega = gauss_hermite(n)
    c = np.asarray(centres, float)
    s = np.asarray(scales, float)
    B, J = c.shape
    with np.errstate(all="ignore"):
        t = (c[:, :, None] + math.sqrt(2.0) * s[:, :, None] * xi).reshape(B, J * n)
        lq = [-0.5 * ((t - c[:, j, None]) / s[:, j, None]) ** 2 - np.log(s[:, j, None]) for j in range(J)]
        log_mix = lq[0] if J == 1 else functools.reduce(np.logaddexp, lq)
        lw = np.tile(np.log(omega), J)[None, :] + log_density(t) - log_mix
    return t, lw


#: :func:`local_maxima` gives a maximum at most this many times its candidate's own scale: where two modes nearly
#: merge, −(log w)'' ≈ 0 at one of them and 1/√(−(log w)'') ran to 16–80, the other mode was merged away and every
#: node fell in a tail where all rules agreed on a wrong answer (gaussian, found in review: KL 2 at an estimate of
#: 8e-7; 4× did not cure it)
MAX_SCALE_GROWTH = 2.0


def local_maxima(log_density, candidates, scales):
    """``(centres, scales, two)``: the two largest distinct local maxima (B, 2) of the 1-D ``log_density`` (a
    function of points t (B, m)) among ``candidates`` (B, K; e.g. approximate stationary points, NaN for none;
    where none is a maximum the highest candidate stands in, or the first as given), and the rows (B,) that have two.  Each candidate
    is moved by one Newton step (at most its scale ``scales`` (B, K), a local scale of it, e.g. the curvature's
    order) from finite differences at a thousandth of its scale, and is a maximum where, there, the density is no
    lower than a thousandth of the scale either side and the curvature is negative; it gets the scale
    1/√(−(log w)'') there, at most :data:`MAX_SCALE_GROWTH` times its own (else its own).  Maxima
    are ranked by Laplace's mass, log w + log scale (a tall narrow spike is not the larger mode); one closer to the
    largest than half the smaller scale is the same maximum; a row with one gives it twice (see
    :func:`multi_centre_gauss_hermite`: a repeated centre costs nodes only).  A step below the rounding at a
    candidate (c + h == c) is taken at the rounding's size."""
    c = np.asarray(candidates, float)
    s0 = np.asarray(scales, float)
    B = c.shape[0]
    first = np.where(np.isfinite(c[:, :1]), c[:, :1], 0.0)
    c = np.where(np.isfinite(c) & np.isfinite(s0) & (s0 > 0), c, first)
    s0 = np.where(np.isfinite(s0) & (s0 > 0), s0, np.where(np.isfinite(s0[:, :1]) & (s0[:, :1] > 0), s0[:, :1], 1.0))
    with np.errstate(all="ignore"):
        h = np.maximum(1e-3 * s0, 4.0 * np.spacing(np.abs(c)))
        l0, lp, lm = np.split(log_density(np.concatenate([c, c + h, c - h], axis=1)), 3, axis=1)  # (one call)
        d2 = (lp - 2.0 * l0 + lm) / (h * h)
        step = np.where(d2 < 0, -(lp - lm) / (2.0 * h) / np.where(d2 < 0, d2, -1.0), 0.0)
        given = c[:, 0], s0[:, 0]
        c = c + np.where(np.isfinite(step), np.clip(step, -s0, s0), 0.0)
        h = np.maximum(1e-3 * s0, 4.0 * np.spacing(np.abs(c)))
        l0, lp, lm = np.split(log_density(np.concatenate([c, c + h, c - h], axis=1)), 3, axis=1)
        d2 = (lp - 2.0 * l0 + lm) / (h * h)
        peak = (d2 < 0) & (l0 >= lp) & (l0 >= lm) & np.isfinite(l0)
        s = np.where(peak, np.minimum(1.0 / np.sqrt(-d2), MAX_SCALE_GROWTH * s0), s0)
        s = np.where(np.isfinite(s) & (s > 0), s, s0)
        score = np.where(peak, l0 + np.log(s), -np.inf)
        rows = np.arange(B)
        best = np.argmax(score, axis=1)
        found = np.isfinite(score[rows, best])
        # (no maximum — e.g. finite differences below log w's rounding: the highest candidate, else the first as given)
        high = np.argmax(np.where(np.isfinite(l0), l0, -np.inf), axis=1)
        some = np.isfinite(l0[rows, high])
        c1 = np.where(found, c[rows, best], np.where(some, c[rows, high], given[0]))
        s1 = np.where(found, s[rows, best], np.where(some, s0[rows, high], given[1]))
        apart = np.abs(c - c1[:, None]) >= 0.5 * np.minimum(s, s1[:, None])
        other = np.where(apart, score, -np.inf)
        second = np.argmax(other, axis=1)
        two = np.isfinite(other[rows, second])
    return (np.stack([c1, np.where(two, c[rows, second], c1)], axis=1),
            np.stack([s1, np.where(two, s[rows, second], s1)], axis=1), two)


def as_shape(p, shape) -> np.ndarray:
    """``np.broadcast_to(np.asarray(p, dtype=float), shape)`` (read-only), without the broadcast's
    ~5 µs where ``p`` has that shape already (a served one-message request's parameters)."""
    a = np.asarray(p, dtype=float)
    return a if a.shape == tuple(shape) else np.broadcast_to(a, shape)


def _node_weights(lw):
    """Normalised weights p ∝ e^{lw} over the last axis (the nodes)."""
    w = np.exp(lw - lw.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return w


def gaussian_from_nodes(lw, mu, var, fallback, max_node_weight: float = 1.0):
    """A Gaussian belief by the moments of the node mixture Σ p_k N(mu_k, var_k), p ∝ e^{lw} over the
    last axis (``var`` 0: point nodes).  Rows whose moments are not finite or whose variance is not
    positive — and, with ``max_node_weight`` < 1, rows where one node holds at least that share of
    the weight (the nodes missed the mass) — take ``fallback``'s parameters (its batch shape is the
    answer's).  The mean is summed about the heaviest node's, as the exact rules'
    (:func:`kjit.exact._common.gaussian_mixture`): Σ p_k mu_k, with weights summing to 1 ± a few ulps, put a
    mean far from 0 one to three ulps off the mixture's, against the exact rule's half ulp — the whole of
    gaussian → x's error on an observed x (variance 1e-10: KL 4e-21–6e-20; 40-digit mpmath, forty-seventh
    session)."""
    with np.errstate(all="ignore"):
        w = _node_weights(lw)
        mu = np.broadcast_to(np.asarray(mu, dtype=float), w.shape)
        c = np.take_along_axis(mu, np.argmax(lw, axis=-1)[..., None], axis=-1)
        d = mu - c
        dm = (w * d).sum(axis=-1)
        mean = c[..., 0] + dm
        v = (w * (var + (d - dm[..., None]) ** 2)).sum(axis=-1)
        if mean.size == 1 and max_node_weight >= 1.0:  # one row: the test by math
            m1, v1 = mean.item(), v.item()
            if math.isfinite(m1) and math.isfinite(v1) and v1 > 0:
                return Gaussian._unchecked(mean.reshape(fallback.shape), v.reshape(fallback.shape))
        ok = np.isfinite(mean) & np.isfinite(v) & (v > 0)
        if max_node_weight < 1.0:
            ok &= np.max(w, axis=-1) < max_node_weight
    shape = fallback.shape
    if all_(ok):
        return Gaussian._unchecked(mean.reshape(shape), v.reshape(shape))
    ok = ok.reshape(shape)
    return Gaussian._unchecked(np.where(ok, mean.reshape(shape), fallback.mean()),
                               np.where(ok, v.reshape(shape), fallback.var()))


#: the smallest statistic log E[v] − E[log v] :func:`gamma_from_log_nodes` projects (a shape of ~5e299; found in
#: review: a gaussian τ reference at 2e-228 raised Gamma's "shape must be finite" for its whole batch)
MIN_GAMMA_STAT = 1e-300


def gamma_from_log_nodes(t, lw, projection: str, fallback, rows_ok=None):
    """A Gamma belief on v = e^t from a quadrature rule over t (nodes ``t`` (n, k), unnormalised log
    weights ``lw``), by the KL projection (E[v], E[log v]) or by ``"moments"``.  Rows whose
    statistics are not finite or positive, or where ``rows_ok`` (n,) is False, take ``fallback``'s
    parameters (its batch shape is the answer's).  log E[v] − E[log v] is formed from centred node
    sums (log Σ p e^{t − t̄}, no cancellation), as the exact rules do; the statistic still carries t̄'s rounding
    (:func:`gamma_stat_rounding`)."""
    with np.errstate(all="ignore"):
        w = _node_weights(lw)
        tbar = np.sum(w * t, axis=1)
        dev = t - tbar[:, None]
        stat = np.log1p(np.sum(w * np.expm1(dev), axis=1))  # log E[v] − E[log v]
        ok = np.isfinite(stat) & (stat > MIN_GAMMA_STAT) & np.isfinite(tbar)  # (below: a shape Gamma cannot hold)
        shape = np.ones_like(stat)
        if projection == "kl":
            if ok.any():
                shape[ok] = Gamma.project(np.stack([np.ones(int(ok.sum())), -stat[ok]], axis=-1)).shape_param
        else:
            rel_var = np.sum(w * np.expm1(dev - stat[:, None]) ** 2, axis=1)  # Var / E²
            ok &= np.isfinite(rel_var) & (rel_var > 0)
            shape = np.where(ok, 1.0 / np.where(ok, rel_var, 1.0), 1.0)
        rate = shape * np.exp(-(tbar + stat))
        ok &= np.isfinite(shape) & (shape > 0) & np.isfinite(rate) & (rate > 0)
    if rows_ok is not None:
        ok &= rows_ok
    keep = ok.reshape(fallback.shape)
    return Gamma._unchecked(np.where(keep, shape.reshape(fallback.shape), fallback.shape_param),
                            np.where(keep, rate.reshape(fallback.shape), fallback.rate))


def tilted_laplace(m, v, dlog: Callable, lo, hi, start=None, max_iter: int = LAPLACE_MAX_ITER, tol: float = 1e-12):
    """Laplace's approximation ``(t*, s)`` of the tilted density N(t; m, v)·exp(ℓ(t)), vectorised.

    ``dlog(t, rows) -> (ℓ'(t), ℓ''(t))`` for the batch rows ``rows``; ``[lo, hi]`` must bracket a
    root of −(t − m)/v + ℓ'(t);
    :func:`laplace_mode` finds it (``start`` default: m clipped to the bracket).  ``s`` =
    1/(1/v − ℓ''(t*)), or v where that is not positive.  Used by factors'
    :meth:`Factor.approximate_belief`.
    """
    m, v = np.asarray(m, dtype=float).ravel(), np.asarray(v, dtype=float).ravel()

    def full(t, rows):
        d1, d2 = dlog(t, rows)
        return -(t - m[rows]) / v[rows] + d1, -1.0 / v[rows] + d2

    # (laplace_mode clips the start to the bracket: m itself is m clipped)
    t, h = laplace_mode(full, lo, hi, start=m if start is None else start, max_iter=max_iter, tol=tol)
    if h.size == 1 and v.size == 1:  # one row: np.where's answer, by math
        hv = h.item()
        return t, np.array([1.0 / hv if hv > 0 else v.item()], dtype=float)
    with np.errstate(all="ignore"):
        return t, np.where(h > 0, 1.0 / h, v)
