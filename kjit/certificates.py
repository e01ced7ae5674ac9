"""Certificates: what each answer of a message operator can be trusted for (issue 20).

Every answer — a projected belief q for one row of a batch — comes with a certificate saying:

* ``source``: where it came from — ``"rule"`` (an exact or hand-crafted rule: quadrature, closed
  form, a user's own code), ``"oracle"`` (a Monte Carlo oracle: importance sampling) or
  ``"learned"`` (the learned operator's prediction);
* ``log_var`` (per regression coordinate) and ``threshold``: the learned operator's log predictive
  variance and the threshold above which the operator is uncertain (NaN / None where none);
* ``ess`` and ``mc_se``: for oracle answers, the effective sample size and the Monte Carlo standard
  error of each projected coordinate (:class:`kjit.oracles.MessageImportanceSampler` reports both,
  :class:`~kjit.oracles.ImportanceSamplingOracle` the ESS; exact rules have none: NaN);
* ``projection``: the projection convention of the factor (``"kl"``, or ``"moments"`` where the
  factor offers that choice);
* ``proper``: whether the outgoing message q / incoming[to] is a proper distribution;
* ``flagged``: learned answers the operator's just-in-time rule would send to its oracle for a
  reason other than their variance (the outgoing precision's sign undetermined, a message far
  from the training data below the density guard): never confident, whatever their ``log_var``;
* ``version``: the operator's version (a served operator: the update records applied, as in the
  response; a local learned operator: the pairs it has learned; None for rules and oracles).

:class:`Certificates` holds them for a flat batch (columns, like the messages).  The operators
produce them — the oracle knows its ESS, the learned operator its variance, the JIT operator which
rows it consulted — and keep the last batch's in ``last_certificates_``; :func:`certified` asks any
operator for ``(belief, Certificates)`` (operators that do not produce certificates get ``rule``
ones, with ``source`` their class's ``certificate_source``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from .families import Family
from .reductions import all_finite

__all__ = ["SOURCES", "Certificates", "above_threshold", "certified", "last_certificates", "projection_convention",
           "outgoing_proper", "count_answers", "json_columns"]

#: where an answer came from
SOURCES = ("rule", "oracle", "learned")


def projection_convention(factor) -> str:
    """The factor's projection convention: its ``projection`` parameter, ``"kl"`` by default."""
    try:
        return str(factor.params().get("projection", "kl"))
    except Exception:  # noqa: BLE001 - a user's factor without params()
        return "kl"


def outgoing_proper(q: Family, incoming_to: Family) -> np.ndarray:
    """(n,) booleans (n: q's rows, flat): is q / incoming_to (the outgoing message) a proper
    distribution; ``incoming_to``: of q's batch shape, or one message for every row."""
    if incoming_to.size != q.size:
        incoming_to = incoming_to.broadcast_to(q.shape)
    q, incoming_to = q.ravel(), incoming_to.ravel()  # (row by row: a flat batch for q's, or the reverse)
    with np.errstate(all="ignore"):
        nat = np.asarray(q.natural(), float) - np.asarray(incoming_to.natural(), float)
        nat = nat.reshape(-1, nat.shape[-1])
        if all_finite(nat):
            return np.array(type(q).natural_is_proper(nat), dtype=bool).reshape(-1)
        ok = np.isfinite(nat).all(axis=1)
        out = np.zeros(len(ok), dtype=bool)
        if ok.any():
            out[ok] = type(q).natural_is_proper(nat[ok]).reshape(-1)
    return out


_F8 = np.dtype(np.float64)


def json_columns(cols) -> list[list]:
    """Rows of a 2-D array (or 1-D columns of one length) as lists of numbers, None (JSON null)
    where a number is not finite: one array, one finiteness test, one conversion — the column
    format of the certificates and of the service's responses."""
    if type(cols) is list and all(type(c) is np.ndarray and c.shape == (1,) and c.dtype == _F8 for c in cols):
        # one row (a one-message response: ~10 columns of one number) by Python floats — what
        # tolist gives, without stacking the columns into an array first
        return [[x] if math.isfinite(x := c.item()) else [None] for c in cols]
    a = np.array(cols, dtype=float)
    out = a.tolist()
    if not all_finite(a):
        for j, i in zip(*np.nonzero(~np.isfinite(a))):
            out[j][i] = None
    return out


