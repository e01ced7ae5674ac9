"""RemoteOperator: a served operator with the interface of a local one, over HTTP.

::

    from kjit.client import RemoteOperator
    from kjit.ep import BayesianLogisticRegression

    op = RemoteOperator("http://127.0.0.1:8000", "logistic-x")     # mode="jit" by default
    model = BayesianLogisticRegression(op).fit(X, y)                # EP, unchanged

``belief``, ``message``, ``predict`` and ``uncertainty`` take the same dicts of message
batches as :class:`kjit.operators.KernelOperator` / :class:`~kjit.operators.JITOperator` and
return the same types; ``partial_fit`` sends (incoming, belief) pairs to the server.  A batch
larger than the server's limit is sent in several requests.

``mode``: ``"jit"`` (the server consults its oracle on uncertain rows and learns; needs the
token if the server has one), ``"predict"`` (learned operator only, read-only — except that a server
auditing its answers (``KJIT_AUDIT_RATE``) may check and learn rows of a request carrying its token) or
``"oracle"`` (needs the token too: it costs the server real CPU).  ``jit`` and ``oracle`` batches
are split at the server's ``max_oracle_batch``.

Numbers cross the wire as JSON, which carries every finite double exactly, so a remote
operator gives the same numbers as the same operator in process.  Non-finite parameters are
refused before sending (JSON has no NaN).

Failures: every HTTP error raises :class:`RemoteOperatorError` carrying the status, the
server's message (with the field it names) and the parsed body; a 4xx caused by the input is
also a ``ValueError`` (:class:`RemoteValidationError`), like local validation.  Connection
errors are retried (``retries`` times, exponential back-off) for idempotent calls: reads,
``predict``/``oracle`` requests, and ``partial_fit`` (which sends an ``Idempotency-Key``, so
the server applies a retried request once).  A ``jit`` request is retried only when the
connection could not be made at all (nothing was sent); timeouts of a ``jit`` request are not
retried, since the server may have learned from it.  ``timeout`` bounds a whole answer (a server
sending it byte by byte cannot hold a call longer), and an answer larger than
:data:`kjit.transport.MAX_RESPONSE_BYTES` is refused unread (with ``client=`` an httpx client of
yours, its own timeouts and limits apply instead).  A 200 answer that is not what the
API promises (missing or mistyped columns, the wrong family or length, a message that is not
finite) is a :class:`RemoteOperatorError` saying what is wrong, never an answer; a NaN log
variance (a server's ``null``) counts as uncertain, and a ``null`` threshold (a server that rates
nothing; this service always sends one) leaves the learned answers unrated — counted
``learned_unrated`` by EP, never confident (found by an audit: this said "uncertain").

Threads may share one RemoteOperator: its calls take turns (they share one connection), each with
its own answer and certificates.  A batch is split at the server's ``max_batch`` and so that no
request's body exceeds its ``max_body_bytes``; a ``jit`` or ``oracle`` batch also at its
``max_oracle_batch`` — a ``jit`` batch split so is answered as the parts in turn by a JIT in process,
not as one request (which rows it consults depends on the request: found by an audit, EP on banknote
through parts of 60 ended 8.7e-6 from the local JIT's posterior, equal unsplit).
"""

from __future__ import annotations

import copy
import email.utils
import json
import math
import threading
import time
import uuid
import warnings
from typing import Any, Mapping
from urllib.parse import quote

import numpy as np

from .certificates import Certificates, above_threshold, last_certificates, outgoing_proper
from .errors import ConfigurationError, OperatorUnavailableError, rows_of_batch
from .factors import Factor, get_factor
from .factors.base import UnknownFactorError
from .families import Family, family_name
from .reductions import all_finite
from .transport import HttpxSession, ResponseTooLarge, Session, TransportError

__all__ = ["RemoteOperator", "RemoteOperatorError", "RemoteUnavailableError", "RemoteValidationError",
           "UnauthorizedError", "UnknownOperatorError"]

_MODES = ("predict", "jit", "oracle")
#: idempotency keys whose split :meth:`RemoteOperator.observe` keeps for retries (the latest)
_KEPT_SPLITS = 256


class RemoteOperatorError(RuntimeError):
    """An error answer of the server (or no answer).  ``status`` is None when nothing came back."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None, method: str = "", path: str = ""):
        self.status = status
        self.detail = detail
        self.method = method
        self.path = path
        super().__init__(message)


class RemoteValidationError(RemoteOperatorError, ValueError):
    """The server rejected the input (4xx): the message names the field.  ``rows``: the rows of the
    batch a 422 named (``["body", "incoming", v, p, i]`` or ``["body", "incoming", i]``), when every
    complaint names one — the EP engines then skip just those and ask again for the rest."""

    rows = None


class RemoteUnavailableError(RemoteOperatorError, OperatorUnavailableError):
    """No answer from the server (it cannot be reached, or did not reply in time), after the retries:
    the EP engines stop asking this operator for the rest of a sweep after a few of these running."""


class UnknownOperatorError(RemoteValidationError, ConfigurationError):
    """The server has no operator of this name (404): EP raises it at once (a ConfigurationError)."""


class UnauthorizedError(RemoteOperatorError, ConfigurationError):
    """The server refuses this client (401: no token or the wrong one; 403): no retry fixes it, so EP
    raises it at once (a ConfigurationError) — it used to be a passing failure, and EP through a server
    with a token, the client without it, ended at max_iter with the prior and a RuntimeWarning (found by
    a new-user audit)."""


def _dumps(obj) -> bytes:
    """JSON, finite numbers only (checked before), every double exact.  pydantic_core's encoder is
    ~10x faster than ``json.dumps`` on long float lists; both write the shortest round-trip repr."""
    try:
        import pydantic_core

        return pydantic_core.to_json(obj)
    except ImportError:  # pragma: no cover
        return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def _loads(data: bytes):
    try:
        import pydantic_core

        return pydantic_core.from_json(data)
    except ImportError:  # pragma: no cover
        return json.loads(data)


def _describe(detail) -> str:
    if isinstance(detail, list):
        parts = []
        for e in detail[:5]:
            if isinstance(e, dict):
                loc = ".".join(str(x) for x in e.get("loc", ()))
                parts.append(f"{loc}: {e.get('msg', '')}" if loc else str(e.get("msg", "")))
            else:
                parts.append(str(e))
        more = f" (and {len(detail) - 5} more)" if len(detail) > 5 else ""
        return "; ".join(parts) + more
    return str(detail)


def _retry_after(value: str, default: float) -> float:
    """Seconds a ``Retry-After`` header asks to wait: a number of seconds or an HTTP date (RFC 9110 allows
    both; proxies send dates — found by an audit: a date was a bare ValueError out of the retry loop),
    ``default`` where it is neither."""
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return default
    if when is None:
        return default
    now = time.time()
    return max(0.0, when.timestamp() - now) if when.tzinfo is not None else default


def _types(detail) -> set:
    return {e.get("type") for e in detail if isinstance(e, dict)} if isinstance(detail, list) else set()


def _status_types(resp) -> set:
    """The ``type`` of each complaint in an error answer's ``detail`` (empty if it is not one)."""
    try:
        body = _loads(resp.content)
    except ValueError:
        return set()
    return _types(body.get("detail")) if isinstance(body, dict) else set()


