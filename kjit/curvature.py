"""The concentrations a learned operator has learned, and the weights a just-in-time rule puts on the
predictive variances of answers more concentrated than those.

A threshold on the log predictive variance of a regressed coordinate is calibrated — or chosen, as
the paper's — on predictions like the beliefs learned, whose errors cost what they cost there.  An
answer whose KL curvature in a coordinate (:meth:`Family.decision_weights`: an error δ costs
½ F̃_jj δ²) is F times that of the learned beliefs costs F times more for the same variance, so the
rule weighs that coordinate's variance by F.  "Learned" is judged twice, and the larger weight
taken:

- **the range**: the :data:`CURVATURE_SUPPORT`-th largest curvature among the beliefs learned
  (``top``, the largest few kept exactly) — an answer more concentrated than that is weighted by
  how much more;
- **the density**: a count of the learned beliefs per quarter decade of curvature (``hist``).  A
  concentration is covered when at least :data:`CURVATURE_SUPPORT` learned beliefs lie within
  :data:`CURVATURE_WINDOW` bins of it; an answer in an uncovered bin is weighted by its curvature
  over the top of the nearest covered bin below it.  Without it, a few beliefs learned far beyond
  the rest made every concentration between them "learned": after a JIT learned six beliefs at a
  Gamma shape of ~1e9 on top of shapes ≤ 46, shapes 1e6–1e8 — never learned, the random features
  saturated alike for every concentrated message — were answered as confident 1.3–6.3 sd off
  (KL up to 20).

In a covered bin at or below the range's level both weights are 1: the paper's rule.  An answer
broader than every covered concentration is not weighted (its errors cost less than those learned).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["CURVATURE_SUPPORT", "CURVATURE_BINS_PER_DECADE", "CURVATURE_WINDOW", "CURVATURE_EDGES", "LearnedCurvature",
           "curvature_top", "curvature_hist", "gap_edges", "log_weights"]

#: learned beliefs at least this concentrated make a concentration learned (the range), and this many
#: within :data:`CURVATURE_WINDOW` bins cover a concentration (the density): one consulted extreme
#: belief does not cover every concentration below it for the messages EP sends next
CURVATURE_SUPPORT = 5
#: the histogram's resolution: bin b > 0 holds curvatures in (10^((b−1)/4), 10^(b/4)] (:data:`CURVATURE_EDGES`),
#: bin 0 those ≤ 1
CURVATURE_BINS_PER_DECADE = 4
#: bins on each side of a concentration that count towards covering it (half a decade)
CURVATURE_WINDOW = 2
#: bins: up to 10^308, near the largest double (a larger curvature is counted in the last bin)
CURVATURE_BINS = 308 * CURVATURE_BINS_PER_DECADE + 1
#: the bins' upper edges, 10^(b/4) (bin 0's is 1)
CURVATURE_EDGES = 10.0 ** (np.arange(CURVATURE_BINS) / CURVATURE_BINS_PER_DECADE)


class LearnedCurvature(NamedTuple):
    """What a prediction's curvatures are compared with: ``level`` (k,) or per row (n, k), the range's
    :data:`CURVATURE_SUPPORT`-th largest; ``gaps`` (k, B), or (G, k, B) per group with ``rows`` (n,)
    each row's group — per bin the curvature an answer in it is compared with by the density
    (:func:`gap_edges`; None: the range alone, an operator saved before the histogram was kept)."""

    level: np.ndarray
    gaps: np.ndarray | None = None
    rows: np.ndarray | None = None


def curvature_top(curv, top=None) -> np.ndarray:
    """The :data:`CURVATURE_SUPPORT` largest KL curvatures (m, k) of each regressed coordinate over
    learned beliefs (n, k) and a previous ``top`` (m, k), descending, at least 1 (padded with 1 while
    fewer are learned); a belief whose curvature is not a number is not counted."""
    c = np.where(np.isfinite(curv) & (np.asarray(curv) >= 1.0), curv, 1.0).reshape(-1, np.shape(curv)[-1])
    if top is not None:
        c = np.concatenate([np.asarray(top, np.float64), c])
    c = -np.sort(-c, axis=0)[:CURVATURE_SUPPORT]
    if len(c) < CURVATURE_SUPPORT:
        c = np.concatenate([c, np.ones((CURVATURE_SUPPORT - len(c), c.shape[1]))])
    return c


def curvature_bins(curv) -> np.ndarray:
    """The histogram bin of each curvature (any shape; int): b with ``CURVATURE_EDGES[b − 1] < c ≤
    CURVATURE_EDGES[b]`` (bin 0: c ≤ 1; the last bin also holds everything larger); not a number: −1."""
    c = np.asarray(curv, np.float64)
    b = np.minimum(np.searchsorted(CURVATURE_EDGES, c), CURVATURE_BINS - 1)
    return np.where(np.isnan(c), -1, b).astype(np.int64)


def curvature_hist(curv, hist=None) -> np.ndarray:
    """Learned beliefs per curvature bin (k, :data:`CURVATURE_BINS`) of each regressed coordinate:
    the beliefs' curvatures (n, k) counted, added to a previous ``hist``; a curvature that is not a
    number is not counted (nor is an infinite one — its bin would be the last)."""
    curv = np.asarray(curv, np.float64)
    k = np.shape(curv)[-1]
    c = curv.reshape(-1, k)
    b = curvature_bins(np.where(np.isinf(c), np.nan, c))
    out = np.zeros((k, CURVATURE_BINS), np.int64) if hist is None else np.array(hist, np.int64)
    for j in range(k):
        bj = b[:, j]
        out[j] += np.bincount(bj[bj >= 0], minlength=CURVATURE_BINS)
    return out


def gap_edges(hist) -> np.ndarray:
    """Per bin of ``hist`` (…, k, B), the curvature an answer in that bin is compared with by the
    density: +inf where the bin is covered (≥ :data:`CURVATURE_SUPPORT` learned beliefs within
    :data:`CURVATURE_WINDOW` bins) or no covered bin lies below it, else the upper edge of the nearest
    covered bin below."""
    h = np.asarray(hist, np.int64)
    B = h.shape[-1]
    w = CURVATURE_WINDOW
    c = np.cumsum(np.pad(h, [(0, 0)] * (h.ndim - 1) + [(w + 1, w)]), axis=-1)
    covered = (c[..., 2 * w + 1:] - c[..., :B]) >= CURVATURE_SUPPORT  # window sums over [b − w, b + w]
    idx = np.where(covered, np.arange(B), -1)
    below = np.maximum.accumulate(idx, axis=-1)  # the highest covered bin ≤ b: < b where b is not covered
    edge = CURVATURE_EDGES[np.maximum(below, 0)]
    return np.where(covered | (below < 0), np.inf, edge)


def log_weights(d, learned: LearnedCurvature) -> np.ndarray:
    """log of the decision weights (n, k) of answers whose KL curvatures are ``d`` (n, k): the larger of
    the range's d / level and the density's d / (its bin's :func:`gap_edges`), at least 1; NaN where
    ``d`` is (an improper answer: never confident)."""
    d = np.asarray(d, np.float64)
    with np.errstate(all="ignore"):
        w = d / learned.level
        if learned.gaps is not None:
            # (curvature_bins' bins; a NaN's is the last here, its weight NaN from d itself)
            b = np.minimum(np.searchsorted(CURVATURE_EDGES, d), CURVATURE_BINS - 1)
            j = np.arange(d.shape[-1])
            if learned.rows is None:
                edge = learned.gaps[j, b]
            else:
                edge = learned.gaps[np.asarray(learned.rows)[:, None], j, b]
            w = np.fmax(w, d / edge)
        return np.log(np.maximum(w, 1.0))