def _col(a, n: int, k: int | None, what: str) -> np.ndarray:
    shape = (n,) if k is None else (n, k)
    if a is None:
        out = np.empty(shape)  # (np.full's result, without its Python-level wrapper: twice a served request)
        out.fill(np.nan)
        return out
    a = np.asarray(a, dtype=float)
    if a.shape == shape:
        return a.copy()
    if k is not None and a.ndim == 1 and a.size == n * k:
        a = a.reshape(n, k)
    try:
        return np.array(np.broadcast_to(a, shape), dtype=float)
    except ValueError:
        raise ValueError(f"certificate `{what}` has shape {a.shape}, expected {shape}") from None


def _flags(a, n: int, what: str) -> np.ndarray:
    """(n,) booleans from ``a`` (None: all false; a scalar or a broadcastable array)."""
    if a is None:
        return np.zeros(n, dtype=bool)
    p = np.asarray(a, dtype=bool)
    if p.shape == (n,):
        return p.copy()
    try:
        return np.array(np.broadcast_to(p, (n,)))
    except ValueError:
        raise ValueError(f"certificate `{what}` has shape {p.shape}, expected ({n},)") from None


class Certificates:
    """Certificates of a flat batch of ``n`` answers (see the module docstring).

    ``coords``: names of the regression coordinates (the columns of ``log_var`` and ``mc_se``).
    Arrays: ``source`` (n,) strings, ``log_var`` (n, k), ``ess`` (n,), ``mc_se`` (n, k),
    ``proper`` (n,) bools, ``flagged`` (n,) bools (default none); scalars ``threshold``,
    ``projection``, ``version``.
    """

    __slots__ = ("source", "log_var", "threshold", "ess", "mc_se", "projection", "proper", "version", "coords",
                 "flagged", "of")

    def __init__(self, source, coords: Sequence[str], *, log_var=None, threshold: float | None = None, ess=None,
                 mc_se=None, projection: str = "kl", proper=None, version: int | None = None, flagged=None):
        src = np.asarray(source, dtype=object).reshape(-1)
        bad = [s for s in set(src.tolist()) if s not in SOURCES]
        if bad:
            raise ValueError(f"certificate `source` must be one of {SOURCES}, got {sorted(map(str, bad))}")
        self._fill(src.astype("<U7"), coords, log_var, threshold, ess, mc_se, projection, proper, version, flagged)

    def _fill(self, source, coords, log_var, threshold, ess, mc_se, projection, proper, version,
              flagged=None) -> None:
        """:meth:`__init__` past the check of ``source`` (a '<U7' array of known sources)."""
        n, k = source.size, len(coords)
        self.source = source
        self.coords = tuple(str(c) for c in coords)
        self.log_var = _col(log_var, n, k, "log_var")
        self.threshold = None if threshold is None or not math.isfinite(threshold) else float(threshold)
        self.ess = _col(ess, n, None, "ess")
        self.mc_se = _col(mc_se, n, k, "mc_se")
        self.projection = str(projection)
        self.proper = np.ones(n, dtype=bool) if proper is None else _flags(proper, n, "proper")
        self.version = None if version is None else int(version)
        self.flagged = _flags(flagged, n, "flagged")
        self.of = None  # the belief object these certificates were issued with (see certified())

    # ---------------------------------------------------------------- construction
    @classmethod
    def uniform(cls, source: str, q: Family, incoming_to: Family | None, *, projection: str = "kl", **kw):
        """Every row of ``q`` from one source; ``proper`` from ``q / incoming_to`` (flat batches)."""
        if source not in SOURCES:
            raise ValueError(f"certificate `source` must be one of {SOURCES}, got {source!r}")
        unknown = set(kw) - {"log_var", "threshold", "ess", "mc_se", "version", "flagged"}
        if unknown:
            raise TypeError(f"Certificates.uniform() got unexpected keyword arguments {sorted(unknown)}")
        proper = None if incoming_to is None else outgoing_proper(q, incoming_to)  # (of q's batch, or one for all)
        q = q.ravel()
        out = cls.__new__(cls)
        out._fill(np.full(len(q), source, dtype="<U7"), type(q).coord_names, kw.get("log_var"),
                  kw.get("threshold"), kw.get("ess"), kw.get("mc_se"), projection, proper, kw.get("version"),
                  kw.get("flagged"))
        return out

    def __len__(self) -> int:
        return int(self.source.size)

    def __repr__(self):
        c = self.counts()
        return (f"Certificates(n={len(self)}, " + ", ".join(f"{s}={c[s]}" for s in SOURCES)
                + f", confident={c['learned_confident']}, improper={c['improper']}, version={self.version})")

    def take(self, rows) -> "Certificates":
        """The certificates of ``rows`` (indices or a boolean mask) of the batch."""
        rows = np.asarray(rows)
        out = Certificates(self.source[rows], self.coords, log_var=self.log_var[rows], threshold=self.threshold,
                           ess=self.ess[rows], mc_se=self.mc_se[rows], projection=self.projection,
                           proper=self.proper[rows], version=self.version, flagged=self.flagged[rows])
        return out

    def replace(self, rows, other: "Certificates") -> "Certificates":
        """A copy whose ``rows`` carry ``other``'s certificates (e.g. rows an oracle answered instead)."""
        rows = np.asarray(rows, dtype=int).reshape(-1)
        if len(other) != rows.size:
            raise ValueError(f"{len(other)} certificates for {rows.size} rows")
        out = self._copy()
        for name in ("source", "log_var", "ess", "mc_se", "proper", "flagged"):
            getattr(out, name)[rows] = getattr(other, name)
        return out

    def _copy(self) -> "Certificates":
        """A copy with its own arrays (what ``take`` of every row gives, without re-checking them)."""
        out = object.__new__(Certificates)
        for name in self.__slots__:
            value = getattr(self, name)
            setattr(out, name, value.copy() if isinstance(value, np.ndarray) else value)
        out.of = None
        return out

    def with_(self, **kw) -> "Certificates":
        """A copy with some scalar fields changed (``threshold``, ``version``, ``projection``), or its
        ``log_var`` (n, k) replaced."""
        out = self._copy()
        if "log_var" in kw:
            out.log_var = _col(kw.pop("log_var"), len(self.source), len(self.coords), "log_var")
        for key, value in kw.items():
            if key not in ("threshold", "version", "projection"):
                raise ValueError(f"cannot set {key!r}")
            setattr(out, key, value if value is None or key == "projection" else
                    (int(value) if key == "version" else float(value)))
        return out

    @classmethod
    def concatenate(cls, parts: Sequence["Certificates"]) -> "Certificates":
        """Rows of several batches; the scalar fields are the last part's (its version is the newest).
        One part is returned as it is."""
        if not parts:
            raise ValueError("nothing to concatenate")
        last = parts[-1]
        if len(parts) == 1:
            return last
        return cls(np.concatenate([p.source for p in parts]), last.coords,
                   log_var=np.concatenate([p.log_var for p in parts]), threshold=last.threshold,
                   ess=np.concatenate([p.ess for p in parts]), mc_se=np.concatenate([p.mc_se for p in parts]),
                   projection=last.projection, proper=np.concatenate([p.proper for p in parts]),
                   version=last.version, flagged=np.concatenate([p.flagged for p in parts]))

    # ---------------------------------------------------------------- quality
    @property
    def confident(self) -> np.ndarray:
        """(n,) learned answers whose log predictive variance is ≤ the threshold in every coordinate
        and that are not ``flagged``."""
        if self.threshold is None:
            return np.zeros(len(self), dtype=bool)
        return (self.source == "learned") & ~above_threshold(self.log_var, self.threshold) & ~self.flagged

    @property
    def uncertain(self) -> np.ndarray:
        """(n,) learned answers above the threshold in some coordinate (or with no variance), or
        ``flagged``."""
        if self.threshold is None:
            return np.zeros(len(self), dtype=bool)
        return (self.source == "learned") & ~self.confident

    def counts(self) -> dict[str, int]:
        """Answers per source and quality: ``rule``, ``oracle``, ``learned``, ``learned_confident``,
        ``learned_uncertain`` (above the threshold, or flagged), ``learned_unrated`` (no threshold or variance),
        ``improper`` (outgoing message not proper — including a flat one, of precision exactly 0: a learned
        belief as wide as the cavity, which EP uses as a message of precision 0 rather than skipping it; an
        audit counted 184 of 4 200 answers so on a breast-cancer run, KL ~1e-10, the exact messages' precision
        ~−1e-4)."""
        learned = self.source == "learned"
        conf, unc = self.confident, self.uncertain
        out = {s: int(np.count_nonzero(self.source == s)) for s in SOURCES}
        out["learned_confident"] = int(np.count_nonzero(conf))
        out["learned_uncertain"] = int(np.count_nonzero(unc))
        out["learned_unrated"] = int(np.count_nonzero(learned & ~conf & ~unc))
        out["improper"] = int(np.count_nonzero(~self.proper))
        return out

    # ---------------------------------------------------------------- JSON (the service's wire format)
    def to_json(self) -> dict[str, Any]:
        """Columns, like the response's messages: lists of n values per field (null: none); a field
        with no finite value at all is null."""
        k = len(self.coords)
        if self.source.size == 1:
            # one row (a one-message response): the 2k + 1 numbers by Python floats — the lists
            # json_columns gives of the (2k + 1, 1) array below, without building it
            cols = [[x] if math.isfinite(x) else [None]
                    for x in (*self.log_var.ravel().tolist(), self.ess.item(), *self.mc_se.ravel().tolist())]
            has = [c[0] is not None for c in cols]
            has_lv, has_ess, has_se = any(has[:k]), has[k], any(has[k + 1:])
        else:
            # the float fields as one (2k + 1, n) array
            a = np.concatenate([self.log_var.T, self.ess[None, :], self.mc_se.T])
            cols = json_columns(a)
            has = np.isfinite(a).any(axis=1)
            has_lv, has_ess, has_se = bool(has[:k].any()), bool(has[k]), bool(has[k + 1:].any())
        return {
            "source": self.source.tolist(),
            "log_var": cols[:k] if has_lv else None,
            "threshold": self.threshold,
            "ess": cols[k] if has_ess else None,
            "mc_se": cols[k + 1:] if has_se else None,
            "projection": self.projection,
            "proper": self.proper.tolist(),
            "version": self.version,
            "coords": list(self.coords),
            # (null where no row is: the one-message answer and most batches)
            "flagged": self.flagged.tolist() if self.flagged.any() else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Certificates":
        def arr(cols):
            if cols is None:
                return None
            return np.array(cols, dtype=float).T  # (null -> NaN: numpy's float conversion of None)

        ess = d.get("ess")
        return cls(d["source"], d["coords"], log_var=arr(d.get("log_var")), threshold=d.get("threshold"),
                   ess=None if ess is None else np.array(ess, dtype=float),
                   mc_se=arr(d.get("mc_se")), projection=d.get("projection", "kl"), proper=d.get("proper"),
                   version=d.get("version"), flagged=d.get("flagged"))


# ------------------------------------------------------------------------------ any operator
def last_certificates(op, answer) -> Certificates | None:
    """``op.last_certificates_`` if it certifies ``answer`` (the very belief object the operator
    returned last), else None — an operator that does not produce certificates, or a wrapper that
    returned a copy."""
    cert = getattr(op, "last_certificates_", None)
    if isinstance(cert, Certificates) and cert.of is answer:
        return cert
    return None


def above_threshold(log_var, threshold) -> np.ndarray:
    """(n,) rows of the (n, k) log variances that are not ≤ ``threshold`` in every coordinate: a NaN
    variance, or a NaN threshold, is never confident (one rule for the JIT, the EP engines and
    the client: ``log_var > threshold`` would let a NaN through as certain)."""
    with np.errstate(invalid="ignore"):
        return ~np.all(np.asarray(log_var, dtype=float) <= threshold, axis=-1)


def certified(op, incoming: Mapping[str, Family], to, *, unknown_source: str = "rule", **kw
              ) -> tuple[Family, Certificates]:
    """``(belief, Certificates)`` from any operator: its own ``certified`` if it has one, else its
    ``belief`` with the certificates it left in ``last_certificates_``, else certificates of one
    source — the operator's ``certificate_source``, or ``unknown_source`` for an object without one
    (``"oracle"`` where it stands in an oracle's place: not an exact rule, unless it says so) — with the
    outgoing messages' propriety."""
    fn = getattr(type(op), "certified", None)
    if callable(fn):
        return op.certified(incoming, to, **kw)
    q = op.belief(incoming, to, **kw)
    cert = last_certificates(op, q)
    if cert is None:
        factor = getattr(op, "factor", None)
        m = incoming.get(to) if to is not None else None
        try:
            cert = Certificates.uniform(getattr(op, "certificate_source", unknown_source), q,
                                        m if isinstance(m, type(q)) else None,
                                        projection=projection_convention(factor) if factor is not None else "kl")
        except Exception:  # noqa: BLE001 - an odd answer: the caller validates it
            cert = Certificates(np.full(math.prod(q.shape), unknown_source, dtype=object), type(q).coord_names)
        cert.of = q
    return q, cert


def count_answers(counts: dict[str, int], cert: Certificates | None) -> None:
    """Add a batch's :meth:`Certificates.counts` into ``counts`` (in place)."""
    if cert is None:
        return
    for k, v in cert.counts().items():
        counts[k] = counts.get(k, 0) + v
