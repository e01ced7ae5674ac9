"""Exponential-family messages: Gaussian, Beta, Gamma (and Bernoulli on {-1, +1}).

A message object holds *arrays* of parameters, broadcast to one common shape, like a
frozen ``scipy.stats`` distribution: a batch of 10 000 messages is one object and every
method is one vectorised call.  ``len``, indexing, ``concatenate`` and ``reshape`` work on
the batch shape.

Each family has

* natural parameters ``natural()`` and sufficient statistics ``u(x)`` such that
  ``p(x) ∝ exp(natural · u(x))``; product and quotient of messages add and subtract
  natural parameters (``p * q``, ``p / q``);
* ``is_proper``: a quotient can be improper (e.g. a Gaussian with negative precision).  It is
  never clipped: an improper message keeps its parameters and callers test ``is_proper``;
  densities, moments, KL and sampling refuse improper messages;
* ``expected_suff_stats()`` and ``Family.project(ess)``: the KL projection ``argmin_q KL(p‖q)``
  of any distribution p whose expected sufficient statistics are ``ess`` (SPEC §1);
* ``to_coords()`` / ``from_coords()``: unconstrained regression coordinates in which every
  real vector maps back to a valid distribution.

| family   | parameters      | u(x)                 | coordinates        |
|----------|-----------------|----------------------|--------------------|
| Gaussian | mean, var       | (x, x²)              | (mean, log var)    |
| Beta     | alpha, beta     | (log x, log(1-x))    | (log α, log β)     |
| Gamma    | shape, rate     | (x, log x)           | (log shape, log rate) |
| Bernoulli| p = P(y = +1)   | (1[y = +1])          | (logit p)          |
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import ClassVar

import numpy as np
from scipy import special

from .charfun import (
    beta_characteristic_function, beta_chebyshev_moments, chebyshev_cf_coefficients, chebyshev_size,
)
from .reductions import all_, all_finite

__all__ = [
    "Family",
    "Gaussian",
    "Beta",
    "Gamma",
    "Bernoulli",
    "FAMILIES",
    "family_by_name",
    "family_name",
    "register_family",
]

_LOG_2PI = np.log(2.0 * np.pi)


def _rng(random_state) -> np.random.Generator:
    if isinstance(random_state, np.random.Generator):
        return random_state
    return np.random.default_rng(random_state)


def _last_axis(a, b):
    """``np.stack([a, b], axis=-1)`` for two float arrays of one shape (a family's parameters), in
    a quarter of its time (the natural parameters and coordinates of a batch-1 message are
    computed ~10 times a served prediction)."""
    out = np.empty(np.shape(a) + (2,))
    out[..., 0] = a
    out[..., 1] = b
    return out


def _one_bool(ok: bool, shape) -> np.ndarray:
    """A boolean array of ``shape`` (one element) holding ``ok``: what the elementwise tests give."""
    return np.array((ok,)).reshape(shape)


def _both_positive(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Elementwise: both parameters finite and > 0 (a two-positive-parameter family's propriety);
    for one message by ``math``."""
    if p.size == 1 and p.ndim:
        x, y = p.item(), q.item()
        return _one_bool(x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y), p.shape)
    return (p > 0) & (q > 0) & np.isfinite(p) & np.isfinite(q)


def trigamma(x):
    """ψ'(x), as ``special.polygamma(1, x)`` computes it (ζ(2, x) times (−1)²·1!: the same doubles,
    checked) without its Python wrapper: ~7 µs a call less, and a batch-1 prediction of a Beta
    message's features makes two."""
    return special.zeta(2.0, x)


def _cached_propriety(compute):
    """``is_proper``'s getter computed once per message (see ``Family.__init_subclass__``)."""

    def is_proper(self):
        ok = self._proper  # (the class's None until computed: no AttributeError raised and caught)
        if ok is None:
            ok = compute(self)
            if isinstance(ok, np.ndarray):
                ok.flags.writeable = False
            self._proper = ok
        return ok

    is_proper._cached = True
    return is_proper


#: numpy dtype kinds a family's parameters may be given in: real floats, integers, booleans
NUMERIC_KINDS = frozenset("fiub")
#: the smallest positive normal double: a Beta or Gamma parameter below it (a subnormal number, whose reciprocal
#: and digamma overflow) is refused — accepted before, it gave NaN (Beta(1e-310, 1).kl(Beta(1, 1)),
#: Beta(5e-324, 1).kl(itself)); a Gaussian's subnormal variance has code that handles it
_TINY = float(np.finfo(float).tiny)


