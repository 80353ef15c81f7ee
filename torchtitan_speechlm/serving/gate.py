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
  the model worker, and the speech generated, charged once spoken); over either a 429 with
  ``Retry-After``, the time until the window has room again. 0 (the default): no limit.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from torchtitan_speechlm.serving.auth import KEY_NAME, OPEN_PATHS
from torchtitan_speechlm.serving.errors import ApiError, busy, send_error

WINDOW_S = 60.0
BURST_DIVISOR = 30  # of a minute's requests, at most this share in one second (twice the mean)
BURST_MIN = 5  # but never fewer than this many in a second


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


class RateLimits:
    """The per-key windows of requests and audio seconds (thread-safe: audio is charged from
    waiter threads)."""

    def __init__(self, requests_per_minute: int = 0, audio_seconds_per_minute: float = 0.0,
                 window_s: float = WINDOW_S):  # fmt: skip
        self.rpm, self.audio_spm, self.window_s = (
            requests_per_minute,
            audio_seconds_per_minute,
            window_s,
        )
        self._requests: dict[str, deque[float]] = {}
        self._audio: dict[str, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.audio_spm)

    def _trim(self, now: float) -> None:
        for table in (self._requests, self._audio):
            for key in list(table):
                q = table[key]
                while q and (q[0] if table is self._requests else q[0][0]) <= now - self.window_s:
                    q.popleft()
                if not q:
                    del table[key]

    def _audio_used(self, name: str) -> float:
        return sum(s for _, s in self._audio.get(name, ()))

    def _audio_wait(self, name: str, now: float, need: float) -> float:
        """Seconds until ``need`` more audio seconds fit in ``name``'s window."""
        used, wait = self._audio_used(name), 0.0
        for t, s in self._audio.get(name, ()):
            if used + need <= self.audio_spm:
                break
            used, wait = used - s, t + self.window_s - now
        return wait

    def admit(self, name: str) -> ApiError | None:
        """Count one request of ``name``, or the 429 refusing it."""
        now = time.monotonic()
        with self._lock:
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
            if self.audio_spm and self._audio_used(name) >= self.audio_spm:
                return self._audio_refusal(name, now, 0.0)
            q.append(now)
        return None

    def charge_audio(self, name: str, seconds: float, refuse_over: bool) -> ApiError | None:
        """Charge ``seconds`` of audio to ``name``; ``refuse_over``: a 429 instead when they
        do not fit in its window (nothing charged), before the work is done."""
        if not self.audio_spm:
            return None
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if refuse_over and self._audio_used(name) + seconds > self.audio_spm:
                return self._audio_refusal(name, now, seconds)
            self._audio.setdefault(name, deque()).append((now, seconds))
        return None

    def _audio_refusal(self, name: str, now: float, need: float) -> ApiError:
        used = self._audio_used(name)
        if need > self.audio_spm:
            return ApiError(429, f"rate limit: this request's {need:.1f} s of audio are more "
                                 f"than {name} may send in {self.window_s:g} s "
                                 f"(--audio-seconds-per-minute {self.audio_spm:g})",
                            code="audio_rate_limited")  # fmt: skip
        return busy(429, f"rate limit: {name} used {used:.1f} s of audio in the last "
                         f"{self.window_s:g} s (--audio-seconds-per-minute {self.audio_spm:g})",
                    "audio_rate_limited", self._audio_wait(name, now, need))  # fmt: skip


class RateLimit:
    """Wraps an ASGI app: ``limits.admit`` for every request but the probes, before its body
    is read."""

    def __init__(self, app, limits: RateLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.limits.enabled and scope["path"] not in OPEN_PATHS:
            refusal = self.limits.admit(who(scope))
            if refusal is not None:
                return await send_error(send, refusal, scope)
        await self.app(scope, receive, send)
