"""What a web page open in a browser on this machine may do with the server: nothing, unless
told otherwise.

A server without a key on localhost trusts whoever can reach it, and a browser can: a page
the local user visits may send it requests (a form post, ``fetch`` without CORS), and by DNS
rebinding (its own name resolving to 127.0.0.1) read the answers. So:

- ``Host`` must be one of ``--trusted-hosts`` (by default, on a loopback ``--host``: the
  loopback names and addresses; on any other: any host): a rebound name is a 400
  ``untrusted_host``;
- a request with an ``Origin`` (every cross-origin request a browser sends, and its POSTs)
  is refused with a 403 ``origin_not_allowed`` unless the origin is one of ``--cors-origins``
  (none by default), whose requests get Starlette's CORS answers (preflight, headers);
- the JSON route takes JSON bodies only (serving/app.py: another ``Content-Type``, such as the
  ``text/plain`` a form or a no-CORS fetch sends, is a 415).

Clients that are not browsers (curl, the ``openai`` client) send no ``Origin`` and the host
they connected to: they are not affected.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.middleware.cors import CORSMiddleware

from torchtitan_speechlm.serving.auth import is_loopback
from torchtitan_speechlm.serving.errors import ApiError, send_error
from torchtitan_speechlm.serving.limits import header

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_trusted_hosts(host: str) -> list[str]:
    """``--trusted-hosts``' default: the loopback names on a loopback ``--host``, else any."""
    return [*LOOPBACK_HOSTS, host] if is_loopback(host) else ["*"]


def split_list(value: str | None) -> list[str]:
    """A comma-separated flag value as its entries (none for an empty or missing value)."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def host_name(value: str) -> str:
    """A Host header's name without its port (``[::1]:8000`` -> ``::1``), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(host: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        p = p.lower()
        if p == "*" or p == host or (p.startswith("*.") and host.endswith(p[1:])):
            return True
    return False


class BrowserGuard:
    """Wraps an ASGI app: the Host and Origin rules above; allowed origins through Starlette's
    CORSMiddleware."""

    def __init__(self, app, trusted_hosts: list[str], cors_origins: list[str]):
        self.trusted_hosts, self.cors_origins = list(trusted_hosts), list(cors_origins)
        self.app = app
        if self.cors_origins:
            self.app = CORSMiddleware(
                app,
                allow_origins=self.cors_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                expose_headers=["X-Request-Id", "Retry-After"],
            )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = header(scope, b"host")
        if host is not None and not host_allowed(host_name(host), self.trusted_hosts):
            error = ApiError(400, f"Host {host_name(host)!r} is not one this server answers to: "
                                  f"start it with --trusted-hosts naming it (now: "
                                  f"{','.join(self.trusted_hosts)})", code="untrusted_host")  # fmt: skip
            return await send_error(send, error, scope)
        origin = header(scope, b"origin")
        if origin is not None and not ("*" in self.cors_origins or origin in self.cors_origins):
            allowed = ",".join(self.cors_origins) or "none"
            error = ApiError(403, f"requests from web pages (Origin {origin!r}) are refused: "
                                  "start the server with --cors-origins naming the origin "
                                  f"(now: {allowed})", code="origin_not_allowed")  # fmt: skip
            return await send_error(send, error, scope)
        await self.app(scope, receive, send)
