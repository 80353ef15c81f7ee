"""The API key: who may call the routes, and where the server may listen without one.

A server that listens beyond this machine (any ``--host`` but a loopback address) serves
whoever reaches it, and runs a model for each request: it must be given a key (``--api-key``,
``TORCHTITAN_SERVE_API_KEY`` or ``--api-key-file``: serving/keys.py), or be told ``--no-auth``
explicitly. With keys, every route but the probes (``GET /health``, ``GET /ready``, for load
balancers) needs ``Authorization: Bearer KEY``, compared in constant time; anything else is a
401 in OpenAI's shape (the ``openai`` client raises ``AuthenticationError``). The key's name
goes into the request's scope (``KEY_NAME``): the access log and the per-key rate limits use it.
"""

from __future__ import annotations

import ipaddress

from torchtitan_speechlm.serving.errors import ApiError, send_error
from torchtitan_speechlm.serving.keys import KeyRing

ENV_KEY = "TORCHTITAN_SERVE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready"})
KEY_NAME = "torchtitan_speechlm.key"  # the scope key of the request's key name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, has_key: bool, no_auth: bool) -> None:
    """Refuse (ValueError, one line) to listen beyond loopback without a key or ``--no-auth``."""
    if has_key or no_auth or is_loopback(host):
        return
    raise ValueError(
        f"--host {host} listens beyond this machine without an API key: give --api-key KEY "
        f"(or set {ENV_KEY}, or --api-key-file FILE), or pass --no-auth to serve anyone who "
        "can reach it"
    )


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Authorization: Bearer TOKEN`` (None: another scheme or none)."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY`` with this server's key (constant-time comparison)."""
    token = bearer_token(authorization)
    return token is not None and KeyRing(api_key).match(token) is not None


class ApiKeyAuth:
    """Wraps an ASGI app: a 401 unless the request carries a key of ``keys`` (``OPEN_PATHS``
    excepted); no check at all when ``keys`` holds none."""

    def __init__(self, app, keys: KeyRing | None):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys is not None and self.keys.enabled:
            auth = next((v.decode("latin-1") for k, v in scope["headers"]
                         if k == b"authorization"), None)  # fmt: skip
            token = bearer_token(auth)
            name = self.keys.match(token) if token is not None else None
            scope[KEY_NAME] = name
            if name is None and scope["path"] not in OPEN_PATHS:
                error = ApiError(
                    401,
                    "Incorrect or missing API key: send the header Authorization: Bearer KEY "
                    "with one of this server's keys (--api-key, --api-key-file)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
                )
                return await send_error(send, error, scope)
        await self.app(scope, receive, send)
