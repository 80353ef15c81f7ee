"""Progress lines on stderr for the steps a user waits on (``generate``, ``eval``, ``prepare``'s
codec fit, the demo's stages): never silent for longer than a few seconds, so that a slow step
reads as working, not as hung.

A ``Progress`` prints ``PREFIX: TEXT`` lines. What the command is doing is its ``status``
(``progress.status = "decoding: 120 frames"``): a line says it when the status is set with
``say``, and a background thread repeats it, with the seconds since the command started,
whenever nothing was printed for ``every`` seconds. So a call that blocks for a minute (loading a model, one
judge's pass over a set) still shows a line every ``every`` seconds without the code inside it
knowing. ``enabled=False`` (``--no-progress``, ``--quiet``) prints nothing: scripts parse
stdout and keep stderr for errors.

Progress objects nest (the console script's around a command's start-up, a command's around
its phases, ``prepare``'s codec fit inside its run): silence is counted over every line any of
them printed, and only the innermost running one speaks for it, so a nested phase never gets
two heartbeats.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

EVERY_S = 5.0  # the longest silence while a step runs (a longer one reads as a hang)
_RUNNING: list[Progress] = []  # started heartbeats, innermost last
_LOCK = threading.Lock()
_LAST = [time.monotonic()]  # when any Progress last printed


class Progress:
    """``PREFIX: TEXT`` lines on ``stream`` (stderr), and the current status repeated every
    ``every`` seconds of silence (default ``EVERY_S``; see the module docstring). A context
    manager: the heartbeat runs inside ``with``."""

    def __init__(
        self,
        prefix: str,
        enabled: bool = True,
        every: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.prefix, self.enabled = prefix, enabled
        self.every = EVERY_S if every is None else every
        self._stream = stream
        self.status = ""  # what the heartbeat repeats (printed only after ``every`` s of silence)
        self.began = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def say(self, text: str, status: str | None = None) -> None:
        """Print ``text`` now; ``status``: what the heartbeat repeats after it (default: text)."""
        self.status = text if status is None else status
        self._print(text)

    def _print(self, text: str) -> None:
        with _LOCK:
            if self.enabled:
                _LAST[0] = time.monotonic()
                print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(min(0.5, self.every / 4)):
            now = time.monotonic()
            innermost = _RUNNING[-1] if _RUNNING else None
            if innermost is self and self.status and now - _LAST[0] >= self.every:
                self._print(f"{self.status} ({now - self.began:.0f}s elapsed)")

    def start(self) -> Progress:
        """Start the heartbeat (what ``with`` does); returns self."""
        if self.enabled and self._thread is None:
            self._stop.clear()
            with _LOCK:
                _RUNNING.append(self)
            self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the heartbeat (what leaving ``with`` does)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            with _LOCK:
                _RUNNING.remove(self)
        self.status = ""

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
