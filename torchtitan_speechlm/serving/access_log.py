"""One JSON line per request (method, path, status, bytes sent, latency, client, the batch it ran
in, its request id, its key's name, and for a refusal its reason), written when its answer has
been sent, by an ASGI middleware around everything else, so that refusals of the outer layers
(400 host, 403 origin, 401, 429, 413, 408, 503) are logged as the routes' answers are.

**Request ids.** A request's ``X-Request-Id`` (up to 128 characters of ``REQUEST_ID``) is its
id, else one is made (32 hex digits); the answer carries it back in ``X-Request-Id`` and the
line, and every error line of the server about the request, names it.

The line goes to ``on_done(record)``: the server counts it (``/health``'s served and failed,
``/metrics``) and logs it, by default through the ``torchtitan_speechlm.serving.access`` logger
(the command sends it to stdout). A route says which job served the request by setting
``record.job`` (``request.scope[RECORD]``): its ``batch_size`` is logged. ``reason`` is the
``code`` of the error answered (serving/errors.py ``REFUSAL``); an answer of status 5xx also
has ``error``, its message. A client that left before its answer is status 499 with reason
``client_gone``, not a server error. One the drain's time (``--drain-seconds``) ran out on is
answered 503 ``shutting_down`` in OpenAI's JSON with ``Retry-After`` (a stream already begun is
cut), and logged and counted so. An exception that escapes the app before an answer
started is answered here with a 500 in OpenAI's shape; one after the answer started (a stream
that failed half-way) is re-raised, so that the server drops the connection and the client
sees the stream unfinished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_speechlm.serving.auth import KEY_NAME
from torchtitan_speechlm.serving.errors import CLIENT_GONE, REFUSAL, ApiError, busy, send_error

LOGGER = logging.getLogger("torchtitan_speechlm.serving.access")
RECORD = "torchtitan_speechlm.access"  # the scope key of a request's Record
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def log_line(line: str) -> None:
    LOGGER.info(line)


def request_id(scope) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a new one."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"x-request-id":
            given = v.decode("latin-1").strip()
            if REQUEST_ID.fullmatch(given):
                return given
    return uuid.uuid4().hex


@dataclass
class Record:
    method: str
    path: str
    client: str
    started: float
    request_id: str = ""
    status: int = 0
    bytes: int = 0
    job: Any = None  # serving/batcher.py Job, once queued
    key: str | None = None  # the name of the API key it carried
    reason: str | None = None  # the code of the error answered
    error: str | None = None
    finished: bool = False  # the whole answer was sent

    def line(self) -> str:
        batch = self.job.batch_size if self.job is not None and self.job.batch_size else None
        out = {"method": self.method, "path": self.path, "status": self.status,
               "bytes": self.bytes, "ms": round(1000 * (time.perf_counter() - self.started), 1),
               "client": self.client, "batch": batch, "request_id": self.request_id}  # fmt: skip
        for name in ("key", "reason", "error"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return json.dumps(out)


class AccessLog:
    """Wraps an ASGI app: a Record per HTTP request, handed to ``on_done`` at its end."""

    def __init__(self, app, on_done: Callable[[Record], None]):
        self.app, self.on_done = app, on_done

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host, port = scope.get("client") or ("-", 0)
        record = Record(scope["method"], scope["path"], f"{host}:{port}", time.perf_counter(),
                        request_id(scope))  # fmt: skip
        scope[RECORD] = record
        echo = (b"x-request-id", record.request_id.encode())

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), echo]}
            elif message["type"] == "http.response.body":
                record.bytes += len(message.get("body", b""))
                record.finished = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except asyncio.CancelledError:  # the drain ran out of time (--drain-seconds)
            await _cut_by_the_drain(record, counted, scope)
        except Exception as e:
            record.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
            if record.finished:  # answered already (FastAPI's 500 handler re-raises)
                return
            if record.status:  # the answer had begun: the connection must be dropped
                record.status = record.status if record.status >= 400 else 500
                raise
            await send_error(counted, ApiError(500, f"internal error: {type(e).__name__}"))
        finally:
            _explain(record, scope)
            self.on_done(record)


async def _cut_by_the_drain(record: Record, send, scope) -> None:
    """A request the drain's time ran out on (uvicorn cancels its task): answered here, not
    re-raised (uvicorn would answer a plain-text 500 and log a traceback). Before its answer
    began: OpenAI's JSON 503 ``shutting_down`` with ``Retry-After`` (another replica or the
    restarted server can take it); a stream cut half-way: the connection is dropped (uvicorn
    closes it) and the line says 503 ``shutting_down``. The task's cancellation is consumed:
    nothing is left to cancel in it."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
        task.uncancel()
    if record.finished:  # answered already: nothing was cut
        return
    record.error = record.error or (
        "cancelled: the server's drain ran out of time (--drain-seconds)"
    )
    record.reason = "shutting_down"
    if record.status:  # a stream had begun: it cannot become a 503, it ends unfinished
        record.status = 503
        return
    await send_error(send, shutting_down(), scope)


def shutting_down() -> ApiError:
    """The answer to a request the server drops because it is stopping."""
    error = busy(503, "the server is shutting down: this request was not finished within "
                      "its drain time; send it again", "shutting_down", 1.0)  # fmt: skip
    error.headers["Connection"] = "close"
    return error


def _explain(record: Record, scope) -> None:
    """The record's key name, and the reason (and for a 5xx the message) of its refusal."""
    record.key = scope.get(KEY_NAME)
    refusal = scope.get(REFUSAL)
    if refusal is not None and refusal.status == record.status:
        record.reason = refusal.code or record.reason
        if refusal.status >= 500 and not record.error:
            record.error = refusal.message
    if record.status >= 500 and not record.reason:
        record.reason = "internal_error"
    if record.status == CLIENT_GONE:
        record.reason = "client_gone"
