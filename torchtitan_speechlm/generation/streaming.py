"""Audio written while it is generated: ``torchtitan generate --stream`` (and the server's
streamed speech) hand each request's complete codec frames, as the decoder produces them
(``Decoder.audio``'s ``on_frames``), to the codec's stream decoder (codecs/streaming.py), and
its samples to a wav file or a client as they come. With the ``delay`` pattern codec frame f is
complete ``num_streams - 1`` steps after it starts; the stream decoder may hold back a frame or
two of lookahead. The first samples' time is recorded: the time to first audio.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


class AudioStream:
    """One request's audio as it is generated: ``frames(codes)`` with all of its complete frames
    so far (``on_frames``), ``finish(codes)`` with the final codes; ``sink`` gets each new block
    of float32 samples. ``first_audio_s``: seconds from ``started`` (default: construction) to
    the first samples."""

    def __init__(
        self, codec, sink: Callable[[np.ndarray], None], started: float | None = None
    ) -> None:
        self.decoder, self.sink = codec.stream_decoder(), sink
        self.started = time.perf_counter() if started is None else started
        self.sent = 0  # frames pushed
        self.samples = 0
        self.first_audio_s: float | None = None

    def frames(self, codes: np.ndarray) -> None:
        if len(codes) > self.sent:
            self._out(self.decoder.push(codes[self.sent :]))
            self.sent = len(codes)

    def finish(self, codes: np.ndarray) -> int:
        """Push what is left of ``codes``, flush; returns the samples written in all."""
        self.frames(codes)
        self._out(self.decoder.flush())
        return self.samples

    def _out(self, block: np.ndarray) -> None:
        if not len(block):
            return
        if self.first_audio_s is None:
            self.first_audio_s = time.perf_counter() - self.started
        self.samples += len(block)
        self.sink(block)


class WavFileStream(AudioStream):
    """An ``AudioStream`` into a 16-bit wav file at the codec's rate (its folder must exist);
    the file grows as the audio is generated."""

    def __init__(self, codec, path: str, started: float | None = None) -> None:
        import soundfile as sf

        try:
            self.file = sf.SoundFile(path, "w", int(codec.sample_rate), 1, "PCM_16")
        except RuntimeError as e:  # soundfile's LibsndfileError
            raise OSError(f"cannot write {path}: {e}") from None
        super().__init__(codec, self._write, started)

    def _write(self, block: np.ndarray) -> None:
        self.file.write(block)
        self.file.flush()

    def finish(self, codes: np.ndarray) -> int:
        try:
            return super().finish(codes)
        finally:
            self.file.close()
