"""Where an evaluation's time goes: wall seconds per phase (generate, the model's own ASR, codec
decode, each judge) for the progress lines ``torchtitan eval`` prints on stderr after each item;
each phase entered becomes the progress status (utils/progress.py), which the heartbeat repeats
while a long phase runs.

Timings are not a property of the model, so they stay out of the results (which must be equal
run to run); a clock of its own keeps them out of the scoring code too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torchtitan_speechlm.utils.progress import Progress


class PhaseClock:
    """Wall seconds per phase of one set's evaluation, for the progress lines on stderr (not
    in the results: they are not a property of the model)."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()
        self.progress = progress
        self.items = ""  # the items being worked on, for the status ("items 1-8 of 20")

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.progress is not None:
            self.progress.status = f"{self.items}: {phase}" if self.items else phase
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def line(self, done: int, total: int) -> str:
        parts = ", ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items())
        return f"{done}/{total} items, {time.perf_counter() - self.start:.0f}s ({parts})"

    def working_on(self, first: int, count: int, total: int) -> str:
        """Set (and return) the items of the status: ``items 1-8 of 20`` (1-based)."""
        self.items = f"items {first + 1}-{first + count} of {total}"
        return self.items
