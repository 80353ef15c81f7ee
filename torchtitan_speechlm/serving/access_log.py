"""One JSON line per request (method, path, status, bytes sent, latency, client, the batch it ran
in), written when its answer has been sent, by an ASGI middleware around everything else, so
that refusals of the outer layers (401, 413, 408) are logged as the routes' answers are.

The line goes to ``on_done(record)``: the server counts it (``/health``'s served and failed)
and logs it, by default through the ``torchtitan_speechlm.serving.access`` logger (the command
sends it to stdout). A route says which job served the request by setting ``record.job``
(``request.scope[RECORD]``): its ``batch_size`` is logged. An exception that escapes the app
before an answer started is answered here with a 500 in OpenAI's shape; one after the answer
started (a stream that failed half-way) is re-raised, so that the server drops the
connection and the client sees the stream unfinished.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_speechlm.serving.errors import ApiError, send_error

LOGGER = logging.getLogger("torchtitan_speechlm.serving.access")
RECORD = "torchtitan_speechlm.access"  # the scope key of a request's Record


def log_line(line: str) -> None:
    LOGGER.info(line)


@dataclass
class Record:
    method: str
    path: str
    client: str
    started: float
    status: int = 0
    bytes: int = 0
    job: Any = None  # serving/batcher.py Job, once queued
    error: str | None = None
    finished: bool = False  # the whole answer was sent

    def line(self) -> str:
        batch = self.job.batch_size if self.job is not None and self.job.batch_size else None
        out = {"method": self.method, "path": self.path, "status": self.status,
               "bytes": self.bytes, "ms": round(1000 * (time.perf_counter() - self.started), 1),
               "client": self.client, "batch": batch}  # fmt: skip
        if self.error:
            out["error"] = self.error
        return json.dumps(out)


class AccessLog:
    """Wraps an ASGI app: a Record per HTTP request, handed to ``on_done`` at its end."""

    def __init__(self, app, on_done: Callable[[Record], None]):
        self.app, self.on_done = app, on_done

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host, port = scope.get("client") or ("-", 0)
        record = Record(scope["method"], scope["path"], f"{host}:{port}", time.perf_counter())
        scope[RECORD] = record

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                record.bytes += len(message.get("body", b""))
                record.finished = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as e:
            record.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
            if record.finished:  # answered already (FastAPI's 500 handler re-raises)
                return
            if record.status:  # the answer had begun: the connection must be dropped
                record.status = record.status if record.status >= 400 else 500
                raise
            await send_error(counted, ApiError(500, f"internal error: {e}"))
        finally:
            self.on_done(record)
