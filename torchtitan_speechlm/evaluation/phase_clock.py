"""Where an evaluation's time goes: wall seconds per phase (generate, the model's own ASR, codec
decode, each judge) for the progress lines ``torchtitan eval`` prints on stderr after each batch.

Timings are not a property of the model, so they stay out of the results (which must be equal
run to run); a clock of its own keeps them out of the scoring code too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseClock:
    """Wall seconds per phase of one set's evaluation, for the progress lines on stderr (not
    in the results: they are not a property of the model)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def line(self, done: int, total: int) -> str:
        parts = ", ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items())
        return f"{done}/{total} items, {time.perf_counter() - self.start:.0f}s ({parts})"
