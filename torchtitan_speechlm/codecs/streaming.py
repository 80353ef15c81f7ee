"""Decoding many clips at once and decoding codes as they arrive: the two calls beside
``Codec.decode``, and the defaults that ``load_codec`` gives a codec that lacks them.

* ``decode_batch(codes: list[np.ndarray [F_i, N]]) -> list[np.ndarray [F_i * samples_per_frame]]``:
  each item equal (to float tolerance) to ``decode`` of it alone. Default: a loop over ``decode``.
* ``stream_decoder() -> StreamDecoder``: ``push(codes [f, N])`` returns the samples that are final
  so far, ``flush()`` the rest; all of them together are exactly ``frames * samples_per_frame``
  samples. ``lookahead_frames`` says how many of the pushed frames a push may hold back.
  Default: ``ChunkedStreamDecoder`` over ``decode`` (each push re-decodes a window of left
  context plus the new frames; seams are cross-faded).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

# The chunked fallback's defaults, for a codec that does not set ``stream_context_frames`` /
# ``stream_lookahead_frames``: the left context re-decoded with each window, and the frames held
# back for a decoder that looks ahead (a non-causal convolution). A decoder that remembers
# further back (Encodec's LSTM, Mimi's attention) makes chunked output close to, not equal to,
# the whole-clip decode (docs/generation.md).
CONTEXT_SECONDS = 1.0
LOOKAHEAD_SECONDS = 0.1


@runtime_checkable
class StreamDecoder(Protocol):
    samples_per_frame: int
    lookahead_frames: int  # frames a push may hold back (plus ``crossfade`` samples)

    def push(self, codes: np.ndarray) -> np.ndarray:
        """Codes ``[f, num_streams]`` (f >= 0) that follow those pushed before -> float32 samples
        that are final (may be empty)."""

    def flush(self) -> np.ndarray:
        """The samples not returned yet; the decoder is finished afterwards."""


def decode_batch_by_loop(codec, codes: list[np.ndarray]) -> list[np.ndarray]:
    """``decode_batch`` for a codec that has no batched decode: one ``decode`` per item."""
    return [codec.decode(c) for c in codes]


def default_stream_decoder(codec, context_frames: int | None = None,
                           lookahead_frames: int | None = None) -> ChunkedStreamDecoder:  # fmt: skip
    """``stream_decoder`` for a codec without its own: ``ChunkedStreamDecoder`` over its
    ``decode``, with its ``stream_context_frames`` / ``stream_lookahead_frames`` when it has
    them, else ``CONTEXT_SECONDS`` / ``LOOKAHEAD_SECONDS`` of frames."""
    rate = float(codec.frame_rate)
    if context_frames is None:
        context_frames = getattr(codec, "stream_context_frames", None)
    if context_frames is None:
        context_frames = max(1, math.ceil(CONTEXT_SECONDS * rate))
    if lookahead_frames is None:
        lookahead_frames = getattr(codec, "stream_lookahead_frames", None)
    if lookahead_frames is None:
        lookahead_frames = math.ceil(LOOKAHEAD_SECONDS * rate)
    return ChunkedStreamDecoder(
        codec.samples_per_frame, codec.num_streams, lambda start, codes: codec.decode(codes),
        context_frames=max(1, int(context_frames)), lookahead_frames=int(lookahead_frames),
    )  # fmt: skip


def add_default_decoders(codec) -> None:
    """Give a loaded codec the ``decode_batch`` and ``stream_decoder`` it lacks (``load_codec``
    calls this), so callers can use both on any codec."""
    if not callable(getattr(codec, "decode_batch", None)):
        codec.decode_batch = functools.partial(decode_batch_by_loop, codec)
    if not callable(getattr(codec, "stream_decoder", None)):
        codec.stream_decoder = functools.partial(default_stream_decoder, codec)


class ChunkedStreamDecoder:
    """Streaming decode by windows: each push decodes the frames since the last window, with
    ``context_frames`` frames before them and ``lookahead_frames`` after them (frames whose
    samples are not final yet), and returns the samples up to ``crossfade`` before the end of
    what it decoded. Those last ``crossfade`` samples are held back and linearly cross-faded with
    the next window's version of them, so seams between windows do not click.

    ``decode_window(start, codes)`` gives the audio of ``codes`` (frames ``start ...`` of the
    stream, each frame's ``samples_per_frame`` samples in order), the default a plain
    ``decode``; a subclass may override ``_decode_window`` to keep state between windows.
    ``min_block`` frames must be new before a push decodes (1: every push that can).
    """

    def __init__(
        self,
        samples_per_frame: int,
        num_streams: int,
        decode_window: Callable[[int, np.ndarray], np.ndarray] | None = None,
        context_frames: int = 0,
        lookahead_frames: int = 0,
        crossfade: int | None = None,
        min_block: int = 1,
    ):
        self.samples_per_frame, self.num_streams = int(samples_per_frame), int(num_streams)
        self.context_frames, self.lookahead_frames = int(context_frames), int(lookahead_frames)
        spf = self.samples_per_frame
        self.crossfade = spf // 2 if crossfade is None else int(crossfade)
        if not 0 <= self.crossfade <= spf:
            raise ValueError(f"crossfade {self.crossfade} must be in 0..{spf} (one frame)")
        if self.crossfade and not self.context_frames:
            raise ValueError("a crossfade needs context_frames >= 1 (the window must reach back)")
        self.min_block = max(1, int(min_block))
        self._decode = decode_window
        self._codes = np.zeros((0, self.num_streams), np.int64)
        self.frames = 0  # frames pushed
        self.block_end = 0  # frames whose samples (less the held-back crossfade) are out
        self.emitted = 0  # samples returned
        self._tail: np.ndarray | None = None  # last window's held-back samples
        self._ramp = ((np.arange(self.crossfade) + 0.5) / max(1, self.crossfade)).astype(np.float32)
        self.finished = False

    # ---- the StreamDecoder interface -------------------------------------------------------
    def push(self, codes: np.ndarray) -> np.ndarray:
        if self.finished:
            raise RuntimeError("push after flush: start a new stream_decoder()")
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {codes.shape}")
        self._append(codes.astype(np.int64, copy=False))
        self.frames += len(codes)
        block_end = self.frames - self.lookahead_frames
        if block_end - self.block_end < self.min_block:
            return np.zeros(0, np.float32)
        return self._emit(block_end, final=False)

    def flush(self) -> np.ndarray:
        if self.finished:
            raise RuntimeError("flush called twice")
        self.finished = True
        if self.frames == 0 or self.emitted == self.frames * self.samples_per_frame:
            return np.zeros(0, np.float32)
        return self._emit(self.frames, final=True)

    # ---- for subclasses --------------------------------------------------------------------
    def _append(self, codes: np.ndarray) -> None:
        self._codes = np.concatenate([self._codes, codes])

    def _decode_window(self, start: int, block_end: int, final: bool) -> np.ndarray:
        """Audio of frames ``[start, block_end)`` (``(block_end - start) * samples_per_frame``
        samples or more), decoded with the frames known so far (lookahead included)."""
        spf = self.samples_per_frame
        wav = np.asarray(self._decode(start, self._codes[start:]), np.float32)
        need = (block_end - start) * spf
        return np.pad(wav[:need], (0, max(0, need - len(wav))))

    # ---- scheduling ------------------------------------------------------------------------
    def _emit(self, block_end: int, final: bool) -> np.ndarray:
        spf, x = self.samples_per_frame, self.crossfade
        start = max(0, self.block_end - self.context_frames)
        wav = self._decode_window(start, block_end, final)[: (block_end - start) * spf]
        seg = wav[self.emitted - start * spf :].copy()  # samples [emitted, block_end * spf)
        if self._tail is not None and x:
            seg[:x] = self._tail * (1.0 - self._ramp) + seg[:x] * self._ramp
        self.block_end = block_end
        if final or not x:
            self._tail = None
            out = seg
        else:
            self._tail, out = seg[-x:].copy(), seg[:-x]
        self.emitted += len(out)
        return out
