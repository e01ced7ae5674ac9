"""Run a real uvicorn server on a free loopback port: in a thread, or as a subprocess.

Used by the tests and by ``benchmarks/service.py``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

from .app import create_app
from .server import uvicorn_config
from .settings import Settings

__all__ = ["ThreadedServer", "SubprocessServer", "free_port"]

_URL_RE = re.compile(r"listening on (http://\S+)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ThreadedServer:
    """``create_app(settings)`` under uvicorn in a background thread, on a socket bound here."""

    def __init__(self, settings: Settings, log_level: str = "warning"):
        self.settings = settings
        self.app = create_app(settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the service's protocol and limits, as ``kjit serve`` runs them
        self.server = uvicorn.Server(uvicorn_config(self.app, settings, log_level=log_level, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 120.0, ready: bool = True) -> "ThreadedServer":
        """Start; wait until ``/ready`` says 200 unless ``ready`` is False."""
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        if ready:
            self.wait_ready(t_end - time.monotonic())
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx

        t_end = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < t_end:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"{self.url} not ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self):
        return self if self.thread.is_alive() else self.start()

    def __exit__(self, *exc):
        self.stop()


class SubprocessServer:
    """``python -m service`` (= ``kjit serve``) in a child process; the URL is read from its output."""

    def __init__(self, store: Path, env: dict | None = None, args=(), train_defaults: bool = False):
        self.store = Path(store)
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.args = ["--port", "0", "--store", str(store), "--log-level", "warning", *args]
        if not train_defaults:
            self.args.append("--no-defaults")
        self.proc = None
        self.url = None
        self.output: list[str] = []

    def start(self, timeout: float = 300.0) -> "SubprocessServer":
        self.proc = subprocess.Popen([sys.executable, "-m", "service", *self.args], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        t_end = time.monotonic() + timeout
        result = {}

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                m = _URL_RE.search(line)
                if m and "url" not in result:
                    result["url"] = m.group(1)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while "url" not in result:
            if self.proc.poll() is not None or time.monotonic() > t_end:
                self.kill()
                raise RuntimeError("the server did not start:\n" + "".join(self.output[-30:]))
            time.sleep(0.02)
        self.url = result["url"]
        import httpx

        while time.monotonic() < t_end:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("the server did not become ready:\n" + "".join(self.output[-30:]))

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGINT: graceful shutdown (final snapshots)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
