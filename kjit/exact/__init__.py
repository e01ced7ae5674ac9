"""Exact EP rules (1-D quadrature / closed form) for the multi-input factors of SPEC §2.

One module per factor; each exposes

* ``belief(to, incoming, projection="kl", power=1.0, **params) -> Family`` — the projected
  belief proj[f^power · Π incoming] on ``to`` (Gaussian beliefs by their first two moments;
  Gamma beliefs by the KL projection, E[x] and E[log x], or with ``projection="moments"`` by
  mean and variance), with the batch shape of the incoming messages;
* ``log_partition(incoming, power=1.0, **params) -> ndarray`` — log ∫ f^power Π incoming;
* ``sample(inputs, size, rng, **params) -> ndarray`` — the output given the inputs (all the
  learned path may use);

and the metadata ``NAME``, ``INPUTS``, ``OUTPUT``, ``FAMILIES``, ``PARAMS`` (defaults) and
``SUPPORTS_POWER``.

| module       | variables (inputs → output)  | params      | power EP |
|--------------|------------------------------|-------------|----------|
| ``product``    | x, y (Gaussian) → z = x·y (Gaussian) | —     | no (deterministic) |
| ``gaussian``   | m (Gaussian), tau (Gamma) → x ~ N(m, 1/tau) (Gaussian) | — | yes |
| ``gamma_rate`` | r (Gamma) → x ~ Gamma(shape, rate=r) (Gamma) | shape = 1 | yes |
| ``exp``        | x (Gaussian) → y = e^x (Gamma) | —           | no (deterministic) |

Every rule reduces to one-dimensional integrals (the other variables integrated in closed
form given one of them) done by the level-panel Gauss–Legendre rule of :mod:`kjit.quadrature`.
Bad input is a ``ValueError`` naming the variable; a row whose integral cannot be computed in
double precision is a :class:`kjit.errors.OracleError` (re-exported by :mod:`kjit.oracles`) naming the rows.
"""

from . import exp, gamma_rate, gaussian, product

FACTORS = {m.NAME: m for m in (product, gaussian, gamma_rate, exp)}

__all__ = ["FACTORS", "product", "gaussian", "gamma_rate", "exp"]
