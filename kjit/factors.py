"""Directed, sampleable factors f(x_out | x_in) and a registry of them by name.

The only thing kjit needs of a factor is a sampler of its output given its inputs (SPEC §2:
"any factor that can be sampled") and the message family of each variable.  A factor may
also provide numerically stable sufficient statistics of a variable computed from the whole
draw (the logistic factor computes log σ(x) from x rather than log z from a rounded z).

Built-ins
---------
``Logistic``      x → z = σ(x); x Gaussian, z Beta.
``CompoundGamma`` τ ~ Gamma(s2, rate=r), r ~ Gamma(s1, rate=r1), r integrated out: a
                  factor on τ alone (no inputs) sending Gamma messages to τ.
``ProbitNoise``   y | f with p(y | f) = ε + (1 − 2ε) Θ(y f), y ∈ {−1, +1}; f Gaussian,
                  y Bernoulli (an observed label is Bernoulli with p = 0 or 1).

Users add a factor with :class:`SampledFactor` (or a subclass) and :func:`register_factor`.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
from scipy import special

from .families import Bernoulli, Beta, Family, Gamma, Gaussian

__all__ = [
    "Factor",
    "SampledFactor",
    "Logistic",
    "CompoundGamma",
    "ProbitNoise",
    "register_factor",
    "get_factor",
    "registered_factors",
]


class Factor:
    """A directed factor: ``inputs`` (possibly none) → one ``output`` variable.

    Subclasses set ``name``, ``inputs``, ``output``, ``families`` and implement
    :meth:`sample`.
    """

    name: str = "factor"
    inputs: tuple[str, ...] = ()
    output: str = ""
    families: Mapping[str, type[Family]] = {}

    @property
    def variables(self) -> tuple[str, ...]:
        """All variables, inputs first then the output: the order of feature maps."""
        return tuple(self.inputs) + (self.output,)

    def sample(self, inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
        """Draw the output given arrays of inputs (each of shape ``(size,)``)."""
        raise NotImplementedError

    def suff_stats(self, var: str, draws: Mapping[str, np.ndarray]) -> np.ndarray:
        """Sufficient statistics of ``var`` at the drawn values, shape ``(size, n_stats)``."""
        return self.families[var].suff_stats(draws[var])

    def params(self) -> dict:
        """Constructor parameters (JSON-ready), so a factor can be rebuilt by name."""
        return {}

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
        equal (a scalar message broadcasts).  Raises ``ValueError`` naming the problem.
        """
        if to is not None:
            self.check_to(to)
        if not isinstance(incoming, Mapping):
            raise ValueError("`incoming` must be a mapping from variable name to message")
        unknown = [k for k in incoming if k not in self.variables]
        if unknown:
            raise ValueError(
                f"unknown variable(s) {', '.join(map(repr, unknown))} in `incoming` for factor "
                f"{self.name!r}; its variables are {', '.join(self.variables)}"
            )
        missing = [v for v in self.variables if v not in incoming]
        if missing:
            raise ValueError(
                f"`incoming` lacks message(s) for {', '.join(map(repr, missing))} (factor {self.name!r})"
            )
        for v in self.variables:
            fam = self.families[v]
            if not isinstance(incoming[v], fam):
                raise ValueError(
                    f"`incoming[{v!r}]` must be a {fam.__name__} message, got {type(incoming[v]).__name__}"
                )
            if not np.all(incoming[v].is_proper):
                raise ValueError(f"`incoming[{v!r}]` contains improper messages")
        shapes = {v: incoming[v].shape for v in self.variables}
        nonscalar = {s for s in shapes.values() if s != ()}
        if len(nonscalar) > 1:
            desc = ", ".join(f"{v}{s}" for v, s in shapes.items())
            raise ValueError(f"mismatched batch shapes in `incoming`: {desc}")
        shape = nonscalar.pop() if nonscalar else ()
        return {v: incoming[v].broadcast_to(shape) for v in self.variables}, shape

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class SampledFactor(Factor):
    """A user factor from a sampler: ``sampler(inputs: dict[str, ndarray], rng) -> output``.

    Example — the product factor z = x·y::

        prod = SampledFactor("product", inputs={"x": Gaussian, "y": Gaussian},
                             output=("z", Gaussian),
                             sampler=lambda v, rng: v["x"] * v["y"])
        register_factor(prod)
    """

    def __init__(
        self,
        name: str,
        inputs: Mapping[str, type[Family]],
        output: tuple[str, type[Family]],
        sampler: Callable[[Mapping[str, np.ndarray], np.random.Generator], np.ndarray],
    ):
        if not name or not isinstance(name, str):
            raise ValueError("`name` must be a non-empty string")
        out_name, out_family = output
        for v, fam in list(inputs.items()) + [(out_name, out_family)]:
            if not (isinstance(fam, type) and issubclass(fam, Family)):
                raise ValueError(f"family of variable {v!r} must be a kjit Family class, got {fam!r}")
        if out_name in inputs:
            raise ValueError(f"output variable {out_name!r} is also an input")
        self.name = name
        self.inputs = tuple(inputs)
        self.output = out_name
        self.families = {**dict(inputs), out_name: out_family}
        self._sampler = sampler

    def sample(self, inputs, size, rng):
        out = np.asarray(self._sampler({k: inputs[k] for k in self.inputs}, rng), dtype=float)
        if out.shape != (size,):
            raise ValueError(f"sampler of factor {self.name!r} returned shape {out.shape}, expected ({size},)")
        return out


