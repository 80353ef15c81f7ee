"""A lingering close for answers sent before the request's body was read (uvicorn has none).

A refusal made from the headers alone (a bad key's 401, a rate limit's 429, a Content-Length
over the limit's 413) closes the connection, since the body left unread cannot be told apart
from the next request. uvicorn then closes the socket at once; with the client's body still
arriving, the kernel answers it with a reset, and a client still sending (as ``http.client``,
``requests`` and the OpenAI SDK do: the whole body, then the answer) gets "connection reset"
instead of the refusal. Keeping the connection open instead costs more: uvicorn passes every
byte of the refused body through h11 (about 5.5 ms a 5.4 MB upload: issue 51's H1 flood, 112
refusals a second, took half the server's core).

``LingeringClose`` (uvicorn's ``H11Protocol``) does what Apache and nginx do (``lingering_close``):
the answer goes out, then the write side is shut (the client reads the answer and an end of
file), and what still arrives is dropped, never parsed, until the client closes,
``LINGER_BYTES`` have been dropped or ``LINGER_S`` have passed; then the socket closes. The
request whose scope has ``NO_LINGER`` set (by the rate limit, serving/gate.py: a client that
sends a large body again before the ``Retry-After`` of its last 429) is closed at once: what it
still sends is reset, not read, so the client who ignores the wait pays for it, not the server
(reading the 5 MB of an H1 upload to drop it cost the server about 3 ms, a refusal each 6 ms).
The dropping is a ``BufferedProtocol`` that the transport reads into one scratch buffer (no bytes
object a read: the 5 MB of an H1 upload were 20 fresh 256 KB buffers, each a fresh mapping).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_BYTES = 16 << 20
LINGER_S = 2.0
NO_LINGER = "torchtitan_speechlm.no_linger"  # a scope key: this request's close does not linger
# what the dropped bytes are read into; never read back, so sharing it (between connections,
# and between the event loops of several servers in one process) is harmless
_SCRATCH = memoryview(bytearray(256 << 10))


class _Transport:
    """The connection's transport as uvicorn sees it: ``close`` lingers while the request's
    body is still arriving."""

    def __init__(self, transport, protocol: LingeringClose):
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        if not self._protocol.linger():
            self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _Drop(asyncio.BufferedProtocol):
    """A lingering connection's protocol: reads into ``_SCRATCH`` until an end of file, a
    byte budget or a deadline, then closes; its end is reported to ``owner`` (uvicorn's)."""

    def __init__(self, owner: asyncio.Protocol, transport, loop: asyncio.AbstractEventLoop):
        self.owner, self.transport, self.left = owner, transport, LINGER_BYTES
        self.deadline = loop.call_later(LINGER_S, transport.close)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _SCRATCH

    def buffer_updated(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.cancel()
        self.owner.connection_lost(exc)


class LingeringClose(H11Protocol):
    """uvicorn's h11 protocol whose closes linger over an unread body (see above)."""

    _lingering = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._socket_transport = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]

    def linger(self) -> bool:
        """Start lingering if the request's body is still arriving (True), else do nothing."""
        transport = self._socket_transport
        if self._lingering:
            return True
        if self.conn.their_state is not h11.SEND_BODY or transport.is_closing():
            return False
        if self.scope.get(NO_LINGER):  # type: ignore[union-attr]
            return False
        if not transport.can_write_eof():
            return False
        self._lingering = True
        transport.set_protocol(_Drop(self, transport, self.loop))
        transport.write_eof()
        transport.resume_reading()
        return True
