"""A store that fails requests: an HTTP proxy on localhost, on threads of this process, in front of an S3 server
(moto's), that fails every ``every``-th request once it is armed, cycling through what real stores do, and the
first armed request whose request line holds each of ``once``'s texts with the fault named beside it:

* ``500 InternalError`` and ``503 SlowDown`` (throttling), before the request reaches the store;
* a reset connection before the request reaches the store;
* a reset connection after the store carried the request out (the answer is lost: the client cannot tell whether
  its write landed, so a retried conditional write finds its own object there).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("500", "503", "reset before", "reset after")

_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>failing-store</RequestId></Error>"
)


class FailingStore:
    """``url``: the proxy's endpoint. ``faults``: what it injected, in order (request line and kind)."""

    def __init__(self, upstream: str, every: int, once: tuple[tuple[str, str], ...] = ()) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.every = every
        self.once = list(once)
        self.armed = False
        self.faults: list[tuple[str, str]] = []
        self._count = 0
        self._lock = threading.Lock()
        store = self

        class Handler(_Handler):
            owner = store

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="failing-store", daemon=True)

    def __enter__(self) -> FailingStore:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fault_for(self, request: str) -> str | None:
        """The fault this request gets, or None (forwarded unharmed)."""
        with self._lock:
            if not self.armed:
                return None
            for index, (text, kind) in enumerate(self.once):
                if text in request:
                    del self.once[index]
                    self.faults.append((request, kind))
                    return kind
            self._count += 1
            if self._count % self.every:
                return None
            kind = FAULTS[len(self.faults) % len(FAULTS)]
            self.faults.append((request, kind))
            return kind


class _Handler(BaseHTTPRequestHandler):
    owner: FailingStore
    protocol_version = "HTTP/1.1"  # keep-alive and ``Expect: 100-continue``, as botocore uses them

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fault = self.owner.fault_for(self.requestline)
        if fault == "reset before":
            self._reset()
            return
        if fault in ("500", "503"):
            code, message = ("InternalError", "We encountered an internal error.") if fault == "500" else (
                "SlowDown", "Please reduce your request rate.")  # fmt: skip
            self._answer(int(fault), {"Content-Type": "application/xml"}, _ERROR.format(code=code, message=message))
            return
        upstream = http.client.HTTPConnection(self.owner.upstream, timeout=30)
        try:
            headers = {name: value for name, value in self.headers.items() if name.lower() != "expect"}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            answer = response.read()
        finally:
            upstream.close()
        if fault == "reset after":
            self._reset()
            return
        relayed = {
            name: value
            for name, value in response.getheaders()
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server")
        }
        if self.command == "HEAD":
            relayed["Content-Length"] = response.getheader("Content-Length") or "0"
        self._answer(response.status, relayed, answer, head=self.command == "HEAD")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    def _answer(self, status: int, headers: dict[str, str], body: str | bytes, head: bool = False) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST, which the client reads as "connection reset by peer".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # the socket was reset on purpose
            super().finish()