class Logistic(Factor):
    """z = σ(x) = 1 / (1 + e^{−x}), deterministic.  x: Gaussian, z: Beta."""

    name = "logistic"
    inputs = ("x",)
    output = "z"
    families = {"x": Gaussian, "z": Beta}

    def sample(self, inputs, size, rng):
        return special.expit(inputs["x"])

    def log_concave(self, to, incoming):
        # the factor on x, z integrated against Beta(α, β): σ(x)^(α−1) σ(−x)^(β−1), log-concave
        # in x exactly when α ≥ 1 and β ≥ 1 (log σ is concave); the labels Beta(2,1)/(1,2) are
        if to != "x":
            return None
        z = incoming["z"]
        return (np.asarray(z.alpha) >= 1.0) & (np.asarray(z.beta) >= 1.0)

    def suff_stats(self, var, draws):
        if var == "z":
            # (log σ(x), log σ(−x)) = −(softplus(−x), softplus(x)), softplus(t) = max(t, 0) +
            # log1p(e^−|t|): one exp and one log1p serve both (≈3× faster than two logaddexp,
            # the same values to an ulp; the importance-sampling oracle evaluates this per call)
            x = np.asarray(draws["x"], dtype=float)
            out = np.empty(x.shape + (2,))
            tail = np.log1p(np.exp(-np.abs(x)))
            np.negative(np.maximum(-x, 0.0) + tail, out=out[..., 0])
            np.negative(np.maximum(x, 0.0) + tail, out=out[..., 1])
            return out
        return super().suff_stats(var, draws)


class CompoundGamma(Factor):
    """τ ~ Gamma(s2, rate=r), r ~ Gamma(s1, rate=r1), with r integrated out.

    The marginal density is p(τ) = Γ(s1+s2)/(Γ(s1)Γ(s2)) r1^{s1} τ^{s2−1} (r1 + τ)^{−(s1+s2)}.
    Defaults (s1, r1, s2) = (1, 1, 1) are the KJIT paper's.
    """

    name = "compound_gamma"
    inputs = ()
    output = "tau"
    families = {"tau": Gamma}

    def __init__(self, s1: float = 1.0, r1: float = 1.0, s2: float = 1.0):
        for n, v in (("s1", s1), ("r1", r1), ("s2", s2)):
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"CompoundGamma: `{n}` must be finite and > 0, got {v!r}")
        self.s1, self.r1, self.s2 = float(s1), float(r1), float(s2)

    def params(self):
        return {"s1": self.s1, "r1": self.r1, "s2": self.s2}

    def sample(self, inputs, size, rng):
        r = rng.gamma(self.s1, 1.0 / self.r1, size=size)
        return rng.gamma(self.s2, 1.0 / r)

    def log_density(self, tau):
        tau = np.asarray(tau, dtype=float)
        s1, r1, s2 = self.s1, self.r1, self.s2
        return (
            special.gammaln(s1 + s2) - special.gammaln(s1) - special.gammaln(s2)
            + s1 * np.log(r1) + (s2 - 1.0) * np.log(tau) - (s1 + s2) * np.log(r1 + tau)
        )


class ProbitNoise(Factor):
    """Probit with label noise: p(y | f) = ε + (1 − 2ε) Θ(y f), y ∈ {−1, +1}."""

    name = "probit_noise"
    inputs = ("f",)
    output = "y"
    families = {"f": Gaussian, "y": Bernoulli}

    def __init__(self, eps: float = 0.0):
        if not (np.isfinite(eps) and 0.0 <= eps < 0.5):
            raise ValueError(f"ProbitNoise: `eps` must lie in [0, 0.5), got {eps!r}")
        self.eps = float(eps)

    def params(self):
        return {"eps": self.eps}

    def log_concave(self, to, incoming):
        # Θ(y f) is the indicator of a half-line (log-concave); with label noise ε > 0 the
        # factor is a two-level step, which is not
        if to != "f" or self.eps > 0.0:
            return None
        return np.ones(incoming["f"].shape, dtype=bool)

    def sample(self, inputs, size, rng):
        y = np.where(inputs["f"] >= 0, 1.0, -1.0)
        flip = rng.random(size) < self.eps
        return np.where(flip, -y, y)


# ------------------------------------------------------------------------ registry
_REGISTRY: dict[str, Callable[..., Factor]] = {
    Logistic.name: Logistic,
    CompoundGamma.name: CompoundGamma,
    ProbitNoise.name: ProbitNoise,
}


def register_factor(factor: Factor | Callable[..., Factor], name: str | None = None, replace: bool = False) -> None:
    """Register a factor instance (or a factory of them) under ``name``."""
    if isinstance(factor, Factor):
        inst = factor
        factory = lambda **kw: inst  # noqa: E731 - a fixed instance
        name = name or inst.name
    elif callable(factor):
        factory = factor
        name = name or getattr(factor, "name", None)
    else:
        raise ValueError("`factor` must be a Factor or a callable returning one")
    if not name:
        raise ValueError("`name` is required to register this factor")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a factor named {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


def get_factor(name: str, **params) -> Factor:
    """Build the registered factor ``name`` with constructor ``params``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown factor {name!r}; registered: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(**params)


def registered_factors() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))
