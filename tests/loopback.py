"""A TCP server on 127.0.0.1 for the client's transport tests (no tests here): a thread accepts
connections and hands each to :meth:`AcceptLoop.on_connection`, so a test controls exactly what a
connection receives and when it closes."""

from __future__ import annotations

import socket
import threading


class AcceptLoop:
    """Listens on a free port (``port``, ``url``); counts ``connections``; :meth:`close` stops the
    loop and closes the listening socket (and ``conns``, the connections a subclass keeps).
    Subclasses set their own attributes before calling ``super().__init__`` (the loop starts there)."""

    def __init__(self, backlog: int = 8):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(backlog)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.conns: list[socket.socket] = []
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            self.on_connection(c)

    def on_connection(self, c: socket.socket) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self):
        self._stop = True
        self.t.join()
        for c in self.conns:
            c.close()
        self.sock.close()
