"""The request body limits, as an ASGI middleware in front of the routes, so that no route can
read more than ``--max-upload-mb`` or wait on a slow client for longer than ``--body-timeout``.

The whole body is read here, before the routes (and the request cap, serving/gate.py) see the
request: a request still arriving holds a socket and the bytes it sent, never a place among
the requests being served, so clients that trickle their bodies slow nobody else.

- A Content-Length over the limit is answered 413 before any of the body is read (with
  ``Expect: 100-continue``, as curl sends over 1 MB, before the client sends it: the server's
  ``100 Continue`` goes out only when the body is first read). What the client still sends is
  dropped unread by the server's lingering close (serving/linger.py), so that a client still
  sending sees the answer rather than a reset connection.
- A chunked body (no Content-Length) is counted as it arrives; the chunk that passes the limit
  ends the read with the same 413.
- The whole body must arrive within ``body_timeout_s`` of the request's start: a client that
  stops sending gets a 408.

Refusals close the connection (the rest of the body is not read). Once the body has been
handed to the route, ``receive`` is the server's own again: it returns when the client
disconnects (a route waiting on the model cancels the request's work then).
"""

from __future__ import annotations

import asyncio
import time

from torchtitan_speechlm.serving.errors import CLIENT_GONE, ApiError, send_error

CLOSE = {"Connection": "close"}


def too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size} bytes, over this server's limit of {limit} bytes "
        f"(--max-upload-mb {limit / (1 << 20):g})",
        code="request_too_large",
        headers=CLOSE,
    )


def header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class BodyLimit:
    """Wraps an ASGI app: the body read whole first; 413 over ``max_bytes``, 408 after
    ``body_timeout_s`` (see above)."""

    def __init__(self, app, max_bytes: int, body_timeout_s: float):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = header(scope, b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await send_error(send, ApiError(400, "Content-Length is not a number",
                                                       headers=CLOSE), scope)  # fmt: skip
            if n > self.max_bytes:
                return await send_error(send, too_large(str(n), self.max_bytes), scope)
        try:
            first = await self._read(receive)
        except ApiError as e:
            return await send_error(send, e, scope)
        if first["type"] != "http.request":  # the client left: nothing to answer (logged)
            gone = ApiError(CLIENT_GONE, "the client left before its body arrived",
                            code="client_gone")  # fmt: skip
            return await send_error(send, gone, scope)
        await self.app(scope, _replay(first, receive), send)

    async def _read(self, receive) -> dict:
        """The whole body as one ``http.request`` message, or the disconnect that came first."""
        deadline = time.monotonic() + self.body_timeout_s
        parts, seen = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    "(--body-timeout)",
                    code="request_timeout",
                    headers=CLOSE,
                ) from None
            if msg["type"] != "http.request":
                return msg
            parts.append(msg.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_bytes:
                raise too_large(f"over {self.max_bytes}", self.max_bytes)
            if not msg.get("more_body", False):
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}


def _replay(first: dict, receive):
    """``receive`` that gives ``first`` (the whole body), then the server's own messages."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
