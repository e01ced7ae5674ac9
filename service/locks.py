"""A readers–writer lock (writer-preferring) for one operator.

Predictions hold it shared; anything that changes an operator (observations, just-in-time
learning, snapshots, recovery) holds it exclusively, so a prediction sees an operator either
before or after an update, never in between (the online update rewrites the posterior
covariance in place).  Writers are preferred: once a writer waits, new readers queue behind
it, so a stream of predictions cannot starve updates.  A long update can instead be prepared
aside under :meth:`RWLock.update` (readers go on) and swapped in under :meth:`RWLock.upgrade`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["RWLock", "WouldBlock"]


class WouldBlock(RuntimeError):
    """``read(blocking=False)`` while a writer holds or waits for the lock."""


class RWLock:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0
        self._updater = False

    @contextmanager
    def read(self, blocking: bool = True):
        """Shared; ``blocking=False`` raises :class:`WouldBlock` instead of waiting for a writer
        (the event loop must never wait here)."""
        with self._cond:
            while self._writer or self._waiting_writers:
                if not blocking:
                    raise WouldBlock("an update holds or waits for this operator")
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        # (while an update is prepared aside, not yet a waiting writer: readers go on meanwhile)
        with self._exclusive(lambda: self._writer or self._readers or self._updater, first=lambda: self._updater):
            yield

    @contextmanager
    def update(self):
        """Exclusive among writers and updaters, shared with readers: a long update is prepared
        aside while predictions go on; :meth:`upgrade` (inside) makes it exclusive for the swap."""
        with self._cond:
            while self._writer or self._updater or self._waiting_writers:
                self._cond.wait()
            self._updater = True
        try:
            yield
        finally:
            with self._cond:
                self._updater = False
                self._cond.notify_all()

    @contextmanager
    def upgrade(self):
        """Inside :meth:`update` only: wait for the readers to leave, hold the lock exclusively."""
        assert self._updater, "upgrade() outside update()"
        with self._exclusive(lambda: self._readers):
            yield

    @contextmanager
    def _exclusive(self, busy, first=None):
        """Hold the lock as the writer once ``busy()`` is false, counted as a waiting writer until
        then (new readers queue behind it) — but only once ``first()`` is false, if given."""
        with self._cond:
            while first is not None and first():
                self._cond.wait()
            self._waiting_writers += 1
            try:
                while busy():
                    self._cond.wait()
            finally:
                self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