def _named_rows(detail, prefix: list, length: int, types=None) -> np.ndarray | None:
    """The rows (last element of each ``loc``) a 4xx ``detail`` names when every complaint's ``loc``
    is ``prefix`` + ``length − len(prefix)`` more elements ending in a row number (and its type is
    one of ``types``, if given); None otherwise."""
    if not isinstance(detail, list) or not detail:
        return None
    rows = []
    for e in detail:
        loc = e.get("loc") if isinstance(e, dict) else None
        if not (isinstance(loc, list) and len(loc) == length and loc[:len(prefix)] == prefix
                and isinstance(loc[-1], int) and not isinstance(loc[-1], bool)
                and (types is None or e.get("type") in types)):
            return None
        rows.append(loc[-1])
    return np.unique(np.asarray(rows, dtype=int))


def _incoming_rows(detail) -> np.ndarray | None:
    """The messages a 422 refused by row: ``["body", "incoming", variable, parameter, row]`` (the
    request's schema) or ``["body", "incoming", row]`` (the server's own checks, an oracle failure)."""
    rows = _named_rows(detail, ["body", "incoming"], 5)
    return rows if rows is not None else _named_rows(detail, ["body", "incoming"], 3)


def _refused_beliefs(exc: "RemoteOperatorError") -> np.ndarray | None:
    """The observations a 422 refused by row — too far outside what the operator has learned, or
    beyond what the server's plausibility rule can vouch for — or None when anything else was."""
    return _named_rows(getattr(exc, "detail", None), ["body", "beliefs"], 3, {"not_learnable", "implausible_belief"})


def _columns(m: Family, what: str) -> dict:
    out = {"family": family_name(m)}
    for n, p in zip(m.param_names, m.params):
        a = np.asarray(p, dtype=float).ravel()
        if not all_finite(a):
            i = int(np.argmin(np.isfinite(a)))
            raise ValueError(f"{what}.{n}[{i}] is {a[i]!r}: JSON carries finite numbers only")
        out[n] = a.tolist()
    return out


def _columns_array(cols, n) -> np.ndarray:
    """k lists of n numbers (null: not finite) → (n, k) float array with NaN for null."""
    try:
        return np.asarray(cols, dtype=float).reshape(len(cols), n).T.copy()
    except (TypeError, ValueError):
        return np.array([[np.nan if x is None else x for x in c] for c in cols], dtype=float).T.copy()


def _joined(parts, fn) -> np.ndarray:
    """``fn`` of each answer of a batch sent in parts, rows concatenated (one part — every batch up
    to the server's limit — without a concatenation)."""
    return fn(parts[0]) if len(parts) == 1 else np.concatenate([fn(p) for p in parts])


def _checked_info(info, url: str, name: str) -> dict:
    """An operator's description as this client reads it (``factor`` and ``to`` strings, a
    numeric or null ``threshold``, a positive ``limits.max_batch``), or a RemoteOperatorError
    saying what is wrong (found by an audit: ``max_batch: 0`` looped on ``range()``'s error)."""
    path = f"/v1/operators/{name}"

    def bad(why):
        return RemoteOperatorError(f"GET {url}{path}: the server's description of the operator is malformed: {why}",
                                   200, None, "GET", path)

    if not isinstance(info, dict):
        raise bad(f"a JSON {type(info).__name__}, not an object")
    for key in ("factor", "to"):
        if not isinstance(info.get(key), str):
            raise bad(f"{key} = {info.get(key)!r}")
    thr = info.get("threshold")
    if thr is not None and (type(thr) not in (int, float) or math.isnan(thr)):
        raise bad(f"threshold = {thr!r}")
    limits = info.get("limits", {})
    if not isinstance(limits, dict):
        raise bad(f"limits = {limits!r}")
    for key in ("max_batch", "max_oracle_batch", "max_body_bytes"):
        v = limits.get(key)
        if v is not None and (type(v) is not int or v < 1):
            raise bad(f"limits.{key} = {v!r}")
    return info


