"""Which rows of a batch a just-in-time operator asks its oracle (SPEC §6): the greedy selection
that brings every row's latent variance under a limit, from the regression's posterior alone."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["greedy_consultations"]

def greedy_consultations(psi: np.ndarray, Sigma: np.ndarray, noise_var: float, limit,
                         rule: str = "max") -> np.ndarray:
    """Rows to ask the oracle so that, once their pairs are learned, every row's latent variance
    ψᵀΣψ is ≤ ``limit``; greedy.  Returns row indices in selection order.

    In Bayesian linear regression the posterior covariance after learning a pair depends only
    on its features, not on the oracle's answer: Σ' = Σ − Σψψᵀ Σ / (σ_y² + ψᵀΣψ).  So the
    effect of consulting a row on the uncertainty of every other row of the batch is known
    before the oracle is called.  With K = ΨΣΨᵀ (m × m) for the m rows, learning row j maps
    K ← K − K[:, j] K[j, :] / (σ_y² + K_jj); the loop picks rows until no diagonal entry
    exceeds ``limit``: O(m² D) once, then O(m²) per pick.  ``rule`` "max" (default) picks the
    most uncertain row (the rule of processing the rows one at a time, most uncertain first);
    "coverage" picks the row that removes the most excess variance
    Σ_i min(K_ii − limit, K_ij²/(σ_y² + K_jj)) over the rows still above the limit.  Measured on
    jit_uci.py, seeds 0/1/2, consultations after the first data set: "max" 89/72/109,
    "coverage" 92/76/115, test errors equal or better with "max".  Either way near-duplicate
    uncertain rows (EP sends many) cost one consultation instead of one each.  With
    ``limit`` ≤ 0 (the noise alone exceeds the threshold) every row with variance > limit is
    returned.  ``limit`` may be one per row (m,) (a just-in-time rule's weighted threshold): "max"
    then picks the row whose variance is the largest multiple of its own limit, a row whose limit
    is ≤ 0 (learning cannot bring it under) first.
    """
    if rule not in ("coverage", "max"):
        raise ValueError(f"`rule` must be 'coverage' or 'max', got {rule!r}")
    psi = np.asarray(psi, np.float64)
    if rule == "max":
        return _greedy_max(psi, np.asarray(Sigma, np.float64), float(noise_var), limit)
    K = (psi @ Sigma) @ psi.T
    K = 0.5 * (K + K.T)
    var = np.diagonal(K).copy()
    limit = np.broadcast_to(np.asarray(limit, np.float64), var.shape)
    if not np.any(limit > 0):
        return np.flatnonzero(var > limit)
    chosen = []
    learned = np.zeros(len(var), dtype=bool)
    while True:
        var[learned] = -np.inf  # learned rows are the oracle's answers: never picked again
        above = var > limit
        if not above.any():
            break
        if rule == "max":
            j = int(np.argmax(np.where(above, var, -np.inf)))
        else:
            gain = K[above] ** 2 / (noise_var + var)[None, :]  # (rows above, candidates)
            excess = (var[above] - limit[above])[:, None]
            score = np.minimum(gain, excess).sum(axis=0)
            score[~above] = -np.inf  # only rows that need it are consulted
            j = int(np.argmax(score))
        chosen.append(j)
        learned[j] = True
        k = K[:, j].copy()
        denom = noise_var + var[j]
        K -= np.outer(k, k / denom)
        var = np.diagonal(K).copy()
    return np.asarray(chosen, dtype=int)


def _greedy_max(psi: np.ndarray, Sigma: np.ndarray, noise_var: float, limit) -> np.ndarray:
    """:func:`greedy_consultations`' rule "max" without K: K's updates are kept as the columns u_p =
    K_p[:, j_p] / √(σ_y² + K_p[j_p, j_p]) of its picks (K_t = K_0 − Σ_p u_p u_pᵀ, a pivoted Cholesky
    of K_0 + σ_y² at the picks), so a pick costs O(m (D + t)) and the memory is O(m (D + t)) — the
    m × m matrix, with an m × m outer product allocated per pick, took 1.8 GB and 130 s under the
    operator's write lock for one served request of 10 000 uncertain rows (found by an audit).  The
    same picks as the dense update in exact arithmetic."""
    P = psi @ Sigma  # (m, D): K_0[:, j] = P ψ_j
    var = np.einsum("ij,ij->i", P, psi)
    one = np.ndim(limit) == 0
    limit = np.broadcast_to(np.asarray(limit, np.float64), var.shape)
    if not np.any(limit > 0):
        return np.flatnonzero(var > limit)
    # the most uncertain row: the largest multiple of its limit (one limit: the largest variance)
    inv = 1.0 if one else np.where(limit > 0, 1.0 / np.where(limit > 0, limit, 1.0), np.inf)
    m = len(var)
    U = np.empty((min(m, 64), m))  # rows: the picks' u_p (grown as needed)
    chosen: list[int] = []
    learned = np.zeros(m, dtype=bool)
    while True:
        var[learned] = -np.inf  # learned rows are the oracle's answers: never picked again
        above = var > limit
        if not above.any():
            break
        with np.errstate(invalid="ignore"):
            j = int(np.argmax(np.where(above, var * inv, -np.inf)))
        t = len(chosen)
        k = P @ psi[j]
        if t:
            k -= U[:t].T @ U[:t, j]
        u = k / math.sqrt(noise_var + var[j])
        if t == U.shape[0]:
            U = np.concatenate([U, np.empty_like(U)])
        U[t] = u
        chosen.append(j)
        learned[j] = True
        var -= u * u
    return np.asarray(chosen, dtype=int)