class Family:
    """Base class of array-valued exponential-family messages.

    Subclasses define ``param_names``, ``_check`` (validation of proper parameters),
    natural-parameter maps and the family-specific formulas.
    """

    param_names: ClassVar[tuple[str, ...]] = ()
    #: whether :attr:`is_proper` already requires every parameter finite (the built-in families: then
    #: :meth:`proper_and_finite` skips its own finiteness test, ~4 µs a call); False by default, and
    #: read only where the class itself sets it (a subclass may loosen is_proper)
    proper_is_finite: ClassVar[bool] = False
    _proper = None  # is_proper, once computed (per message: see ``__init_subclass__``)
    n_stats: ClassVar[int] = 2
    coord_names: ClassVar[tuple[str, ...]] = ()
    # index of the regression coordinate that is log(spread) (Gaussian: log variance), where a
    # log-concave factor bounds the belief by the incoming message; None: no such coordinate
    spread_coord: ClassVar[int | None] = None
    #: the values a variable of the family takes (:meth:`in_closed_support`), for error messages
    closed_support: ClassVar[str] = "[-inf, inf]"

    # ------------------------------------------------------------------ construction
    def __init__(self, *params, validate: bool = True):
        if len(params) != len(self.param_names):
            raise TypeError(
                f"{type(self).__name__} takes {len(self.param_names)} parameters "
                f"({', '.join(self.param_names)}), got {len(params)}"
            )
        arrays, owned = [], []
        for name, p in zip(self.param_names, params):
            try:
                # a list (a served request's column) becomes an own array at once; anything else is
                # converted first (an ``__array__`` object without numpy 2's ``copy`` argument) and
                # copied below
                if type(p) is list:
                    a = np.array(p)
                    owned.append(True)
                else:
                    a = np.asarray(p)
                    owned.append(False)
                if a.dtype.kind == "O" and all(isinstance(x, (int, float)) for x in a.flat):
                    a = a.astype(float)  # (Python integers beyond 64 bits: real numbers too)
                elif a.dtype.kind not in NUMERIC_KINDS:
                    # (a cast would drop an imaginary part, or read "2" or a date as a number)
                    raise TypeError(f"got an array of {a.dtype}")
                if a.dtype != np.float64:
                    a = a.astype(float)
            except (TypeError, ValueError, OverflowError) as exc:  # (a Python int beyond ~1.8e308: overflow)
                raise ValueError(f"{type(self).__name__}: `{name}` must be real numbers ({exc})") from None
            arrays.append(a)
        for a in arrays:
            if a.shape != arrays[0].shape:  # (one shape, the usual case: nothing to broadcast)
                try:
                    arrays = np.broadcast_arrays(*arrays)
                except ValueError:
                    shapes = ", ".join(f"{n}{np.shape(b)}" for n, b in zip(self.param_names, arrays))
                    raise ValueError(
                        f"{type(self).__name__}: parameter shapes do not broadcast: {shapes}"
                    ) from None
                owned = [False] * len(arrays)
                break
        if not all(owned):  # own, writeable copies
            arrays = [a if own else np.array(a, dtype=float) for a, own in zip(arrays, owned)]
        if validate:
            for name, a in zip(self.param_names, arrays):
                if not all_finite(a):
                    bad = ~np.isfinite(a)
                    raise ValueError(
                        f"{type(self).__name__}: `{name}` must be finite "
                        f"(got {a[bad].ravel()[0]!r} at {int(np.argmax(bad.ravel()))})"
                    )
            self._check(*arrays)
        for name, a in zip(self.param_names, arrays):
            a.flags.writeable = False
            object.__setattr__(self, "_" + name, a)
        self._extras = None

    # Some families keep extra arrays that the standard parameters cannot carry for improper
    # messages (a zero-precision Gaussian has no finite mean but a finite mean·precision).
    def _with(self, params, extras):
        obj = type(self)._unchecked(*params)
        if extras is not None:
            obj._extras = tuple(extras)
        return obj

    def _map(self, fn):
        ex = self._extras
        return self._with([fn(p) for p in self.params], None if ex is None else [fn(e) for e in ex])

    def _check(self, *arrays) -> None:  # pragma: no cover - overridden
        pass

    @staticmethod
    def _require_positive(family: str, name: str, a: np.ndarray, least: float = 0.0) -> None:
        """Refuse entries not above 0 (``least`` 0) or below ``least`` (Beta, Gamma: the smallest normal
        double, ``_TINY``)."""
        if a.size == 1 and ((x := a.item()) > 0 and x >= least):  # (a served message: no ufunc on one number)
            return
        bad = ~(a >= least) if least else ~(a > 0)
        if bad.any():
            got = a[bad].ravel()[0]
            what = "> 0" if not got > 0 else f"at least {least!r}, the smallest normal double (not subnormal)"
            raise ValueError(
                f"{family}: `{name}` must be {what} (got {got!r} at flat index "
                f"{int(np.argmax(bad.ravel()))})"
            )

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # ``params`` is read a few dozen times per batch-1 prediction: one C-level getter per family
        attrs = tuple("_" + n for n in cls.param_names)
        if len(attrs) > 1:
            get = operator.attrgetter(*attrs)
        elif attrs:
            one = operator.attrgetter(attrs[0])
            get = lambda obj: (one(obj),)  # noqa: E731
        else:
            get = lambda obj: ()  # noqa: E731
        cls._params_getter = staticmethod(get)
        if attrs:
            cls._first_param = staticmethod(operator.attrgetter(attrs[0]))
        # a message is immutable (owned read-only arrays), so its propriety is computed once: a
        # batch-1 prediction asks for it ~7 times.  The cached array is read-only too.
        prop = cls.__dict__.get("is_proper")
        if isinstance(prop, property) and not getattr(prop.fget, "_cached", False):
            cls.is_proper = property(_cached_propriety(prop.fget), doc=prop.__doc__)

    @property
    def params(self) -> tuple[np.ndarray, ...]:
        return self._params_getter(self)

    @classmethod
    def _unchecked(cls, *params):
        """Without validation.  Parameters of one shape (every internal caller: views,
        slices, computed arrays) skip the broadcasting of ``__init__``; they are still copied
        into owned read-only arrays."""
        if len(params) == len(cls.param_names):
            arrays = [np.array(p, dtype=float) for p in params]
            shape = arrays[0].shape
            if all(a.shape == shape for a in arrays):
                obj = cls.__new__(cls)
                for name, a in zip(cls.param_names, arrays):
                    a.flags.writeable = False
                    object.__setattr__(obj, "_" + name, a)
                obj._extras = None
                return obj
        return cls(*params, validate=False)

    # ------------------------------------------------------------------ batch protocol
    @property
    def shape(self) -> tuple[int, ...]:
        return self._first_param(self).shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of a scalar {type(self).__name__} message")
        return self.shape[0]

    def __getitem__(self, index):
        return self._map(lambda p: p[index])

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # A message is immutable (read-only arrays), so a reshape or broadcast to its own shape
    # returns it as it is: no copy (a batch-1 prediction does a dozen of these).
    def reshape(self, *shape):
        p0 = self.params[0]
        if p0.reshape(*shape).shape == p0.shape:
            return self
        return self._map(lambda p: p.reshape(*shape))

    def ravel(self):
        return self if self.ndim == 1 else self.reshape(-1)

    def broadcast_to(self, shape):
        if self.shape == tuple(np.broadcast_shapes(shape)):
            return self
        return self._map(lambda p: np.broadcast_to(p, shape))

    @classmethod
    def concatenate(cls, messages, axis: int = 0):
        messages = list(messages)
        if not messages:
            raise ValueError("concatenate: `messages` is empty")
        for m in messages:
            if type(m) is not cls and not (cls is Family and type(m) is type(messages[0])):
                raise ValueError(
                    f"concatenate: all messages must be {cls.__name__}, got {type(m).__name__}"
                )
        kind = type(messages[0])
        nd = max(1, messages[0].ndim)  # (0-d messages count as batches of one)
        if not -nd <= axis < nd:
            raise np.exceptions.AxisError(axis, nd)
        axis = axis % nd  # an axis of the batch: natural parameters have one more (the statistics', last)
        if len(messages) == 1 and messages[0].ndim == 1 and axis == 0:
            return messages[0]  # (immutable: its own concatenation)
        if any(m._extras is not None for m in messages):
            return kind.from_natural(
                np.concatenate([np.atleast_1d(m.natural()) if m.ndim else m.natural()[None] for m in messages], axis=axis)
            )
        params = [
            np.concatenate([np.atleast_1d(m.params[j]) for m in messages], axis=axis)
            for j in range(len(kind.param_names))
        ]
        return kind._unchecked(*params)

    def with_rows(self, rows, other: "Family") -> "Family":
        """A copy of this flat batch whose rows ``rows`` (indices) are ``other``'s messages, in
        order — e.g. an oracle's answers in place of a learned operator's uncertain ones.  Messages
        carrying natural parameters (an improper row) are merged in those."""
        if type(other) is not type(self):
            raise ValueError(f"with_rows: `other` must be {type(self).__name__} messages, got {type(other).__name__}")
        rows = np.asarray(rows, dtype=np.intp).reshape(-1)
        if self.ndim != 1 or other.shape != (rows.size,):
            raise ValueError(f"with_rows: a flat batch and {rows.size} messages for its rows, got shapes "
                             f"{self.shape} and {other.shape}")
        if self._extras is not None or other._extras is not None:
            nat = np.array(self.natural(), dtype=float)
            nat[rows] = other.natural()
            return type(self).from_natural(nat)
        params = [np.array(p, dtype=float) for p in self.params]
        for p, new in zip(params, other.params):
            p[rows] = new
        return type(self)._unchecked(*params)

    def __eq__(self, other):
        return (
            type(self) is type(other)
            and self.shape == other.shape
            and all(np.array_equal(a, b) for a, b in zip(self.params, other.params))
        )

    __hash__ = None  # mutable-array holder

    def allclose(self, other, rtol=1e-9, atol=0.0) -> bool:
        return type(self) is type(other) and all(
            np.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(self.params, other.params)
        )

    def __repr__(self):
        body = ", ".join(
            f"{n}={np.array2string(p, precision=6, threshold=6)}"
            for n, p in zip(self.param_names, self.params)
        )
        return f"{type(self).__name__}({body})"

    def to_dict(self) -> dict[str, list]:
        """Plain parameter lists (JSON-ready)."""
        return {n: p.tolist() for n, p in zip(self.param_names, self.params)}

    @classmethod
    def from_dict(cls, d) -> "Family":
        """Inverse of :meth:`to_dict` (validated); a missing parameter is a ValueError naming it."""
        missing = [n for n in cls.param_names if n not in d]
        if missing:
            raise ValueError(f"{cls.__name__}: missing parameter(s) {', '.join(map(repr, missing))}")
        return cls(*(d[n] for n in cls.param_names))

    # ------------------------------------------------------------------ natural parameters
    def natural(self) -> np.ndarray:
        """Natural parameters, shape ``(*batch, n_stats)``."""
        raise NotImplementedError

    @classmethod
    def from_natural(cls, eta):
        """Message with natural parameters ``eta`` (``(*batch, n_stats)``); may be improper."""
        raise NotImplementedError

    @property
    def is_proper(self) -> np.ndarray:
        """Boolean array: which messages are normalisable distributions."""
        raise NotImplementedError

    def proper_and_finite(self) -> np.ndarray:
        """Boolean array: which messages are normalisable distributions with finite parameters — what an
        oracle's, a rule's or an operator's answer must be (:attr:`proper_is_finite` families: their
        propriety alone)."""
        if vars(type(self)).get("proper_is_finite", False):  # (declared by the class itself: a subclass
            return np.asarray(self.is_proper, bool)          # may loosen is_proper)
        with np.errstate(invalid="ignore"):
            return np.asarray(self.is_proper, bool) & np.all([np.isfinite(p) for p in self.params], axis=0)

    @classmethod
    def natural_is_proper(cls, eta) -> np.ndarray:
        """``from_natural(eta).is_proper`` (families may answer without building the messages)."""
        return np.asarray(cls.from_natural(eta).is_proper, dtype=bool)

    def _require_proper(self, what: str) -> None:
        ok = self.is_proper
        if not all_(np.asarray(ok)):
            raise ValueError(
                f"{what}: {type(self).__name__} message is improper at "
                f"{int(np.size(ok) - np.count_nonzero(ok))} position(s) "
                f"(first flat index {int(np.argmin(np.ravel(ok)))})"
            )

    def _same_family(self, other, op: str):
        if type(other) is not type(self):
            raise TypeError(
                f"cannot {op} {type(self).__name__} and {type(other).__name__} messages"
            )
        try:  # (batches of 2 and 3 messages met numpy's broadcast error in the middle of a formula: an audit)
            np.broadcast_shapes(self.shape, other.shape)
        except ValueError:
            raise ValueError(f"cannot {op} {type(self).__name__} batches of shapes {self.shape} and {other.shape}: "
                             f"they do not broadcast") from None

    def __mul__(self, other):
        self._same_family(other, "multiply")
        return type(self).from_natural(self.natural() + other.natural())

    def __truediv__(self, other):
        self._same_family(other, "divide")
        return type(self).from_natural(self.natural() - other.natural())

    def __pow__(self, power):
        """Power of a message: natural parameters times ``power`` (power EP)."""
        return type(self).from_natural(self.natural() * np.asarray(power, dtype=float)[..., None])

    # ------------------------------------------------------------------ statistics
    @staticmethod
    def suff_stats(x) -> np.ndarray:
        raise NotImplementedError

    def log_kernel(self, stats, limits: bool = False) -> np.ndarray:
        """log m(x) up to a per-message constant, for a flat batch (B,) at points given by their
        sufficient statistics ``stats`` (N, k): the (B, N) matrix η · u (one matrix product).
        ``limits``: statistics may be ±inf (a value on the support's boundary), each term η_k u_k
        then taken in the limit, 0 where η_k = 0."""
        eta = self.natural().reshape(-1, self.n_stats)
        stats = np.asarray(stats, float)
        if np.all(np.isfinite(eta)) and not limits:
            return eta @ stats.T
        return kernel_limits(eta, stats)

    def expected_suff_stats(self) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def project(cls, ess):
        """KL projection: the member whose expected sufficient statistics equal ``ess``."""
        raise NotImplementedError

    def to_coords(self) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def from_coords(cls, coords):
        raise NotImplementedError

    def log_pdf(self, x) -> np.ndarray:
        raise NotImplementedError

    def pdf(self, x) -> np.ndarray:
        return np.exp(self.log_pdf(x))

    def mean(self) -> np.ndarray:
        raise NotImplementedError

    def var(self) -> np.ndarray:
        raise NotImplementedError

    def affine(self, scale, shift=0.0) -> "Family":
        """The law of ``scale·X + shift`` for X with this law (``scale`` > 0, per row), when the
        family is closed under that map; a ValueError otherwise.  Used by factor symmetries
        (:meth:`kjit.factors.Factor.symmetry`)."""
        raise ValueError(f"{type(self).__name__} messages are not closed under x -> scale*x + shift")

    def log_normalizer(self) -> np.ndarray:
        """log ∫ exp(η · u(x)) dx at the natural parameters η (the family's log partition with its
        base measure): what a product of messages integrates to, e.g. for the EP evidence."""
        raise NotImplementedError(f"{type(self).__name__} has no log_normalizer")

    def log_pdf_stats(self, stats) -> np.ndarray:
        """log m(x) at points given by their sufficient statistics ``stats`` (..., k), elementwise
        (the batch broadcast against ``stats[..., j]``): η · u − A(η), 0 · ±inf counted as 0.  A
        factor can give the statistics of a value exactly where the value itself rounds onto the
        boundary of the support (a logistic z = σ(x) at 1, an exp y = e^x at 0), where
        :meth:`log_pdf` of the rounded value is −inf (found by an audit: the per-message importance
        sampler dropped those particles, KL 0.6–4 at ESS 4e4)."""
        stats = np.asarray(stats, dtype=float)
        eta = self.natural()
        with np.errstate(invalid="ignore"):
            terms = eta * stats
        terms = np.where(stats == 0.0, 0.0, terms)  # (η = 0: a factor of 1 at any point, also ±inf)
        terms = np.where((eta == 0.0) & ~np.isnan(stats), 0.0, terms)
        return np.sum(terms, axis=-1) - self.log_normalizer()

    def unbounded_density(self) -> np.ndarray:
        """Which messages of the batch have a density without an upper bound (a Gamma of shape < 1 at
        0, a Beta with a parameter < 1 at its boundary): importance weights made of it can have an
        infinite variance that neither the ESS nor a standard error shows (see
        :func:`kjit.oracles.pareto_khat`)."""
        return np.zeros(self.shape, dtype=bool)

    def unbounded_ratio(self, proposal: "Family") -> np.ndarray:
        """Which messages m of the batch have m / ``proposal`` (a message of the same family) without an upper
        bound on the support: importance weights of particles drawn from ``proposal`` then can have an
        infinite variance (found by an audit: logistic → x with x's message N(0, 1000) against the shared
        proposal N(0, 200) answered a variance of 263–310 for 365, at ESS 692–3 252).  By default: where m's
        density is unbounded (a family with tails overrides it)."""
        return np.asarray(self.unbounded_density(), bool)

    @staticmethod
    def in_support(x) -> np.ndarray:
        """Whether the values ``x`` lie in the family's support (its interior, for a bounded one):
        a draw of an extreme message can round onto its boundary (Gamma(1e-3) gives exact zeros
        47 % of the time), where a factor's sampler may be undefined."""
        return np.isfinite(np.asarray(x, dtype=float))

    @classmethod
    def in_closed_support(cls, x) -> np.ndarray:
        """Whether the values ``x`` are values a variable of this family may take: in the closure of its
        support in the extended reals (a factor's sampler may round onto the boundary — a logistic
        σ(x) = 1, an e^x = 0 or inf — but a NaN or a value outside, such as a negative draw for a
        Gamma variable, is none of its values: :class:`kjit.errors.SamplerOutputError`)."""
        return ~np.isnan(np.asarray(x, dtype=float))

    def kl(self, other) -> np.ndarray:
        """KL[self ‖ other], closed form, elementwise over the batch."""
        raise NotImplementedError

    def sample(self, n: int, random_state=None) -> np.ndarray:
        """``n`` draws per message: array of shape ``(n, *batch)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what other layers need
    # Everything specific to a family lives here, so the feature maps, the regression, the
    # oracles and the service's JSON never branch on a family's type.

    #: the characteristic function is exactly that of N(mean(), var()) (Gaussian only): the
    #: feature maps then treat the variable with the batched Gaussian formula
    gaussian_cf: ClassVar[bool] = False
    #: JSON columns of a message batch: parameter → constraint ("finite", "positive",
    #: "probability"); the service generates its request schemas and validation from these
    json_columns: ClassVar[dict[str, str]] = {}
    #: the importance-sampling oracle estimates (mean, centred variance) rather than E[u(x)]
    centred_estimate: ClassVar[bool] = False

    def unconstrained_moments(self):
        """Mean and variance of the variable in its unconstrained coordinate (the inner
        embedding's "unconstrained" treatment); the variable itself unless overridden."""
        return self.mean(), self.var()

    def characteristic_function(self, omega) -> np.ndarray:
        """``E exp(i ω x)`` of every message at 1-D frequencies ``omega``: complex ``(*batch, len(omega))``."""
        raise ValueError(f"characteristic_function: unsupported family {type(self).__name__}")

    @classmethod
    def cf_plan(cls, omega, dt):
        """Precomputation for :meth:`cf_terms` at one feature map's frequencies, in dtype ``dt``
        (default none)."""
        return None

    def cf_terms(self, omega, plan, dt):
        """The characteristic function of a flat batch at ``omega`` for the exact treatment, as
        ``("polar", log_modulus, phase)`` (real arrays, added to the Gaussian part's) or
        ``("complex", re, im)`` (multiplied in); arrays broadcast to ``(n, len(omega))``."""
        cf = self.characteristic_function(omega)
        return "complex", cf.real.astype(dt), cf.imag.astype(dt)

    @classmethod
    def to_relative(cls, coords, base):
        """Regression coordinates relative to ``base`` (the recipient's incoming message's)."""
        return coords - base

    @classmethod
    def from_relative(cls, rel, base):
        return rel + base

    @classmethod
    def relative_scale(cls, base) -> np.ndarray:
        """∂coords/∂rel of :meth:`from_relative` at ``base`` (..., k): the relative coordinates'
        units in the regression coordinates' (the map is affine per coordinate); ones unless
        overridden."""
        return np.ones_like(np.asarray(base, np.float64))

    @classmethod
    def fisher_information(cls, coords) -> np.ndarray:
        """Fisher information (..., k, k) of the family in its regression coordinates
        (:meth:`to_coords`) at ``coords``: KL[p(c) ‖ p(c + δ)] = ½ δᵀ F(c) δ + O(|δ|³) — the
        KL metric of the coordinates the operators regress."""
        raise ValueError(f"fisher_information: unsupported family {cls.__name__}")

    @classmethod
    def decision_weights(cls, coords, base=None) -> np.ndarray:
        """Per-coordinate KL curvatures (..., k), at least 1: w_j = max(1, F̃_jj), F̃ the Fisher
        information (:meth:`fisher_information`) at the belief ``coords`` in the regressed coordinates —
        relative to ``base`` where given (scaled by :meth:`relative_scale`).  An error δ in coordinate j
        alone costs KL ½ F̃_jj δ², as an error of √F̃_jj δ standard deviations in a Gaussian's mean: a
        Gaussian's mean relative to a reference is in the reference's standard deviation (F̃ = reference
        variance / variance, ≈ 1 against the factor's approximation of the belief), a Gamma's log rate
        costs ``shape``.  :meth:`KernelOperator.decision_log_weights` compares a prediction's curvature
        with the learned one (:mod:`kjit.curvature`: beyond the fifth largest among the beliefs learned, or
        between learned concentrations).  NaN on a row whose
        coordinates or Fisher information are not numbers (never confident)."""
        c = np.asarray(coords, np.float64)
        with np.errstate(all="ignore"):
            d = np.diagonal(cls.fisher_information(c), axis1=-2, axis2=-1)
            if base is not None:
                d = d * cls.relative_scale(base) ** 2
            bad = np.isnan(d) | np.isnan(c).any(axis=-1, keepdims=True)
            return np.where(bad, np.nan, np.maximum(d, 1.0))

    @classmethod
    def least_expected_kl(cls, coords, var, base=None) -> np.ndarray:
        """The expected KL[p(c) ‖ p(c + δ)] to second order, ½ E[δᵀ F(c) δ], of an error δ whose
        coordinates have variances ``var`` (..., k) — the smallest over every correlation between
        them (a regression's per-coordinate variances say nothing of it): min over correlation
        matrices R of ½ tr(F D R D), D = diag(√var).  With ``base`` the variances are of
        coordinates relative to ``base`` (:meth:`to_relative`) and are scaled by
        :meth:`relative_scale` first.  Closed form for k ≤ 2 (every family here):
        ½ (M₀₀ + M₁₁) − |M₀₁|, M = D F D; shape (...,).

        Why the smallest: the errors of a learned operator's coordinates are correlated and the
        correlation is not known row by row.  Where the Fisher metric couples the coordinates
        (Gamma, Beta: an error in the log shape and the log rate of a Gamma at a fixed mean costs
        ~½ δ², in the mean ~a δ²) assuming them independent weighs every row by its shape or
        precision; the bound keeps what no correlation can cancel."""
        c = np.asarray(coords, np.float64)
        v = np.asarray(var, np.float64)
        if np.any(v < 0):  # (a NaN variance stays a NaN: never confident)
            raise ValueError(f"least_expected_kl: `var` must be >= 0 (variances), got {v[v < 0].ravel()[:3].tolist()}")
        if base is not None:
            v = v * cls.relative_scale(base) ** 2
        k = c.shape[-1]
        if k > 2:
            raise ValueError(f"least_expected_kl: no closed form for {k} coordinates ({cls.__name__})")
        F = cls.fisher_information(c)
        sd = np.sqrt(v)
        M = F * sd[..., :, None] * sd[..., None, :]
        out = 0.5 * np.einsum("...ii->...", M)
        if k == 2:
            out = out - np.abs(M[..., 0, 1])
        return np.maximum(out, 0.0)

    @classmethod
    def default_proposal(cls) -> "Family":
        """A broad scalar message, the importance-sampling oracle's default proposal."""
        raise ValueError(f"no default proposal for {cls.__name__} variables; give one")

    @classmethod
    def estimate_ok(cls, stats) -> np.ndarray:
        """Rows of an importance-sampling estimate that make a valid message."""
        return np.ones(len(stats), dtype=bool)

    @classmethod
    def from_estimate(cls, stats) -> "Family":
        """The belief from an importance-sampling estimate (rows :meth:`estimate_ok`)."""
        return cls.project(stats)



def _coords_of_shape(cls, coords, method: str = "from_coords") -> np.ndarray:
    c = np.asarray(coords, dtype=float)
    if c.ndim < 1 or c.shape[-1] != len(cls.coord_names):
        raise ValueError(
            f"{cls.__name__}.{method}: `coords` must have last axis of length "
            f"{len(cls.coord_names)} ({', '.join(cls.coord_names)}), got shape {c.shape}"
        )
    return c


def _check_coords(cls, coords) -> np.ndarray:
    c = _coords_of_shape(cls, coords)
    if not all_finite(c):
        raise ValueError(f"{cls.__name__}.from_coords: `coords` must be finite")
    return c


def _check_ess(cls, ess) -> np.ndarray:
    s = np.asarray(ess, dtype=float)
    if s.ndim < 1 or s.shape[-1] != cls.n_stats:
        raise ValueError(
            f"{cls.__name__}.project: `ess` must have last axis of length {cls.n_stats}, "
            f"got shape {s.shape}"
        )
    if not np.isfinite(s).all():
        raise ValueError(f"{cls.__name__}.project: `ess` must be finite")
    return s


# ====================================================================== Gaussian
class Gaussian(Family):
    """Univariate Gaussian N(x; mean, var); natural parameters (mean/var, -1/(2 var))."""

    param_names = ("mean", "var")
    proper_is_finite = True  # (is_proper tests finiteness)
    coord_names = ("mean", "log_var")
    # the coordinate that is the log of the spread: a belief ÷ cavity message has a negative
    # precision exactly when this coordinate of the belief exceeds the cavity's
    spread_coord = 1

    def _check(self, mean, var):
        self._require_positive("Gaussian", "var", var)

    def mean(self):
        return self._mean

    def var(self):
        return self._var

    def affine(self, scale, shift=0.0):
        scale = np.asarray(scale, dtype=float)
        return Gaussian(scale * self._mean + shift, scale**2 * self._var, validate=False)

    @property
    def precision(self):
        return 1.0 / self._var

    @property
    def is_proper(self):
        v, m = self._var, self._mean
        if v.size == 1 and v.ndim:  # (a served message: by math, not five ufuncs on one number)
            x = v.item()
            return _one_bool(math.isfinite(x) and x > 0 and math.isfinite(m.item()), v.shape)
        return np.isfinite(v) & (v > 0) & np.isfinite(m)

    def unbounded_ratio(self, proposal):
        # exp(−(x − m)²/2v + (x − m')²/2v'): unbounded in a tail where v > v', or where v = v' and m ≠ m'
        self._same_family(proposal, "compare")
        v, v2 = self._var, proposal._var
        return (v > v2) | ((v == v2) & (self._mean != proposal._mean))

    def natural(self):
        if self._extras is not None:  # built from natural parameters: exact even at precision 0
            return _last_axis(*self._extras)
        v = self._var
        if v.size == 1 and v.ndim and (x := v.item()) != 0.0:
            # one message (a served request computes its belief's and messages' ~5 times): the
            # same IEEE operations on Python floats (the division by 0 numpy makes ±inf is left to it)
            prec = 1.0 / x
            return np.array((self._mean.item() * prec, -0.5 * prec)).reshape(v.shape + (2,))
        prec = 1.0 / v
        return _last_axis(self._mean * prec, -0.5 * prec)

    @classmethod
    def from_natural(cls, eta):
        eta = np.asarray(eta, dtype=float)
        if eta.size == 2 and eta.ndim > 1 and eta.shape[-1] == 2:  # one message: as below, on Python floats
            e1, e2 = eta.ravel().tolist()
            prec = -2.0 * e2
            if prec != 0.0:  # (1/±0 is numpy's: ±inf)
                var = 1.0 / prec
                shape = eta.shape[:-1]
                obj = cls._unchecked(np.array((e1 * var,)).reshape(shape), np.array((var,)).reshape(shape))
                x1, x2 = np.array((e1,)).reshape(shape), np.array((e2,)).reshape(shape)
                x1.flags.writeable = False
                x2.flags.writeable = False
                obj._extras = (x1, x2)
                return obj
        prec = -2.0 * eta[..., 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            var = 1.0 / prec
            mean = eta[..., 0] * var
        obj = cls._unchecked(mean, var)
        e1, e2 = np.array(eta[..., 0]), np.array(eta[..., 1])
        e1.flags.writeable = False
        e2.flags.writeable = False
        obj._extras = (e1, e2)
        return obj

    @classmethod
    def natural_is_proper(cls, eta) -> np.ndarray:
        # from_natural's mean and variance, and is_proper on them, without the message
        eta = np.asarray(eta, dtype=float)
        if eta.size == 2 and eta.ndim > 1:  # one message: the same IEEE operations on Python floats
            e1, e2 = eta.ravel().tolist()
            prec = -2.0 * e2
            ok = prec != 0.0 and math.isfinite(var := 1.0 / prec) and var > 0 and math.isfinite(e1 * var)
            return _one_bool(ok, eta.shape[:-1])
        with np.errstate(divide="ignore", invalid="ignore"):
            var = 1.0 / (-2.0 * eta[..., 1])
            mean = eta[..., 0] * var
        return np.isfinite(var) & (var > 0) & np.isfinite(mean)

    @classmethod
    def from_mean_precision(cls, mean, precision):
        return cls.from_natural(np.stack(np.broadcast_arrays(
            np.asarray(mean, float) * np.asarray(precision, float),
            -0.5 * np.asarray(precision, float)), axis=-1))

    @staticmethod
    def suff_stats(x):
        x = np.asarray(x, dtype=float)
        return np.stack([x, x * x], axis=-1)

    def expected_suff_stats(self):
        self._require_proper("expected_suff_stats")
        return _last_axis(self._mean, self._var + self._mean**2)

    @classmethod
    def project(cls, ess):
        s = _check_ess(cls, ess)
        var = s[..., 1] - s[..., 0] ** 2
        if np.any(var <= 0):
            raise ValueError("Gaussian.project: `ess` has E[x^2] <= E[x]^2 (non-positive variance)")
        return cls(s[..., 0], var)

    @classmethod
    def from_moments(cls, mean, var):
        return cls(mean, var)

    def to_coords(self):
        self._require_proper("to_coords")
        return _last_axis(self._mean, np.log(self._var))

    @classmethod
    def from_coords(cls, coords):
        c = _check_coords(cls, coords)
        return cls(c[..., 0], np.exp(c[..., 1]))

    def log_pdf(self, x):
        self._require_proper("log_pdf")
        x = np.asarray(x, dtype=float)
        return -0.5 * (_LOG_2PI + np.log(self._var) + (x - self._mean) ** 2 / self._var)

    def log_normalizer(self):
        self._require_proper("log_normalizer")
        return 0.5 * np.log(2 * np.pi * self._var) + 0.5 * self._mean**2 / self._var

    def kl(self, other):
        self._same_family(other, "compare")
        self._require_proper("kl")
        other._require_proper("kl")
        with np.errstate(all="ignore"):
            r = self._var / other._var
            near = np.abs(r - 1.0) < 0.5
            # r − 1 − ln r: by ln(1 + u) − u's series near r = 1 (a near pair's KL ~ (r − 1)²/4, found by an
            # audit to lose digits there); elsewhere ln r from the logs (r under/overflows: KL inf for a
            # finite 391, NaN for +inf; and r − 1 rounds to −1 below 2⁻⁵⁴ — found in review)
            normal = (r > 1e-300) & (r < 1e300)  # (ln r itself where r is a normal number: the difference of
            # two logs ~600 leaves ~1e-13 — found in review)
            lr = np.where(normal, np.log(np.where(normal, r, 1.0)), np.log(self._var) - np.log(other._var))
            spread = np.where(near, -log1p_minus(np.where(near, r, 1.0) - 1.0), r - 1.0 - lr)
        return (0.5 * (spread + (self._mean - other._mean) ** 2 / other._var))[()]

    def sample(self, n, random_state=None):
        self._require_proper("sample")
        rng = _rng(random_state)
        return self._mean + np.sqrt(self._var) * rng.standard_normal((int(n),) + self.shape)

    gaussian_cf = True
    json_columns = {"mean": "finite", "var": "positive"}
    centred_estimate = True

    def characteristic_function(self, omega):
        self._require_proper("characteristic_function")
        w = np.atleast_1d(np.asarray(omega, dtype=np.float64))
        m, v = self.mean()[..., None], self.var()[..., None]
        return np.exp(-0.5 * v * w**2 + 1j * m * w)

    def cf_terms(self, omega, plan, dt):
        m, v = self._mean.astype(dt)[:, None], self._var.astype(dt)[:, None]
        w = omega.astype(dt)[None, :]
        return "polar", -0.5 * v * w * w, m * w

    @classmethod
    def to_relative(cls, coords, base):
        # the mean in units of the incoming message's standard deviation
        rel = coords - base
        rel[..., 0] = rel[..., 0] / np.exp(0.5 * base[..., 1])
        return rel

    @classmethod
    def from_relative(cls, rel, base):
        out = rel + base
        out[..., 0] = base[..., 0] + rel[..., 0] * np.exp(0.5 * base[..., 1])
        return out

    @classmethod
    def relative_scale(cls, base):
        b = np.asarray(base, np.float64)
        out = np.ones_like(b)
        out[..., 0] = np.exp(0.5 * b[..., 1])
        return out

    @classmethod
    def decision_weights(cls, coords, base=None):
        # the Fisher information is diagonal: (max(1, var_base / var), 1) relative to a base, (max(1, 1 / var), 1)
        # in absolute units — written out, the general form's few numbers in a one-message request's path
        c = _coords_of_shape(cls, coords, "decision_weights")
        with np.errstate(all="ignore"):
            logr = -c[..., 1] if base is None else np.asarray(base, np.float64)[..., 1] - c[..., 1]
            w = np.empty(np.broadcast_shapes(c.shape, np.shape(logr) + (2,)))
            w[..., 0] = np.maximum(np.exp(logr), 1.0)
            w[..., 1] = 1.0
            bad = np.isnan(c).any(axis=-1) | np.isnan(logr)
            if bad.any():
                w[bad] = np.nan
        return w

    @classmethod
    def fisher_information(cls, coords):
        # (mean, log var): diag(1 / var, ½)
        c = _coords_of_shape(cls, coords, "fisher_information")  # (non-finite rows: NaN, never refused)
        F = np.zeros(c.shape + (2,))
        F[..., 0, 0] = np.exp(-c[..., 1])
        F[..., 1, 1] = 0.5
        return F

    @classmethod
    def default_proposal(cls):
        return cls(0.0, 200.0)  # the KJIT paper's proposal on the logistic input

    @classmethod
    def estimate_ok(cls, stats):
        return stats[:, 1] > 0

    @classmethod
    def from_estimate(cls, stats):
        return cls(stats[:, 0], stats[:, 1])


# ====================================================================== Beta
_ASYMPTOTIC = 1e4  # above this argument the digamma differences use the asymptotic series


def _digamma_diff(x, y):
    """ψ(x) − ψ(x + y) for y > 0, without cancellation when x ≫ y (series for x ≥ 1e4)."""
    x, y = np.broadcast_arrays(np.asarray(x, float), np.asarray(y, float))
    big = x >= _ASYMPTOTIC
    xs = np.where(big, x, _ASYMPTOTIC)  # evaluate the series only where it is valid
    xy = xs + y
    # ψ(x) ~ log x − 1/(2x) − 1/(12x²) + 1/(120x⁴), differences formed term by term, in r = y/x
    # and v = 1/(x + y) (products such as x·(x + y) overflow beyond x ~ 1e154: found by an audit,
    # Beta.project then answered 15 % off)
    with np.errstate(over="ignore", invalid="ignore"):  # (rows off the series' range: discarded below)
        r, v = y / xs, 1.0 / xy
        series = (
            -np.log1p(r)
            - r * v / 2.0
            - (r * v) * ((2.0 + r) * v) / 12.0
            + ((1.0 / xs) ** 4 - v**4) / 120.0
        )
    out = _near_taylor(np.where(big, series, special.digamma(x) - special.digamma(x + y)), x, y, big, 0)
    # x ≤ 1e-30 with y ≪ x (below Taylor's series' range): ψ(x) ≈ −1/x, and x + y rounds to x — the direct
    # difference was 0 for −y/(x(x + y)) (found in review: Beta(1e-100, 1e-80).kl(Beta(1e-60, 1e-20)) half the
    # truth).  ψ(x) − ψ(x + y) = [ψ(x + 1) − ψ(x + 1 + y)] − y/(x(x + y)), the bracket −ψ'(1 + x) y to first order
    tiny = ~big & (x <= 1e-30) & (y < _TAYLOR_RATIO * x) & (y > 0)
    if np.any(tiny):
        xt, yt = x[tiny], y[tiny]
        out = np.array(out, dtype=float)
        with np.errstate(over="ignore"):
            out[tiny] = -(yt / xt) / (xt + yt) - special.polygamma(1, 1.0 + xt) * yt
    return out


#: Taylor's series of the ψ differences where y ≪ x < 1e4: terms, and the largest y/x (next term < 1e-21 of the first)
_TAYLOR_TERMS, _TAYLOR_RATIO = 7, 1e-3


def _taylor_terms(ratio: float, most: int) -> int:
    """Terms of a Taylor series whose n-th term is ~ratioⁿ⁻¹ of the first, to below 1e-17 of it (at most
    ``most``, at least 2): polygamma calls are what these series cost (found in review: a fixed 17 made
    Gamma.kl 57× slower on near pairs)."""
    if not ratio > 0:
        return 2
    return int(min(most, max(2, 2 + np.ceil(17.0 / -np.log10(min(float(ratio), 0.5))))))


def _near_taylor(out, x, y, big, order):
    """``out`` with the rows where y < 1e-3 x < 10 (not ``big``) replaced by Taylor's series of
    ψ⁽ᵒʳᵈᵉʳ⁾(x) − ψ⁽ᵒʳᵈᵉʳ⁾(x + y) = −Σ ψ⁽ᵒʳᵈᵉʳ⁺ⁿ⁾(x) yⁿ/n! (times x for order 1, as
    :func:`_scaled_trigamma_diff`): the direct difference cancels to ~1e-16 ψ(x), which was all of
    y/x where y ≪ x (found by an audit: Beta(100, 1e-8)'s E[log x] 7e-6 off, Beta.project 7e-4 off)."""
    near = ~big & (y < _TAYLOR_RATIO * x) & (x > 1e-30)
    if not np.any(near):
        return out
    i = np.flatnonzero(near.ravel())
    xi, yi = x.ravel()[i], y.ravel()[i]
    acc, yn = np.zeros(i.size), yi.copy()
    for n in range(1, _taylor_terms(np.max(yi / xi), _TAYLOR_TERMS) - 1 + 1):
        acc -= special.polygamma(order + n, xi) * yn
        yn = yn * yi / (n + 1)
    out = np.array(out, dtype=float)
    out.ravel()[i] = acc * xi if order == 1 else acc
    return out


def kernel_limits(eta, stats) -> np.ndarray:
    """The (B, N) matrix η · u of natural parameters ``eta`` (B, k) and statistics ``stats`` (N, k),
    each term η_k u_k in its limit where one factor is infinite: 0 where the other is 0."""
    eta, stats = np.asarray(eta, float), np.asarray(stats, float)
    out = np.zeros((eta.shape[0], len(stats)))
    for k in range(eta.shape[1]):
        with np.errstate(invalid="ignore"):
            term = eta[:, k, None] * stats[None, :, k]
        zero = (stats[None, :, k] == 0) | ((eta[:, k, None] == 0) & ~np.isnan(stats[None, :, k]))
        out += np.where(zero, 0.0, term)  # 0 · ±inf = 0
    return out


def log1p_minus(u):
    """ln(1 + u) − u, without cancellation for small |u| (its series below 1e-2: error < u⁹/9)."""
    u = np.asarray(u, dtype=float)
    small = np.abs(u) < 1e-2
    us = np.where(small, u, 0.0)
    series = us * us * (-1 / 2 + us * (1 / 3 + us * (-1 / 4 + us * (1 / 5 + us * (-1 / 6 + us * (1 / 7 - us / 8))))))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(small, series, np.log1p(u) - u)


def _log_gamma_diff(x, d):
    """ln Γ(x + d) − ln Γ(x) (x, x + d > 0), without cancellation where both are large: beyond 1e3,
    x ln(1 + d/x) + d ln(x + d) − d + R(x + d) − R(x) (ln Γ(y) = y ln y − y + R(y), R =
    :func:`stirling_rest`)."""
    x, d = np.broadcast_arrays(np.asarray(x, float), np.asarray(d, float))
    y = x + d
    big = (x > 1e3) & (y > 1e3)
    xs, ds = np.where(big, x, 1e3), np.where(big, d, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        series = xs * np.log1p(ds / xs) + ds * np.log(xs + ds) - ds + stirling_rest(xs + ds) - stirling_rest(xs)
        direct = special.gammaln(y) - special.gammaln(x)
    return np.where(big, series, direct)


def _log_beta_diff(a1, b1, a2, b2):
    """ln B(a2, b2) − ln B(a1, b1), without the cancellation of two large ln B (each ~(a + b) ln 2 where
    both parameters are large, ~a ln b where one is): with ln B(a, b) = R(a) + R(b) − R(a + b) − f(a, b)
    (R = :func:`stirling_rest`, as :func:`log_beta`), f(a, b) = a ln(1 + b/a) + b ln(1 + a/b), the
    difference of f is taken term by term from the exact differences da = a2 − a1, db = b2 − b1:
    a2 L(r2) − a1 L(r1) = da L(r2) + a1 ln(1 + (r2 − r1)/(1 + r1)), r = b/a, r2 − r1 = (db a1 − b1 da)/(a1 a2)
    (L = ln(1 + ·)), and likewise for b — never a + b itself, whose rounding (ulp 0.06 at 4e14) would
    move ln Γ(a + b) by ~2.  Everywhere: a first version used it only where all four parameters exceed
    1e5 and scipy's betaln elsewhere — a KL of −1.3e-5 for 1.0e-5 at Beta(5e4, 1e10), found in review."""
    a1, b1, a2, b2 = np.broadcast_arrays(*(np.asarray(p, float) for p in (a1, b1, a2, b2)))
    A1, B1, A2, B2 = a1, b1, a2, b2
    da, db = A2 - A1, B2 - B1

    def term(x1, x2, dx, y1, y2, dy):  # x2 L(y2/x2) − x1 L(y1/x1)
        r1, r2 = y1 / x1, y2 / x2
        # r2 − r1 = (dy x1 − y1 dx)/(x1 x2), or (dy − r1 dx)/x2 where x1 x2 underflows (α ~ 1e-170: NaN); where
        # the ratios are far apart L(r2) − L(r1) from the logs (y1 + dy, as y2 was rebuilt, lost a y2 ≪ y1, and
        # the difference above cancelled: Beta(1e16, 1) ‖ Beta(1, 1) was inf, found by an audit)
        # — the exact difference only where both parameters moved by less than half of themselves: beyond, its
        # two products (~1e28 for parameters ~1e14) cancel to more than the difference of the ratios themselves
        # (Beta(1.5e14, 2.1e14) ‖ Beta(0.04, 0.29) was −1.7e12 for 18.2, found in review)
        x12 = x1 * x2
        moved = ~((np.abs(dx) < 0.5 * x1) & (np.abs(dy) < 0.5 * y1))
        dr = np.where(moved, r2 - r1, np.where(x12 > 1e-290, (dy * x1 - y1 * dx) / x12, (dy - r1 * dx) / x2))
        far = ~(np.abs(r2 - r1) < 0.5 * (1.0 + r1))
        # (L in logs, ln(1 + e^(ln y − ln x)): a ratio that overflows — Beta(1e-6, 1e100) ‖ Beta(1e-300, 1e16) — was
        # −inf + inf, found in review)
        L2 = np.where(far, np.logaddexp(0.0, np.log(y2) - np.log(x2)), np.log1p(r2))
        return dx * L2 + x1 * np.where(far, L2 - np.logaddexp(0.0, np.log(y1) - np.log(x1)), np.log1p(dr / (1.0 + r1)))

    with np.errstate(all="ignore"):
        f_diff = term(A1, A2, da, B1, B2, db) + term(B1, B2, db, A1, A2, da)
        rest = (stirling_rest(A2) - stirling_rest(A1) + stirling_rest(B2) - stirling_rest(B1)
                - (stirling_rest(A2 + B2) - stirling_rest(A1 + B1)))
    return rest - f_diff


#: a Beta parameter this share of the other or less: Beta.kl's near form takes the larger's ln Γ part with α + β's
_LOPSIDED = 1e-3


def _lgamma_bregman_shift_diff(y, dy, a, da) -> np.ndarray:
    """B(y, dy) − B(y + a, dy + da), B(x, d) = ln Γ(x + d) − ln Γ(x) − d ψ(x) (:func:`_lgamma_bregman`), for
    a ≤ 10⁻³ y, y ≥ 1, |dy| < y/10, |da| < a/10, without the cancellation of the two (~dy²/2y each): Taylor's series
    Σₙ [Δψₙ dyⁿ − ψ⁽ⁿ⁻¹⁾(y + a)((dy + da)ⁿ − dyⁿ)]/n!, Δψₙ = ψ⁽ⁿ⁻¹⁾(y) − ψ⁽ⁿ⁻¹⁾(y + a) = −Σₖ ψ⁽ⁿ⁻¹⁺ᵏ⁾(y) aᵏ/k!,
    (dy + da)ⁿ − dyⁿ = Σⱼ C(n, j) daʲ dyⁿ⁻ʲ — every term of the size of the result."""
    y, dy, a, da = (np.asarray(v, float) for v in (y, dy, a, da))
    if not y.size:
        return np.zeros(0)
    s = y + a
    nt = _taylor_terms(float(np.max(np.abs(dy) / y)), _GAMMA_KL_TERMS)
    kt = _taylor_terms(float(np.max(a / y)), 8)
    out, fact = np.zeros_like(y), 1.0
    for n in range(2, nt + 1):
        fact *= n
        dpsi, ak = np.zeros_like(y), np.ones_like(y)
        for k in range(1, kt + 1):
            ak = ak * a / k
            dpsi -= special.polygamma(n - 1 + k, y) * ak
        grow = sum(math.comb(n, j) * da**j * dy ** (n - j) for j in range(1, n + 1))
        out += (dpsi * dy**n - special.polygamma(n - 1, s) * grow) / fact
    return out


def _beta_kl_near(a1, b1, a2, b2) -> np.ndarray:
    """The pairs :func:`_beta_kl_bregman` answers: both parameters within a tenth of themselves (relative below 1 too:
    Beta(1e-170, 1e-300) ‖ Beta(1e-20, 1e-170) was taken as near, and its three parts' ~1e150 cancelled to 0 for
    1e130 — found in review)."""
    with np.errstate(invalid="ignore"):
        return (np.abs(a2 - a1) < 0.1 * a1) & (np.abs(b2 - b1) < 0.1 * b1)


def _beta_kl_bregman(a1, b1, a2, b2) -> np.ndarray:
    """KL[Beta(a1, b1) ‖ Beta(a2, b2)] of a near pair (:func:`_beta_kl_near`) as the Bregman divergence of
    ln B = ln Γ(α) + ln Γ(β) − ln Γ(α + β): B(a1, a2) + B(b1, b2) − B(s1, s1 + dα + dβ) (B = :func:`_lgamma_bregman`,
    s1 = a1 + b1), each of the three by Taylor's series — the general form's ln B and ψ differences cancelled to
    ~1e-14 absolute (a negative KL for 7.6 % of near pairs at parameters 0.1–100, found by an audit).  Where every
    parameter is beyond the Stirling form's 30, the three are taken together, since apart they are ~α t² each and
    cancel for a mean-matched pair (t = dα/α = dβ/β): by Stirling, ln Γ(y) = y ln y − y − ½ ln y + ½ ln 2π + R̃(y), the
    y ln y − y parts make s₁ times the Jensen gap of h(t) = (1 + t) ln(1 + t) − t between t_α and t_β (weights
    a1/s1, b1/s1), formed from t_α − t_β; the −½ ln y parts −½(ℓ(t_α) + ℓ(t_β) − ℓ(t_s)), ℓ(t) = ln(1 + t) − t; the
    R̃ parts as Gamma.kl's.  Returns ``(KL, size)``: ``size`` the sum of the magnitudes of what was added, whose
    rounding bounds the KL's."""
    da, db = a2 - a1, b2 - b1
    s1, ds = a1 + b1, da + db
    parts = (_lgamma_bregman(a1, a2), _lgamma_bregman(b1, b2), _lgamma_bregman(s1, a2 + b2, ds))
    out, size = parts[0] + parts[1] - parts[2], np.abs(parts[0]) + np.abs(parts[1]) + np.abs(parts[2])
    # one parameter a thousandth of the other or less (and the larger at least 1): the larger's part and α + β's
    # together (apart, ~b t² each, they cancelled: Beta(0.01, 1e15) ‖ Beta(0.01, 0.95e15) was 0 for 1.3e-5 — review)
    for small, big_, d_small, d_big, part_small in ((a1, b1, da, db, parts[0]), (b1, a1, db, da, parts[1])):
        lop = (small < _LOPSIDED * big_) & (big_ >= 1.0)
        if np.any(lop):
            i = np.flatnonzero(lop.ravel())
            pair = _lgamma_bregman_shift_diff(*(x.ravel()[i] for x in (big_, d_big, small, d_small)))
            out.ravel()[i] = part_small.ravel()[i] + pair
            size.ravel()[i] = np.abs(part_small.ravel()[i]) + np.abs(pair)
    big = (a1 > _GAMMA_KL_SERIES) & (b1 > _GAMMA_KL_SERIES) & (a2 > _GAMMA_KL_SERIES) & (b2 > _GAMMA_KL_SERIES)
    if not np.any(big):
        return out, size
    a, b, s, da, db, ds = (np.where(big, x, y) for x, y in ((a1, 1e3), (b1, 1e3), (s1, 2e3), (da, 0.0), (db, 0.0),
                                                            (ds, 0.0)))
    ta, tb, ts = da / a, db / b, ds / s
    w = a / s
    m = 1.0 + ts
    delta = (ta - tb) / m  # (1 + t_α)/(1 + t_s) − 1 = (1 − w)δ, (1 + t_β)/(1 + t_s) − 1 = −wδ
    u1, u2 = (1.0 - w) * delta, -w * delta
    # w(1 + t_α) ln(1 + u1) + (1 − w)(1 + t_β) ln(1 + u2), its first-order terms together: w(1 − w) m δ²
    gap = (w * (1.0 - w) * m * delta * delta + w * (1.0 + ta) * log1p_minus(u1)
           + (1.0 - w) * (1.0 + tb) * log1p_minus(u2))
    half = -0.5 * (log1p_minus(ta) + log1p_minus(tb) - log1p_minus(ts))
    corr = 0.0
    for n, c in _STIRLING:
        corr = corr + c * (a ** -n * _pow_minus_one_plus(ta, np.log1p(ta), n)
                           + b ** -n * _pow_minus_one_plus(tb, np.log1p(tb), n)
                           - s ** -n * _pow_minus_one_plus(ts, np.log1p(ts), n))
    value = s * gap + half + corr
    return np.where(big, value, out), np.where(big, np.abs(s * gap) + np.abs(half) + np.abs(corr), size)


def _stirling_d(x):
    """D(x) = ψ(x) − ln x = R'(x) (R = :func:`stirling_rest`): from 30 by Stirling's series −1/(2x) − Σ n cₙ x⁻⁽ⁿ⁺¹⁾
    (its next term ~0.02 x⁻¹², < 1e-17 of the value there), directly below (~200 ulp at 29, where ψ and ln x agree
    to 2 %)."""
    x = np.asarray(x, float)
    big = x >= _STIRLING_FROM
    ix = 1.0 / np.where(big, x, _STIRLING_FROM)
    series = -0.5 * ix - sum(n * c * ix ** (n + 1) for n, c in _STIRLING)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(big, series, special.digamma(x) - np.log(x))


def _stirling_diffs(x, y):
    """(R(x + y) − R(x), D(x) − D(x + y)) for x ≥ 30 (R = :func:`stirling_rest`, D = :func:`_stirling_d`), from
    their series term by term: x⁻ᵏ − vᵏ = r v Σⱼ x⁻ʲ vᵏ⁻¹⁻ʲ (r = y/x, v = 1/(x + y)), never a difference of two
    values, so each is within a few ulp of itself for every y ≥ 0."""
    ix, v = 1.0 / x, 1.0 / (x + y)
    rv = (y / x) * v  # 1/x − v
    rest, jensen = -0.5 * np.log1p(y / x), -0.5 * rv
    for n, c in _STIRLING:
        rest = rest - c * rv * sum(ix**j * v ** (n - 1 - j) for j in range(n))
        jensen = jensen - n * c * rv * sum(ix**j * v ** (n - j) for j in range(n + 1))
    return rest, jensen


def _rest_taylor(x, d, start: int):
    """Σ_{n ≥ start} R⁽ⁿ⁾(x) dⁿ/n! for |d| < x/10 and x < 30 (R = :func:`stirling_rest`): R' = D (:func:`_stirling_d`)
    and, from n = 2, R⁽ⁿ⁾ = ψ⁽ⁿ⁻¹⁾(x) − (−1)ⁿ (n − 2)!/xⁿ⁻¹ (they cancel by at most ~2x); below x = 1 with ψ⁽ⁿ⁻¹⁾(x)
    = ψ⁽ⁿ⁻¹⁾(x + 1) + (−1)ⁿ (n − 1)!/xⁿ, the terms in q = d/x (ψ⁽¹⁶⁾(1e-19) overflows)."""
    shift = np.where(x < 1.0, 1.0, 0.0)
    q = d / x
    out, dn, qn, fact = np.zeros_like(x), np.ones_like(x), np.ones_like(x), 1.0
    for n in range(1, _taylor_terms(float(np.max(np.abs(q), initial=0.0)), _GAMMA_KL_TERMS) + 1):
        qprev, sign = qn, (-1.0) ** n
        dn, qn, fact = dn * d, qn * q, fact * n
        if n < start:
            continue
        if n == 1:
            out = out + _stirling_d(x) * d
            continue
        out = out + (special.polygamma(n - 1, x + shift) * dn / fact + shift * sign * qn / n
                     - sign * qprev * d / (n * (n - 1)))
    return out


def _rest_step(x, y):
    """R(x + y) − R(x) for 0 ≤ y ≤ x: by :func:`_stirling_diffs` from x = 30, Taylor's series below where y < x/10,
    directly otherwise (there it is at least ~y/(2x), the two R at most ~1.2 or ~−ln x)."""
    x, y = np.broadcast_arrays(np.asarray(x, float), np.asarray(y, float))
    big = x >= _STIRLING_FROM
    out = np.where(big, _stirling_diffs(np.where(big, x, _STIRLING_FROM), np.where(big, y, 0.0))[0],
                   stirling_rest(x + y) - stirling_rest(x))
    taylor = ~big & (y < 0.1 * x)
    if np.any(taylor):
        out[taylor] = _rest_taylor(x[taylor], y[taylor], 1)
    return out


def _log_jensen_gap(x, y):
    """E[ln X] − ln E[X] = ψ(x) − ψ(x + y) + ln(1 + y/x) = D(x) − D(x + y) for X ~ Beta(x, y) (D = :func:`_stirling_d`),
    ≤ 0: from x = 30 by :func:`_stirling_diffs`; below as D(x) − D(x + y) where y ≥ x, and as
    :func:`_digamma_diff` + ln(1 + y/x) where y < x (the two cancel there by at most ~2(x + y) ≤ 120)."""
    x, y = np.broadcast_arrays(np.asarray(x, float), np.asarray(y, float))
    big = x >= _STIRLING_FROM
    with np.errstate(all="ignore"):
        series = _stirling_diffs(np.where(big, x, _STIRLING_FROM), np.where(big, y, 0.0))[1]
        apart = _stirling_d(x) - _stirling_d(x + y)
        close = _digamma_diff(x, y) + np.log1p(y / x)
    return np.where(big, series, np.where(y < x, close, apart))


def _log_share(x, y):
    """ln(x/(x + y)) = −ln(1 + y/x), in logs where y/x overflows."""
    r = y / x
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.isfinite(r), -np.log1p(np.where(np.isfinite(r), r, 0.0)), np.log(x) - np.log(y))


def _times_z_minus_one_minus_log(a, az, lz, t):
    """a (z − 1 − ln z) ≥ 0 for z = e^lz, given a·z (``az``, formed without z itself, which may overflow) and ``t`` =
    z − 1 (formed exactly where z is near 1), which is taken where |ln z| < ½ (−a (ln(1 + t) − t),
    :func:`log1p_minus`)."""
    near = np.abs(lz) < 0.5
    return np.where(near, -a * log1p_minus(np.where(near, t, 0.0)), az - a * (1.0 + lz))


def _beta_kl_far(a1, b1, a2, b2) -> np.ndarray:
    """KL[Beta(a1, b1) ‖ Beta(a2, b2)] for any pair, with nothing of the parameters' size left to cancel (Beta.kl's
    form for pairs that are not near).  With ln Γ(x) = x ln x − x + R(x) (R = :func:`stirling_rest`) and ψ(x) = ln x
    + D(x) (D = R', :func:`_stirling_d`), the x ln x parts of the KL make s2 KL[Bernoulli(m2) ‖ Bernoulli(m1)]
    (m = a/s, s = a + b), written a2 (za − 1 − ln za) + b2 (zb − 1 − ln zb), za = m1/m2, zb = (1 − m1)/(1 − m2)
    (the linear terms sum to 0), each ≥ 0; the rest is R(a2) − R(a1) + R(b2) − R(b1) − R(s2) + R(s1) −
    (a2 − a1) Ja − (b2 − b1) Jb, Ja = D(a1) − D(s1) = E_p[ln x] − ln m1 and likewise Jb (:func:`_log_jensen_gap`),
    with R(s) = R(L) + [R(L + S) − R(L)] (L, S the larger and smaller parameter, :func:`_rest_step`), so that R is
    never taken at α + β apart from the larger parameter.  The textbook form instead adds ln B(a1, b1) ~ −(a1 + b1)
    ln 2 to terms of its size: where a concentrated Beta is compared with a broad one (parameters ~1e16 against ~1)
    the KL ~ ½ ln(a1 + b1) was left 0.1–50 % off; here every part is about the KL's size or the parameters'
    changes', and a smaller parameter S that changes by less than a tenth takes R(S2) − R(S1) − (S2 − S1) D(S1) by
    Taylor's series (:func:`_rest_taylor`: apart they cancel to the KL, ~S, where S is tiny).  Measured against
    mpmath (benchmarks/beta_precision.py) in the module's docstring of Beta.kl."""
    a1, b1, a2, b2 = np.broadcast_arrays(*(np.asarray(p, float) for p in (a1, b1, a2, b2)))
    shape = a1.shape
    a1, b1, a2, b2 = (x.ravel() for x in (a1, b1, a2, b2))
    with np.errstate(all="ignore"):
        s1 = a1 + b1  # (overflowing: the result is marked not finite below, so Beta.kl's other form answers)
        lma1, lma2, lmb1, lmb2 = _log_share(a1, b1), _log_share(a2, b2), _log_share(b1, a1), _log_share(b2, a2)
        ta = (a1 * (b2 / a2) - b1) / s1  # za − 1 = (a1 b2 − a2 b1)/(a2 s1)
        tb = (b1 * (a2 / b2) - a1) / s1  # zb − 1
        s2 = a2 + b2
        s2 = np.where(np.isfinite(s2), s2, np.inf)
        # a2 za = m1 s2, b2 zb = (1 − m1) s2 (a2 + b2 overflowing: the KL too)
        bern = (_times_z_minus_one_minus_log(a2, (a1 / s1) * s2, lma1 - lma2, ta)
                + _times_z_minus_one_minus_log(b2, (b1 / s1) * s2, lmb1 - lmb2, tb))
        small1, small2 = np.minimum(a1, b1), np.minimum(a2, b2)
        rest = (stirling_rest(small2) - stirling_rest(small1) + _rest_step(np.maximum(a1, b1), small1)
                - _rest_step(np.maximum(a2, b2), small2))
        ja, jb = _log_jensen_gap(a1, b1), _log_jensen_gap(b1, a1)
        out = bern + rest - (a2 - a1) * ja - (b2 - b1) * jb
        # the smaller parameter on both sides (the same one), below 30 and moved by less than a tenth of itself
        same_a = (a1 <= b1) & (a2 <= b2)
        same = ((same_a | ((b1 <= a1) & (b2 <= a2))) & (small1 < _STIRLING_FROM)
                & (np.abs(small2 - small1) < 0.1 * small1))
        if np.any(same):
            lo1, lo2, sa = small1[same], small2[same], same_a[same]
            # −(S2 − S1) J = −(S2 − S1) D(S1) + (S2 − S1) D(s1): the first with R(S2) − R(S1) by Taylor's series
            out[same] = (bern[same] + _rest_taylor(lo1, lo2 - lo1, 2) + (lo2 - lo1) * _stirling_d(s1[same])
                         + _rest_step(np.maximum(a1, b1)[same], lo1) - _rest_step(np.maximum(a2, b2)[same], lo2)
                         - np.where(sa, (b2 - b1)[same] * jb[same], (a2 - a1)[same] * ja[same]))
        # a1 + b1 beyond the largest double: the parts above read it (found in review: Beta(1e308, 1e308) against
        # Beta(1e307, 1e307) gave 1.15 for 0.70) — not answered here
        out = np.where(np.isfinite(s1), out, np.nan)
    return out.reshape(shape)


def _scaled_trigamma_diff(x, y):
    """x·(ψ'(x) − ψ'(x + y)) for y > 0, without cancellation when x ≫ y, and without underflow
    (the difference alone is ~y/x², zero in doubles beyond x ~ 1e154: Beta.project's Jacobian
    then was singular — found by an audit)."""
    x, y = np.broadcast_arrays(np.asarray(x, float), np.asarray(y, float))
    big = x >= _ASYMPTOTIC
    xs = np.where(big, x, _ASYMPTOTIC)
    xy = xs + y
    # ψ'(x) ~ 1/x + 1/(2x²) + 1/(6x³) − 1/(30x⁵), times x, in r = y/x, v = 1/(x + y), x·v = 1/(1 + r)
    with np.errstate(over="ignore", invalid="ignore"):  # (rows off the series' range: discarded below)
        r, v = y / xs, 1.0 / xy
        xv = 1.0 / (1.0 + r)
        series = (
            r * xv
            + (r * xv) * ((2.0 + r) * v) / 2.0
            + ((1.0 / xs) ** 2 - xv * v * v) / 6.0
            - ((1.0 / xs) ** 4 - xv * v**4) / 30.0
        )
        small = x * (trigamma(x) - trigamma(x + y))
    return _near_taylor(np.where(big, series, small), x, y, big, 1)


def _beta_project_noise(a, b, la, lb, s1, s2, j11, j12, j21, j22):
    """Beta.project's residuals' rounding at (α, β) = (``a``, ``b``) = exp(``la``, ``lb``): the statistics' (½ ulp,
    with :func:`_digamma_diff`'s few ulp of the same size: 4 ulp), the direct ψ(x) − ψ(x + y) of :func:`_digamma_diff`
    (where neither of its series applies: 2 ulp of the two ψ, ~3000 ulp of the value at ψ(308) − ψ(308.6)), and the
    parameters' own grain (one ulp of ln α moves the first residual by j11 ulp(ln α): 1.4e-3 at α = 2.6e-12, above
    the rest)."""
    eps = np.finfo(float).eps
    with np.errstate(all="ignore"):
        pa, pb, ps = np.abs(special.digamma(a)), np.abs(special.digamma(b)), np.abs(special.digamma(a + b))
    direct1 = (a < _ASYMPTOTIC) & ~(b < _TAYLOR_RATIO * a)
    direct2 = (b < _ASYMPTOTIC) & ~(a < _TAYLOR_RATIO * b)
    grain1 = eps * (np.abs(j11) * np.maximum(np.abs(la), 1.0) + np.abs(j12) * np.maximum(np.abs(lb), 1.0))
    grain2 = eps * (np.abs(j21) * np.maximum(np.abs(la), 1.0) + np.abs(j22) * np.maximum(np.abs(lb), 1.0))
    return (4.0 * eps * np.abs(s1) + np.where(direct1, 2.0 * eps * (pa + ps), 0.0) + grain1,
            4.0 * eps * np.abs(s2) + np.where(direct2, 2.0 * eps * (pb + ps), 0.0) + grain2)


class Beta(Family):
    """Beta(x; alpha, beta) on (0, 1); natural parameters (alpha-1, beta-1) on (log x, log(1-x))."""

    closed_support = "[0, 1]"

    param_names = ("alpha", "beta")
    proper_is_finite = True  # (is_proper tests finiteness)
    coord_names = ("log_alpha", "log_beta")

    def _check(self, alpha, beta):
        self._require_positive("Beta", "alpha", alpha, _TINY)
        self._require_positive("Beta", "beta", beta, _TINY)

    @property
    def alpha(self):
        return self._alpha

    @property
    def beta(self):
        return self._beta

    @property
    def is_proper(self):
        return _both_positive(self._alpha, self._beta)

    def natural(self):
        return _last_axis(self._alpha - 1.0, self._beta - 1.0)

    @classmethod
    def from_natural(cls, eta):
        eta = np.asarray(eta, dtype=float)
        return cls._unchecked(eta[..., 0] + 1.0, eta[..., 1] + 1.0)

    @staticmethod
    def suff_stats(x):
        x = np.asarray(x, dtype=float)
        return np.stack([np.log(x), np.log1p(-x)], axis=-1)

    def expected_suff_stats(self):
        self._require_proper("expected_suff_stats")
        a, b = self._alpha, self._beta
        return np.stack([_digamma_diff(a, b), _digamma_diff(b, a)], axis=-1)

    @classmethod
    def project(cls, ess, method: str = "kl", tol: float = 1e-12, max_iter: int = 100):
        """KL projection: solve ψ(α)−ψ(α+β) = E[log x], ψ(β)−ψ(α+β) = E[log(1−x)].

        Vectorised Newton on (log α, log β), started at Minka's approximation (ψ(x) ≈ log(x − 1/2)), with step
        halving so that the residual measured as a Newton step from the current Jacobian (J⁻¹ r: each equation
        weighed by what it says of the parameters) never grows.  An element stops when its full Newton step — its
        parameters' relative distance from the root — is below ``tol``, or below the step that the residuals'
        rounding (:func:`_beta_project_noise`) alone would make: what the statistics determine, ~1e-16 (α + β)
        relative where both parameters are large (the statistics fix α + β through terms ~1/α only: 3e-4 at
        Beta(1e12, 1e12), 0.1 at (3e14, 5e14) against mpmath), and up to ~1e-11 where _digamma_diff's direct
        ψ difference is its limit (Beta(570, 2850): 5e-12).  Elements beyond both after ``max_iter`` steps are
        named in a RuntimeWarning.  (The step halving compared the sum of the squared residuals, and stopped on the
        change it made: where one statistic is ~5e10 in magnitude its rounding, ~1e-5, outweighed the other
        equation, every step that improved that one looked worse, and halved thirty times it passed the test — α, β
        1.4e-5 off, reported converged; found by an audit.  Against mpmath, one parameter 1e-12–1e-9 and the other
        1e-3–1e6, 2 000 draws: worst 1.4e-5 → 2.0e-15, 7 beyond 1e-12 → 0.)
        ``method="moments"`` is not available from log statistics: use :meth:`project_moments` with mean and variance
        instead (the paper's cheaper moment matching).
        """
        if method != "kl":
            raise ValueError("Beta.project: `method` must be 'kl' (use Beta.project_moments for moment matching)")
        s = _check_ess(cls, ess)
        s1, s2 = s[..., 0], s[..., 1]
        g1, g2 = np.exp(s1), np.exp(s2)
        # 1 − g1 − g2 without cancellation when one of the statistics is ≈ 0
        denom = np.where(s2 > s1, -np.expm1(s2) - g1, -np.expm1(s1) - g2)
        if np.any(~(denom > 0)) or np.any(s1 >= 0) or np.any(s2 >= 0):
            raise ValueError(
                "Beta.project: `ess` is not attainable by a Beta (need exp(E log x) + exp(E log(1-x)) < 1)"
            )
        shape = s1.shape
        a = np.maximum(-0.5 * np.expm1(s2) / denom, 1e-8)
        b = np.maximum(-0.5 * np.expm1(s1) / denom, 1e-8)
        la, lb = np.log(a), np.log(b)

        la, lb, s1, s2 = la.ravel(), lb.ravel(), s1.ravel(), s2.ravel()

        def resid(la, lb, idx):
            a, b = np.exp(la), np.exp(lb)
            return _digamma_diff(a, b) - s1[idx], _digamma_diff(b, a) - s2[idx]

        idx = np.arange(la.size)  # elements still iterating (converged ones drop out)
        for _ in range(max_iter):
            if idx.size == 0:
                break
            xa, xb = la[idx], lb[idx]
            r1, r2 = resid(xa, xb, idx)
            a, b = np.exp(xa), np.exp(xb)
            tab = trigamma(a + b)
            j11 = _scaled_trigamma_diff(a, b)
            j12 = -tab * b
            j21 = -tab * a
            j22 = _scaled_trigamma_diff(b, a)
            det = j11 * j22 - j12 * j21
            d1 = (j22 * r1 - j12 * r2) / det
            d2 = (-j21 * r1 + j11 * r2) / det
            # the step the residuals' rounding alone would make: below it the root is not better determined
            noise1, noise2 = _beta_project_noise(a, b, xa, xb, s1[idx], s2[idx], j11, j12, j21, j22)
            floor = np.maximum(np.abs(j22) * noise1 + np.abs(j12) * noise2,
                               np.abs(j21) * noise1 + np.abs(j11) * noise2) / np.abs(det)
            done = ~(np.maximum(np.abs(d1), np.abs(d2)) > np.maximum(tol, floor))
            # limit the step in log space, then halve until the residual, as a step, is no longer than this one
            with np.errstate(divide="ignore"):
                scale = np.minimum(1.0, 2.0 / np.maximum(np.abs(d1), np.abs(d2)))
            old = np.maximum(d1 * d1 + d2 * d2, floor * floor)
            d1, d2 = d1 * scale, d2 * scale
            step = np.ones_like(xa)
            for _h in range(30):
                nla, nlb = xa - step * d1, xb - step * d2
                n1, n2 = resid(nla, nlb, idx)
                # the residual in the step's own units, J⁻¹ r with this iterate's J (natural monotonicity): both
                # equations weighed by what they say of the parameters, not by their statistics' sizes
                e1, e2 = (j22 * n1 - j12 * n2) / det, (-j21 * n1 + j11 * n2) / det
                worse = ~(e1 * e1 + e2 * e2 <= old)
                if not worse.any():
                    break
                step = np.where(worse, step * 0.5, step)
            la[idx], lb[idx] = nla, nlb
            idx = idx[~done]
        if idx.size:
            warnings.warn(
                f"Beta.project: {idx.size} element(s) did not converge in {max_iter} Newton steps (first: flat index "
                f"{idx[:10].tolist()}); their parameters are not within tol={tol:g}", RuntimeWarning, stacklevel=2)
        la, lb = la.reshape(shape), lb.reshape(shape)
        return cls(np.exp(la), np.exp(lb))

    @classmethod
    def project_moments(cls, mean, var):
        """Moment matching: the Beta with the given mean and variance (the paper's code)."""
        m = np.asarray(mean, dtype=float)
        v = np.asarray(var, dtype=float)
        if np.any(~((m > 0) & (m < 1))):
            raise ValueError("Beta.project_moments: `mean` must lie in (0, 1)")
        if np.any(~((v > 0) & (v < m * (1 - m)))):
            raise ValueError("Beta.project_moments: `var` must lie in (0, mean (1 - mean))")
        k = m * (1 - m) / v - 1.0
        return cls(m * k, (1 - m) * k)

    def to_coords(self):
        self._require_proper("to_coords")
        return _last_axis(np.log(self._alpha), np.log(self._beta))

    @classmethod
    def from_coords(cls, coords):
        c = _check_coords(cls, coords)
        return cls(np.exp(c[..., 0]), np.exp(c[..., 1]))

    def log_pdf(self, x):
        """(α − 1) ln x + (β − 1) ln(1 − x) − ln B(α, β); where α − 1 and β − 1 both exceed 1e5 formed
        about the mode from the logit of x (:func:`beta_log_pdf_logit`): the textbook sum's terms are
        each ~(α + β) ln 2 — 1.3e-5 off at Beta(1e12, 1e12), 0.12 at (1e15, 3e15) against mpmath."""
        self._require_proper("log_pdf")
        x = np.asarray(x, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (
                special.xlogy(self._alpha - 1.0, x)
                + special.xlog1py(self._beta - 1.0, -x)
                - log_beta(self._alpha, self._beta)
            )
            big = beta_concentrated(self._alpha, self._beta)
            if np.any(big):
                inside = (x > 0) & (x < 1)
                t = np.log(np.where(inside, x, 0.5)) - np.log1p(-np.where(inside, x, 0.5))
                out = np.where(big, beta_log_pdf_logit(t, self._alpha, self._beta), out)
        return np.where((x > 0) & (x < 1), out, -np.inf)

    def log_pdf_logit(self, t):
        """log Beta(σ(t); α, β) from the logit t (no Jacobian): :func:`beta_log_pdf_logit`."""
        self._require_proper("log_pdf_logit")
        return beta_log_pdf_logit(t, self._alpha, self._beta)

    def mean(self):
        # (α + β overflows beyond ~9e307: Beta(1e308, 1e308)'s mean was 0, found by an audit; halves do not)
        a, b = self._alpha, self._beta
        with np.errstate(over="ignore"):
            return np.where(np.isfinite(a + b), a / (a + b), (0.5 * a) / (0.5 * a + 0.5 * b))[()]

    def var(self):
        # in ratios: s³ overflows beyond ~1e102 (found by an audit) and α·β underflows below ~1e-154
        # (Beta(1e-300, 1e-300)'s variance, 1/4, was NaN)
        s = self._alpha + self._beta
        with np.errstate(over="ignore"):
            return ((self._alpha / s) * (self._beta / s) / (s + 1.0))[()]

    def log_normalizer(self):
        self._require_proper("log_normalizer")
        return log_beta(self._alpha, self._beta)

    @staticmethod
    def in_support(x):
        x = np.asarray(x, dtype=float)
        return (x > 0.0) & (x < 1.0)

    @classmethod
    def in_closed_support(cls, x):
        x = np.asarray(x, dtype=float)
        return (x >= 0.0) & (x <= 1.0)

    def unbounded_density(self):
        return (self._alpha < 1.0) | (self._beta < 1.0)

    def unbounded_ratio(self, proposal):
        # x^(α − α') (1 − x)^(β − β'): unbounded at 0 or 1 where a parameter is below the proposal's
        self._same_family(proposal, "compare")
        return (self._alpha < proposal._alpha) | (self._beta < proposal._beta)

    def kl(self, other):
        self._same_family(other, "compare")
        self._require_proper("kl")
        other._require_proper("kl")
        a1, b1, a2, b2 = np.broadcast_arrays(self._alpha, self._beta, other._alpha, other._beta)
        # ln B(a2, b2) − ln B(a1, b1) + (a1 − a2)(ψ(a1) − ψ(a1 + b1)) + (b1 − b2)(ψ(b1) − ψ(a1 + b1)),
        # the differences formed without cancellation: with ψ(a1), ψ(b1), ψ(a1 + b1) and the two ln B
        # apart, a β ~ 2e14 gave −0.5 for 0.003 (found by an audit; logistic → z beliefs reach it)
        # near pairs (_beta_kl_near) as ln B's Bregman divergence (_beta_kl_bregman): the general form's ~1e-14
        # absolute made 7.6 % of near pairs at parameters 0.1–100 negative (found by an audit); measured against
        # mpmath (forty-third session, 300 pairs a set): near pairs at 0.1–100 relative error ≤ 2e-13 (was up to
        # 5e3, 7 % negative), mean-matched pairs at 1e-3–1e14 ≤ 2.6e-13 (2e4), near pairs at 1e-3–1e14 ≤ 4.2e-5
        # (8.2), far pairs ≤ 1.1e-2 (5.6e11, and 10 of 300 inf or NaN).
        # Pairs that are not near by _beta_kl_far, whose parts are each about the KL's size: the form above adds
        # ln B(a1, b1) ~ −(a1 + b1) ln 2 to terms of its size, and a concentrated Beta against a broad one (a parameter
        # falling by ~16 orders) was 0.1–50 % off.  Against mpmath (benchmarks/beta_precision.py, 400 pairs a regime,
        # 150 digits), worst relative error before → after: every parameter log-uniform on 1e-12–1e16 8.1e-2 → 5.3e-14,
        # p's 1e12–1e16 with q's 1e-12–1e2 3.7e-1 → 5.4e-16, the reverse 5.6e-15 → 5.6e-15, q = p·10^U(−16, 16)
        # 4.1e-2 → 4.9e-14, one parameter kept and the other log-uniform 2.1e-2 → 2.0e-13 (other seeds: ≤ 1.8e-13 in
        # these and tiny or mid-sized pairs); near pairs are the near form's, unchanged.  The form above only where
        # the far form is not finite (a1 + b1 beyond the largest double: it answers −inf or NaN there, not a number)
        with np.errstate(all="ignore"):
            near = _beta_kl_near(a1, b1, a2, b2)
            out = np.empty(a1.shape)
            if np.any(near):
                i = np.flatnonzero(near.ravel())
                out.ravel()[i] = _beta_kl_bregman(*(x.ravel()[i] for x in (a1, b1, a2, b2)))[0]
            if not np.all(near):
                i = np.flatnonzero(~near.ravel())
                p = [x.ravel()[i] for x in (a1, b1, a2, b2)]
                far = _beta_kl_far(*p)
                bad = ~np.isfinite(far)
                if np.any(bad):
                    p = [x[bad] for x in p]
                    far[bad] = (_log_beta_diff(*p) + (p[0] - p[2]) * _digamma_diff(p[0], p[1])
                                + (p[1] - p[3]) * _digamma_diff(p[1], p[0]))
                out.ravel()[i] = far
        return out[()]

    def sample(self, n, random_state=None):
        self._require_proper("sample")
        rng = _rng(random_state)
        return rng.beta(self._alpha, self._beta, size=(int(n),) + self.shape)

    json_columns = {"alpha": "positive", "beta": "positive"}

    def unconstrained_moments(self):
        # logit z: (ψ(α) − ψ(β), ψ'(α) + ψ'(β))
        a, b = self._alpha, self._beta
        return special.digamma(a) - special.digamma(b), trigamma(a) + trigamma(b)

    def characteristic_function(self, omega):
        self._require_proper("characteristic_function")
        return beta_characteristic_function(self._alpha, self._beta, omega)

    @classmethod
    def cf_plan(cls, omega, dt):
        omega = np.asarray(omega, dtype=np.float64)
        G = chebyshev_size(float(np.max(np.abs(omega))))
        Kc, Ks = chebyshev_cf_coefficients(omega, G)
        return G, np.concatenate([Kc, Ks], axis=1).astype(dt)

    def cf_terms(self, omega, plan, dt):
        G, K = plan
        D = len(omega)
        CS = beta_chebyshev_moments(self._alpha, self._beta, G).astype(dt) @ K
        return "complex", CS[:, :D], CS[:, D:]

    @classmethod
    def fisher_information(cls, coords):
        # (log α, log β): α² (ψ'(α) − ψ'(α+β)), −αβ ψ'(α+β), β² (ψ'(β) − ψ'(α+β))
        c = _coords_of_shape(cls, coords, "fisher_information")  # (non-finite rows: NaN, never refused)
        a, b = np.exp(c[..., 0]), np.exp(c[..., 1])
        F = np.empty(c.shape + (2,))
        F[..., 0, 0] = a * _scaled_trigamma_diff(a, b)
        F[..., 1, 1] = b * _scaled_trigamma_diff(b, a)
        F[..., 0, 1] = F[..., 1, 0] = -a * b * trigamma(a + b)
        return F

    @classmethod
    def default_proposal(cls):
        return cls(1.0, 1.0)


# ====================================================================== Gamma
def stirling_rest(x):
    """ln Γ(x) − (x ln x − x), without the cancellation of the two for large x: ½ ln(2π/x) plus
    Stirling's series (:data:`_STIRLING`) from :data:`_STIRLING_FROM` = 30, where its first omitted
    term is < 1e-19 (it was taken from 1e3 with three terms, and the direct difference below that
    cancelled to ~1e-12 near 1e3)."""
    x = np.asarray(x, float)
    big = x >= _STIRLING_FROM
    xb = np.where(big, x, _STIRLING_FROM)
    series = 0.5 * np.log(2.0 * np.pi / xb) + sum(c * xb**-n for n, c in _STIRLING)
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = special.gammaln(x) - special.xlogy(x, x) + x
    return np.where(big, series, direct)


def log_beta(a, b):
    """ln B(a, b): where either argument reaches :data:`_STIRLING_FROM` (30), R(a) + R(b) − R(a + b) −
    a ln(1 + b/a) − b ln(1 + a/b) (R = :func:`stirling_rest`), whose terms do not cancel; scipy's
    ``betaln`` below.  ``betaln`` is 1e-2 off at (1e12, 1e12) (found by an audit, in the logistic
    factor's evidence), 1e-10 relative at (0.5, 2e5) and (30, 1e7), NaN at (1e100, 1e300); the form
    above is within 2e-16 relative of mpmath there (it was used beyond 1e5 each until the
    twenty-third session)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    # (finite positive arguments only: betaln's inf / NaN elsewhere — a review found NaN for ln B(0, 100))
    big = (np.maximum(a, b) >= _STIRLING_FROM) & (a > 0) & (b > 0) & (a < np.inf) & (b < np.inf)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ab, bb = np.where(big, a, _STIRLING_FROM), np.where(big, b, _STIRLING_FROM)
        stable = stirling_rest(ab) + stirling_rest(bb) - stirling_rest(ab + bb) - _x_log1p_ratio(ab, bb) \
            - _x_log1p_ratio(bb, ab)
        return np.where(big, stable, special.betaln(a, b))[()]


def _x_log1p_ratio(x, y):
    """x ln(1 + y/x) for x, y > 0, also where y/x overflows (then x (ln y − ln x): 1 + y/x rounds to y/x)."""
    r = y / x
    return np.where(np.isfinite(r), x * np.log1p(np.where(np.isfinite(r), r, 0.0)), x * (np.log(y) - np.log(x)))


#: where a Beta's α − 1 and β − 1 both exceed this, its log density is formed about its mode
BETA_CONCENTRATED = 1e5


def beta_concentrated(alpha, beta):
    """Which Beta(α, β) have a log density formed about the mode (:func:`beta_log_pdf_logit`)."""
    return (np.asarray(alpha) - 1.0 > BETA_CONCENTRATED) & (np.asarray(beta) - 1.0 > BETA_CONCENTRATED)


def beta_log_pdf_logit(t, alpha, beta):
    """``log Beta(σ(t); α, β) = (α−1) log σ(t) + (β−1) log σ(−t) − log B(α, β)`` (no Jacobian);
    broadcasts.  Where α − 1 and β − 1 both exceed 1e5 (:func:`beta_concentrated`), the two terms and
    log B are each ~(α+β) ln 2 and cancel to ~1e-16 (α+β) absolute (the logistic factor's evidence
    was 1e-5–1e-4 nats off at Beta(1e12, 1e12), 1e-2 at 1e14); there it is formed about its mode
    (:func:`_beta_log_about_mode`).  (The logistic factor's label density; Beta.log_pdf's in the
    concentrated case.)"""
    t, alpha, beta = np.broadcast_arrays(*(np.asarray(p, float) for p in (t, alpha, beta)))
    with np.errstate(over="ignore", invalid="ignore"):
        out = -(alpha - 1.0) * np.logaddexp(0.0, -t) - (beta - 1.0) * np.logaddexp(0.0, t) - log_beta(alpha, beta)
    big = beta_concentrated(alpha, beta)
    if big.any():
        out = np.array(out, dtype=float)
        out[big] = _beta_log_about_mode(t[big], alpha[big] - 1.0, beta[big] - 1.0)
    return out[()]


def _beta_log_about_mode(t, a, b):
    """ℓ(t) for α − 1 = ``a``, β − 1 = ``b`` (both large), about the mode t₀ = ln(a/b), σ(t₀) = a/c
    (c = a + b): ℓ(t) = ℓ(t₀) − a ln(1 + (b/c)(e^{−d} − 1)) − b ln(1 + (a/c)(e^{d} − 1)), d = t − t₀,
    whose terms vanish with d; ℓ(t₀) = a ln(a/c) + b ln(b/c) − ln B(a + 1, b + 1) = ln(c + 1) −
    ln(ab/c) − R(a) − R(b) + R(c) by Stirling (lnΓ(x) = x ln x − x + R(x), R =
    :func:`stirling_rest`), with nothing left to cancel."""
    c = a + b
    d = t - np.log(a / b)  # (a/b correctly rounded: ln a − ln b lost ~1e-14 absolute, ×κd in ℓ — review)
    mode = np.log1p(c) - (np.log(a) + np.log(b) - np.log(c)) - stirling_rest(a) - stirling_rest(b) + stirling_rest(c)
    with np.errstate(over="ignore", invalid="ignore"):
        near_d = np.abs(d) <= 1.0
        dn = np.where(near_d, d, 0.0)
        u, w = (b / c) * np.expm1(-dn), (a / c) * np.expm1(dn)
        # near the mode, a u + b w = (ab/c)(e^−d + e^d − 2) = (ab/c) 4 sinh²(d/2): the first-order
        # terms of the two logarithms, which cancel there, taken out exactly (found in review: 1e-9
        # relative left otherwise); beyond |d| = 1 they do not cancel, and the sinh² form would
        # (ab/c e^|d| against b w: found in review, 2.6e33 for −9.9e7 at d = 100)
        sh = np.sinh(0.5 * dn)
        near = mode - a * log1p_minus(u) - b * log1p_minus(w) - (a * (b / c)) * 4.0 * sh * sh
        # beyond: 1 + u = a/c + (b/c) e^−d and 1 + w = b/c + (a/c) e^d as sums of logs — 1 + w formed
        # directly rounded to 0 where a/c rounds to 1 (+inf at Beta(2e21, 1e5 + 2) at 0.5), e^|d|
        # overflowed beyond 709 (−inf for −7.2e14) — found in review
        la, lb = -np.log1p(b / a), -np.log1p(a / b)  # ln(a/c), ln(b/c)
        direct = mode - a * np.logaddexp(la, lb - d) - b * np.logaddexp(lb, la + d)
    return np.where(near_d, near, direct)


def _log_minus_digamma(a):
    """(ln a − ψ(a), 1/a − ψ'(a)): by their asymptotic series beyond a = 1e3, where the differences
    cancel (~1e-16·ln a absolute against a value ~1/(2a): Gamma.project's shape was 2.6 % off at
    1e13, found in review), directly below."""
    a = np.asarray(a, float)
    big = a > 1e3
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = 1.0 / np.where(big, a, 1e3)
        r2 = r * r
        f_series = r * (0.5 + r * (1.0 / 12.0 - r2 * (1.0 / 120.0 - r2 / 252.0)))
        fp_series = -r2 * (0.5 + r * (1.0 / 6.0 - r2 * (1.0 / 30.0 - r2 / 42.0)))
        f = np.where(big, f_series, np.log(a) - special.digamma(a))
        fp = np.where(big, fp_series, 1.0 / a - trigamma(a))
    return f, fp


#: terms of Gamma.kl's Taylor series for near pairs (|d/x| < 0.1: the next is < 1e-15 of the first)
_GAMMA_KL_TERMS = 17
#: Gamma.kl's Stirling form beyond this shape (both): R̃'s next term 691/(360360 y¹¹) < 1e-19 there, so the
#: shape and rate parts go together for mean-matched pairs from 30 up (found in review: 3.8e-10 relative at 877)
_GAMMA_KL_SERIES = 30.0
#: (n, cₖ) of Stirling's R̃(y) = ln Γ(y) − (y − ½) ln y + y − ½ ln 2π = Σ cₖ y⁻ⁿ, n = 2k − 1
_STIRLING = ((1, 1 / 12), (3, -1 / 360), (5, 1 / 1260), (7, -1 / 1680), (9, 1 / 1188))
#: from here :func:`stirling_rest` is Stirling's series (its next term, 691/360360 x⁻¹¹, < 1e-19)
_STIRLING_FROM = 30.0


def _pow_minus_one_plus(t, lt, n: int):
    """(1 + t)⁻ⁿ − 1 + n t (``lt`` = ln(1 + t)), by its series Σ_{j≥2} (−1)ʲ C(n + j − 1, j) tʲ where |t| < 0.1
    (the direct form cancels to ~1e-16 n t, all of a value ~n² t²/2)."""
    small = np.abs(t) < 0.1
    ts = np.where(small, t, 0.0)
    acc, tj, coef = np.zeros_like(ts), ts * ts, n * (n + 1) / 2.0
    for j in range(2, 19):
        acc = acc + (coef if j % 2 == 0 else -coef) * tj
        tj, coef = tj * ts, coef * (n + j) / (j + 1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(small, acc, np.expm1(-n * lt) + n * t)


def _lgamma_bregman(x1, x2, d=None):
    """ln Γ(x₂) − ln Γ(x₁) − d ψ(x₁), d = x₂ − x₁ (≥ 0: Gamma.kl's shape part, and the three parts of Beta.kl;
    ``d`` given where it is known more exactly than x₂ − x₁ — Beta's α + β moved by dα + dβ):
    directly, but for near pairs (|d| < (x₁ + s)/10) by Taylor's series in d, Σ_{n≥2} ψ⁽ⁿ⁻¹⁾(x₁ + s) dⁿ/n!, at x₁ + 1
    below 1 (s = 1: ln Γ(x) = ln Γ(x + 1) − ln x; the series then converges for |d| < x₁ + 1, and ln Γ(x) ~ −ln x no
    longer dominates) — the direct difference cancels to ~1e-16 ln Γ(x₁), which is all of a value ~d²/x₁."""
    x1, x2 = np.broadcast_arrays(np.asarray(x1, float), np.asarray(x2, float))
    d = x2 - x1 if d is None else np.broadcast_to(np.asarray(d, float), x1.shape)
    with np.errstate(all="ignore"):
        out = np.array(special.gammaln(x2) - special.gammaln(x1) - d * special.digamma(x1), dtype=float)
        s = np.where(x1 < 1.0, 1.0, 0.0)
        near = np.abs(d) < 0.1 * (x1 + s)
        if np.any(near):
            i = np.flatnonzero(near.ravel())
            x, di, si = (x1 + s).ravel()[i], d.ravel()[i], s.ravel()[i]
            taylor, dn = np.zeros(i.size), di * di / 2.0
            for n in range(2, _taylor_terms(np.max(np.abs(di) / x), _GAMMA_KL_TERMS) + 1):  # Σ ψ⁽ⁿ⁻¹⁾(x) dⁿ/n!
                taylor += special.polygamma(n - 1, x) * dn
                dn = dn * di / (n + 1)
            x1i, x2i = x1.ravel()[i], x2.ravel()[i]
            ti = di / x1i
            # ln(x₂/x₁) − d/x₁ (the shift's ln Γ(x + 1) − ln x), from the logs where x₂ ≪ x₁
            taylor -= si * np.where(np.abs(ti) < 0.5, log1p_minus(ti), np.log(x2i) - np.log(x1i) - ti)
            out.ravel()[i] = taylor
    return out


class Gamma(Family):
    """Gamma(x; shape, rate) on (0, ∞); natural parameters (-rate, shape-1) on (x, log x)."""

    closed_support = "[0, inf]"

    param_names = ("shape", "rate")
    proper_is_finite = True  # (is_proper tests finiteness)
    coord_names = ("log_shape", "log_rate")

    def _check(self, shape, rate):
        self._require_positive("Gamma", "shape", shape, _TINY)
        self._require_positive("Gamma", "rate", rate, _TINY)

    @property
    def shape_param(self):
        return self._shape

    @property
    def rate(self):
        return self._rate

    @property
    def is_proper(self):
        return _both_positive(self._shape, self._rate)

    def natural(self):
        return _last_axis(-self._rate, self._shape - 1.0)

    @classmethod
    def from_natural(cls, eta):
        eta = np.asarray(eta, dtype=float)
        return cls._unchecked(eta[..., 1] + 1.0, -eta[..., 0])

    @staticmethod
    def suff_stats(x):
        x = np.asarray(x, dtype=float)
        return np.stack([x, np.log(x)], axis=-1)

    def expected_suff_stats(self):
        self._require_proper("expected_suff_stats")
        return np.stack(
            [self._shape / self._rate, special.digamma(self._shape) - np.log(self._rate)], axis=-1
        )

    @classmethod
    def project(cls, ess, tol: float = 1e-12, max_iter: int = 100):
        """KL projection: log a − ψ(a) = log E[x] − E[log x], b = a / E[x].

        Minka's generalised Newton iteration on 1/a from his closed-form start; it
        converges monotonically in a handful of steps for every s > 0.
        """
        s_ = _check_ess(cls, ess)
        ex, elog = s_[..., 0], s_[..., 1]
        if np.any(ex <= 0):
            raise ValueError("Gamma.project: `ess` has E[x] <= 0")
        s = np.log(ex) - elog
        if np.any(~(s > 0)):
            raise ValueError("Gamma.project: `ess` needs log E[x] > E[log x] (Jensen)")
        # Minka's start (3 − s + √((s − 3)² + 24s)) / 12s, without its cancellation for large s (a
        # shape below ~1e-18 started at 0 and was refused; found by an audit) or the square's overflow
        u = s - 3.0
        h = np.hypot(u, np.sqrt(24.0 * s))
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(u > 0, 2.0 / (h + u), (h - u) / (12.0 * s))
        active = np.ones(np.shape(a), dtype=bool)
        for _ in range(max_iter):
            f, fp = _log_minus_digamma(a)
            f = f - s
            inv = 1.0 / a + f / (a * a * fp)
            new = np.where(active & (inv > 0), 1.0 / inv, a)
            change = np.abs(new - a) / a
            a = new
            active = active & (change > tol)
            if not active.any():
                break
        return cls(a, a / ex)

    @classmethod
    def from_log_normal(cls, mean_log, var_log, projection: str = "kl") -> "Gamma":
        """The Gamma closest to the log-normal with log-mean ``mean_log`` and log-variance
        ``var_log`` (arrays): by KL (E[x] = e^{μ + σ²/2}, E[log x] = μ; :meth:`project`) or by
        ``"moments"`` (mean and variance).  Unvalidated: rows that overflow are NaN."""
        mu, s2 = np.asarray(mean_log, dtype=float), np.asarray(var_log, dtype=float)
        with np.errstate(all="ignore"):
            if projection == "moments":
                shape = 1.0 / np.expm1(s2)
                return cls._unchecked(shape, np.exp(np.log(shape) - mu - 0.5 * s2))
            # log a − ψ(a) = log E x − E log x = σ²/2: Gamma.project's equation, solved there at E x = 1
            # (the shape does not depend on the scale), then b = a / E x
            ok = np.isfinite(mu) & (s2 > 0) & np.isfinite(s2)
            shape = np.full(mu.shape, np.nan)
            if ok.any():
                shape[ok] = cls.project(np.stack([np.ones(int(ok.sum())), -0.5 * s2[ok]], axis=-1)).params[0]
            rate = np.exp(np.log(shape) - mu - 0.5 * s2)  # in logs: E[x] itself may underflow
        return cls._unchecked(shape, rate)

    def to_coords(self):
        self._require_proper("to_coords")
        return _last_axis(np.log(self._shape), np.log(self._rate))

    @classmethod
    def from_coords(cls, coords):
        c = _check_coords(cls, coords)
        return cls(np.exp(c[..., 0]), np.exp(c[..., 1]))

    def log_pdf(self, x):
        """a ln b − ln Γ(a) + (a − 1) ln x − b x; from shape 30 as a (ln(1 + u) − u) − ln x − S(a), u = b x / a
        − 1, S = :func:`stirling_rest` (ln Γ(a) = a ln a − a + S(a)), whose terms do not cancel: the textbook
        sum's are each ~a ln a, and it was 6.5e-3 off at shape 1e12, 3.8 at 1e15 (against mpmath)."""
        self._require_proper("log_pdf")
        x = np.asarray(x, dtype=float)
        a, b = self._shape, self._rate
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = a * np.log(b) - special.gammaln(a) + special.xlogy(a - 1.0, x) - b * x
            big = a >= _STIRLING_FROM
            if np.any(big):
                ab = np.where(big, a, _STIRLING_FROM)
                stable = ab * log1p_minus(b * x / ab - 1.0) - np.log(x) - stirling_rest(ab)
                out = np.where(big & np.isfinite(stable), stable, out)
        return np.where(x > 0, out, -np.inf)

    def mean(self):
        return self._shape / self._rate

    def var(self):
        with np.errstate(over="ignore", divide="ignore"):  # (rate² under/overflows beyond ~1e±154: then (a/b)/b)
            return np.where((self._rate > 1e-150) & (self._rate < 1e150), self._shape / self._rate**2,
                            (self._shape / self._rate) / self._rate)[()]

    def affine(self, scale, shift=0.0):
        if np.any(np.asarray(shift) != 0):
            raise ValueError("Gamma messages are closed under scaling only (shift must be 0)")
        return Gamma(self._shape, self._rate / np.asarray(scale, dtype=float), validate=False)

    def log_normalizer(self):
        self._require_proper("log_normalizer")
        return special.gammaln(self._shape) - self._shape * np.log(self._rate)

    @staticmethod
    def in_support(x):
        x = np.asarray(x, dtype=float)
        return (x > 0.0) & np.isfinite(x)

    @classmethod
    def in_closed_support(cls, x):
        x = np.asarray(x, dtype=float)
        return x >= 0.0

    def unbounded_density(self):
        return self._shape < 1.0

    def unbounded_ratio(self, proposal):
        # x^(a − a') e^{−(b − b') x}: unbounded at 0 where a < a', at ∞ where b < b' (or b = b' and a > a')
        self._same_family(proposal, "compare")
        a, b, a2, b2 = self._shape, self._rate, proposal._shape, proposal._rate
        return (a < a2) | (b < b2) | ((b == b2) & (a > a2))

    def kl(self, other):
        """KL[self ‖ other], each part formed from the differences d = a₂ − a₁ and ρ = b₂/b₁ − 1 so that
        nothing of size a ln a cancels (found by an audit: the textbook sum, ~a ln a term by term, was
        3.7e-3 for 2.5e-15 at shape 1e12 and negative for half of the near pairs beyond 1e5): the rate
        part a₁(ρ − ln(1 + ρ)) − d ln(1 + ρ); the shape part ln Γ(a₂) − ln Γ(a₁) − d ψ(a₁), beyond 1e3
        a₁[(1 + t) ln(1 + t) − t] + ½(t − ln(1 + t)) + d(ln a₁ − ψ(a₁) − 1/(2a₁)) + R̃(a₂) − R̃(a₁),
        t = d/a₁ (Stirling: ln Γ(x) = x ln x − x + ½ ln(2π/x) + R̃(x)); a₁ beyond it and a₂ not: a₁ ln a₁
        taken out (see the code); below it by Taylor's series in d where |d| < a₁/10, else directly."""
        self._same_family(other, "compare")
        self._require_proper("kl")
        other._require_proper("kl")
        a1, b1, a2, b2 = np.broadcast_arrays(self._shape, self._rate, other._shape, other._rate)
        d = a2 - a1
        with np.errstate(all="ignore"):
            rho = (b2 - b1) / b1
            near = np.abs(rho) < 0.5
            log_ratio = np.where(near, np.log1p(rho), np.log(b2) - np.log(b1))  # ln(b₂/b₁)
            rate = -a1 * np.where(near, log1p_minus(rho), log_ratio - rho) - d * log_ratio
            big = (a1 > _GAMMA_KL_SERIES) & (a2 > _GAMMA_KL_SERIES)
            x = np.where(big, a1, _GAMMA_KL_SERIES)
            t = np.where(big, d, 0.0) / x
            # ln(1 + t) = ln(a₂/a₁): from the logs where a₂ is far from a₁ (1 + t rounds a₂ away below
            # a₂/a₁ ~ 1e-8: inf/NaN, found in review), and ln(1 + t) − t likewise
            far_t = np.abs(t) >= 0.5
            r = 1.0 / x
            lt = np.where(far_t, np.log(np.where(big, a2, _GAMMA_KL_SERIES)) - np.log(x), np.log1p(t))
            lm = np.where(far_t, lt - t, log1p_minus(t))
            # R̃(a₂) − R̃(a₁) + d (ln a₁ − ψ(a₁) − 1/(2a₁)): Stirling's R̃(y) = Σ cₖ y⁻ⁿ (n = 2k − 1) and
            # ln a − ψ(a) − 1/(2a) = Σ n cₖ a⁻ⁿ⁻¹, each k's two terms together: cₖ a₁⁻ⁿ g_n(t), g_n(t) =
            # (1 + t)⁻ⁿ − 1 + n t (apart they cancelled at first order in t: found in review)
            corr = 0.0
            for n, c in _STIRLING:
                corr = corr + c * r**n * _pow_minus_one_plus(t, lt, n)
            # the series' a₁[(1 + t) ln(1 + t) − t] and the rate part together: a₁ (b₂/b₁) h(q), h(q) =
            # (1 + q) ln(1 + q) − q, 1 + q = the ratio of the means (a₂/b₂)/(a₁/b₁) — apart, each ~a₁t² and
            # they cancelled for a mean-matched pair (1e-3 relative at shape 1e12, found in review)
            br = b2 / b1
            q = np.where(near & ~far_t, (t - rho) / (1.0 + rho), (np.where(big, a2, 1e3) / x) / br - 1.0)
            lq = np.where(np.abs(q) < 0.5, np.log1p(q),
                          (np.log(np.where(big, a2, 1e3)) - np.log(x)) - (np.log(b2) - np.log(b1)))
            hq = np.where(np.abs(q) < 0.5, log1p_minus(q), lq - q) + q * lq
            # (x b₂/b₁ h(q) = a₂ ln(1 + q) − a₂ + x b₂/b₁ where q is far from 0: there b₂/b₁ may underflow, and
            # x · 0 · (∞ − ∞) was a NaN for Gamma(50, 1e160) ‖ Gamma(60, 1e-160) — found by an audit)
            ya = np.where(big, a2, 1e3)
            main = np.where(np.abs(q) < 0.5, x * br * hq, ya * lq - ya + x * br)
            series = main - 0.5 * lm + corr  # (the whole KL, rate part included)
            # a₁ beyond 1e3, a₂ not: −ln Γ(a₁) − d ψ(a₁) = a₁ψ(a₁) − ln Γ(a₁) − a₂ψ(a₁), whose first two
            # terms (~a₁ ln a₁ each) are a₁ − a₁(ln a₁ − ψ(a₁)) − ½ ln(2π/a₁) − R̃(a₁); that a₁ and the
            # rate part's a₁ρ (~ −a₁ where b₂ ≪ b₁) are taken together: a₁(1 + ρ) = a₁ b₂/b₁
            y = np.where(a1 > _GAMMA_KL_SERIES, a1, _GAMMA_KL_SERIES)
            mixed = (special.gammaln(a2) - a2 * special.digamma(y) - y * _log_minus_digamma(y)[0]
                     - 0.5 * np.log(2.0 * np.pi / y) - sum(c * y**-n for n, c in _STIRLING) + y * (b2 / b1)
                     - a2 * log_ratio)
            # below the Stirling form: directly, or by Taylor's series for near pairs (_lgamma_bregman)
            shape = _lgamma_bregman(np.where(big, 1.0, a1), np.where(big, 1.0, a2))  # (big rows: the series)
            near_pair = ~big & (np.abs(d) < 0.1 * (a1 + np.where(a1 < 1.0, 1.0, 0.0)))
            return np.where(big, series, np.where((a1 > _GAMMA_KL_SERIES) & ~near_pair, mixed, shape + rate))[()]

    def sample(self, n, random_state=None):
        self._require_proper("sample")
        rng = _rng(random_state)
        return rng.gamma(self._shape, 1.0 / self._rate, size=(int(n),) + self.shape)

    json_columns = {"shape": "positive", "rate": "positive"}

    def unconstrained_moments(self):
        # log τ: (ψ(a) − log b, ψ'(a))
        a, b = self._shape, self._rate
        return special.digamma(a) - np.log(b), trigamma(a)

    def characteristic_function(self, omega):
        self._require_proper("characteristic_function")
        w = np.atleast_1d(np.asarray(omega, dtype=np.float64))
        a, t = self._shape[..., None], w / self._rate[..., None]
        return np.exp(-0.5 * a * np.log1p(t * t) + 1j * a * np.arctan(t))

    def cf_terms(self, omega, plan, dt):
        # (1 − i ω / b)^(−a) = exp(−a/2 log1p(t²) + i a atan t), t = ω / b
        a = self._shape.astype(dt)[:, None]
        t = omega[None, :] / self._rate.astype(dt)[:, None]
        phase = a * np.arctan(t)
        np.multiply(t, t, out=t)
        np.log1p(t, out=t)
        t *= a
        t *= 0.5
        np.negative(t, out=t)
        return "polar", t, phase

    @classmethod
    def fisher_information(cls, coords):
        # (log a, log b): a² ψ'(a), −a, a
        c = _coords_of_shape(cls, coords, "fisher_information")  # (non-finite rows: NaN, never refused)
        a = np.exp(c[..., 0])
        F = np.empty(c.shape + (2,))
        F[..., 0, 0] = a * a * trigamma(a)
        F[..., 1, 1] = a
        F[..., 0, 1] = F[..., 1, 0] = -a
        return F

    @classmethod
    def default_proposal(cls):
        return cls(1.0, 0.1)


# ====================================================================== Bernoulli
class Bernoulli(Family):
    """Distribution on y ∈ {-1, +1} with p = P(y = +1); p = 0 or 1 is an observation.

    Natural parameter logit(p) on u(y) = 1[y = +1] (infinite for observations).  A product of
    contradicting observations (p = 0 times p = 1) or an observation divided by itself has logit
    −inf + inf: it is improper, as an improper quotient of the other families — p NaN,
    ``is_proper`` False — and refused by what they refuse (densities, the expected statistics,
    ``to_coords``, KL, sampling), naming how many rows and the first.
    """

    closed_support = "{-1, +1}"

    param_names = ("p",)
    proper_is_finite = True  # (is_proper tests finiteness)
    n_stats = 1
    coord_names = ("logit_p",)

    def _check(self, p):
        bad = ~((p >= 0) & (p <= 1))
        if bad.any():
            raise ValueError(f"Bernoulli: `p` must lie in [0, 1] (got {p[bad].ravel()[0]!r})")

    @property
    def p(self):
        return self._p

    @property
    def is_proper(self):
        return (self._p >= 0) & (self._p <= 1)  # False for NaN

    def natural(self):
        with np.errstate(divide="ignore"):
            return (np.log(self._p) - np.log1p(-self._p))[..., None]

    @classmethod
    def from_natural(cls, eta):
        eta = np.asarray(eta, dtype=float)
        return cls._unchecked(special.expit(eta[..., 0]))

    @staticmethod
    def suff_stats(y):
        return (np.asarray(y, dtype=float) > 0).astype(float)[..., None]

    def expected_suff_stats(self):
        self._require_proper("expected_suff_stats")  # (a NaN p: silently NaN statistics, found in review)
        return self._p[..., None]

    def log_normalizer(self):
        # Σ_{y = ±1} exp(η u(y)) = 1 + e^η = 1 / (1 − p)
        self._require_proper("log_normalizer")
        with np.errstate(divide="ignore"):
            return -np.log1p(-self._p)

    def log_pdf_stats(self, stats):
        self._require_proper("log_pdf_stats")  # (as Family.log_pdf_stats, through log_normalizer)
        u = np.asarray(stats, float)[..., 0]
        with np.errstate(divide="ignore"):
            return np.where(u > 0, np.log(self._p), np.log1p(-self._p))

    @staticmethod
    def in_support(y):
        y = np.asarray(y, dtype=float)
        return (y == 1.0) | (y == -1.0)

    def log_kernel(self, stats, limits: bool = False):
        # log p · u + log(1 − p) · (1 − u): finite for observations (p = 0 or 1), unlike logit p
        # (its statistics are 0 or 1: no limits to take)
        p = self._p.reshape(-1, 1)
        u = np.asarray(stats, float)[None, :, 0]
        with np.errstate(divide="ignore"):
            return np.where(u > 0, np.log(p), np.log1p(-p))

    @classmethod
    def project(cls, ess):
        s = _check_ess(cls, ess)
        p = s[..., 0]
        if np.any((p < -1e-12) | (p > 1 + 1e-12)):
            raise ValueError("Bernoulli.project: `ess` must lie in [0, 1]")
        return cls(np.clip(p, 0.0, 1.0))  # clip only round-off of a weighted average

    def to_coords(self):
        self._require_proper("to_coords")
        return special.logit(self._p)[..., None]

    @classmethod
    def from_coords(cls, coords):
        c = _check_coords(cls, coords)
        return cls(special.expit(c[..., 0]))

    @classmethod
    def fisher_information(cls, coords):
        # (logit p): p (1 − p)
        c = _coords_of_shape(cls, coords, "fisher_information")  # (non-finite rows: NaN, never refused)
        p = special.expit(c[..., 0])
        return (p * (1.0 - p))[..., None, None]

    def log_pdf(self, y):
        self._require_proper("log_pdf")
        y = np.asarray(y, dtype=float)
        with np.errstate(divide="ignore"):
            return np.where(y > 0, np.log(self._p), np.log1p(-self._p))

    def mean(self):
        return 2.0 * self._p - 1.0

    def var(self):
        return 4.0 * self._p * (1.0 - self._p)

    def kl(self, other):
        self._same_family(other, "compare")
        self._require_proper("kl")
        other._require_proper("kl")
        p, q = self._p, other._p
        with np.errstate(divide="ignore", invalid="ignore"):
            return special.xlogy(p, p) - special.xlogy(p, q) + special.xlog1py(1 - p, -p) - special.xlog1py(1 - p, -q)

    def sample(self, n, random_state=None):
        self._require_proper("sample")
        rng = _rng(random_state)
        return np.where(rng.random((int(n),) + self.shape) < self._p, 1.0, -1.0)

    json_columns = {"p": "probability"}

    def characteristic_function(self, omega):
        self._require_proper("characteristic_function")
        w = np.atleast_1d(np.asarray(omega, dtype=np.float64))
        return np.cos(w) + 1j * (2.0 * self._p[..., None] - 1.0) * np.sin(w)

    def cf_terms(self, omega, plan, dt):
        k = self.shape[0]
        re = np.broadcast_to(np.cos(omega), (k, len(omega)))
        im = (2.0 * self._p.astype(dt) - 1.0)[:, None] * np.sin(omega)[None, :]
        return "complex", re, im

    @classmethod
    def default_proposal(cls):
        return cls(0.5)


FAMILIES: dict[str, type[Family]] = {
    "gaussian": Gaussian,
    "beta": Beta,
    "gamma": Gamma,
    "bernoulli": Bernoulli,
}


#: the name :func:`family_name` found for a class — the first registered for it — kept until the
#: registry changes (``register_family`` clears it; a name removed from FAMILIES is checked on each use):
#: a served one-message request names families ~5 times, and the scan of the registry is ~1 µs each
_NAME_OF: dict[type, str] = {}


def register_family(name: str, cls: type[Family], replace: bool = False) -> None:
    """Add a family to the one name map (JSON ``"family"`` tags, training-set and operator files)."""
    if not (isinstance(cls, type) and issubclass(cls, Family)):
        raise ValueError(f"`cls` must be a Family subclass, got {cls!r}")
    name = str(name).lower()
    if name in FAMILIES and FAMILIES[name] is not cls and not replace:
        raise ValueError(f"a family named {name!r} is already registered")
    FAMILIES[name] = cls
    _NAME_OF.clear()  # (family_name's memo: the scan's first name may have changed)


def family_name(cls_or_message) -> str:
    """The registered name of a family class (or of a message's family)."""
    cls = cls_or_message if isinstance(cls_or_message, type) else type(cls_or_message)
    name = _NAME_OF.get(cls)
    if name is not None and FAMILIES.get(name) is cls:  # (still registered under it)
        return name
    for name, c in FAMILIES.items():
        if c is cls:
            _NAME_OF[cls] = name
            return name
    raise ValueError(f"family {cls.__name__} is not registered in kjit.families.FAMILIES")


def family_by_name(name: str) -> type[Family]:
    try:
        return FAMILIES[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unknown family `{name}`; known: {', '.join(sorted(FAMILIES))}"
        ) from None
