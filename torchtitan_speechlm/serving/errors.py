"""OpenAI's error answer, ``{"error": {"message", "type", "param", "code"}}``, in one place, so
that every layer of the server (the routes, the body limits, the API key check, the access log's
last-resort 500) refuses a request in the shape the ``openai`` client turns into its own
exception classes (``BadRequestError``, ``NotFoundError``, ...)."""

from __future__ import annotations

import json

CLIENT_ERRORS = {
    400,
    401,
    404,
    405,
    408,
    413,
}  # type "invalid_request_error"; the rest "server_error"


class ApiError(Exception):
    """An answer other than success: its status, OpenAI's error fields and extra headers."""

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
        kind = "invalid_request_error" if self.status in CLIENT_ERRORS else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()


async def send_error(send, error: ApiError) -> None:
    """Answer ``error`` on a raw ASGI ``send`` (for the middlewares, which run outside FastAPI)."""
    body = error.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
