"""uvicorn's httptools protocol, with a response's head and body written to the socket together.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start`` and the body when it sends ``http.response.body``: two writes, and on
loopback two TCP segments, each waking the client (with ``TCP_NODELAY``, which uvicorn sets).
A one-message answer is a few hundred bytes, so that second wake-up is a fair part of the round
trip (issue 17; the client's side does the same for requests: :class:`kjit.transport._Connection`).
:class:`OneWriteHttpToolsProtocol` gives uvicorn's protocol a transport that holds a response
head (a write that is a complete ``HTTP/1.x`` status line and header block) until the next write
— the body, normally in the same step of the app's task — and sends both in one write.  Nothing
waits on the body: a held head is written at the latest on the event loop's next iteration (a
streamed or slow body), before a close or ``write_eof``, and is dropped only by ``abort``, which
drops the transport's own buffer too.  Bytes and their order on the wire are unchanged.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["OneWriteHttpToolsProtocol", "HeadHoldingTransport"]


def _is_head(data) -> bool:
    return data[:7] == b"HTTP/1." and data[-4:] == b"\r\n\r\n"


class HeadHoldingTransport:
    """A proxy of an asyncio transport whose ``write`` holds a response head until the next write
    (see the module's docstring); every other attribute is the transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held = None

    def write(self, data) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + bytes(data))
        elif _is_head(data) and not self._transport.is_closing():
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a held head now (a no-op when none is held)."""
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def writelines(self, data) -> None:
        self.flush()
        self._transport.writelines(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a :class:`HeadHoldingTransport`; pass the class as
    ``uvicorn.Config(http=...)``."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, self.loop))
