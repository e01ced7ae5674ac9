"""The HTTP floor of ``benchmarks/service.py``: a bare ASGI app under uvicorn, set up as the service
runs it (uvloop, and httptools with a response's head and body in one write:
``service.protocol.OneWriteHttpToolsProtocol``), that answers every GET
with one fixed body and every other request with another — the bytes the real service answered.
A ``RemoteOperator`` pointed at it does all of its own work (validation, JSON, decoding, families,
certificates) and the same HTTP exchange, while the server does none: the round trip a request
costs with no service behind it.  Not a benchmark itself.

    python benchmarks/_http_floor.py PORT GET_BODY_FILE OTHER_BODY_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.protocol import OneWriteHttpToolsProtocol  # noqa: E402


def make_app(get_body: bytes, other_body: bytes):
    heads = {}
    for key, body in (("GET", get_body), ("other", other_body)):
        heads[key] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        key = "GET" if scope["method"] == "GET" else "other"
        await send({"type": "http.response.start", "status": 200, "headers": heads[key]})
        await send({"type": "http.response.body", "body": get_body if key == "GET" else other_body})

    return app


if __name__ == "__main__":
    port, get_file, other_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with open(get_file, "rb") as f, open(other_file, "rb") as g:
        app = make_app(f.read(), g.read())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=OneWriteHttpToolsProtocol)
