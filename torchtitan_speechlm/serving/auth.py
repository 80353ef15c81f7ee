"""The API key: who may call the routes, and where the server may listen without one.

A server that listens beyond this machine (any ``--host`` but a loopback address) serves
whoever reaches it, and runs a model for each request: it must be given a key (``--api-key``
or ``TORCHTITAN_SERVE_API_KEY``), or be told ``--no-auth`` explicitly. With a key, every route
but ``GET /health`` (for load balancers and probes) needs ``Authorization: Bearer KEY``,
compared in constant time; anything else is a 401 in OpenAI's shape (the ``openai`` client
raises ``AuthenticationError``).
"""

from __future__ import annotations

import hmac
import ipaddress

from torchtitan_speechlm.serving.errors import ApiError, send_error

ENV_KEY = "TORCHTITAN_SERVE_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, no_auth: bool) -> None:
    """Refuse (ValueError, one line) to listen beyond loopback without a key or ``--no-auth``."""
    if api_key or no_auth or is_loopback(host):
        return
    raise ValueError(
        f"--host {host} listens beyond this machine without an API key: give --api-key KEY "
        f"(or set {ENV_KEY}), or pass --no-auth to serve anyone who can reach it"
    )


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY`` with this server's key (constant-time comparison)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyAuth:
    """Wraps an ASGI app: a 401 unless the request carries the key (``OPEN_PATHS`` excepted);
    no check at all when ``api_key`` is None."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] not in OPEN_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope["headers"]
                         if k == b"authorization"), None)  # fmt: skip
            if not bearer_ok(auth, self.api_key):
                error = ApiError(
                    401,
                    "Incorrect or missing API key: send the header Authorization: Bearer KEY "
                    "with this server's --api-key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
                )
                return await send_error(send, error)
        await self.app(scope, receive, send)
