"""Shared pieces of the exact rules: input checks, stationary-point search, belief projections.

The quadrature engine itself is :func:`kjit.quadrature.panel_rule` (level panels between the
integrand's stationary points, Gauss–Legendre per panel, vectorised over the batch); this module
only prepares what it needs (the break points and a length scale) and turns its nodes and
weights into beliefs.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import special

from ..errors import OracleError
from ..families import Gamma, Gaussian, stirling_rest
from ..quadrature import bisect as _bisect, panel_rule as _panel_rule

PROJECTIONS = ("kl", "moments")

# below this variance of log x under the tilted distribution the Gamma statistics are taken
# from the tilted rule's own nodes (centred sums, no cancellation); above it E[x] and E[x²]
# get panel rules of their own (their mass can sit in the tilted distribution's tail)
_NARROW_LOG_VAR = 1.0


# ---------------------------------------------------------------------------- validation
def check_to(factor: str, variables, to) -> str:
    if not isinstance(to, str) or to not in variables:
        raise ValueError(
            f"unknown recipient variable `to`={to!r} for factor {factor!r}; "
            f"its variables are {', '.join(variables)}"
        )
    return to


def check_projection(projection) -> str:
    if projection not in PROJECTIONS:
        raise ValueError(f"`projection` must be one of {PROJECTIONS}, got {projection!r}")
    return projection


def check_power(power) -> float:
    try:
        u = float(power)
    except (TypeError, ValueError):
        raise ValueError(f"`power` must be a finite number > 0, got {power!r}") from None
    if not (np.isfinite(u) and u > 0):
        raise ValueError(f"`power` must be a finite number > 0, got {power!r}")
    return u


def check_positive_param(factor: str, name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{factor}: parameter `{name}` must be a finite number > 0, got {value!r}") from None
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{factor}: parameter `{name}` must be a finite number > 0, got {value!r}")
    return v


def check_incoming(factor: str, families: Mapping[str, type], incoming) -> tuple[dict, tuple]:
    """Validate the incoming messages of every variable of a factor.

    Returns ``(flat, shape)``: each variable's message broadcast to the common batch shape and
    flattened, and that shape.  Every problem is a ``ValueError`` naming the variable: not a
    mapping, a missing or unknown variable, the wrong family, NaN/inf parameters, an improper
    message (negative or zero variance, Gamma shape or rate <= 0), shapes that do not broadcast.
    """
    if not isinstance(incoming, Mapping):
        raise ValueError(f"{factor}: `incoming` must be a mapping from variable name to message")
    unknown = [k for k in incoming if k not in families]
    if unknown:
        raise ValueError(
            f"{factor}: unknown variable(s) {', '.join(map(repr, unknown))} in `incoming`; "
            f"its variables are {', '.join(families)}"
        )
    missing = [v for v in families if v not in incoming]
    if missing:
        raise ValueError(f"{factor}: `incoming` lacks a message for variable(s) {', '.join(map(repr, missing))}")
    for v, fam in families.items():
        msg = incoming[v]
        if not isinstance(msg, fam):
            raise ValueError(
                f"{factor}: `incoming[{v!r}]` must be a {fam.__name__} message, got {type(msg).__name__}"
            )
        for pname, p in zip(msg.param_names, msg.params):
            bad = ~np.isfinite(p)
            if bad.any():
                raise ValueError(
                    f"{factor}: `incoming[{v!r}]` has a non-finite `{pname}` "
                    f"({p[bad].ravel()[0]!r} at flat index {int(np.argmax(bad.ravel()))})"
                )
        ok = np.asarray(msg.is_proper)
        if not ok.all():
            i = int(np.argmin(ok.ravel()))
            detail = ", ".join(f"{n}={np.ravel(p)[i]!r}" for n, p in zip(msg.param_names, msg.params))
            raise ValueError(
                f"{factor}: `incoming[{v!r}]` is improper at {int(ok.size - np.count_nonzero(ok))} "
                f"position(s) (first at flat index {i}: {detail})"
            )
    try:
        shape = np.broadcast_shapes(*(incoming[v].shape for v in families))
    except ValueError:
        desc = ", ".join(f"{v}{incoming[v].shape}" for v in families)
        raise ValueError(f"{factor}: batch shapes of `incoming` do not broadcast: {desc}") from None
    flat = {v: incoming[v].broadcast_to(shape).ravel() for v in families}
    return flat, shape


def is_empty(shape) -> bool:
    return int(np.prod(shape, dtype=int)) == 0


def empty_belief(fam, shape):
    """The belief of an empty batch (shape with a 0)."""
    return fam(np.ones(shape), np.ones(shape))


def raise_bad_rows(factor: str, rows, what: str):
    """Raise an OracleError naming the failed rows (flat batch indices, also in ``err.rows``)."""
    rows = np.asarray(rows)
    err = OracleError(
        f"{factor}: {what} for {rows.size} message(s) (rows {rows[:10].tolist()}"
        f"{'…' if rows.size > 10 else ''})"
    )
    err.rows = rows
    raise err


def check_finite_rows(factor: str, what: str, *arrays) -> None:
    ok = np.ones(np.shape(arrays[0]), dtype=bool)
    for a in arrays:
        ok &= np.isfinite(a)
    if ok.ndim > 1:
        ok = ok.reshape(ok.shape[0], -1).all(axis=1)
    if not ok.all():
        raise_bad_rows(factor, np.flatnonzero(~ok), what)


# ---------------------------------------------------------------------------- quadrature helpers
def col(p, t, rows):
    """Per-message parameter ``p`` (B,) aligned with nodes ``t`` (the `_panel_rule` convention)."""
    return p[rows] if rows is not None else p.reshape(p.shape + (1,) * (np.ndim(t) - 1))


def stationary_points(dlogf, candidates, lo, hi, accept=None, n_iter: int = 200):
    """All sign changes of ``dlogf`` on [lo, hi], bracketed by approximate roots.

    ``candidates`` (B, K): approximate stationary points (e.g. real parts of polynomial roots;
    NaN allowed); every sign change of ``dlogf`` between consecutive sorted points of
    [lo, candidates clipped to [lo, hi], hi] is refined by bisection.  ``dlogf(t, rows)`` takes
    flat ``t`` and the message index of each entry.
    Returns (B, K+1) roots, with NaN where an interval has no sign change, followed (if
    ``accept`` (B, K) is given) by the accepted candidates inside [lo, hi]: a candidate that is a
    root to within a few ulps leaves no sign change between its neighbours (the derivative can
    be steep: a tilted width of 1e-7 on a line where the candidates are 1e2 apart), yet it is a
    stationary point.
    """
    c = np.where(np.isfinite(candidates), candidates, lo[:, None])
    c = np.clip(c, lo[:, None], hi[:, None])
    pts = np.sort(np.concatenate([lo[:, None], c, hi[:, None]], axis=1), axis=1)
    a, b = pts[:, :-1].ravel(), pts[:, 1:].ravel()
    rows = np.repeat(np.arange(pts.shape[0]), pts.shape[1] - 1)
    with np.errstate(invalid="ignore", over="ignore"):
        sa, sb = np.sign(dlogf(a, rows)), np.sign(dlogf(b, rows))
    roots = np.where(sa == 0, a, np.nan)
    idx = np.flatnonzero(sa * sb < 0)
    if idx.size:
        with np.errstate(invalid="ignore", over="ignore"):
            roots[idx] = _bisect(lambda t: dlogf(t, rows[idx]), a[idx], b[idx], n_iter)
    roots = roots.reshape(pts.shape[0], -1)
    if accept is None:
        return roots
    inside = accept & np.isfinite(candidates) & (candidates >= lo[:, None]) & (candidates <= hi[:, None])
    return np.concatenate([roots, np.where(inside, candidates, np.nan)], axis=1)


def rule(factor: str, logf, breaks, step):
    """`_panel_rule` with NaN breaks replaced by the first finite one, and a check that every row's
    integral is finite and positive (an underflowing row is an OracleError naming it)."""
    breaks = np.asarray(breaks, float)
    finite = np.isfinite(breaks)
    if not finite.any(axis=1).all():
        raise_bad_rows(factor, np.flatnonzero(~finite.any(axis=1)), "the tilted integrand has no finite mode")
    first = breaks[np.arange(len(breaks)), np.argmax(finite, axis=1)]
    breaks = np.where(finite, breaks, first[:, None])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        t, lw, log_z = _panel_rule(logf, breaks, step)
    check_finite_rows(factor, "the tilted integral under/overflowed (not finite)", log_z)
    return t, lw, log_z


def _centred(lw, x):
    """``(weights w / Σw, mean of x, x − mean)`` per row, the mean formed about the heaviest node's x: the
    deviations then carry the spread, not the rounding of a large mean (found by an audit: about a mean of
    1e20, Σ w·x with weights summing to 1 ± 1e-16 put the mean ~1e4 off the nodes, and a tilted variance
    of 8 came out 1.1e9)."""
    w = np.exp(lw)
    w = w / np.sum(w, axis=1, keepdims=True)
    c = np.take_along_axis(x, np.argmax(lw, axis=1)[:, None], axis=1)
    dm = np.sum(w * (x - c), axis=1, keepdims=True)
    return w, (c + dm)[:, 0], (x - c) - dm


def gaussian_from_nodes(t, lw):
    """Mean and (centred) variance of the nodes ``t`` under normalised log weights ``lw``."""
    w, mean, d = _centred(lw, np.asarray(t, float))
    return mean, np.sum(w * d * d, axis=1)


def gaussian_mixture(lw, mu, var):
    """Moments of the mixture Σ w_i N(mu_i, var_i): E[var_i] + Var[mu_i] (centred)."""
    w, mean, d = _centred(lw, np.asarray(mu, float))
    return mean, np.sum(w * (var + d * d), axis=1)


def _expm1_minus(d):
    """e^d − 1 − d without cancellation for small |d|."""
    d = np.asarray(d, float)
    small = np.abs(d) < 0.5
    ds = np.where(small, d, 0.0)
    # Horner series Σ_{k≥2} d^k / k! to k = 16 (truncation < 1e-17 relative for |d| < 0.5)
    acc = np.zeros_like(ds)
    fact = [1.0]
    for k in range(1, 17):
        fact.append(fact[-1] * k)
    for k in range(16, 1, -1):
        acc = acc * ds + 1.0 / fact[k]
    series = acc * ds * ds
    with np.errstate(over="ignore"):
        return np.where(small, series, np.expm1(d) - d)


def gamma_shift(a, b):
    """u₀ = ln(a/b), the mode of a Gamma message's exponent a u − b e^u (shape a > 0, rate b) in
    u = ln of its variable; c = a u₀ − a is the exponent's value there.  Rules integrate the exponent
    less c, a(s − expm1(s)) with s = u − u₀ (:func:`gamma_exponent`), and any other power of the
    variable (the factor's, a moment's k) as a term of its own — for a message of shape 1e12 the
    exponent and c are both ~3e13 and their sum was rounded to ~0.01, and a shape plus a power is
    not even representable beyond 1e16 (found by an audit and its review: the evidence of a
    Gamma(a, a) precision 0.29 nats off at a = 1e14, and off by ln τ₀ at 1e16).  The message's
    normaliser with c given back is −R(a) (:func:`gamma_normaliser`)."""
    return np.log(a / b)


def gamma_exponent(t, a, u0, extra=0.0):
    """a u − b e^u − c + extra·u at nodes ``t`` (u₀ of :func:`gamma_shift`, c = a u₀ − a; ``extra``:
    the power of the variable the rule adds, kept apart from a)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sft = t - u0
        # −a(e^s − 1 − s) without the cancellation of s − expm1(s) near the mode (found in review: an
        # error ~1e-16·√a in the exponent, 1e-3 of the evidence at shape 1e30); the series only where
        # it matters (a > 1e4: below 1e-14 otherwise)
        big = a > 1e4
        core = np.where(big, -a * _expm1_minus(np.where(big, sft, 0.0)), a * (sft - np.expm1(sft)))
    return core + extra * t


