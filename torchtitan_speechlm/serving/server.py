"""The App's routes served by uvicorn on a socket bound up front, in a thread of its own.

Binding in the constructor makes a taken port an OSError at start-up, and ``--port 0`` know its
port before the URL is printed. uvicorn runs the HTTP/1.1 connections (h11): keep-alive
connections idle for ``keep_alive_s`` are closed. uvicorn's own cap (``limit_concurrency``,
which counts idle sockets and half-sent requests alike and answers a plain-text 503 that no log
sees) is off: the App caps the requests being served (serving/gate.py), in JSON, logged.
``HeaderTimeout`` adds what uvicorn lacks: a connection must finish sending a request's headers
within ``header_timeout_s`` of opening (or of its previous answer), else it gets a 408 and is
closed (``on_header_timeout`` logs and counts it), so slow clients cannot hold connections open
by trickling headers; and an answer sent before its request's body was read closes the
connection without a reset (serving/linger.py). ``proxy_headers``: the proxy addresses whose ``X-Forwarded-For`` /
``X-Forwarded-Proto`` are trusted (uvicorn's ``forwarded_allow_ips``; None: none are read).

``shutdown`` is the drain: stop listening, let the requests in flight finish for at most
``drain_s`` seconds (each waits on its job, so the batcher's queued jobs run), then cancel
those left (their jobs are cancelled: the worker stops them between decode steps), close
idle connections, and return.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import uvicorn

from torchtitan_speechlm.serving.app import App
from torchtitan_speechlm.serving.linger import LingeringClose

_408_BODY = (
    b'{"error": {"message": "the request headers did not arrive in time (--header-timeout)", '
    b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}'
)
TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(_408_BODY)}\r\n\r\n".encode()
    + _408_BODY
)


def header_timeout(seconds: float, on_timeout: Callable[[str], None] = lambda client: None
                   ) -> type[asyncio.Protocol]:  # fmt: skip
    """uvicorn's h11 protocol (with serving/linger.py's lingering close) with a deadline on
    each request's headers (``on_timeout(client address)`` when one is cut)."""

    class HeaderTimeout(LingeringClose):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            # the timer holds the protocol (and the body it buffered): not for the rest of
            # the timeout once the connection is gone (300 refused uploads a second kept
            # 3,000 of them, 125 KB each)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire, self.cycle)

        def _expire(self, armed_at) -> None:
            """No request began since the deadline was set: answer 408 to one that had begun
            sending its headers, and close the connection."""
            self._deadline = None
            if self.cycle is not armed_at or self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:
                self.transport.write(TIMEOUT_408)
                host, port = self.client or ("-", 0)
                on_timeout(f"{host}:{port}")
            self.transport.close()

    return HeaderTimeout


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class SpeechServer:
    """``app`` on ``host:port`` (0: any free port): ``serve_forever`` (blocks; run it in a
    thread), ``shutdown`` (the drain, from another thread), ``server_close``."""

    def __init__(
        self,
        app: App,
        host: str = "127.0.0.1",
        port: int = 8000,
        keep_alive_s: float = 5.0,
        header_timeout_s: float = 10.0,
        sock: socket.socket | None = None,
        drain_s: float = 25.0,
        proxy_headers: str | None = None,
    ):
        self.app = app
        # ``sock``: bound already (the replicas of serving/replicas.py share one)
        self.socket = sock if sock is not None else bind(host, port)
        config = uvicorn.Config(
            app.asgi(),
            http=header_timeout(header_timeout_s, app.header_timeout),
            lifespan="off",
            log_config=None,
            access_log=False,
            proxy_headers=proxy_headers is not None,
            forwarded_allow_ips=proxy_headers or "127.0.0.1",
            server_header=False,
            timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  (a float works)
            limit_concurrency=None,  # the App's RequestCap instead (the docstring)
            timeout_graceful_shutdown=drain_s,  # type: ignore[arg-type]  (a float works)
        )
        self.drain_s = drain_s
        self.server = uvicorn.Server(config)
        self._running, self._stopped = threading.Event(), threading.Event()

    @property
    def server_address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self._running.set()
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, finish the requests in flight (``drain_s`` at most), return when
        the server has stopped."""
        self.server.should_exit = True
        if self._running.is_set():
            self._stopped.wait(timeout)
        self.app.close()

    def server_close(self) -> None:
        self.socket.close()