class RemoteOperator:
    """A message operator served by ``kjit serve`` (see the module docstring).

    Parameters
    ----------
    url : base URL of the service, e.g. ``"http://127.0.0.1:8000"``.
    name : operator name (``GET /v1/operators`` lists them).
    token : bearer token, if the server has one (needed for ``jit`` and ``oracle`` modes and ``partial_fit``).
    mode : ``"jit"`` (default), ``"predict"`` or ``"oracle"``.
    timeout : seconds for each request (connect: at most 5 s).
    retries : extra attempts after a connection error on idempotent calls.
    backoff : first wait between attempts in seconds (doubles each time).
    client : an ``httpx.Client`` to send the requests through (its base URL, transport, proxies); by
        default one keep-alive connection of :mod:`kjit.transport`.
    oracle : a local oracle (``belief(incoming, to)``, e.g. a
        :class:`~kjit.oracles.MessageImportanceSampler` of your own factor) for a served operator whose
        oracle runs on its clients (created with ``source.kind = "client"``): the just-in-time loop
        runs across the wire — the server answers ``mode=predict`` with beliefs and log variances
        and marks the rows uncertain before the request (log variance above its threshold, or an outgoing
        message whose precision's sign is undetermined: ``JITOperator.screen``; its ``mode=jit`` may consult
        fewer of them, those after whose learning the others are under the threshold);
        those rows are answered here by ``oracle``, used, and sent back as
        observations (with an ``Idempotency-Key``: a retry is counted once).  ``consultations_``
        counts the rows answered here.  After a ``predict``-mode request ``last_uncertain_`` holds
        the rows the server marked (None from a server that does not mark them).
    """

    def __init__(self, url: str, name: str, token: str | None = None, mode: str = "jit", timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.1, client=None, oracle=None):
        if oracle is not None and not callable(getattr(oracle, "belief", None)):
            raise ValueError("`oracle` must have a belief(incoming, to) method")
        self.local_oracle = oracle
        self.consultations_ = 0
        self.unlearned_ = 0  # oracle answers (client-side oracle) the server refused or left unlearned: used

        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {', '.join(_MODES)}, got {mode!r}")
        if not timeout > 0:
            raise ValueError("`timeout` must be > 0")
        if int(retries) < 0:
            raise ValueError("`retries` must be >= 0")
        self.url = url.rstrip("/")
        self.name = name
        # (quoted: a name with a space, "?" or "#" asked another operator's URL — found by an audit)
        self._base = f"/v1/operators/{quote(str(name), safe='')}"
        self.mode = mode
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        headers = {"Accept": "application/json"}
        self._has_token = bool(token)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # kjit.transport: one keep-alive connection (measured 0.44 ms a request less than httpx's
        # client); a caller's httpx.Client is used as it is (proxies, HTTP/2, TLS settings)
        self._own_client = client is None
        self._session = (Session(self.url, headers, timeout=self.timeout, connect_timeout=min(5.0, self.timeout))
                         if client is None else HttpxSession(client, headers if token else None))
        self._info = None
        self._factor = None
        self._factor_said = None  # (the factor and parameters as the server said them, once read)
        self.last_version_ = None
        self.last_consulted_ = None
        self.last_certificates_: Certificates | None = None
        self._cert: Certificates | None = None
        self.last_uncertain_ = None
        self._row_cap = None  # rows a request may carry under the server's max_body_bytes (learned)
        # a mode=jit batch that failed after its first parts were answered and learned: (those rows' columns,
        # their answers, their sizes) — a call asking for them again first gets them (_jit_answered)
        self._jit_done = None
        self._splits: dict = {}  # idempotency key → (pairs, pairs per part) of observe's first call with it
        # one call at a time: a call's certificates and marks are kept on the instance between its
        # request and its answer (found by an audit: threads sharing one client got each other's)
        self._lock = threading.RLock()

    def __repr__(self):
        return f"RemoteOperator({self.url!r}, {self.name!r}, mode={self.mode!r})"

    # ------------------------------------------------------------------ HTTP
    def close(self) -> None:
        if self._own_client:
            self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, *, json_body=None, params=None, headers=None,
                 retry: str = "connection", content: bytes | None = None) -> Any:
        """One call with retries.  ``retry``: "connection" (any transport error), "connect"
        (only when the request cannot have reached the server: no connection) or "never".
        ``content``: the JSON body already encoded (instead of ``json_body``).  A request carrying an
        ``Idempotency-Key`` is also retried, with that key, when the server cannot say whether it
        applied it (503 ``outcome_unknown``): the key makes it apply exactly once."""
        hdrs = dict(headers or {})
        if json_body is not None:
            content = _dumps(json_body)
        if content is not None:
            hdrs["Content-Type"] = "application/json"
        attempts = 1 + (self.retries if retry != "never" else 0)
        wait = self.backoff
        for attempt in range(attempts):
            try:
                resp = self._session.request(method, path, params=params, content=content, headers=hdrs)
            except TransportError as exc:
                safe = ((retry == "connection" or (retry == "connect" and not exc.sent))
                        and not isinstance(exc, ResponseTooLarge))  # (the same answer again)
                if safe and attempt + 1 < attempts:
                    time.sleep(wait)
                    wait *= 2
                    continue
                raise (RemoteOperatorError if isinstance(exc, ResponseTooLarge) else RemoteUnavailableError)(
                    f"{method} {self.url}{path}: no answer from the server ({type(exc).__name__}: {exc})"
                    + (f" after {attempt + 1} attempts" if attempt else ""), None, None, method, path) from exc
            if resp.status_code in (429, 503) and retry != "never" and attempt + 1 < attempts:
                # a server not ready (503) or whose oracle slots are busy (429 oracle_busy): nothing was
                # done, and it says when to come back
                after = resp.headers.get("Retry-After")
                if after is not None:
                    time.sleep(max(wait, min(_retry_after(after, wait), 5.0)))
                    wait *= 2
                    continue
                # an update whose outcome the server could not learn (a shared-log append's answer lost):
                # the same key again applies it once (found by an audit: never retried, and the caller's
                # own retry carried a new key — the pairs were learned twice)
                if resp.status_code == 503 and "Idempotency-Key" in hdrs and _status_types(resp) == {"outcome_unknown"}:
                    time.sleep(wait)
                    wait *= 2
                    continue
            return self._decode(resp, method, path)
        raise AssertionError("unreachable")  # pragma: no cover

    def _decode(self, resp, method, path):
        try:
            body = _loads(resp.content)
        except ValueError:
            body = None
        if resp.status_code < 400:
            if body is None:
                raise RemoteOperatorError(f"{method} {path}: the server's answer is not JSON", resp.status_code,
                                          None, method, path)
            return body
        detail = body.get("detail") if isinstance(body, dict) else resp.text[:500]
        msg = f"{method} {path} → HTTP {resp.status_code}: {_describe(detail)}"
        cls = RemoteValidationError if resp.status_code in (400, 404, 409, 413, 422) else RemoteOperatorError
        if resp.status_code in (502, 504):  # (a proxy's: the server behind it did not answer — found in review)
            cls = RemoteUnavailableError
        if resp.status_code == 404 and path.startswith(self._base) and _types(detail) == {"not_found"}:
            cls = UnknownOperatorError
        if resp.status_code in (401, 403):
            cls = UnauthorizedError
            msg += (" — give RemoteOperator the server's token (token=..., the server's KJIT_TOKEN), or use "
                    "mode='predict', which needs none" if not getattr(self, "_has_token", False) else
                    " — the token given is not the server's (KJIT_TOKEN)")
        exc = cls(msg, resp.status_code, detail, method, path)
        if cls is RemoteValidationError and resp.status_code == 422:
            exc.rows = _incoming_rows(detail)
        raise exc

    # ------------------------------------------------------------------ description
    def info(self, refresh: bool = False) -> dict:
        """``GET /v1/operators/{name}``: factor, direction, families, sizes, counters, version."""
        if self._info is None or refresh:
            self._info = _checked_info(self._request("GET", self._base), self.url, self.name)
        return self._info

    def counters(self) -> dict:
        """The server-side just-in-time counters (fresh each call)."""
        return self.info(refresh=True)["counters"]

    @property
    def version(self) -> int:
        return int(self.info(refresh=True)["version"])

    @property
    def factor(self) -> Factor:
        if self._factor is None:
            i = self.info()
            try:
                self._factor = get_factor(i["factor"], **i.get("factor_params", {}))
                # (as the server said it: answers are compared with this, not with this process's rebuilt
                # factor, whose params() may carry a parameter the server's version lacks)
                self._factor_said = (i["factor"], i.get("factor_params", {}))
            except UnknownFactorError as exc:
                # (found by an audit: a client process that had not imported the user's factor module got
                # only "unknown factor 'audit_exp'; registered: …", with no hint of what to do)
                raise UnknownFactorError(exc.name, (
                    f"operator {self.name!r} at {self.url} is for factor {exc.name!r}, which is not registered in "
                    f"this client process: RemoteOperator checks and flattens the incoming messages with the "
                    f"factor's variables and families, so import the module that registers it here too (the "
                    f"same module the server loads with KJIT_FACTORS / --factors, or an installed package with "
                    f"a `kjit.factors` entry point) before calling belief/message. {exc}")) from None
            if self.local_oracle is not None:
                mine = self.local_oracle.factor
                theirs = {v: family_name(f) for v, f in self._factor.families.items()}
                if {v: family_name(f) for v, f in mine.families.items()} != theirs:
                    raise ValueError(f"the oracle's factor {mine.name!r} has variables and families "
                                     f"{ {v: family_name(f) for v, f in mine.families.items()} }, operator "
                                     f"{self.name!r} {theirs}")
        return self._factor

    @property
    def to(self) -> str:
        return self.info()["to"]

    @property
    def family(self) -> type[Family]:
        return self.factor.families[self.to]

    @property
    def threshold(self) -> float | None:
        """The served operator's uncertainty threshold (log predictive variance): the EP engine
        counts, and by its ``on_uncertain`` policy handles, answers above it."""
        thr = self.info().get("threshold")
        return None if thr is None else float(thr)

    @property
    def oracle(self) -> "RemoteOperator":
        """The same served operator in ``oracle`` mode (sharing this client's connection): what the
        EP engine asks for uncertain answers with ``on_uncertain="oracle"`` — or the local oracle
        when one was given."""
        if self.local_oracle is not None:
            return self.local_oracle
        if self.mode == "oracle":
            return self
        view = copy.copy(self)
        view.mode = "oracle"
        view._own_client = False
        return view

    @property
    def max_batch(self) -> int:
        return int(self.info().get("limits", {}).get("max_batch", 10_000))

    def health(self) -> dict:
        return self._request("GET", "/health")

    def ready(self) -> bool:
        try:
            self._request("GET", "/ready", retry="never")
            return True
        except RemoteOperatorError as exc:
            if exc.status == 503:
                return False
            raise

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server answers ``/ready`` with 200 (or raise after ``timeout`` s)."""
        t_end = time.monotonic() + timeout
        last = None
        while time.monotonic() < t_end:
            try:
                if self.ready():
                    return
            except RemoteOperatorError as exc:
                last = exc
            time.sleep(0.05)
        raise RemoteOperatorError(f"{self.url} not ready after {timeout:g}s" + (f" ({last})" if last else ""))

    # ------------------------------------------------------------------ operator interface
    def _check_to(self, to):
        if to is not None and to != self.to:
            raise ConfigurationError(f"operator {self.name!r} sends messages to {self.to!r}, not `to`={to!r}")

    def _flat(self, incoming: Mapping[str, Family]):
        return self.factor.flat_incoming(incoming, self.to)

    def _step(self) -> int:
        """Rows a request may carry: the server's ``max_batch``, and what its ``max_body_bytes`` allows."""
        step = self.max_batch
        return step if self._row_cap is None else max(1, min(step, self._row_cap))

    def _bodies(self, n: int, step: int, body):
        """``(first row, rows, encoded JSON)`` of the requests carrying ``n`` rows: at most ``step`` rows
        each, and no body above the server's ``max_body_bytes`` (found by an audit: only ``max_batch``
        split a batch, so a batch under it but over the body limit was a 413 every call and EP
        stopped).  ``body(first, rows)``: the request's JSON object for those rows.  A body too large
        is split by the bytes a row took in it (and the size kept for the next calls)."""
        limit = self.info().get("limits", {}).get("max_body_bytes")
        s = 0
        while s < n:
            m = min(step, n - s)
            content = _dumps(body(s, m))
            if limit is not None and len(content) > limit and m > 1:
                step = max(1, min(m - 1, int(m * limit / len(content) * 0.95)))
                self._row_cap = step
                continue
            yield s, m, content
            s += m

    def _call(self, incoming, mode, natural: bool = True, logvar: bool = True, _refreshed: bool = False,
              draw: int | None = None):
        """The server's answer to ``incoming`` in ``mode``: ``(beliefs, natural, logvar, consulted,
        shape, flat)``; ``natural`` / ``logvar`` False: those columns are not decoded (None); ``draw``: the
        seed of a draw of the served operator (``POST …/draws/{seed}/messages``, :meth:`draws`; ``mode`` "predict")."""
        flat, shape = self._flat(incoming)
        n = math.prod(shape) if shape else 1
        step = self._step()
        if mode in ("oracle", "jit"):  # the server caps the oracle work of a request separately
            step = min(step, int(self.info().get("limits", {}).get("max_oracle_batch", step)))
        parts, sizes = [], []
        retry = "connection" if mode in ("predict", "oracle") else "connect"
        to = self.to
        done, self._jit_done = self._jit_done, None
        if mode == "jit" and draw is None and done is not None:
            parts, sizes = self._jit_answered(done, flat, n)
        s0, n_reused = sum(sizes), len(parts)  # rows answered before: a failed call's parts this call asks for again

        def body(s, m):
            s += s0
            rows = flat if m == n else {v: b[s:s + m] for v, b in flat.items()}  # (one part: no copies)
            return {"to": to, "incoming": {v: _columns(b, f"incoming[{v!r}]") for v, b in rows.items()}}

        for s, m, content in self._bodies(n - s0, step, body):
            try:
                if draw is None:
                    parts.append(self._request("POST", f"{self._base}/messages", content=content,
                                               params={"mode": mode}, retry=retry))
                else:  # (read-only, as mode=predict; never audited)
                    parts.append(self._request("POST", f"{self._base}/draws/{draw}/messages", content=content,
                                               retry=retry))
                    if parts[-1].get("draw") != draw:
                        raise self._malformed(f"{self._base}/draws/{draw}/messages",
                                              f"it answered draw {parts[-1].get('draw')!r}, not {draw!r}")
                sizes.append(m)
            except RemoteValidationError as exc:
                nothing_done = len(parts) == n_reused
                if nothing_done and not _refreshed and (_types(exc.detail) == {"too_long"} or exc.status == 413):
                    # the server's limits changed (a restart with a smaller KJIT_MAX_BATCH or body limit): learn
                    # them and split again — nothing was done yet (found in review: every later call failed)
                    self.info(refresh=True)
                    self._row_cap = None
                    self._jit_done = done if n_reused else None
                    return self._call(incoming, mode, natural, logvar, _refreshed=True, draw=draw)
                if exc.rows is not None:
                    exc.rows = exc.rows + s + s0  # the part's rows as the batch's
                if mode == "jit" and draw is None and parts:
                    exc.applied_rows = s + s0  # (as observe's: the first rows were learned before the error)
                    # the parts before were consulted and learned: a call asking for those rows again (EP
                    # drops the rows named and asks for the rest) gets these answers, not a second learning
                    # (found by an audit: 100 pairs learned twice over 5 sweeps of a 40-row batch in parts of 20)
                    self._jit_done = ({v: b[:s + s0] for v, b in flat.items()}, parts, sizes)
                raise
        fam = self.family
        path = f"{self._base}/messages"
        for p, m in zip(parts, sizes):
            self._check_answer(p, m, path)
            self._check_factor(p)

        def joined(fn):
            return _joined(parts, fn)

        try:
            beliefs = fam.concatenate([fam(*(p["beliefs"][k] for k in fam.param_names)) for p in parts])
        except ValueError as exc:  # (a family's own check: NaN, a negative variance, ...)
            raise self._malformed(path, f"its beliefs are not {fam.__name__} messages ({exc})") from None
        consulted = joined(lambda p: np.asarray(p["consulted"], dtype=bool))
        # mode=predict: the rows uncertain to the served operator's just-in-time rule (None from
        # a server that does not say)
        uncertain = (joined(lambda p: np.asarray(p["uncertain"], dtype=bool))
                     if all(p.get("uncertain") is not None for p in parts) else None)
        versions = {p["version"] for p in parts} if draw is not None else ()
        if len(versions) > 1:  # (a split batch: every part of a draw from one operator)
            raise RemoteOperatorError(f"operator {self.name!r} changed (versions {sorted(versions)}) during one request "
                                      f"of its draw {draw}: a draw is of one version of the operator")
        self.last_version_ = parts[-1]["version"]
        self.last_consulted_ = int(np.count_nonzero(consulted))
        self._cert = self._certificates(parts, beliefs, flat, consulted)
        thr = self._cert.threshold
        if thr is not None and self._info is not None and self._info.get("threshold") != thr:
            # the served threshold moved (the audit lowers it): what `threshold` reports from now on
            # (found in review: EP kept the first one and used uncertain answers uncounted)
            self._info = {**self._info, "threshold": thr}
        self.last_uncertain_ = uncertain
        return (beliefs, joined(lambda p: p["_natural"]) if natural else None,
                self._logvar(parts) if logvar else None, consulted, shape, flat)

    @staticmethod
    def _jit_answered(done, flat, n):
        """The parts and sizes of ``done`` (a failed mode=jit call's answered parts) where this call's first rows are
        exactly their rows (the same variables, families and numbers; one recipient per client), else none."""
        cols, parts, sizes = done
        k = sum(sizes)
        if k > n or set(cols) != set(flat) or any(type(cols[v]) is not type(flat[v]) for v in flat):
            return [], []
        for v, b in flat.items():
            for p, q in zip(cols[v].params, b.params):
                if not np.array_equal(np.asarray(p).ravel(), np.asarray(q).ravel()[:k]):
                    return [], []
        return list(parts), list(sizes)

    def _check_factor(self, p) -> None:
        """The factor an answer says it is for (a server since the thirty-ninth session says) is the one this
        client read when it started — else a :class:`~kjit.errors.ConfigurationError` (EP stops at once), and
        the next call reads the operator afresh.  Found by an audit: a server restarted with probit_noise eps
        0.3 under the same operator name answered a client (and a model) checked against eps 0.05; EP
        "converged" at the other model's posterior."""
        name = p.get("factor")
        said = self._factor_said
        if name is None or self._factor is None or said is None:
            return
        params = p.get("factor_params") or {}
        if (name, params) != said:
            why = (self._factor.mismatch((name, params), "the server's answer", "this client's operator")
                   or f"the answer is for {name!r} with {params}, the client read {said[0]!r} with {said[1]}")
            self._info = self._factor = self._factor_said = None
            raise ConfigurationError(
                f"operator {self.name!r} at {self.url} changed since this client first read it: {why}. The model "
                "using it was checked against the old one; build it (and this client) again")

    def _malformed(self, path: str, why: str) -> RemoteOperatorError:
        return RemoteOperatorError(f"POST {self.url}{path}: the server's answer is malformed: {why}", 200, None,
                                   "POST", path)

    def _check_answer(self, p, rows: int, path: str) -> None:
        """A messages answer holds what this client reads, for ``rows`` messages: beliefs of the
        recipient's family, ``consulted`` (and ``uncertain``) booleans, the messages' finite natural
        parameters, ``log_var`` (k columns of numbers or null; or null), certificates, ``version``
        — else a :class:`RemoteOperatorError` saying what is wrong (found by audits: raw KeyError,
        TypeError or broadcast errors, a message of NaN returned as an answer, a null ``uncertain``
        read as confident).  The decoded columns are kept in ``p`` (``_natural``, ``_log_var``,
        ``_cert``): read once."""
        fam = self.family
        k = len(fam.coord_names)

        def bad(why):
            return self._malformed(path, why)

        def column(c, what):
            if not isinstance(c, list) or len(c) != rows:
                raise bad(f"{what} holds {len(c) if isinstance(c, list) else type(c).__name__} values for "
                          f"{rows} messages")
            return c

        def flags(c, what):
            if np.asarray(column(c, what)).dtype != bool:
                raise bad(f"{what} holds values that are not true or false")

        def columns(cs, what, width):
            if not isinstance(cs, list) or len(cs) != width:
                raise bad(f"{what} is not a list of {width} columns")
            for j, c in enumerate(cs):
                column(c, f"{what}[{j}]")
            try:
                return _columns_array(cs, rows)  # (n, width); null → NaN
            except (TypeError, ValueError):
                raise bad(f"{what} holds values that are not numbers") from None

        if not isinstance(p, dict):
            raise bad(f"a JSON {type(p).__name__}, not an object")
        if type(p.get("n")) is not int or p["n"] != rows:  # (3.0 == 3, then np.full((3.0, k)) — found by an audit)
            raise bad(f"n = {p.get('n')!r} for a request of {rows} messages")
        b = p.get("beliefs")
        if not isinstance(b, dict) or b.get("family") != family_name(fam):
            raise bad(f"its beliefs are {b.get('family') if isinstance(b, dict) else b!r}, not "
                      f"{family_name(fam)} messages")
        for name in fam.param_names:
            column(b.get(name), f"beliefs.{name}")
        flags(p.get("consulted"), "consulted")
        if p.get("uncertain") is not None:
            flags(p["uncertain"], "uncertain")
        msgs = p.get("messages")
        nat = columns(msgs.get("natural") if isinstance(msgs, dict) else None, "messages.natural", fam.n_stats)
        if not all_finite(nat):
            raise bad("messages.natural holds a value that is not a finite number")
        p["_natural"] = nat
        p["_log_var"] = None if p.get("log_var") is None else columns(p["log_var"], "log_var", k)
        if type(p.get("version")) is not int:
            raise bad(f"version = {p.get('version')!r}")
        p["_cert"] = None
        if p.get("certificates"):
            try:
                cert = Certificates.from_json(p["certificates"])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                raise bad(f"its certificates are not readable ({type(exc).__name__}: {exc})") from None
            if len(cert) != rows or cert.log_var.shape[-1] != k:
                raise bad(f"its certificates are for {len(cert)} rows of {cert.log_var.shape[-1]} coordinates")
            p["_cert"] = cert

    def _logvar(self, parts) -> np.ndarray:
        """The answers' log predictive variances (n, k); NaN where the server gives none (mode=oracle)."""
        k = len(self.family.coord_names)
        return _joined(parts, lambda p: np.full((p["n"], k), np.nan) if p["_log_var"] is None else p["_log_var"])

    def _certificates(self, parts, beliefs, flat, consulted) -> Certificates:
        """The server's certificates of the batch (a server without them: learned where not consulted)."""
        if all(p["_cert"] is not None for p in parts):
            return Certificates.concatenate([p["_cert"] for p in parts])
        return Certificates(np.where(consulted, "oracle", "learned"), self.family.coord_names, log_var=self._logvar(parts),
                            threshold=self.threshold, proper=outgoing_proper(beliefs, flat[self.to]),
                            version=self.last_version_)

    def _keep(self, answer):
        """Remember the certificates of ``answer`` (the object returned to the caller)."""
        self._cert.of = answer
        self.last_certificates_ = self._cert
        return answer

    @property
    def last_certificates(self) -> Certificates | None:
        """The certificates of the last answer (:mod:`kjit.certificates`): per row the source
        (rule, oracle, learned), log predictive variance and threshold, ESS and Monte Carlo
        standard error of oracle answers, projection convention, propriety, version."""
        return self.last_certificates_

    def certified(self, incoming: Mapping[str, Family], to: str | None = None):
        """``(belief, Certificates)``: :meth:`belief` with the server's certificates."""
        with self._lock:
            q = self.belief(incoming, to)
            return q, self.last_certificates_

    def _answer(self, incoming, natural: bool = True, logvar: bool = True):
        """``_call`` in this operator's mode, or with a local oracle the just-in-time loop across
        the wire (see the class docstring); ``natural`` / ``logvar`` as ``_call``'s."""
        if self.local_oracle is None:
            return self._call(incoming, self.mode, natural, logvar)
        q, natural, logvar, consulted, shape, flat = self._call(incoming, "predict")
        uncertain = self.last_uncertain_
        if uncertain is None:  # a server that does not mark the rows: its threshold alone
            thr = self.threshold
            uncertain = above_threshold(logvar, thr) if thr is not None else np.zeros(len(q), dtype=bool)
        if uncertain.any():
            rows = np.flatnonzero(uncertain)
            sub = {v: m[rows] for v, m in flat.items()}
            try:
                q_or = self.local_oracle.belief(sub, self.to)
            except Exception as exc:
                raise rows_of_batch(exc, rows)  # the sub-batch's rows named as the batch's
            fam = self.family
            if not isinstance(q_or, fam) or q_or.shape != (rows.size,):
                raise ValueError(f"the oracle must answer {rows.size} {fam.__name__} beliefs, got "
                                 f"{type(q_or).__name__} of shape {getattr(q_or, 'shape', None)}")
            bad = ~q_or.proper_and_finite()
            if bad.any():
                raise ValueError(f"the oracle's beliefs are improper or not finite in row(s) "
                                 f"{rows[bad].tolist()} of the batch: nothing was sent")
            params = [np.array(p, dtype=float) for p in q.params]
            for p, new in zip(params, q_or.params):
                p[rows] = new
            q = fam(*params)
            natural = (q / flat[self.to]).natural().reshape(len(q), -1)
            self._observe_learnable(sub, q_or)  # durable on the server when this returns; retried once-only
            consulted = uncertain
            self.consultations_ += int(rows.size)
            # the rows answered here carry the local oracle's certificates
            cert_or = last_certificates(self.local_oracle, q_or)
            if cert_or is None:  # an oracle of the user's that gives no certificates
                cert_or = Certificates.uniform(getattr(self.local_oracle, "certificate_source", "oracle"), q_or, None)
            self._cert = self._cert.replace(rows, cert_or)
            self._cert.proper[rows] = outgoing_proper(q_or, flat[self.to][rows])
        self.last_consulted_ = int(uncertain.sum())
        return q, natural, logvar, consulted, shape, flat

    def predict(self, incoming: Mapping[str, Family], to: str | None = None):
        """``(belief, log predictive variance (…, k), consulted mask)`` like ``JITOperator.predict``
        (log variance is NaN where the server was asked in ``oracle`` mode)."""
        self._check_to(to)
        with self._lock:
            q, _, logvar, consulted, shape, _ = self._answer(incoming, natural=False)
            return self._keep(q.reshape(shape)), logvar.reshape(shape + (logvar.shape[-1],)), consulted.reshape(shape)

    def belief(self, incoming: Mapping[str, Family], to: str | None = None) -> Family:
        self._check_to(to)
        with self._lock:
            q, _, _, _, shape, _ = self._answer(incoming, natural=False, logvar=False)
            return self._keep(q.reshape(shape))

    def draws(self, n: int, random_state=None, mean: bool = False) -> list:
        """``n`` draws of the served operator from its regression's posterior, answered by the server
        (``POST /v1/operators/{name}/draws/{seed}/messages``; the seeds of :func:`~kjit.draws.draw_seeds`, as
        :meth:`KernelOperator.draws`'s, so the same draws as the operator's in process); ``mean``: the operator's
        own answers first (``…/draws/mean/messages``: as ``mode=predict``'s, never audited).  Every answer of the
        draws of one call must come from one version of the served operator: draws of an operator that learned
        meanwhile are of another operator (a :class:`RemoteOperatorError`, which stops EP's error bars).  What
        :mod:`kjit.ep.error_bars` re-runs EP with; the weights stay on the server."""
        from .draws import draw_seeds

        seeds = draw_seeds(n, random_state)
        if self.mode == "oracle":
            raise ValueError("this RemoteOperator answers with the server's oracle (mode='oracle'): there is no learned "
                             "answer to draw")
        pin: dict = {}  # (one version for all the draws of this call: they are compared with each other)
        return ([RemoteDraw(self, "mean", pin)] if mean else []) + [RemoteDraw(self, s, pin) for s in seeds]

    def message(self, incoming: Mapping[str, Family], to: str | None = None) -> Family:
        """Outgoing messages q / incoming[to], rebuilt from the server's natural parameters (exact;
        may be improper: check ``is_proper``)."""
        self._check_to(to)
        with self._lock:
            _, natural, _, _, shape, _ = self._answer(incoming, logvar=False)
            return self._keep(self.family.from_natural(natural).reshape(shape))

    def uncertainty(self, incoming: Mapping[str, Family], to: str | None = None) -> np.ndarray:
        """Log predictive variance per output coordinate (``predict`` mode: never consults) — the served
        operator's just-in-time rule's, each coordinate weighted by how many times the prediction's KL
        curvature in it exceeds the learned one (:meth:`~kjit.operators.KernelOperator.decision_log_weights`)."""
        self._check_to(to)
        with self._lock:
            _, _, logvar, _, shape, _ = self._call(incoming, "predict", natural=False)
            return logvar.reshape(shape + (logvar.shape[-1],))

    def partial_fit(self, incoming: Mapping[str, Family], beliefs: Family,
                    idempotency_key: str | None = None) -> "RemoteOperator":
        """Send (incoming, belief) pairs computed elsewhere; durable on the server when this returns
        (``idempotency_key``: see :meth:`observe`).  Pairs the server acknowledges without learning them
        (``not_learned``: outside the data its operator learned — below its density guard or beyond its
        input margin, which an operator in process has no guard for) are counted in ``unlearned_`` and
        named in a RuntimeWarning (found by an audit: dropped silently; :meth:`observe` returns the count)."""
        k = int(self.observe(incoming, beliefs, idempotency_key).get("not_learned", 0))
        if k:
            self.unlearned_ += k
            warnings.warn(f"operator {self.name!r}: {k} of {len(beliefs)} pair(s) acknowledged but not learned (outside "
                          "the data the served operator learned: below its density guard or beyond its input margin)",
                          RuntimeWarning, stacklevel=2)
        return self

    def observe(self, incoming: Mapping[str, Family], beliefs: Family, idempotency_key: str | None = None) -> dict:
        """Like :meth:`partial_fit`, returning the server's answer (``accepted``, ``version``...).

        ``idempotency_key``: this call's key (default a fresh one); a batch sent in several requests
        sends ``key-i`` with its i-th part, so calling again with the same key and the same pairs
        after a failure sends every part again and the server applies each exactly once (it answers a
        key it applied before checking the request again).  This client sends a key's pairs again in
        the parts of its first call (refused, a ValueError, where a part's body now exceeds the
        server's body limit, which is checked before the key); another client splits them by the
        server's limits, the same parts only if those are unchanged.  An error carries
        ``idempotency_key`` and ``applied_rows`` (the first ``applied_rows`` pairs were learned before
        it — found by an audit: a later part's failure hid the earlier parts' success and named its
        rows as the part's).  A new key's first part refused as too long or too large (the server's
        limits shrank: nothing was learned) makes the client read the limits again and split anew.  The server
        remembers an operator's 10 000 most recent keys (``service.store.MAX_IDEMPOTENCY_KEYS``): a retry after
        that many later keyed updates of the operator is applied again — retry within that window (a busy operator
        took 10 000 keyed updates in 39 s on a 2-core host)."""
        key = uuid.uuid4().hex if idempotency_key is None else idempotency_key
        if not (isinstance(key, str) and 0 < len(key) <= 180 and key.isascii() and key.isprintable()):
            raise ValueError(f"`idempotency_key` must be 1 to 180 printable ASCII characters, got {key!r}")
        with self._lock:
            flat, shape = self._flat(incoming)
            if not isinstance(beliefs, self.family):
                raise ValueError(f"`beliefs` must be {self.family.__name__} messages, got {type(beliefs).__name__}")
            if beliefs.shape != shape:
                raise ValueError(f"`beliefs` has shape {beliefs.shape}, the incoming messages {shape}")
            b = beliefs.ravel()
            n = len(b)

            def body(s, m):
                return {"incoming": {v: _columns(x[s:s + m], f"incoming[{v!r}]") for v, x in flat.items()},
                        "beliefs": _columns(b[s:s + m], "beliefs")}

            retried = key in self._splits  # (this client sent this key before)
            for attempt in range(2):
                bodies = self._observation_parts(key, n, body)
                try:
                    return self._send_observations(key, bodies)
                except RemoteValidationError as exc:
                    if (attempt or exc.applied_rows or retried
                            or (exc.status != 413 and _types(exc.detail) != {"too_long"})):
                        raise
                    # a new key's first part refused by the server's shrunken limits (a restart): nothing was
                    # learned — read them again and split anew (found in review: every later call failed, as
                    # _call's did).  A key sent before is not split anew (new part keys would be learned
                    # again — found in review): the server answered its applied parts from their keys
                    self._splits.pop(key, None)
                    self.info(refresh=True)
                    self._row_cap = None
            raise AssertionError("unreachable")  # pragma: no cover

    def _observation_parts(self, key: str, n: int, body) -> list:
        """The requests of :meth:`observe` for ``n`` pairs under ``key``: the parts of this key's first
        call where there was one (the part keys ``key-i`` name those parts: another split would be
        other keys, learned again — found in review), else a new split, kept for retries.  The server
        answers a part it applied from its key before its batch limit; but a body above its
        ``max_body_bytes`` is refused before the key is read, so such a part cannot be sent again."""
        first = self._splits.get(key)
        if first is None or first[0] != n:
            bodies = list(self._bodies(n, self._step(), body))
            self._splits[key] = (n, bodies[0][1])
            while len(self._splits) > _KEPT_SPLITS:
                self._splits.pop(next(iter(self._splits)))
            return bodies
        m = first[1]
        bodies = [(s, min(m, n - s), _dumps(body(s, min(m, n - s)))) for s in range(0, n, m)]
        limit = self.info().get("limits", {}).get("max_body_bytes")
        if limit is not None and max(len(c) for _, _, c in bodies) > limit:
            raise ValueError(f"operator {self.name!r}: the server's body limit shrank since the first call with "
                             f"idempotency_key={key!r}; its parts of {m} pairs cannot be sent again as they were "
                             f"(other parts would be learned again): read the operator's version and n_train to see "
                             f"what it learned, then send the rest with a new key")
        return bodies

    def _send_observations(self, key: str, bodies: list) -> dict:
        """:meth:`observe`'s requests, in order; an error names the batch's rows (see there).  The answer
        is the last request's, with ``accepted`` and ``not_learned`` summed over the requests."""
        out, accepted, not_learned = None, 0, 0
        for i, (s, m, content) in enumerate(bodies):
            part_key = key if len(bodies) == 1 else f"{key}-{i}"
            try:
                out = self._request("POST", f"{self._base}/observations", content=content,
                                    headers={"Idempotency-Key": part_key}, retry="connection")
            except RemoteOperatorError as exc:
                # (with the parts sent before it: their pairs acknowledged but not learned — found in review)
                exc.idempotency_key, exc.applied_rows, exc.not_learned = key, s, not_learned
                if isinstance(exc, RemoteValidationError):
                    refused = _refused_beliefs(exc)
                    exc.refused_rows = None if refused is None else refused + s
                    if exc.rows is not None:
                        exc.rows = exc.rows + s
                if s:
                    exc.args = (f"{exc.args[0]} (pairs 0–{s - 1} of this call were learned; call again with "
                                f"idempotency_key={key!r} and the same pairs to send the rest exactly once)",)
                raise
            self.last_version_ = out["version"]
            accepted += int(out.get("accepted", 0))
            not_learned += int(out.get("not_learned", 0))  # (a server before the density guard: none)
        return {**out, "accepted": accepted, "not_learned": not_learned}

    def _observe_learnable(self, incoming: Mapping[str, Family], beliefs: Family) -> None:
        """:meth:`observe` for the just-in-time loop with a local oracle, one server batch at a time:
        rows the server refuses by row — too far outside what the operator has learned
        (``not_learnable``), or beyond what its plausibility rule can vouch for (``implausible_belief``:
        a server without the factor's code cannot check a far row) — are left out and the rest sent
        again; the local oracle's answers are used either way (found in review: one such row discarded
        the whole batch's exact answers, every call, and EP never got past its first iterate).  The
        rows left unlearned are counted in ``unlearned_`` and a warning names the reason; so are the
        rows the server acknowledged without learning them (``not_learned``: outside the data its operator
        learned — below its density guard or beyond its input margin; no warning: the server's mode=jit
        leaves them unlearned the same way)."""
        n, step = len(beliefs), self.max_batch
        for s in range(0, n, step):
            inc, bel = {v: m[s:s + step] for v, m in incoming.items()}, beliefs[s:s + step]
            try:
                self.unlearned_ += self.observe(inc, bel)["not_learned"]
            except RemoteValidationError as exc:
                refused = getattr(exc, "refused_rows", None)
                self.unlearned_ += int(getattr(exc, "not_learned", 0))  # (of the parts sent before it)
                if refused is None:
                    raise
                self.unlearned_ += int(refused.size)
                warnings.warn(f"operator {self.name!r}: {refused.size} oracle answer(s) used but not learned (the "
                              f"server refused them: {_describe(exc.detail)})", RuntimeWarning, stacklevel=3)
                # (the pairs before the refused request were learned; the refused request learned nothing)
                keep = np.setdiff1d(np.arange(exc.applied_rows, len(bel)), refused)
                if keep.size:
                    self.unlearned_ += self.observe({v: m[keep] for v, m in inc.items()}, bel[keep])["not_learned"]