def gamma_normaliser(a):
    """a ln b − ln Γ(a) + c of a Gamma message (c of :func:`gamma_shift`): −R(a), R = :func:`stirling_rest`
    — the normaliser and the shift, each ~a ln a, summed without cancellation."""
    return -stirling_rest(a)


def log_gamma_ratio(a, d):
    """ln Γ(a + d) − ln Γ(a) for a, a + d > 0, without the cancellation of the two for large a:
    a ln(1 + d/a) + d ln(a + d) − d + R(a + d) − R(a), R = :func:`stirling_rest`."""
    a, d = np.asarray(a, float), np.asarray(d, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return a * np.log1p(d / a) + special.xlogy(d, a + d) - d + stirling_rest(a + d) - stirling_rest(a)


def gamma_belief(factor: str, u, lw, log_moment, projection: str) -> Gamma:
    """Gamma belief of x = e^u from a rule over u (nodes ``u``, normalised log weights ``lw``).

    ``log_moment(k)`` returns log E[x^k] (k = 1, 2) computed by a panel rule of its own (for
    rows whose statistic lives in the tail).  KL projection (match E[x], E[log x]): the shape
    solves log a − ψ(a) = s with s = log E[x] − E[log x]; for a narrow tilted distribution s is
    formed from centred node sums (s = log Σ p e^{u−ū}, no cancellation) and handed to
    ``Gamma.project`` as the statistics (1, −s) of x / E[x], so no digit of s is lost there.
    Moment matching: shape = E[x]² / Var[x], rate = E[x] / Var[x], Var/E² again centred.

    ``Gamma.project`` solves log a − ψ(a) = s with that function's asymptotic series beyond
    a = 1e3 (its direct difference cancelled: a KL shape carried a relative error ~3e-16·a·log a,
    2.6 % at 1e13), so a narrow belief's shape is as accurate as s.
    """
    w = np.exp(lw)
    ubar = np.sum(w * u, axis=1)
    vu = np.sum(w * (u - ubar[:, None]) ** 2, axis=1)
    narrow = vu < _NARROW_LOG_VAR
    d = u - ubar[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        s_nodes = np.log1p(np.sum(w * _expm1_minus(d), axis=1))
    broad = ~narrow
    s = s_nodes
    lm1 = lm2 = None
    if broad.any():
        lm1 = log_moment(1)
        s = np.where(narrow, s_nodes, lm1 - ubar)
    check_finite_rows(factor, "the Gamma belief's statistics (E[v], E[log v]) are not finite", s, ubar)
    bad = ~(s > 0)
    if bad.any():
        raise_bad_rows(factor, np.flatnonzero(bad), "the tilted distribution is too narrow for a Gamma "
                       "belief in double precision (log E[x] - E[log x] rounds to <= 0)")
    log_mean = ubar + s
    if projection == "kl":
        g = Gamma.project(np.stack([np.ones_like(s), -s], axis=-1))
        a = g.shape_param
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            r_nodes = np.sum(w * np.expm1(d - s[:, None]) ** 2, axis=1)  # Var / E²
        r = r_nodes
        if broad.any():
            lm2 = log_moment(2)
            with np.errstate(over="ignore", invalid="ignore"):
                r = np.where(narrow, r_nodes, np.expm1(lm2 - 2.0 * lm1))
        check_finite_rows(factor, "the Gamma belief's variance is not finite (beyond double precision)", r)
        bad = ~(r > 0)
        if bad.any():
            raise_bad_rows(factor, np.flatnonzero(bad), "the tilted distribution's variance is not positive")
        a = 1.0 / r
    with np.errstate(over="ignore", under="ignore"):
        rate = a * np.exp(-log_mean)
    check_finite_rows(factor, "the Gamma belief's rate is not finite (its mean is beyond double precision)", rate, a)
    if np.any(~(rate > 0)):
        raise_bad_rows(factor, np.flatnonzero(~(rate > 0)), "the Gamma belief's rate underflowed")
    return Gamma(a, rate)


def gaussian_belief(factor: str, mean, var) -> Gaussian:
    check_finite_rows(factor, "the Gaussian belief's moments are not finite", mean, var)
    bad = ~(var > 0)
    if bad.any():
        raise_bad_rows(factor, np.flatnonzero(bad), "the Gaussian belief's variance underflowed to 0")
    return Gaussian(mean, var)


def check_sample_inputs(factor: str, names, inputs, size) -> tuple[dict, int]:
    if not isinstance(inputs, Mapping):
        raise ValueError(f"{factor}: `inputs` must be a mapping from input variable to array")
    try:
        size = int(size)
    except (TypeError, ValueError):
        raise ValueError(f"{factor}: `size` must be a non-negative integer, got {size!r}") from None
    if size < 0:
        raise ValueError(f"{factor}: `size` must be a non-negative integer, got {size!r}")
    out = {}
    for v in names:
        if v not in inputs:
            raise ValueError(f"{factor}: `inputs` lacks input variable {v!r}")
        try:
            a = np.broadcast_to(np.asarray(inputs[v], dtype=float), (size,))
        except (TypeError, ValueError):
            raise ValueError(
                f"{factor}: `inputs[{v!r}]` must be numeric and broadcast to ({size},), "
                f"got shape {np.shape(inputs[v])}"
            ) from None
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{factor}: `inputs[{v!r}]` must be finite")
        out[v] = a
    return out, size


def log_concave_mode(dlogf, lo, hi, n_iter: int = 200):
    """The unique root of a decreasing ``dlogf`` in [lo, hi] (dlogf(lo) >= 0 >= dlogf(hi))."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _bisect(lambda t: dlogf(t, None), lo, hi, n_iter)


__all__ = [
    "check_to",
    "check_projection",
    "check_power",
    "check_incoming",
    "check_positive_param",
    "stationary_points",
    "rule",
    "col",
    "gaussian_from_nodes",
    "gaussian_mixture",
    "gamma_belief",
    "gaussian_belief",
    "check_sample_inputs",
    "is_empty",
    "empty_belief",
    "log_concave_mode",
    "gamma_shift",
    "gamma_exponent",
    "gamma_normaliser",
    "stirling_rest",
    "log_gamma_ratio",
]
