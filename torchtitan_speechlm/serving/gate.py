"""Admission: how much of the server one client, and all of them together, may hold.

- ``RequestCap``: at most ``max_requests`` requests in the routes at once (``--max-requests``),
  counted from when a request's body has arrived (serving/limits.py reads it first) to its
  last byte, so that sockets still sending headers or a body hold nothing; more get a 503
  ``server_busy`` in OpenAI's JSON with ``Retry-After``. The probes (``/health``, ``/ready``)
  are never refused.
- ``RateLimits``: per key (its name, serving/keys.py; without keys, per client address) and per
  minute, at most ``--requests-per-minute`` requests (and at most a thirtieth of them, or 5,
  in any one second: a burst may not spend the minute's allowance at once) and
  ``--audio-seconds-per-minute`` seconds of audio (a transcription's upload, charged before
  the model worker, and the speech generated, charged once spoken) and
  ``--body-mb-per-minute`` MiB of request bodies (charged from the Content-Length before the
  body is read; a chunked body as it is read); over any, a 429 with ``Retry-After``, the time
  until the window has room again. 0 (the default): no limit. A key that sends again before
  the ``Retry-After`` of its last 429 waits up to ``HOLD_S`` for its next one (at most
  ``HELD_MAX`` at once), and a large body it sends then is reset, not read (serving/linger.py):
  a client that ignores the wait pays for it, not the server. The body window is what makes a
  key's refused requests cost it: an 8-hour FLAC or a 10 MB ``input`` is refused (413, 400)
  only once it has been read and parsed, which costs the event loop tens of milliseconds each,
  so without it a key that sends such requests as fast as it may spends the server's thread
  (benchmarks/bench_serve_abuse.py, H1 and H2).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from torchtitan_speechlm.serving.auth import KEY_NAME, OPEN_PATHS
from torchtitan_speechlm.serving.errors import ApiError, busy, send_error
from torchtitan_speechlm.serving.limits import CLOSE, header
from torchtitan_speechlm.serving.linger import NO_LINGER

WINDOW_S = 60.0
BURST_DIVISOR = 30  # of a minute's requests, at most this share in one second (twice the mean)
BURST_MIN = 5  # but never fewer than this many in a second
MIB = 1 << 20
# a refusal made before a body over this many bytes (or a chunked one) is read closes the
# connection (serving/linger.py drops the rest unread); a smaller one is skipped and kept alive
CLOSE_OVER = 64 << 10
# a request sent before its key's last Retry-After waits this long (at most) for its 429, so a
# client that ignores the wait sends one a second per connection, not hundreds; at most
# HELD_MAX such requests wait at once (the rest are answered at once)
HOLD_S = 1.0
HELD_MAX = 256


def who(scope) -> str:
    """Whom a request is counted against: its key's name, else its client's address."""
    name = scope.get(KEY_NAME)
    if name:
        return f"key {name}"
    host, _ = scope.get("client") or ("-", 0)
    return f"client {host}"


class RequestCap:
    """Wraps an ASGI app: a 503 ``server_busy`` beyond ``max_requests`` requests in flight."""

    def __init__(self, app, max_requests: int, retry_after_s: float = 1.0):
        self.app, self.max_requests, self.retry_after_s = app, max_requests, retry_after_s
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_requests:
            error = busy(503, f"the server is busy ({self.in_flight} requests in flight, its "
                              f"--max-requests {self.max_requests})", "server_busy",
                         self.retry_after_s)  # fmt: skip
            return await send_error(send, error, scope)
        self.in_flight += 1  # the event loop's thread only: no lock
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class AmountWindow:
    """Per key, the amounts (audio seconds, body bytes) charged in the last ``window_s``
    seconds, against ``limit`` (callers hold RateLimits' lock)."""

    def __init__(self, limit: float, window_s: float):
        self.limit, self.window_s = limit, window_s
        self._charged: dict[str, deque[tuple[float, float]]] = {}
        self._used: dict[str, float] = {}  # each key's sum of _charged: no sum per request

    def trim(self, now: float) -> None:
        for key in list(self._charged):
            q = self._charged[key]
            while q and q[0][0] <= now - self.window_s:
                self._used[key] -= q.popleft()[1]
            if not q:
                del self._charged[key], self._used[key]

    def used(self, name: str) -> float:
        return self._used.get(name, 0.0)

    def fits(self, name: str, need: float) -> bool:
        return self.used(name) + need <= self.limit

    def wait(self, name: str, now: float, need: float) -> float:
        """Seconds until ``need`` more fit in ``name``'s window."""
        used, wait = self.used(name), 0.0
        for t, a in self._charged.get(name, ()):
            if used + need <= self.limit:
                break
            used, wait = used - a, t + self.window_s - now
        return wait

    def charge(self, name: str, now: float, amount: float) -> None:
        self._charged.setdefault(name, deque()).append((now, amount))
        self._used[name] = self._used.get(name, 0.0) + amount


class RateLimits:
    """The per-key windows of requests, audio seconds and body bytes (thread-safe: audio is
    charged from waiter threads)."""

    def __init__(self, requests_per_minute: int = 0, audio_seconds_per_minute: float = 0.0,
                 window_s: float = WINDOW_S, body_bytes_per_minute: int = 0):  # fmt: skip
        self.rpm, self.window_s = requests_per_minute, window_s
        self.audio = AmountWindow(audio_seconds_per_minute, window_s)
        self.body = AmountWindow(body_bytes_per_minute, window_s)
        self._requests: dict[str, deque[float]] = {}
        self._retry_at: dict[str, float] = {}  # the Retry-After of each key's last 429
        self._lock = threading.Lock()

    @property
    def audio_spm(self) -> float:
        return self.audio.limit

    @property
    def body_bpm(self) -> int:
        return int(self.body.limit)

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.audio_spm or self.body_bpm)

    def _trim(self, now: float) -> None:
        for key in list(self._requests):
            q = self._requests[key]
            while q and q[0] <= now - self.window_s:
                q.popleft()
            if not q:
                del self._requests[key]
        self.audio.trim(now)
        self.body.trim(now)
        for key in [k for k, t in self._retry_at.items() if t <= now]:
            del self._retry_at[key]

    def admit(self, name: str, body_bytes: int = 0) -> ApiError | None:
        """Count one request of ``name`` and its ``body_bytes`` (its Content-Length), or the
        429 refusing it (nothing counted), before its body is read."""
        now = time.monotonic()
        with self._lock:
            refusal = self._admit(name, body_bytes, now)
            if refusal is not None and "Retry-After" in refusal.headers:
                self._retry_at[name] = now + int(refusal.headers["Retry-After"])
        return refusal

    def came_early(self, name: str) -> bool:
        """Whether ``name`` sends before the Retry-After of its last 429 has passed."""
        with self._lock:
            return time.monotonic() < self._retry_at.get(name, 0.0)

    def _admit(self, name: str, body_bytes: int, now: float) -> ApiError | None:
        """``admit`` under the lock."""
        self._trim(now)
        q = self._requests.setdefault(name, deque())
        if self.rpm and len(q) >= self.rpm:
            return busy(429, f"rate limit: {name} sent {len(q)} requests in the last "
                             f"{self.window_s:g} s (--requests-per-minute {self.rpm})",
                        "rate_limited", q[0] + self.window_s - now)  # fmt: skip
        burst = min(self.rpm, max(BURST_MIN, -(-self.rpm // BURST_DIVISOR)))
        if self.rpm and len(q) >= burst and q[-burst] > now - 1.0:
            return busy(429, f"rate limit: {name} sent {burst} requests in the last second "
                             f"(--requests-per-minute {self.rpm} allows {burst} in any "
                             "one second)", "rate_limited", 1.0)  # fmt: skip
        if self.audio_spm and self.audio.used(name) >= self.audio_spm:
            return self._audio_refusal(name, now, 0.0)
        if self.body_bpm and not self.body.fits(name, body_bytes):
            return self._body_refusal(name, now, body_bytes)
        q.append(now)
        if self.body_bpm and body_bytes:
            self.body.charge(name, now, body_bytes)
        return None

    def charge_body(self, name: str, n: int) -> None:
        """Charge ``n`` body bytes read without a Content-Length (a chunked body) to ``name``:
        its next requests see them."""
        if self.body_bpm and n:
            now = time.monotonic()
            with self._lock:
                self.body.charge(name, now, n)

    def charge_audio(self, name: str, seconds: float, refuse_over: bool) -> ApiError | None:
        """Charge ``seconds`` of audio to ``name``; ``refuse_over``: a 429 instead when they
        do not fit in its window (nothing charged), before the work is done."""
        if not self.audio_spm:
            return None
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if refuse_over and not self.audio.fits(name, seconds):
                return self._audio_refusal(name, now, seconds)
            self.audio.charge(name, now, seconds)
        return None

    def _audio_refusal(self, name: str, now: float, need: float) -> ApiError:
        return self._refusal(self.audio, name, now, need, "audio_rate_limited",
                             f"--audio-seconds-per-minute {self.audio_spm:g}",
                             lambda s: f"{s:.1f} s of audio")  # fmt: skip

    def _body_refusal(self, name: str, now: float, need: int) -> ApiError:
        return self._refusal(self.body, name, now, need, "body_rate_limited",
                             f"--body-mb-per-minute {self.body_bpm / MIB:g}",
                             lambda n: f"{int(n)} bytes of request body")  # fmt: skip

    def _refusal(self, window: AmountWindow, name: str, now: float, need: float, code: str,
                 flag: str, amount: Callable[[float], str]) -> ApiError:  # fmt: skip
        """The 429 of ``window``: without Retry-After when ``need`` alone is over its limit."""
        if need > window.limit:
            return ApiError(429, f"rate limit: this request's {amount(need)} is more than "
                                 f"{name} may send in {self.window_s:g} s ({flag})",
                            code=code)  # fmt: skip
        return busy(429, f"rate limit: {name} used {amount(window.used(name))} in the last "
                         f"{self.window_s:g} s ({flag})", code, window.wait(name, now, need))  # fmt: skip


def _declared(length: str | None) -> int:
    """A Content-Length as bytes to charge: 0 when absent, not a number (BodyLimit answers that
    400) or longer than any body (BodyLimit's 413)."""
    if length is None or not length.isdigit() or len(length) > 18:
        return 0
    return int(length)


def _chunked(scope) -> bool:
    return "chunked" in (header(scope, b"transfer-encoding") or "").lower()


class RateLimit:
    """Wraps an ASGI app: ``limits.admit`` for every request but the probes, before its body
    is read."""

    def __init__(self, app, limits: RateLimits):
        self.app, self.limits = app, limits
        self._held = 0  # refusals waiting in _hold (on the event loop: no lock)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.limits.enabled and scope["path"] not in OPEN_PATHS:
            name, length = who(scope), header(scope, b"content-length")
            declared = _declared(length)
            early = self.limits.came_early(name)
            refusal = self.limits.admit(name, declared)
            if refusal is not None:
                if declared > CLOSE_OVER or length is None and _chunked(scope):
                    refusal.headers.update(CLOSE)
                    if early:  # its Retry-After ignored: what it still sends is reset, not read
                        scope[NO_LINGER] = True
                if early and "Retry-After" in refusal.headers:
                    await self._hold(int(refusal.headers["Retry-After"]))
                return await send_error(send, refusal, scope)
            if length is None and self.limits.body_bpm:  # chunked: charged as it is read
                receive = self._counted(receive, name)
        await self.app(scope, receive, send)

    async def _hold(self, retry_after_s: int) -> None:
        """Wait ``HOLD_S`` (or the Retry-After, if shorter) before a refusal, unless
        ``HELD_MAX`` refusals wait already. At most 64 KiB of its body is read meanwhile
        (uvicorn stops reading there), so a held request costs a socket and a timer."""
        if self._held >= HELD_MAX:
            return
        self._held += 1
        try:
            await asyncio.sleep(min(HOLD_S, retry_after_s))
        finally:
            self._held -= 1

    def _counted(self, receive, name: str):
        async def counted():
            msg = await receive()
            if msg["type"] == "http.request":
                self.limits.charge_body(name, len(msg.get("body", b"")))
            return msg

        return counted