class RemoteDraw:
    """One draw of a served operator (:meth:`RemoteOperator.draws`): ``belief(incoming, to)`` answered by the
    server's ``POST …/draws/{seed}/messages`` (``seed`` "mean": ``…/draws/mean/messages``, the operator's own
    answers), every answer of every draw sharing ``pin`` from one version of the operator (else a
    :class:`RemoteOperatorError`: draws of two versions are not draws of one operator)."""

    certificate_source = "learned"

    def __init__(self, remote: RemoteOperator, seed: int | str, pin: dict | None = None):
        self.remote, self.seed = remote, seed
        self.factor, self.to = remote.factor, remote.to
        self.pin = {} if pin is None else pin

    @property
    def version(self) -> int | None:
        return self.pin.get("version")

    def belief(self, incoming: Mapping[str, Family], to: str | None = None) -> Family:
        r = self.remote
        r._check_to(to)
        with r._lock:
            q, _, _, _, shape, _ = r._call(incoming, "predict", natural=False, logvar=False, draw=self.seed)
            version = r.last_version_
        first = self.pin.setdefault("version", version)
        if version != first:
            raise RemoteOperatorError(
                f"operator {r.name!r} changed (version {first} → {version}) while its draws were in use (draw "
                f"{self.seed}): draws are of one version of the operator")
        return q.reshape(shape)

    def __repr__(self):
        return f"RemoteDraw({self.remote.name!r}, seed={self.seed})"
