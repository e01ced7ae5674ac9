"""service.locks.RWLock: shared readers, writer preference, and updates prepared aside."""

from __future__ import annotations

import threading
import time

import pytest

from service.locks import RWLock, WouldBlock


def _start(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _hold(cm, entered: threading.Event, release: threading.Event):
    """A thread that enters ``cm``, says so, and leaves it when ``release`` is set."""
    def run():
        with cm:
            entered.set()
            release.wait(10)
    return _start(run)


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_readers_share_and_a_writer_waits_for_them_then_excludes_them():
    lock = RWLock()
    with lock.read(), lock.read():  # two readers at once (no deadlock)
        done, release = threading.Event(), threading.Event()
        t = _hold(lock.write(), done, release)
        _until(lambda: lock._waiting_writers == 1)
        assert not done.is_set()  # the writer waits for the readers
        with pytest.raises(WouldBlock):  # and new readers queue behind a waiting writer
            with lock.read(blocking=False):
                pass
    assert done.wait(10) and lock._writer
    with pytest.raises(WouldBlock):
        with lock.read(blocking=False):
            pass
    release.set()
    t.join(10)
    assert not lock._writer and lock._waiting_writers == 0
    with lock.read(blocking=False):
        pass


def test_readers_go_on_while_an_update_is_prepared_aside_and_a_writer_waits_behind_it():
    lock = RWLock()
    state = {}
    in_update, release, upgraded = threading.Event(), threading.Event(), threading.Event()

    def updater():
        with lock.update():
            in_update.set()
            release.wait(10)
            with lock.upgrade():
                state["readers_at_upgrade"] = lock._readers
                upgraded.set()

    tu = _start(updater)
    in_update.wait(10)
    wrote, done_writing = threading.Event(), threading.Event()
    tw = _hold(lock.write(), wrote, done_writing)
    time.sleep(0.05)
    # the writer waits behind the updater without counting as a waiting writer: readers go on
    assert not wrote.is_set() and lock._waiting_writers == 0
    with lock.read(blocking=False):
        release.set()
        time.sleep(0.05)
        assert not upgraded.is_set()  # the upgrade waits for this reader to leave
    upgraded.wait(10)
    assert state["readers_at_upgrade"] == 0
    tu.join(10)
    assert wrote.wait(10) and lock._writer  # then the writer gets the lock
    done_writing.set()
    tw.join(10)


def test_upgrade_outside_update_is_refused():
    with pytest.raises(AssertionError, match="outside update"):
        with RWLock().upgrade():
            pass
