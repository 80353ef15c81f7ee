"""OpenAI's error answer, ``{"error": {"message", "type", "param", "code"}}``, in one place, so
that every layer of the server (the routes, the body limits, the API key check, the admission
gate, the access log's last-resort 500) refuses a request in the shape the ``openai`` client
turns into its own exception classes (``BadRequestError``, ``RateLimitError``, ...).

A message a client reads names no folder of this machine: ``Redactions`` replaces the
server's own paths (the model folder, ``--voices``) by the names a client knows, so that a
model's reason for a refusal ("DIR was trained without speaker prompts") does not tell a
caller where the server keeps its files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import NamedTuple

# the scope key of the ``Refusal`` a request was answered with (the access log's reason): a
# summary, never the exception itself, whose traceback holds the frames that hold the request
# (its scope, its body): a cycle that kept every refused upload's bytes until the cyclic
# garbage collector ran (an 8-hour FLAC refused 800 times: 4 GB)
REFUSAL = "torchtitan_speechlm.refusal"


class Refusal(NamedTuple):
    status: int
    code: str | None
    message: str


# 499: the client closed the connection before its answer (nginx's status; never sent, logged)
CLIENT_GONE = 499


class ApiError(Exception):
    """An answer other than success: its status, OpenAI's error fields and extra headers.
    4xx are ``invalid_request_error`` (the request's fault), the rest ``server_error``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()

    def refusal(self) -> Refusal:
        return Refusal(self.status, self.code, self.message)


def busy(status: int, message: str, code: str, retry_after_s: float) -> ApiError:
    """A refusal for load (429, 503): the client may retry after ``retry_after_s``."""
    wait = max(1, int(-(-retry_after_s // 1)))
    return ApiError(status, f"{message}; retry after {wait} s", code=code,
                    headers={"Retry-After": str(wait)})  # fmt: skip


async def send_error(send, error: ApiError, scope: dict | None = None) -> None:
    """Answer ``error`` on a raw ASGI ``send`` (for the middlewares, which run outside FastAPI);
    ``scope``: the request's, where the access log finds why it was refused."""
    if scope is not None:
        scope[REFUSAL] = error.refusal()
    body = error.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Redactions:
    """The server's folders (absolute and resolved spellings) and what a client reads instead."""

    def __init__(self, names: dict[str, str] | None = None):
        self.pairs: list[tuple[str, str]] = []
        for path, name in (names or {}).items():
            self.add(path, name)

    def add(self, path: str, name: str) -> None:
        spellings = {os.path.normpath(path), os.path.abspath(path), os.path.realpath(path)}
        self.pairs += [(p, name) for p in spellings if p not in (".", "/", "")]
        self.pairs.sort(key=lambda pair: -len(pair[0]))  # the longest first: nested folders

    def __call__(self, message: str) -> str:
        for path, name in self.pairs:
            message = message.replace(path, name)
        return message

    @classmethod
    def of(cls, folders: Iterable[tuple[str | None, str]]) -> Redactions:
        return cls({p: n for p, n in folders if p})
