"""What ``generate`` and ``eval`` say while a model decodes, and after: the frames decoded so
far (the progress status, repeated by utils/progress.py's heartbeat during a long decode), and
the line for generations that ran into ``--max-frames`` (their duration and end-of-speech
figures then describe the limit, not the model, and a user should be told so)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from torchtitan_speechlm.utils.progress import Progress


class FrameCounter:
    """``on_frames(i, codes)`` for ``run_requests`` / ``Decoder.audio``: the longest row's
    frames so far as ``progress``' status, then ``then(i, codes)`` (streaming) if given."""

    def __init__(
        self,
        frame_rate: float,
        progress: Progress,
        then: Callable[[int, np.ndarray], None] | None = None,
        label: str = "decoding",
    ) -> None:
        self.rate, self.progress, self.then, self.label = frame_rate, progress, then, label
        self.frames: dict[int, int] = {}
        self.start = time.perf_counter()

    def __call__(self, i: int, codes: np.ndarray) -> None:
        self.frames[i] = len(codes)
        longest = max(self.frames.values())
        self.progress.status = (
            f"{self.label}: {longest} frames ({longest / self.rate:.1f} s of audio)"
            + (f", {len(self.frames)} rows" if len(self.frames) > 1 else "")
        )
        if self.then is not None:
            self.then(i, codes)

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def frame_limit_line(hit: int, total: int, max_frames: int, frame_rate: float) -> str:
    """One line: ``hit`` of ``total`` generations stopped at ``--max-frames``, what that means
    and what to do."""
    return (
        f"{hit} of {total} generated utterance(s) reached --max-frames {max_frames} "
        f"({max_frames / frame_rate:.1f} s) without the model ending the speech: they stop at "
        "the limit, so their duration and end-of-speech figures measure it, not the model; "
        "raise --max-frames if the speech is longer, else the model has not learnt to end it"
    )
