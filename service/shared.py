"""Shared update logs: several service replicas serving the same operators.

A replica is a ``kjit serve`` process with its own store directory (``KJIT_STORE``: its
snapshots, a cache) and a shared store (``KJIT_SHARED_STORE``) that all replicas of a
deployment name.  Per operator the shared store holds

* the **base**: the operator's state when it was first published (written once: the first
  replica to publish wins, every other replica adopts that exact blob), and
* the **log**: one totally ordered sequence of update records (observations, and pairs the
  oracle answered in ``jit`` requests), each a CRC-checked JSON record.

The state of a replica's operator is always the base plus the first ``version`` records of
the log, applied in log order (``KernelOperator.partial_fit`` per record) — a prefix, never
a subset.  Updates are therefore never counted twice or lost, and two replicas at the same
version predict bit for bit identically (floating-point updates do not commute, so the order
is part of the state; a sum of sufficient statistics merged in another order would differ in
the last bits).

A replica appends with a compare-and-set: "append this record as number ``version + 1``" —
which fails if another replica appended first; the replica then applies the records it
missed (they may include the same ``Idempotency-Key``, which makes the request a duplicate)
and tries again.  The record is durable in the shared store before the replica applies it
and before the response is sent.  Other replicas apply it when they next *merge*: every
``KJIT_MERGE_INTERVAL`` seconds in the background, before any update they take, and on
``POST /v1/operators/{name}/merge``.  Consistency a client gets:

* read-your-writes and monotonic versions on the replica that took the write;
* on any replica, a response's ``version`` says exactly which updates it reflects (the first
  ``version`` records of the log); other replicas' updates appear within one merge interval;
* ``Idempotency-Key`` retries are applied once across all replicas.

Two implementations, chosen by the URL in ``KJIT_SHARED_STORE``:

* a directory (``/path`` or ``file:///path``; the default kind): ``<dir>/<name>/base.npz``
  (put-if-absent by ``link(2)``), ``<dir>/<name>/log.jsonl`` appended under an exclusive
  ``flock`` on ``<dir>/<name>/.lock`` with ``fsync`` — for replicas on one machine or on a
  file system with working POSIX locks;
* Redis (``redis://host:port/db``): the log is a list appended by a Lua script that checks
  its length (atomic in Redis), the base a key set with ``NX``.  The acknowledgement is as
  durable as the Redis server is configured to be: run it with ``appendonly yes`` and
  ``appendfsync always`` (a warning is logged otherwise).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from .files import append_durably, fsync_dir, record_ok
from .names import check_name

log = logging.getLogger("kjit.service.shared")

__all__ = ["SharedLog", "DirectorySharedLog", "RedisSharedLog", "open_shared", "SharedLogError", "SharedLogCorrupt"]


class SharedLogError(RuntimeError):
    """The shared store could not be read or written (the outcome of an append is unknown)."""


class SharedLogCorrupt(ValueError):
    """The shared log is damaged where acknowledged records follow: it cannot be served."""


class SharedLog(Protocol):
    url: str

    def names(self) -> list[str]: ...

    def get_base(self, name: str) -> bytes | None: ...

    def publish_base(self, name: str, blob: bytes) -> bytes:
        """Store ``blob`` as the base of ``name`` unless one exists; return the stored base."""

    def append(self, name: str, expected: int, record: bytes) -> bool:
        """Append ``record`` as number ``expected + 1`` if the log holds exactly ``expected``."""

    def length(self, name: str) -> int: ...

    def read(self, name: str, after: int) -> list[bytes]:
        """The complete records after the first ``after``, in log order."""

    def close(self) -> None: ...


def open_shared(url: str) -> SharedLog:
    """A shared log from a URL: ``redis://…`` or a directory (``/path``, ``file:///path``)."""
    parsed = urlparse(url)
    if parsed.scheme in ("redis", "rediss", "unix"):
        return RedisSharedLog(url)
    if parsed.scheme == "file":
        return DirectorySharedLog(Path(parsed.path))
    if parsed.scheme in ("", "dir"):
        return DirectorySharedLog(Path(parsed.path if parsed.scheme else url))
    raise ValueError(f"shared store {url!r}: unknown scheme {parsed.scheme!r} (use a directory or redis://)")


