"""Training sets of (incoming messages, projected belief) pairs, made by an oracle.

Generation is embarrassingly parallel: the incoming messages are cut into chunks and each
chunk goes to the oracle through :class:`joblib.Parallel`, so ``joblib.parallel_config(
backend=...)`` can hand the work to a cluster.  Each chunk's importance-sampling oracle gets
its own child of one ``SeedSequence``, so the result depends on the seed and the chunk size,
never on ``n_jobs`` or the backend.

A training set is saved as a plain ``.npz`` (numbers and one JSON string; loaded with
``allow_pickle=False``).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
from joblib import Parallel, delayed

from . import __version__
from .errors import check_number
from .factors import Factor, get_factor, param_mismatch, registered_factors
from .families import Family, family_by_name, family_name
from .oracles import ImportanceSamplingOracle, LowESSError, OracleError

__all__ = ["TrainingSet", "make_training_set", "FORMAT_VERSION", "DEFAULT_DISTRIBUTIONS", "default_incoming",
           "HELD_OUT_STREAM"]

#: what the seeds of pairs held out to calibrate an operator add to the run's ``random_state`` (streams of their own,
#: ``make_training_set(..., random_state=[seed, HELD_OUT_STREAM])``): drawn from the training pairs' seeds, a
#: sampling oracle gave them the same particles, hence the same errors, which the operator had learned — a new-user
#: audit's factor (z = 1 − x, Beta, the shared-proposal sampler at 100 particles) reported a held-out mean KL of
#: 7.7e-6 and a calibrated threshold where the truth was 1.2e-2
HELD_OUT_STREAM = 0x48454C44

FORMAT_VERSION = 1


@dataclass
class TrainingSet:
    """Pairs of incoming messages (a dict of batches of length n) and beliefs (length n), for the factor
    named ``factor`` with ``factor_params`` (its :meth:`~kjit.factors.Factor.params`): an operator fits
    only pairs of its own factor, name and parameters (:meth:`~kjit.factors.Factor.check_same`)."""

    factor: str
    to: str
    incoming: dict[str, Family]
    beliefs: Family
    factor_params: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.beliefs)
        for v, m in self.incoming.items():
            if m.shape != (n,):
                raise ValueError(f"`incoming[{v!r}]` has shape {m.shape}, expected ({n},) like `beliefs`")

    def __len__(self):
        return len(self.beliefs)

    def subset(self, index) -> "TrainingSet":
        return TrainingSet(
            self.factor, self.to, {v: m[index] for v, m in self.incoming.items()},
            self.beliefs[index], dict(self.factor_params), dict(self.meta),
        )

    def split(self, n_first: int, random_state=None):
        """Random split into ``n_first`` and the rest."""
        if not 0 < n_first < len(self):
            raise ValueError(f"`n_first` must lie in (0, {len(self)}), got {n_first}")
        perm = np.random.default_rng(random_state).permutation(len(self))
        return self.subset(perm[:n_first]), self.subset(perm[n_first:])

    @classmethod
    def concatenate(cls, sets) -> "TrainingSet":
        sets = list(sets)
        first = sets[0]
        for i, s in enumerate(sets[1:], 1):
            if (s.factor, s.to) != (first.factor, first.to):
                raise ValueError("cannot concatenate training sets of different factors or directions")
            why = param_mismatch(s.factor_params, first.factor_params, f"set {i}", "set 0")
            if why is not None:
                raise ValueError(f"cannot concatenate training sets of different factors: {first.factor!r} with {why}")
        return cls(
            first.factor, first.to,
            {v: type(m).concatenate([s.incoming[v] for s in sets]) for v, m in first.incoming.items()},
            type(first.beliefs).concatenate([s.beliefs for s in sets]),
            dict(first.factor_params), {**_joined_meta(sets), "n_sets": len(sets)},
        )

    # ------------------------------------------------------------------ npz I/O
    def save(self, path) -> None:
        arrays = {}
        header = {
            "format": "kjit-training-set", "format_version": FORMAT_VERSION, "kjit_version": __version__,
            "factor": self.factor, "factor_params": self.factor_params, "to": self.to, "meta": self.meta,
            "incoming": {v: family_name(m) for v, m in self.incoming.items()},
            "belief": family_name(self.beliefs),
        }
        for v, m in self.incoming.items():
            for name, p in zip(m.param_names, m.params):
                arrays[f"incoming.{v}.{name}"] = p
        for name, p in zip(self.beliefs.param_names, self.beliefs.params):
            arrays[f"belief.{name}"] = p
        arrays["header"] = np.array(json.dumps(header))
        with open(path, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    @classmethod
    def load(cls, path) -> "TrainingSet":
        """Read a set written by :meth:`save`; a ValueError naming the entry for a file that is not
        one (not an npz, truncated, missing or mistyped entries, parameters a family refuses)."""
        try:
            z = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)):
                raise
            raise ValueError(f"{path}: not a kjit training set (not a readable .npz file: {exc})") from None
        if not isinstance(z, np.lib.npyio.NpzFile):  # (a bare .npy array)
            raise ValueError(f"{path}: not a kjit training set (a single array, not an .npz archive)")
        with z:
            try:
                return cls._from_npz(z, path)
            except (zipfile.BadZipFile, EOFError, OSError) as exc:  # (an entry cut short)
                raise ValueError(f"{path}: a damaged training set ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_npz(cls, z, path) -> "TrainingSet":
        def entry(name):
            if name not in z.files:
                raise ValueError(f"{path}: not a kjit training set (no {'header' if name == 'header' else f'entry {name!r}'})")
            return z[name]

        try:
            header = json.loads(str(entry("header")))
        except json.JSONDecodeError:
            raise ValueError(f"{path}: the training set's header is not JSON") from None
        if not isinstance(header, dict) or header.get("format") != "kjit-training-set":
            raise ValueError(f"{path}: not a kjit training set")
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: training-set format version {header.get('format_version')!r} is not "
                f"supported (this kjit reads version {FORMAT_VERSION})"
            )
        for key, kind in (("factor", str), ("to", str), ("incoming", dict), ("belief", str),
                          ("factor_params", dict), ("meta", dict)):
            if not isinstance(header.get(key), kind):
                raise ValueError(f"{path}: the training set's header entry {key!r} must be a JSON "
                                 f"{'string' if kind is str else 'object'}, got {header.get(key)!r}"[:300])

        def batch(fam_name, prefix):
            try:
                fam = family_by_name(fam_name)
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}: {prefix}: unknown family {fam_name!r}") from None
            try:
                return fam(*(entry(f"{prefix}.{p}") for p in fam.param_names))
            except ValueError as exc:
                raise ValueError(f"{path}: {prefix}: {exc}") from None

        incoming = {v: batch(f, f"incoming.{v}") for v, f in header["incoming"].items()}
        beliefs = batch(header["belief"], "belief")
        for name, m in [*(("incoming." + v, m) for v, m in incoming.items()), ("belief", beliefs)]:
            if m.ndim != 1:
                raise ValueError(f"{path}: {name}: a batch must be 1-D, got shape {m.shape}")
        return cls(header["factor"], header["to"], incoming, beliefs, header["factor_params"], header["meta"])


def _joined_meta(sets) -> dict:
    """The sets' meta as one: counts (``n_*`` integers every set has) summed, other entries that
    every set has with one value kept (found by an audit: a service job of 300 pairs in two
    slices reported ``n_failed: 0`` with 251 of them dropped)."""
    out = {}
    for key, value in sets[0].meta.items():
        values = [s.meta.get(key, _MISSING) for s in sets]
        if key == "failures":  # per cause: counts summed, the first failure kept (numbered in the joined set)
            offset, parts = 0, []
            for s in sets:
                parts.append((s.meta.get("failures") or {}, offset))
                offset += int(s.meta.get("n_requested", len(s)))
            out[key] = _merged_failures(parts)
        elif key.startswith("n_") and all(type(x) is int for x in values):
            out[key] = sum(values)
        elif all(x == value for x in values):
            out[key] = value
    return out


_MISSING = object()


def _merged_failures(parts) -> dict:
    """``failures`` of several chunks or sets as one: ``parts`` = [(failures, offset of its first
    message)]; per cause the counts summed and the first failure (message number shifted) kept."""
    out: dict = {}
    for failures, offset in parts:
        for cause, rec in failures.items():
            if cause not in out:
                out[cause] = {**rec, "first_message": int(rec["first_message"]) + int(offset)}
            else:
                out[cause]["count"] += int(rec["count"])
    return out


def failures_text(failures: Mapping | None, limit: int = 3) -> str:
    """``failures`` (a training set's ``meta["failures"]``) in a sentence: the count per cause and, for
    the commonest, its first message's error."""
    if not failures:
        return ""
    ranked = sorted(failures.items(), key=lambda kv: -kv[1]["count"])
    counts = ", ".join(f"{rec['count']} × {cause}" for cause, rec in ranked[:limit])
    if len(ranked) > limit:
        counts += f", {sum(r['count'] for _, r in ranked[limit:])} × other causes"
    cause, rec = ranked[0]
    return f"{counts}; the first ({cause}), message {rec['first_message']}: {rec['first_error']}"


def _note_failure(failures: dict, exc: BaseException, row: int) -> None:
    cause = getattr(exc, "cause", None) or type(exc).__name__
    rec = failures.setdefault(cause, {"count": 0, "first_message": int(row), "first_error": str(exc)[:1000]})
    rec["count"] += 1


def _oracle_chunk(oracle, incoming: Mapping[str, Family], to: str, drop_failures: bool):
    """Beliefs for one chunk, a mask of the rows the oracle could answer, and why the others failed:
    ``{cause: {"count", "first_message" (its row in the chunk), "first_error"}}`` (an OracleError's
    ``cause``; found by an audit: a job whose user sampler returned NaN "succeeded" with 45 of 50
    pairs dropped, and one whose sampler left its output's support failed with "the oracle failed
    on every message" — neither said why)."""
    n = len(next(iter(incoming.values())))
    fam = oracle.factor.families[to]
    failures: dict = {}
    if isinstance(oracle, ImportanceSamplingOracle):
        stats, ess = oracle.estimate(incoming, to)
        ok = ess >= oracle.min_ess
        ok &= fam.estimate_ok(stats)
        if not drop_failures and not ok.all():
            raise OracleError(f"importance sampling failed on {int((~ok).sum())} message(s) (low ESS)")
        undefined = oracle.last_undefined_ if oracle.last_undefined_ is not None else np.zeros(0, dtype=int)
        for i in np.flatnonzero(~ok):
            if i in undefined:
                exc = OracleError("more than 1e-06 of its mass lies where the factor's sampler returned NaN or a "
                                  "value on the boundary of a variable's support", cause="sampler returned NaN or "
                                  "a value on a support's boundary")
            elif ess[i] < oracle.min_ess:
                exc = LowESSError([i], [ess[i]], oracle.min_ess)
            else:
                exc = OracleError(f"the estimate is not a {fam.__name__} message's statistics",
                                  cause="estimate not a message")
            _note_failure(failures, exc, i)
        return fam.from_estimate(stats[ok]), ok, failures
    try:
        return oracle.belief(incoming, to), np.ones(n, dtype=bool), failures
    except OracleError:
        if not drop_failures:
            raise
    # find the failing rows one by one (rare)
    parts, ok = [], np.zeros(n, dtype=bool)
    for i in range(n):
        try:
            parts.append(oracle.belief({v: m[i:i + 1] for v, m in incoming.items()}, to))
            ok[i] = True
        except OracleError as exc:
            _note_failure(failures, exc, i)
    if not parts:
        return None, ok, failures
    return fam.concatenate(parts), ok, failures


def _chunk_job(oracle, part: Mapping[str, Family], to: str, seed, drop_failures: bool):
    """One task: the oracle, re-seeded with the chunk's own child seed, on one chunk.

    A module-level function of plain arguments, so it pickles by reference and runs on any
    joblib backend, a Dask worker included.
    """
    if hasattr(oracle, "with_random_state"):
        oracle = oracle.with_random_state(seed)
    return _oracle_chunk(oracle, part, to, drop_failures)


def make_training_set(
    factor: Factor | str,
    to: str,
    incoming: Mapping[str, Family] | Callable[[int, np.random.Generator], Mapping[str, Family]],
    oracle,
    n: int | None = None,
    n_jobs: int = 1,
    chunk_size: int = 256,
    random_state=None,
    progress: bool = False,
    drop_failures: bool = True,
) -> TrainingSet:
    """Run ``oracle`` on incoming messages and keep (incoming, belief) pairs.

    Parameters
    ----------
    factor : Factor or registered name.
    to : recipient variable.
    incoming : recorded messages (dict of batches of one length), or a sampler
        ``incoming(n, rng) -> dict`` of message batches (then ``n`` is required).
    oracle : an oracle for ``factor`` (QuadratureOracle or ImportanceSamplingOracle).
    n_jobs, chunk_size : joblib parallelism; the result does not depend on ``n_jobs`` or the
        backend, but does on ``chunk_size`` (one seed per chunk).  On a Dask cluster::

            with distributed.Client("tcp://host:8786"), joblib.parallel_config(backend="dask"):
                ts = make_training_set(...)   # every worker thread is used, whatever n_jobs

        (``kjit[dask]`` on the client and on the workers).  Size chunks so the scheduler is not
        the bottleneck: a chunk should cost ≥ max(100 ms, 20 × the per-task overhead, measured by
        ``benchmarks/scale.py``), i.e. ``chunk_size ≥ that / per-pair cost``, with ≥ ~4 chunks per
        worker for load balance.  The default 256 costs ~5–10 s with 5×10^5 particles; for the
        quadrature oracle (~0.2 ms a pair) use a few thousand.
    random_state : seeds the incoming sampler and each chunk's importance sampler.
    progress : show a tqdm progress bar.
    drop_failures : drop messages the oracle cannot answer (low ESS) and count them in
        ``meta["n_failed"]``, and per cause in ``meta["failures"]`` (``{cause: {"count",
        "first_message", "first_error"}}``, the cause an OracleError's ``cause``); otherwise raise
        :class:`~kjit.oracles.OracleError`.  When every message fails, the OracleError says why.
    """
    if isinstance(factor, str):
        factor = get_factor(factor)
    factor.check_to(to)
    factor.check_same(oracle.factor, "`oracle`", "`factor`")
    chunk_size = check_number("chunk_size", chunk_size, 1, integer=True)
    if n is not None:  # (n=2.5 ran as 2: found by an audit)
        n = check_number("n", n, 1, integer=True)
    if isinstance(random_state, np.random.SeedSequence):
        seed = random_state
    elif isinstance(random_state, np.random.Generator):
        seed = np.random.SeedSequence(int(random_state.integers(2**63)))
    else:
        seed = np.random.SeedSequence(random_state)
    sampler_seed, oracle_seed = seed.spawn(2)
    if callable(incoming):
        if n is None:
            raise ValueError("`n` (a positive count) is required when `incoming` is a sampler")
        sampler = incoming
        incoming = incoming(n, np.random.default_rng(sampler_seed))
    else:
        sampler = None
    incoming, shape = factor.check_incoming(incoming, to)
    if len(shape) != 1:
        raise ValueError(f"`incoming` must be 1-D batches, got batch shape {shape}")
    if sampler is not None and shape[0] != n:  # (found by an audit: a sampler's 5 messages for n=3 were taken)
        raise ValueError(f"the `incoming` sampler {getattr(sampler, '__name__', sampler)!r} returned {shape[0]} "
                         f"messages for n={n}")
    total = shape[0]
    if n is not None and n != total:
        if n > total:
            raise ValueError(f"`n`={n} exceeds the {total} recorded messages")
        incoming = {v: m[:n] for v, m in incoming.items()}
        total = n
    starts = list(range(0, total, chunk_size))
    child_seeds = oracle_seed.spawn(len(starts))
    # each task carries only its own slice of the messages and its own child seed (a few kB), not
    # the whole batch: on a cluster (joblib's "dask" backend) every task is shipped to a worker
    tasks = (
        delayed(_chunk_job)(oracle, {v: m[s: s + chunk_size] for v, m in incoming.items()}, to,
                            child_seeds[i], drop_failures)
        for i, s in enumerate(starts)
    )
    results = Parallel(n_jobs=n_jobs, return_as="generator")(tasks)
    if progress:
        from tqdm.auto import tqdm

        results = tqdm(results, total=len(starts), desc=f"oracle {factor.name}→{to}", unit="chunk")
    beliefs, oks, failures = [], [], []
    for i, (b, ok, why) in enumerate(results):
        oks.append(ok)
        failures.append((why, starts[i]))
        if b is not None:
            beliefs.append(b)
    ok = np.concatenate(oks)
    failures = _merged_failures(failures)
    if not beliefs:
        raise OracleError(f"the oracle failed on every message: {failures_text(failures)}",
                          cause=next(iter(failures), None))
    fam = factor.families[to]
    meta = {
        "n_requested": int(total), "n_failed": int((~ok).sum()), "oracle": repr(oracle),
        "chunk_size": chunk_size, "failures": failures,
    }
    keep = np.flatnonzero(ok)
    return TrainingSet(
        factor.name, to, {v: m[keep] for v, m in incoming.items()}, fam.concatenate(beliefs),
        factor.params(), meta,
    )


# ------------------------------------------------------------------ default incoming distributions
class _DefaultDistributions(Mapping):
    """factor name → its default incoming-message distribution ``(n, rng) -> dict``, read from
    the registry (each factor module declares its own: ``Factor.default_incoming``)."""

    def _get(self, name):
        try:
            f = get_factor(name)
        except (TypeError, ValueError):  # unknown, or a factory that needs parameters
            return None
        return f.default_incoming

    def __getitem__(self, name):
        d = self._get(name)
        if d is None:
            raise KeyError(name)
        return d

    def __iter__(self):
        return (n for n in registered_factors() if self._get(n) is not None)

    def __len__(self):
        return sum(1 for _ in self)


DEFAULT_DISTRIBUTIONS: Mapping[str, Callable[[int, np.random.Generator], dict[str, Family]]] = _DefaultDistributions()
"""Training inputs for operators of the registered factors when no recorded messages are given
(the service's default operators and ``kjit train``): each factor's ``default_incoming``."""


def default_incoming(factor: Factor):
    """The factor's default incoming-message distribution, or ``ValueError`` if it has none."""
    d = factor.default_incoming
    if d is None:
        raise ValueError(f"no default incoming distribution for factor {factor.name!r}; give per-parameter "
                         "ranges or a training-set file")
    return d


def __getattr__(name):
    # the factors' default distributions (``logistic_incoming`` …) under their historical home
    if name.endswith("_incoming"):
        from . import factors

        if hasattr(factors, name):
            return getattr(factors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
