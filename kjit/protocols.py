"""The message-operator protocol: what the EP engine, the models and the service need of an operator.

Every operator — learned (:class:`kjit.operators.KernelOperator`, :class:`~kjit.operators.JITOperator`),
oracle (:mod:`kjit.oracles`), hand-crafted (:class:`kjit.factors.logistic.LogisticOperator`, …),
remote (:class:`kjit.client.RemoteOperator`) or a user's own — answers batches::

    belief(incoming: dict[str, Family], to) -> Family        # q = proj[f · Π incoming], required
    message(incoming, to) -> Family                          # q / incoming[to] (Operator's default)
    log_partition(incoming[, power]) -> ndarray              # log ∫ f^power Π m, optional
    supports_power: bool                                     # belief/log_partition take power=u, optional
    projection_kl(incoming, to[, power]) -> ndarray          # KL(tilted ‖ proj tilted), optional (relaxed EP)
    predict(incoming, to) -> (belief, log_var[, consulted])  # with its uncertainty, optional (see below)
    log_var_is_variance: bool                                # predict's log_var is a log variance (default True)
    threshold: float                                         # the log variance above which it is uncertain, optional
    oracle                                                   # an operator to ask instead where uncertain, optional
    certified(incoming, to) -> (belief, Certificates)        # the answer with its certificates, optional
    last_certificates_                                       # the last answer's certificates, optional

Certificates (:mod:`kjit.certificates`) say where each answer came from (rule, oracle, learned) and
how good it is; :func:`kjit.certificates.certified` gives them for any operator.

:class:`Operator` is the base the kjit operators share: ``message = belief / incoming[to]``
written once, and the optional members' defaults (no power, no log partition, no projection KL).
The engine asks through :func:`supports_power`, :func:`has_log_partition` and
:func:`has_projection_kl`, which read those optional members for any object with a ``belief``
method — a user's operator need not inherit from :class:`Operator` (the EP engine calls
``belief``, or ``predict`` where :func:`reports_uncertainty`; :func:`outgoing_message` gives any
operator's message).

An operator *reports uncertainty* when its class defines ``predict`` (KernelOperator,
JITOperator, RemoteOperator): the engine then asks ``predict`` and gets the log predictive
variance of each answer (and, for a JIT operator, which rows its oracle answered).  A wrapper
that forwards attributes through ``__getattr__`` (a recorder, a tap counting calls) does not
count: the engine keeps calling its ``belief``, so what it records stays what EP asked.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Protocol, runtime_checkable

import numpy as np

from .errors import ConfigurationError, OracleError
from .families import Family

__all__ = [
    "MessageOperator",
    "Operator",
    "is_operator",
    "outgoing_message",
    "supports_power",
    "has_log_partition",
    "has_projection_kl",
    "log_var_is_variance",
    "reports_uncertainty",
    "answered_factor",
    "check_same_factor",
]


@runtime_checkable
class MessageOperator(Protocol):
    """The required part of the protocol (see the module docstring for the optional members)."""

    def belief(self, incoming: Mapping[str, Family], to: Any) -> Family: ...


class Operator:
    """Base of kjit's operators: the protocol's defaults and the one ``message``."""

    #: belief/log_partition accept ``power=u`` (power EP)
    supports_power: ClassVar[bool] = False
    #: log_partition is implemented
    has_log_partition: ClassVar[bool] = False
    #: projection_kl is implemented (relaxed EP)
    has_projection_kl: ClassVar[bool] = False
    #: where this operator's answers come from, for their certificates (:mod:`kjit.certificates`):
    #: "rule" (exact or hand-crafted), "oracle" (Monte Carlo) or "learned"
    certificate_source: ClassVar[str] = "rule"

    def belief(self, incoming: Mapping[str, Family], to=None) -> Family:  # pragma: no cover - abstract
        raise NotImplementedError

    def message(self, incoming: Mapping[str, Family], to=None) -> Family:
        """``belief(incoming, to) / incoming[to]``: the outgoing message (may be improper)."""
        return _belief_over_incoming(self, incoming, to, self._recipient(to))

    def _recipient(self, to):
        """The recipient a call addresses (operators for one direction default it)."""
        return to

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} has no log_partition")


def is_operator(op) -> bool:
    return isinstance(op, MessageOperator)


def outgoing_message(op, incoming: Mapping[str, Family], to) -> Family:
    """``op.message`` if the operator has one, else ``belief / incoming[to]``."""
    fn = getattr(op, "message", None)
    if callable(fn):
        return fn(incoming, to)
    return _belief_over_incoming(op, incoming, to, to)


def _belief_over_incoming(op, incoming, to, recipient) -> Family:
    """The one ``message = belief / incoming[to]`` (natural parameters subtract; may be improper).  Not where
    ``incoming[to]`` is a point mass (an infinite natural parameter: an observed label): there the quotient has no
    value — an OracleError naming those rows (found by an audit: the samplers' message to an observed Bernoulli
    label was Bernoulli(1.0) or NaN for the exact rule's 0.773; a factor's exact message rule answers it)."""
    m = incoming.get(recipient) if isinstance(incoming, Mapping) else None
    if not isinstance(m, Family):  # (no such message: the operator's belief names what is wrong)
        return op.belief(incoming, to) / incoming[recipient]
    with np.errstate(all="ignore"):
        nat = np.asarray(m.natural(), float)
    point = ~np.all(np.isfinite(nat), axis=-1)
    if point.any():
        try:  # (rows of the batch: a single message sent with a batch stands for every row — found in review)
            shape = np.broadcast_shapes(*(x.shape for x in incoming.values() if isinstance(x, Family)))
            point = np.broadcast_to(point.reshape(m.shape), shape)
        except ValueError:
            pass
        point = point.reshape(-1)
        rows = np.flatnonzero(point)
        raise OracleError(f"no outgoing message to {recipient!r} as belief / incoming where its incoming message is a "
                          f"point mass (rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''}): an observed value "
                          "gets its message from the factor's exact message rule", rows=rows,
                          cause="point-mass incoming message")
    return op.belief(incoming, to) / m


def supports_power(op) -> bool:
    return bool(getattr(op, "supports_power", False))


def has_log_partition(op) -> bool:
    flag = getattr(op, "has_log_partition", None)
    if isinstance(flag, bool):
        return flag
    return callable(getattr(op, "log_partition", None))


def has_projection_kl(op) -> bool:
    flag = getattr(op, "has_projection_kl", None)
    if isinstance(flag, bool):
        return flag
    return callable(getattr(op, "projection_kl", None))


def log_var_is_variance(op) -> bool:
    """Is ``op.predict``'s ``log_var`` a log predictive variance (the default), which the engine may
    read as the answer's spread (its precision-0 tolerance)?  False for an operator whose uncertainty is
    in other units — a just-in-time operator whose rule is a learned KL puts the predicted log KL there,
    compared with its threshold alike but no variance."""
    flag = getattr(op, "log_var_is_variance", True)
    return flag if isinstance(flag, bool) else True


def reports_uncertainty(op) -> bool:
    """Does ``op``'s class define ``predict(incoming, to) -> (belief, log_var[, consulted])``
    (see the module docstring; an explicit class flag ``reports_uncertainty`` overrides)."""
    flag = getattr(type(op), "reports_uncertainty", None)
    if isinstance(flag, bool):
        return flag
    return callable(getattr(type(op), "predict", None))


def answered_factor(op, unknown=None):
    """The factor ``op`` answers for, where it says one (its ``factor``: an attribute, or a property —
    a :class:`~kjit.client.RemoteOperator`'s asks its server, once it answers); None where it says none;
    ``unknown`` where it cannot say now (a server that does not answer: the engine's own calls then fail,
    and say so).  A factor this process cannot build (not registered here) raises, as the first call
    would."""
    try:
        f = getattr(op, "factor", None)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - (no answer from a server: RemoteOperatorError, a RuntimeError)
        return unknown
    return f if callable(getattr(f, "mismatch", None)) else None


def check_same_factor(op, other, theirs: str, mine: str) -> None:
    """A :class:`~kjit.errors.ConfigurationError` saying how the factor ``op`` answers for differs from
    ``other``'s (an operator, or a factor) — none where they agree or either says none
    (:func:`answered_factor`).  The one check that an oracle, an operator and a model agree on their factor,
    for local and served operators alike (found by an audit: the check read attributes only, and a
    RemoteOperator's factor, a property, went unchecked — EP with a served gamma_rate(shape=1) on a shape-3
    model "converged", 30 % off)."""
    f = answered_factor(op)
    g = other if callable(getattr(other, "mismatch", None)) else answered_factor(other)
    if f is not None and g is not None:
        why = g.mismatch(f, theirs, mine)
        if why is not None:
            raise ConfigurationError(why)