_check_name = check_name


# ------------------------------------------------------------------------------ directory
class DirectorySharedLog:
    def __init__(self, root: Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)
        # per operator: byte offsets of the starts of the complete records read so far
        self._offsets: dict[str, list[int]] = {}
        self._end: dict[str, int] = {}
        self._mutex = threading.Lock()

    def _dir(self, name: str) -> Path:
        d = self.root / _check_name(name)
        if not d.is_dir():
            d.mkdir(exist_ok=True)
            fsync_dir(self.root)  # the new name must survive a power cut with what is written in it
        return d

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and (p / "base.npz").exists())

    def get_base(self, name: str) -> bytes | None:
        p = self.root / _check_name(name) / "base.npz"
        try:
            return p.read_bytes()
        except FileNotFoundError:
            return None

    def publish_base(self, name: str, blob: bytes) -> bytes:
        d = self._dir(name)
        fd, tmp = tempfile.mkstemp(prefix=".base-", dir=d)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
                fh.flush()
                os.fchmod(fh.fileno(), 0o644)  # replicas may run as other users
                os.fsync(fh.fileno())
            try:
                os.link(tmp, d / "base.npz")  # atomic put-if-absent
                fsync_dir(d)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
        return (d / "base.npz").read_bytes()

    def _scan(self, name: str, fh) -> list[int]:
        """Index the complete records of the open log (from where the last scan stopped)."""
        offsets = self._offsets.setdefault(name, [])
        end = self._end.get(name, 0)
        size = os.fstat(fh.fileno()).st_size
        if size < end:  # the file was cut (a torn tail removed) before this reader saw it complete
            offsets.clear()
            end = 0
        fh.seek(end)
        data = fh.read(size - end)
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            if not record_ok(data[pos:nl]):
                if data.find(b"\n", nl + 1) >= 0:
                    raise SharedLogCorrupt(f"shared log of {name!r}: damaged record at byte {end + pos} followed by "
                                           f"others: refusing to skip an acknowledged update")
                # a damaged last record — a multi-page write cut by a power loss, its newline on
                # disk but an earlier page not — is a torn write: never acknowledged
                break
            offsets.append(end + pos)
            pos = nl + 1
        self._end[name] = end + pos
        return offsets

    @contextmanager
    def _locked(self, name: str, mode: int):
        """The log of ``name``, open, under ``flock`` (``LOCK_SH`` to read, ``LOCK_EX`` to append):
        a reader never sees a record whose append has not completed (and might still be cut)."""
        try:
            with self._mutex, open(self._dir(name) / ".lock", "a+b") as lk:
                fcntl.flock(lk.fileno(), mode)
                try:
                    p = self.root / name / "log.jsonl"
                    created = not p.exists()
                    with open(p, "a+b", buffering=0) as fh:
                        if created:
                            fsync_dir(p.parent)
                        yield fh
                finally:
                    fcntl.flock(lk.fileno(), fcntl.LOCK_UN)
        except OSError as exc:
            raise SharedLogError(f"shared log of {name!r} in {self.root}: {exc}") from exc

    def _cut(self, name: str, fh, end: int, why: str) -> None:
        size = os.fstat(fh.fileno()).st_size
        log.warning("shared log %s: cutting %s (%d bytes; never acknowledged)", name, why, size - end)
        fh.truncate(end)
        os.fsync(fh.fileno())

    def append(self, name: str, expected: int, record: bytes) -> bool:
        if not record.endswith(b"\n") or b"\n" in record[:-1]:
            raise ValueError("a record is one line ending in a newline")
        with self._locked(name, fcntl.LOCK_EX) as fh:
            offsets = self._scan(name, fh)
            size = os.fstat(fh.fileno()).st_size
            if size > self._end[name]:
                fh.seek(self._end[name])
                tail = fh.read(size - self._end[name])
                if b"\n" not in tail and record_ok(tail):
                    # a whole record but for its newline (found by an audit, in the operator's own log: one byte
                    # truncated off an acknowledged record cut it): kept, its newline restored
                    log.warning("shared log %s: the last record had lost its newline: kept, the newline restored", name)
                    append_durably(fh, b"\n")
                    offsets = self._scan(name, fh)
                else:
                    # a writer died half-way through a record (it held this lock, so it is not
                    # writing any more): the torn or damaged last record was never acknowledged
                    self._cut(name, fh, self._end[name], "a torn record")
            if len(offsets) != expected:
                return False
            start = self._end[name]
            try:
                append_durably(fh, record)
            except OSError as exc:
                raise SharedLogError(f"could not append to the shared log of {name!r}: {exc}") from exc
            offsets.append(start)
            self._end[name] = start + len(record)
            return True

    def length(self, name: str) -> int:
        with self._locked(name, fcntl.LOCK_SH) as fh:
            return len(self._scan(name, fh))

    def read(self, name: str, after: int) -> list[bytes]:
        with self._locked(name, fcntl.LOCK_SH) as fh:
            offsets = self._scan(name, fh)
            if after >= len(offsets):
                return []
            fh.seek(offsets[after])
            data = fh.read(self._end[name] - offsets[after])
        return [line + b"\n" for line in data.split(b"\n")[:-1]]

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ Redis
_APPEND_LUA = """
if redis.call('LLEN', KEYS[1]) == tonumber(ARGV[1]) then
  redis.call('RPUSH', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class RedisSharedLog:
    """The shared log in Redis (redis-py): ``<prefix>:<name>:log`` list, ``<prefix>:<name>:base``."""

    CHUNK = 1000

    def __init__(self, url: str, prefix: str = "kjit"):
        try:
            import redis
        except ImportError:  # pragma: no cover - depends on the extra
            raise RuntimeError("a Redis shared store needs the redis package: pip install 'kjit[redis]'") from None
        self.url = url
        self.prefix = prefix
        self._redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        try:
            self.client.ping()
            cfg = {**self.client.config_get("appendonly"), **self.client.config_get("appendfsync")}
        except redis.ResponseError:  # CONFIG may be disabled on managed servers
            cfg = {}
        except redis.RedisError as exc:
            # not fatal: a replica (re)started while Redis is briefly away comes up, answers 503 and
            # retries, as one running does (found by an audit: it exited, and stayed down)
            log.warning("the shared store %s is unreachable now (%s): operators that need it load when it is back",
                        url, exc)
            cfg = {}
        if cfg and (cfg.get("appendonly") != "yes" or cfg.get("appendfsync") != "always"):
            log.warning("Redis at %s runs with appendonly=%s appendfsync=%s: an acknowledged update is durable "
                        "only as far as Redis persists it (use appendonly yes, appendfsync always)",
                        url, cfg.get("appendonly"), cfg.get("appendfsync"))
        self._append = self.client.register_script(_APPEND_LUA)

    def _key(self, name: str, what: str) -> str:
        return f"{self.prefix}:{_check_name(name)}:{what}"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._redis.RedisError as exc:
            raise SharedLogError(f"shared store {self.url}: {exc}") from exc

    def names(self) -> list[str]:
        return sorted(n.decode() for n in self._call(self.client.smembers, f"{self.prefix}:names"))

    def get_base(self, name: str) -> bytes | None:
        return self._call(self.client.get, self._key(name, "base"))

    def publish_base(self, name: str, blob: bytes) -> bytes:
        self._call(lambda: self.client.set(self._key(name, "base"), blob, nx=True))
        self._call(self.client.sadd, f"{self.prefix}:names", name)
        return self.get_base(name)

    def append(self, name: str, expected: int, record: bytes) -> bool:
        return bool(self._call(lambda: self._append(keys=[self._key(name, "log")], args=[int(expected), record])))

    def length(self, name: str) -> int:
        return int(self._call(self.client.llen, self._key(name, "log")))

    def read(self, name: str, after: int) -> list[bytes]:
        key = self._key(name, "log")
        out: list[bytes] = []
        while True:
            chunk = self._call(self.client.lrange, key, after + len(out), after + len(out) + self.CHUNK - 1)
            out.extend(chunk)
            if len(chunk) < self.CHUNK:
                return out

    def close(self) -> None:
        self.client.close()
